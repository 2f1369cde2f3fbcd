"""Delayed-scaling states of one (recipe, group) key share contiguous buffers (recipe_state.DelayedScalingBuffers):
the batched update must give each state what its own update gives, whatever order and subset of the states a
step registers, and quantizers and copies must follow the state they belong to."""
import copy

import torch

from mindspeed_te import DelayedScaling, Linear, fp8_autocast
from mindspeed_te.recipe import HIF8DelayedScaling
from mindspeed_te.recipe_state import RecipeState, update_delayed_states
from mindspeed_te.state import fp8_model_init


def _states(recipe, steps=(0, 0, 0)):
    states = [RecipeState.create(recipe, mode="forward", num_quantizers=3) for _ in steps]
    for state, done in zip(states, steps):
        if hasattr(state, "steps"):
            state.steps = done
    return states


def _check_against_own_updates(recipe, steps):
    """Three states at the given step counts; each step a random subset in a random order runs (writes slot 0)
    and updates batched; the reference states, identical, update one by one with their own `update`."""
    ours, ref = _states(recipe, steps), _states(recipe, steps)
    g = torch.Generator().manual_seed(3)
    for step in range(14):
        ran = [i for i in torch.randperm(3, generator=g).tolist() if step < 2 or torch.rand(1, generator=g) < 0.7]
        if not ran:
            continue
        for i in ran:
            amax = torch.rand(3, generator=g) * 10
            for states in (ours, ref):
                torch.maximum(states[i].amax_history[0], amax, out=states[i].amax_history[0])
        update_delayed_states([ours[i] for i in ran])
        for i in ran:
            ref[i].update()
        for i in range(3):
            assert torch.equal(ours[i].scale, ref[i].scale), (step, i)
            assert torch.equal(ours[i].amax_history, ref[i].amax_history), (step, i)
            assert torch.equal(ours[i].scale_inv.get(), ref[i].scale.reciprocal()), (step, i)
    assert all(s.buffers is ours[0].buffers for s in ours)  # one set of buffers, kept as subsets came and went


def test_batched_update_equals_each_states_own_update_for_any_order_and_subset():
    _check_against_own_updates(DelayedScaling(amax_history_len=3, margin=1), (0, 0, 0))


def test_hif8_states_at_different_steps_update_at_their_own_steps():
    """HIF8DelayedScaling counts steps per state: states that started at different steps (added later, or
    steps loaded from a checkpoint) update at different steps, whichever order they register in."""
    _check_against_own_updates(HIF8DelayedScaling(amax_collect_interval=1, scale_update_interval=3,
                                                  amax_history_len=3), (0, 1, 2))


def test_a_module_that_skips_steps_keeps_the_keys_buffers_and_no_stale_views():
    a, b = Linear(64, 64), Linear(64, 64)
    x = torch.randn(32, 64)
    seen = set()
    for step in range(8):
        with fp8_autocast(fp8_recipe=DelayedScaling()):
            y = a(x)
            if step % 2 == 0:
                y = b(y)
        y.sum().backward()
        seen.add(id(a.fp8_states[0].buffers))
        assert len(a.fp8_states[0].slots._views) <= 2  # scale and history: views of tensors it no longer holds go
    assert len(seen) == 1


def test_a_copied_module_keeps_its_fp8_weight_tied_to_its_own_state():
    """deepcopy of a model with FP8 weights: the copy's weight quantizer writes the copy's state (its amax
    slot, then its scale), not a detached snapshot nor the original's."""
    recipe = DelayedScaling(amax_history_len=4)
    with fp8_model_init(recipe=recipe):
        layer = Linear(64, 64)
    x = torch.randn(32, 64)
    for _ in range(2):  # the states now live in their key's buffers
        with fp8_autocast(fp8_recipe=recipe):
            layer(x).sum().backward()
    twin = copy.deepcopy(layer)
    slot = layer.fp8_meta_index("weight")
    state, original = twin.fp8_states[0], layer.fp8_states[0]
    before = original.amax_history.clone()
    with torch.no_grad():
        twin.weight.quantize_(twin.weight.dequantize() * 10)
    assert state.amax_history[0, slot] > 1.0  # weights ~0.125 before, x10 now
    assert torch.equal(original.amax_history, before)
    with fp8_autocast(fp8_recipe=recipe):
        twin(x).sum().backward()
    assert torch.equal(twin.weight._quantizer.scale, state.scale[slot : slot + 1])
