"""Scaling math against closed-form values and the element-by-element reference in oracles.py."""
import math
import random

import numpy as np
import pytest
import torch

from mindspeed_te import scaling
from tests.oracles import FLT_MAX, DelayedReference, current_scale, current_scale_inv


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("history_len", [1, 2, 5])
@pytest.mark.parametrize("margin", [0, 2])
def test_delayed_update_matches_reference_over_many_steps(algo, history_len, margin):
    rng = random.Random(history_len * 10 + margin)
    n, target = 4, 448.0
    refs = [DelayedReference(history_len, target, margin, algo) for _ in range(n)]
    history = torch.zeros(history_len, n)
    scale = torch.ones(n)
    for _ in range(12):
        amaxes = [float(np.float32(rng.choice([0.0, 2.0 ** rng.uniform(-20, 20), math.nan, math.inf, 1e-44])))
                  for _ in range(n)]
        history[0] = torch.tensor(amaxes)
        for ref, a in zip(refs, amaxes):
            ref.observe(a)
            ref.update()
        history, scale = scaling.delayed_scaling_update(history, scale, target, margin, algo)
        for i, ref in enumerate(refs):
            assert history[:, i].tolist() == pytest.approx(ref.history, rel=0, abs=0)
            assert scale[i].item() == ref.scale


def test_roll_window_closed_form():
    # Two steps of amax 4 then 1 with a window of 3: "max" keeps 4, "most_recent" follows the newest.
    h = torch.zeros(3, 1)
    s = torch.ones(1)
    h[0] = 4.0
    h, s = scaling.delayed_scaling_update(h, s, 448.0, 0, "max")
    assert h[:, 0].tolist() == [0.0, 0.0, 4.0] and s.item() == 112.0
    h[0] = 1.0
    h2, s2 = scaling.delayed_scaling_update(h, s, 448.0, 0, "max")
    assert h2[:, 0].tolist() == [0.0, 4.0, 1.0] and s2.item() == 112.0
    _, s3 = scaling.delayed_scaling_update(h, s, 448.0, 1, "most_recent")
    assert s3.item() == 224.0  # 448 / 1 / 2^1


def test_zero_and_nonfinite_amax_keep_history_and_scale():
    h = torch.tensor([[0.0, math.nan, math.inf], [3.0, 3.0, 3.0]])
    s = torch.tensor([7.0, 7.0, 7.0])
    # Window max of column 0 is 3 -> scale updates from the old window; columns 1-2 ignore the bad amax.
    h2, s2 = scaling.delayed_scaling_update(h, s, 448.0, 0, "most_recent")
    assert h2.tolist() == [[0.0, 0.0, 0.0], [3.0, 3.0, 3.0]]
    assert s2.tolist() == [7.0, 7.0, 7.0]
    assert torch.isfinite(s2).all() and torch.isfinite(h2).all()


def test_tiny_amax_gives_flt_max_and_callables_are_used():
    h = torch.tensor([[1e-45]])
    _, s = scaling.delayed_scaling_update(h, torch.ones(1), 448.0, 0, "max")
    assert s.item() == FLT_MAX
    _, s = scaling.delayed_scaling_update(
        torch.tensor([[2.0], [8.0]]), torch.ones(1), 448.0, 0, lambda hist: hist.min(dim=0).values,
        scaling_factor_compute_algo=lambda amax, old, fp8_max, recipe: fp8_max / amax / 4,
    )
    assert s.item() == 448.0 / 2.0 / 4


@pytest.mark.parametrize("amax", [2.0, 3.0, 448.0, 1e-3, 0.0, math.inf, math.nan, 1e-44, 6e4])
@pytest.mark.parametrize("eps", [0.0, 1e-2])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("ours, oracle, target", [(scaling.current_scale, current_scale, 448.0),
                                                  (scaling.current_scale_inv, current_scale_inv, 15.0)],
                         ids=["scale", "scale_inv"])
def test_current_scale_and_inverse_match_reference(amax, eps, pow2, ours, oracle, target):
    assert ours(torch.tensor([amax]), target, eps, pow2).item() == float(oracle(amax, target, eps, pow2))


def test_current_scale_closed_form():
    assert scaling.current_scale(torch.tensor(2.0), 448.0).item() == 224.0
    assert scaling.current_scale(torch.tensor(3.0), 448.0, power_2_scale=True).item() == 128.0
    assert scaling.current_scale(torch.tensor(0.0), 15.0).item() == 1.0
    assert scaling.current_scale(torch.tensor(1e-6), 15.0, amax_epsilon=1e-3).item() == pytest.approx(15e3)


@pytest.mark.parametrize("rounding", ["ceil", "floor"])
def test_mx_exponents_closed_form(rounding):
    values = [448.0, 449.0, 1.0, 896.0, 0.0, 3e38, 1e-40]
    e = scaling.mx_scale_exponent(torch.tensor(values), 448.0, 8, rounding).tolist()
    for v, got in zip(values, e):
        if v == 0.0:
            assert got == -127
        elif rounding == "ceil":
            assert 2.0**got * 448 >= v and 2.0 ** (got - 1) * 448 < v or got == -127
        else:
            assert got == max(-127, math.floor(math.log2(v)) - 8)


def test_e8m0_round_trip():
    e = torch.arange(-127, 128, dtype=torch.int32)
    codes = scaling.e8m0_encode(e)
    assert codes.dtype == torch.uint8
    np.testing.assert_array_equal(scaling.e8m0_decode(codes).double().numpy(), np.ldexp(1.0, e.numpy()))


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0.0, 1.0])
def test_batched_delayed_update_equals_the_per_state_update(algo, margin):
    """The per-step update of many states at once (one [L, N] buffer, a fixed handful of ops) gives each
    state exactly what its own `delayed_scaling_update` gives: rolled windows, kept windows and scales for
    0 / NaN / Inf newest amaxes, the FLT_MAX clamp."""
    from mindspeed_te.recipe import DelayedScaling
    from mindspeed_te.recipe_state import DelayedScalingRecipeState, update_delayed_states
    from mindspeed_te.scaling import delayed_scaling_update

    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo=algo, margin=margin)
    g = torch.Generator().manual_seed(3)
    states = [DelayedScalingRecipeState(recipe, mode="forward", num_quantizers=n) for n in (3, 6, 3)]
    for state in states:
        state.amax_history.copy_(torch.rand(state.amax_history.shape, generator=g) * 10)
        state.scale.copy_(torch.rand(state.num_quantizers, generator=g) + 0.5)
    newest = states[1].amax_history[0]
    newest[0], newest[1], newest[2], newest[3], newest[4] = 0.0, float("nan"), float("inf"), 1e-40, 3.0
    want = [delayed_scaling_update(s.amax_history, s.scale, s.fp8_max, margin, algo) for s in states]
    update_delayed_states(states)
    for state, (history, scale) in zip(states, want):
        assert torch.equal(state.amax_history, history)
        assert torch.equal(state.scale, scale)
        assert torch.equal(state.scale_inv.get(), scale.reciprocal())
