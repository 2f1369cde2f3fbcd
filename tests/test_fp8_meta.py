"""TransformerEngine's `fp8_meta` on our modules: TE's slot layouts (checked with amaxes put into known
tensors: scale = format max / amax), the live objects the forward quantizes with, and metadata present after
a checkpoint load without any forward."""
from __future__ import annotations

import pytest
import torch

from mindspeed_te import GroupedLinear, LayerNormMLP, Linear, fp8_autocast
from mindspeed_te.modules.base import decode_extra_state, encode_extra_state
from mindspeed_te.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    HIF8DelayedScaling,
    MXFP8BlockScaling,
    recipe_from_config,
    recipe_to_config,
)

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _f32(x: float) -> float:
    """x rounded to float32, as a float32 scale holds it."""
    return torch.tensor(x, dtype=torch.float32).item()


def _recipe(history: int = 2) -> DelayedScaling:
    return DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=history)


def _with_amax(shape: tuple[int, ...], amax: float, seed: int) -> torch.Tensor:
    """Values in [0, 1) with one entry -amax: the tensor's amax is exactly `amax` (> 1)."""
    torch.manual_seed(seed)
    t = torch.rand(*shape) * 0.5
    t.view(-1)[len(t.view(-1)) // 2] = -amax
    return t


def _step(module, *args, grad: float, recipe=None):
    with fp8_autocast(fp8_recipe=recipe or _recipe()):
        out = module(*args)
    out.backward(torch.full_like(out, grad))
    return out


def test_fp8_meta_before_and_after_the_first_fp8_forward():
    linear = Linear(16, 8)
    assert linear.fp8_meta == {"fp8_checkpoint": False, "fp8_group": None}  # TE's initial dict
    with pytest.raises(KeyError):
        linear.fp8_meta["scaling_fwd"]
    recipe = _recipe()
    _step(linear, torch.rand(4, 16), grad=1.0, recipe=recipe)
    meta = linear.fp8_meta
    assert meta["recipe"] is recipe and meta["num_gemms"] == 1 and meta["fp8_checkpoint"] is True
    assert (meta["fp8_max_fwd"], meta["fp8_max_bwd"]) == (E4M3_MAX, E5M2_MAX)
    assert meta["scaling_fwd"] is linear.fp8_states[0] and meta["scaling_bwd"] is linear.fp8_states[1]
    assert meta["scaling_fwd"].amax_history.shape == (2, 3) and meta["scaling_bwd"].scale.shape == (2,)


def test_linear_layout_input_weight_output_then_grad_output_grad_input():
    linear = Linear(16, 8, bias=False)
    with torch.no_grad():
        linear.weight.copy_(_with_amax((8, 16), 2.0, seed=1))
    _step(linear, _with_amax((4, 16), 3.0, seed=2), grad=5.0)
    fwd, bwd = linear.fp8_meta["scaling_fwd"], linear.fp8_meta["scaling_bwd"]
    assert [linear.fp8_meta_index(r) for r in ("input", "weight", "output")] == [0, 1, 2]
    assert [linear.fp8_meta_index(r) for r in ("grad_output", "grad_input")] == [0, 1]
    assert fwd.scale.tolist() == [_f32(E4M3_MAX / 3.0), E4M3_MAX / 2.0, 1.0]  # no output quantizer in use
    assert bwd.scale.tolist() == [_f32(E5M2_MAX / 5.0), 1.0]


def test_layernorm_mlp_layout_is_per_gemm():
    """TE's LayerNormMLP: FC1's input, weight, output at 0-2, FC2's at 3-5."""
    mlp = LayerNormMLP(16, 32, bias=False)
    with torch.no_grad():
        mlp.fc1_weight.copy_(_with_amax((32, 16), 2.0, seed=3))
        mlp.fc2_weight.copy_(_with_amax((16, 32), 6.0, seed=4))
    _step(mlp, torch.rand(4, 16), grad=1.0)
    scale = mlp.fp8_meta["scaling_fwd"].scale
    assert mlp.fp8_meta_index("weight", 1) == 4
    assert scale[1].item() == E4M3_MAX / 2.0 and scale[4].item() == _f32(E4M3_MAX / 6.0)


def test_grouped_layout_all_inputs_then_all_weights_then_all_outputs():
    """GroupedLinear with 3 experts: expert i's input at i, weight at 3 + i, output at 6 + i; backward its
    grad_output at i, grad_input at 3 + i. Expert i sees input amax i + 2, weight amax 2 i + 3, gradient
    amax 4 i + 1."""
    n, splits = 3, [2, 3, 4]
    grouped = GroupedLinear(n, 16, 8, bias=False)
    with torch.no_grad():
        for i, weight in enumerate(grouped.weights):
            weight.copy_(_with_amax((8, 16), 2.0 * i + 3, seed=10 + i))
    x = torch.cat([_with_amax((m, 16), i + 2.0, seed=20 + i) for i, m in enumerate(splits)])
    with fp8_autocast(fp8_recipe=_recipe()):
        out = grouped(x, splits)
    out.backward(torch.cat([torch.full((m, 8), 4.0 * i + 1) for i, m in enumerate(splits)]))
    fwd, bwd = grouped.fp8_meta["scaling_fwd"], grouped.fp8_meta["scaling_bwd"]
    for i in range(n):
        assert (grouped.fp8_meta_index("input", i), grouped.fp8_meta_index("weight", i),
                grouped.fp8_meta_index("output", i)) == (i, n + i, 2 * n + i)
        assert fwd.scale[i].item() == _f32(E4M3_MAX / (i + 2.0))
        assert fwd.scale[n + i].item() == _f32(E4M3_MAX / (2.0 * i + 3))
        assert fwd.scale[2 * n + i].item() == 1.0
        assert grouped.fp8_meta_index("grad_output", i) == i and grouped.fp8_meta_index("grad_input", i) == n + i
        assert bwd.scale[i].item() == _f32(E5M2_MAX / (4.0 * i + 1))
    assert fwd.roles == ["input"] * n + ["weight"] * n + ["output"] * n
    assert bwd.roles == ["grad_output"] * n + ["grad_input"] * n


def test_grouped_matches_sequential_experts_the_way_megatron_compares_them():
    """megatron-core's expert test lays the sequential experts' [L, 3] histories side by side
    (cat of view(-1, 1) along dim 1, then view(L, -1)) and compares that with the grouped module's: equal
    here because each tensor's amax sits in the grouped slot of the same tensor."""
    n, splits = 4, [3, 1, 2, 5]
    torch.manual_seed(0)
    grouped = GroupedLinear(n, 16, 8)
    linears = [Linear(16, 8) for _ in range(n)]
    with torch.no_grad():
        for i, linear in enumerate(linears):
            linear.weight.copy_(grouped.weights[i])
    x = torch.randn(sum(splits), 16) * 3
    grads = torch.randn(sum(splits), 8)
    for _ in range(2):
        with fp8_autocast(fp8_recipe=_recipe(3)):
            out = grouped(x, splits)
        out.backward(grads)
        for linear, rows, grad in zip(linears, torch.split(x, splits), torch.split(grads, splits)):
            with fp8_autocast(fp8_recipe=_recipe(3)):
                y = linear(rows)
            y.backward(grad)
    for key in ("scaling_fwd", "scaling_bwd"):
        side_by_side = torch.cat([lin.fp8_meta[key].amax_history.view(-1, 1) for lin in linears], dim=1).view(3, -1)
        assert torch.equal(side_by_side, grouped.fp8_meta[key].amax_history)
        scales = torch.cat([lin.fp8_meta[key].scale.view(-1, 1) for lin in linears], dim=1).view(-1)
        assert torch.equal(scales, grouped.fp8_meta[key].scale)
    assert grouped.fp8_meta["scaling_fwd"].amax_history.ne(0).sum() > 0


def test_writes_through_fp8_meta_reach_the_forward():
    linear = Linear(16, 8, bias=False)
    x = torch.rand(4, 16) + 0.5
    _step(linear, x, grad=1.0)
    fwd = linear.fp8_meta["scaling_fwd"]
    # An input scale of 2^-20 puts every x * scale below E4M3's smallest subnormal 2^-9: all codes are 0.
    fwd.scale[linear.fp8_meta_index("input")] = 2.0 ** -20
    with fp8_autocast(fp8_recipe=_recipe()):
        assert torch.equal(linear(x), torch.zeros(4, 8))
    # An amax written into the history is what the next update scales by (max over the window).
    fwd.amax_history[1, linear.fp8_meta_index("input")] = 7.0
    with fp8_autocast(fp8_recipe=_recipe()):
        linear(x)
    assert fwd.scale[0].item() == _f32(E4M3_MAX / 7.0)
    # A state put in place of the module's (as Megatron does when it splits a fused layer) is the one used.
    other = Linear(16, 8, bias=False)
    _step(other, x, grad=1.0)
    other.fp8_meta["scaling_fwd"].scale[0] = 2.0 ** -20
    linear.fp8_meta["scaling_fwd"] = other.fp8_meta["scaling_fwd"]
    assert linear.fp8_states[0] is other.fp8_meta["scaling_fwd"]
    with fp8_autocast(fp8_recipe=_recipe()):
        assert torch.equal(linear(x), torch.zeros(4, 8))


@pytest.mark.parametrize("recipe", [_recipe(4), HIF8DelayedScaling(amax_history_len=4, amax_collect_interval=2,
                                                                    scale_update_interval=2)],
                         ids=["delayed", "hif8_delayed"])
def test_fp8_meta_is_there_after_a_load_without_forward(recipe):
    torch.manual_seed(0)
    source = GroupedLinear(2, 16, 8)
    for step in range(3):
        _step(source, torch.randn(6, 16) * (step + 1), [2, 4], grad=float(step + 1), recipe=recipe)
    target = GroupedLinear(2, 16, 8)
    target.load_state_dict(source.state_dict())
    meta = target.fp8_meta
    assert meta["recipe"].key() == recipe.key() and meta["recipe"].amax_history_len == 4
    assert meta["num_gemms"] == 2 and meta["fp8_checkpoint"] is True
    for key in ("scaling_fwd", "scaling_bwd"):
        assert torch.equal(meta[key].amax_history, source.fp8_meta[key].amax_history)
        assert torch.equal(meta[key].scale, source.fp8_meta[key].scale)
        assert getattr(meta[key], "steps", None) == getattr(source.fp8_meta[key], "steps", None)
    # The loaded states are the ones the first forward uses: the same outputs as the source's.
    x = torch.randn(6, 16)
    with fp8_autocast(fp8_recipe=recipe):
        expected, got = source(x, [2, 4]), target(x, [2, 4])
    assert torch.equal(expected, got)
    assert target.fp8_meta["scaling_fwd"] is meta["scaling_fwd"]


def test_loaded_metadata_is_saved_again_as_loaded():
    """A recipe with a callable is not stored; its metadata waits for the first forward under that recipe
    and a save before then gives back what was loaded."""
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=2, amax_compute_algo=lambda h: h.amax(0))
    source = Linear(16, 8)
    _step(source, torch.randn(4, 16), grad=2.0, recipe=recipe)
    target = Linear(16, 8)
    target.load_state_dict(source.state_dict())
    assert "scaling_fwd" not in target.fp8_meta
    saved = decode_extra_state(target.get_extra_state(), "Linear")
    assert torch.equal(saved["fwd_scale"], source.fp8_meta["scaling_fwd"].scale)
    with fp8_autocast(fp8_recipe=recipe):
        target(torch.randn(4, 16))
    assert torch.equal(target.fp8_meta["scaling_bwd"].scale, source.fp8_meta["scaling_bwd"].scale)


