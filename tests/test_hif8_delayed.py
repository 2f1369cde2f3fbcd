"""HIF8DelayedScaling, MindSpeed's `hif8_delayed` recipe (issue 12 item 2): warm-up under current scaling
while the history fills, then delayed scales updated every `scale_update_interval` steps, per-tensor margins,
history length 128; and its Megatron flags."""
import types

import pytest
import torch

from mindspeed_te import FP8GlobalStateManager, RecipeState, fp8_autocast
from mindspeed_te.formats import FP8Dtype
from mindspeed_te.megatron.common import recipe_from_config
from mindspeed_te.quantizers import Float8CurrentScalingQuantizer
from mindspeed_te.recipe import Format, HIF8DelayedScaling
from tests.test_patches_arguments import _parse


def test_mindspeed_defaults_and_validation():
    r = HIF8DelayedScaling()
    assert (r.fp8_format, r.amax_history_len, r.scale_update_interval, r.amax_collect_interval) == (
        Format.HIF8, 128, 10, 5)
    assert (r.hif8_input_margin, r.hif8_weight_margin, r.hif8_grad_margin) == (11, 12, 11)
    # guard bits below HiF8's largest value 2^15
    assert [r.role_target(role) for role in ("input", "weight", "output", "grad_output")] == [16.0, 8.0, 16.0, 16.0]
    with pytest.raises(ValueError, match="scale_update_interval"):
        HIF8DelayedScaling(scale_update_interval=0)
    with pytest.raises(ValueError, match="hif8_weight_margin"):
        HIF8DelayedScaling(hif8_weight_margin=-1)
    with pytest.raises(ValueError, match="fp8_format"):
        HIF8DelayedScaling(fp8_format=Format.E4M3)
    with pytest.raises(ValueError, match="margin is not used"):
        HIF8DelayedScaling(margin=2)


def test_schedule_warm_up_then_updates_every_interval():
    """Slot 0 (input, target 16) and slot 1 (weight, target 8) over 9 steps with amax = step number, against
    the schedule in closed form: collect 2, interval 3, window 4, amax over the window."""
    recipe = HIF8DelayedScaling(amax_collect_interval=2, scale_update_interval=3, amax_history_len=4)
    state = RecipeState.create(recipe, mode="forward", num_quantizers=3)
    scales, window, scale = [], [], 1.0
    for step in range(1, 10):
        x = torch.full((8,), float(step))
        with fp8_autocast(fp8_recipe=recipe):
            FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(state)
            q = state.make_quantizers()
            out = q[0](x)
            q[1](x * 2)
        if step <= 2:  # warm-up: current scaling with the slot's target, independent of the stored scale
            want = Float8CurrentScalingQuantizer(FP8Dtype.HIF8, 16.0)(x)
            assert torch.equal(out.data, want.data) and torch.equal(out.scale_inv, want.scale_inv)
        else:
            assert out.scale_inv.item() == (1.0 / torch.tensor(scale)).item()  # float32 reciprocal
        # closed form of the update at the end of this step
        window.append(step)  # each step's amax; between updates they are max-accumulated
        if step <= 2 or (step - 2) % 3 == 0:
            collected = max(window)
            window = []
            scales.append(collected)
            scale = (torch.tensor(16.0) / max(scales[-4:])).item()  # one float32 division
        assert state.scale[0].item() == scale and state.scale[1].item() == scale / 4  # weight: target 8, amax x2
    assert scales == [1.0, 2.0, 5.0, 8.0] and state.steps == 9


def test_failed_step_reset_restarts_the_warm_up():
    recipe = HIF8DelayedScaling(amax_collect_interval=1)
    state = RecipeState.create(recipe, mode="backward", num_quantizers=2)
    with fp8_autocast(fp8_recipe=recipe):
        FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(state)
        state.make_quantizers()[0](torch.full((4,), 2.0))
    FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
    assert not state.warming_up() and state.scale[0].item() == 8.0  # gradient target 16 / amax 2
    state.reset_amax_history()
    assert state.warming_up() and state.scale.eq(1).all() and state.amax_history.eq(0).all()


def test_megatron_flags_build_the_recipe():
    args = _parse(["--fp8-format", "hif8", "--fp8-recipe", "hif8_delayed", "--hif8-scale-update-interval", "4",
                   "--hif8-weight-margin", "10", "--hif8-amax-history-len", "64"])
    config = types.SimpleNamespace(fp8=args.fp8, fp8_recipe=args.fp8_recipe, fp8_wgrad=True,
                                   fp8_amax_compute_algo="max",
                                   **{name: getattr(args, name) for name in vars(args) if name.startswith("hif8_")})
    recipe = recipe_from_config(config)
    assert isinstance(recipe, HIF8DelayedScaling)
    assert (recipe.scale_update_interval, recipe.hif8_weight_margin, recipe.amax_history_len,
            recipe.amax_collect_interval, recipe.hif8_input_margin) == (4, 10, 64, 5, 11)
    with pytest.raises(ValueError, match="--fp8-recipe hif8_delayed needs --fp8-format hif8"):
        _parse(["--fp8-format", "e4m3", "--fp8-recipe", "hif8_delayed"])


def test_bad_interval_fails_at_parse_time(capsys):
    with pytest.raises(SystemExit):
        _parse(["--fp8-format", "hif8", "--fp8-recipe", "hif8_delayed", "--hif8-scale-update-interval", "0"])
    assert "--hif8-scale-update-interval must be >= 1, got 0" in capsys.readouterr().err


def _train(backend, use_backend):
    from mindspeed_te.modules import Linear

    use_backend(backend)
    torch.manual_seed(0)
    layer = Linear(64, 64, params_dtype=torch.bfloat16)
    recipe = HIF8DelayedScaling(amax_collect_interval=2, scale_update_interval=2)
    outputs = []
    for step in range(7):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step)).bfloat16().requires_grad_()
        with fp8_autocast(fp8_recipe=recipe):
            y = layer(x)
        y.float().square().sum().backward()
        outputs.append((y.detach(), x.grad, layer.weight.grad.clone()))
        layer.weight.grad = None
    return outputs, layer


def test_a_linear_trains_with_it_identically_on_the_npu_kernels(use_backend):
    reference, layer = _train("reference", use_backend)
    npu, _ = _train("npu", use_backend)
    for a, b in zip(reference, npu):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    fwd, bwd = layer.fp8_states
    assert fwd.steps == bwd.steps == 7 and torch.isfinite(fwd.scale).all() and fwd.scale[0].item() != 1.0
