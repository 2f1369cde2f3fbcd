"""GroupedLinear (MoE experts): equals one Linear per expert, in every recipe; expert tensor parallelism on
2 gloo processes matches one process; the backward amax reduction waits for every expert."""
import pytest
import torch

from mindspeed_te import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    FP8GlobalStateManager,
    MXFP8BlockScaling,
    fp8_autocast,
)
from mindspeed_te.modules import GroupedLinear, Linear
from tests.dist_utils import run_distributed

RECIPES = {
    "high precision": None,
    "delayed/hybrid": DelayedScaling(fp8_format=Format.HYBRID),
    "tensorwise/hif8": Float8CurrentScaling(fp8_format=Format.HIF8),
    "blockwise/e4m3": Float8BlockScaling(),
    "mxfp8/e4m3": MXFP8BlockScaling(),
}
SPLITS = [64, 0, 96, 32]


def _experts(seed=0, k=128, n=64):
    torch.manual_seed(seed)
    grouped = GroupedLinear(len(SPLITS), k, n)
    linears = [Linear(k, n) for _ in SPLITS]
    with torch.no_grad():
        for i, lin in enumerate(linears):
            lin.weight.copy_(grouped.weights[i])
            lin.bias.normal_()
            grouped.biases[i].copy_(lin.bias)
    return grouped, linears


@pytest.mark.parametrize("name", list(RECIPES))
def test_grouped_equals_one_linear_per_expert(name):
    recipe = RECIPES[name]
    grouped, linears = _experts()
    x = torch.randn(sum(SPLITS), 128)
    dy = torch.randn(sum(SPLITS), 64)
    results = []
    for use_grouped in (True, False):
        FP8GlobalStateManager.reset()
        xr = x.clone().requires_grad_()
        with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            if use_grouped:
                y = grouped(xr, SPLITS)
            else:
                y = torch.cat([lin(part) for lin, part in zip(linears, torch.split(xr, SPLITS)) if part.shape[0]])
        y.backward(dy)
        weights = grouped.weights if use_grouped else [lin.weight for lin in linears]
        biases = grouped.biases if use_grouped else [lin.bias for lin in linears]
        active = [i for i, m in enumerate(SPLITS) if m]
        results.append([y, xr.grad] + [weights[i].grad for i in active] + [biases[i].grad for i in active])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert not grouped.weight1.grad.any() and not grouped.bias1.grad.any()  # the expert with no rows


def test_bad_m_splits_and_empty_experts():
    grouped, _ = _experts()
    with pytest.raises(ValueError, match="m_splits"):
        grouped(torch.randn(10, 128), [5, 5, 5, 5])
    with pytest.raises(ValueError, match="m_splits"):
        grouped(torch.randn(10, 128), [5, 5])
    out = grouped(torch.randn(0, 128), [0, 0, 0, 0])
    assert out.shape == (0, 64)


def test_backward_amax_reduction_after_every_expert():
    FP8GlobalStateManager.reset()
    grouped, _ = _experts()
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=2)
    x = torch.randn(sum(SPLITS), 128, requires_grad=True)
    with fp8_autocast(fp8_recipe=recipe):
        y = grouped(x, SPLITS)
    y.backward(torch.ones_like(y) * 4.0)
    bwd = grouped.fp8_states[1]
    # grad_output quantizers of the three non-empty experts saw amax 4: scale 57344 / 4 for each.
    assert bwd.scale[[0, 4, 6]].tolist() == [57344.0 / 4] * 3
    assert bwd.scale[2].item() == 1.0 and not bwd.amax_history[0].any()


def test_return_bias_and_bf16_gmm_switch():
    grouped = GroupedLinear(2, 32, 16, return_bias=True)
    x = torch.randn(6, 32)
    out, biases = grouped(x, [2, 4])
    assert len(biases) == 2 and biases[0] is grouped.bias0
    plain = GroupedLinear(2, 32, 16, use_fp8_gemm=False)  # Megatron's --no-use-gmm-fp8: BF16 expert GEMMs
    with torch.no_grad():
        for i in range(2):
            plain.weights[i].copy_(grouped.weights[i])
    with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        y = plain(x, [2, 4])
    assert torch.allclose(y, out + torch.cat([plain.bias0.expand(2, -1), plain.bias1.expand(4, -1)]), atol=1e-6)


def _tp_worker(rank: int, world: int) -> dict:
    group = torch.distributed.new_group(list(range(world)))
    recipe = DelayedScaling(fp8_format=Format.HYBRID)
    out = {}
    for mode in ("column", "row"):
        FP8GlobalStateManager.reset()
        full, _ = _experts(seed=3, k=128, n=128)
        layer = GroupedLinear(len(SPLITS), 128, 128, parallel_mode=mode, tp_group=group)
        with torch.no_grad():
            for i in range(len(SPLITS)):
                dim = 0 if mode == "column" else 1
                layer.weights[i].copy_(full.weights[i].chunk(world, dim)[rank])
                layer.biases[i].copy_(full.biases[i].chunk(world, 0)[rank] if mode == "column" else full.biases[i])
        g = torch.Generator().manual_seed(5)
        x = torch.randn(sum(SPLITS), 128, generator=g)
        dy = torch.randn(sum(SPLITS), 128, generator=g)
        x_local = x if mode == "column" else x.chunk(world, 1)[rank]
        x_local = x_local.clone().requires_grad_()
        for _ in range(2):
            layer.zero_grad()
            with fp8_autocast(fp8_recipe=recipe, fp8_group=group):
                y = layer(x_local, SPLITS)
            y.backward(dy.chunk(world, 1)[rank] if mode == "column" else dy)
        out[mode] = (y.detach(), layer.weight0.grad.clone())
    return out


def test_expert_tensor_parallel_matches_single_process():
    results = run_distributed(_tp_worker, 2)
    recipe = DelayedScaling(fp8_format=Format.HYBRID)
    FP8GlobalStateManager.reset()
    full, _ = _experts(seed=3, k=128, n=128)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(sum(SPLITS), 128, generator=g)
    dy = torch.randn(sum(SPLITS), 128, generator=g)
    for _ in range(2):
        full.zero_grad()
        with fp8_autocast(fp8_recipe=recipe):
            y = full(x, SPLITS)
        y.backward(dy)
    for rank, res in enumerate(results):
        y_col, dw_col = res["column"]
        assert torch.allclose(y_col, y.chunk(2, 1)[rank], rtol=1e-5, atol=1e-5)
        assert torch.allclose(dw_col, full.weight0.grad.chunk(2, 0)[rank], rtol=1e-5, atol=1e-5)
        y_row, dw_row = res["row"]
        assert torch.allclose(y_row, y, rtol=1e-5, atol=1e-4)
        assert torch.allclose(dw_row, full.weight0.grad.chunk(2, 1)[rank], rtol=1e-5, atol=1e-5)