def test_version_1_grouped_entries_are_reordered():
    """Version 1 kept a grouped module's slots GEMM by GEMM; loading one puts each slot where TE's grouped
    layout wants it."""
    grouped = GroupedLinear(2, 16, 8)
    key = DelayedScaling(amax_history_len=1).key()
    per_gemm_fwd = torch.tensor([10.0, 11.0, 12.0, 20.0, 21.0, 22.0])  # GEMM g, role r -> 10 (g + 1) + r
    per_gemm_bwd = torch.tensor([10.0, 11.0, 20.0, 21.0])
    grouped.set_extra_state(encode_extra_state({
        "version": 1, "recipe_key": key, "fwd_amax_history": per_gemm_fwd[None], "fwd_scale": per_gemm_fwd,
        "bwd_amax_history": per_gemm_bwd[None], "bwd_scale": per_gemm_bwd}))
    with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=1)):
        grouped._states_for_current_recipe(torch.device("cpu"))
    assert grouped.fp8_meta["scaling_fwd"].scale.tolist() == [10.0, 20.0, 11.0, 21.0, 12.0, 22.0]
    assert grouped.fp8_meta["scaling_bwd"].scale.tolist() == [10.0, 20.0, 11.0, 21.0]


@pytest.mark.parametrize("recipe", [DelayedScaling(margin=1, amax_history_len=7), HIF8DelayedScaling(),
                                    Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling()],
                         ids=lambda r: type(r).__name__)
def test_recipes_round_trip_through_their_stored_form(recipe):
    assert recipe_from_config(recipe_to_config(recipe)).key() == recipe.key()


def test_bad_slot_questions_name_the_argument():
    grouped = GroupedLinear(2, 16, 8)
    with pytest.raises(ValueError, match="role"):
        grouped.fp8_meta_index("bias")
    with pytest.raises(ValueError, match="gemm"):
        grouped.fp8_meta_index("input", 2)
