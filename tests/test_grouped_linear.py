"""GroupedLinear (MoE experts): equals one Linear / fp8_linear per expert in every recipe and stays within the
formats' bounds of float64; backward keeps only columnwise quantized operands; main_grad fusion, calibration,
the BF16 expert switch; expert tensor parallelism on 2 gloo processes matches one process; the backward amax
reduction waits for every expert."""
import pytest
import torch
import torch.nn.functional as F

from mindspeed_te import (
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    FP8GlobalStateManager,
    MXFP8BlockScaling,
    QuantizedTensor,
    fp8_autocast,
    fp8_model_init,
)
from mindspeed_te.modules import GroupedLinear, Linear
from mindspeed_te.ops import LinearQuantizers, WeightCache, fp8_linear
from mindspeed_te.ops.grouped_linear import grouped_linear
from mindspeed_te.recipe_state import RecipeState
from mindspeed_te.tensor import MXFP8TensorStorage
from tests.dist_utils import run_distributed
from tests.recipes import recipe, recipes

RECIPES = recipes("high precision", "delayed/hybrid", "tensorwise/hif8", "blockwise/e4m3", "mxfp8/e4m3")
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


# Unit roundoff of the coarsest operand format of the forward and the backward GEMMs: each element of a
# quantized operand is off by at most this (relative), so a GEMM's relative error norm stays below it.
FORMAT_BOUNDS = {
    "high precision": (1e-6, 1e-6),
    "delayed/hybrid": (2**-4, 2**-3),  # E4M3 forward, E5M2 gradients
    "tensorwise/hif8": (2**-4, 2**-3),  # 3 mantissa bits up to the target 15, 2 bits near the gradient target 224
    "blockwise/e4m3": (2**-4, 2**-4),
    "mxfp8/e4m3": (2**-4, 2**-4),
}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("name", list(RECIPES))
def test_outputs_and_gradients_within_format_bounds_of_float64(name):
    grouped, _ = _experts(seed=1)
    x = torch.randn(sum(SPLITS), 128, requires_grad=True)
    dy = torch.randn(sum(SPLITS), 64)
    with fp8_autocast(enabled=RECIPES[name] is not None, fp8_recipe=RECIPES[name]):
        y = grouped(x, SPLITS)
    y.backward(dy)
    xd = x.detach().double().requires_grad_()
    wd = [w.detach().double().requires_grad_() for w in grouped.weights]
    bd = [b.detach().double().requires_grad_() for b in grouped.biases]
    yd = torch.cat([F.linear(part, w, b) for part, w, b in zip(torch.split(xd, SPLITS), wd, bd)])
    yd.backward(dy.double())
    fwd_bound, bwd_bound = FORMAT_BOUNDS[name]
    assert _rel(y, yd) <= fwd_bound
    assert _rel(x.grad, xd.grad) <= bwd_bound
    for i in (0, 2, 3):
        assert _rel(grouped.weights[i].grad, wd[i].grad) <= bwd_bound
        assert _rel(grouped.biases[i].grad, bd[i].grad) <= 1e-6  # bias gradients are high-precision sums


def _mx_quantizers(n):
    fwd = RecipeState.create(MXFP8BlockScaling(), forward=True, num_quantizers=3 * n).make_quantizers()
    bwd = RecipeState.create(MXFP8BlockScaling(), forward=False, num_quantizers=2 * n).make_quantizers()
    return [LinearQuantizers(fwd[3 * i], fwd[3 * i + 1], bwd[2 * i]) for i in range(n)]


def test_op_matches_fp8_linear_per_slice_and_saves_only_columnwise_operands():
    grouped, _ = _experts()
    weights = [w.detach().clone().requires_grad_() for w in grouped.weights]
    x = torch.randn(sum(SPLITS), 128, requires_grad=True)
    dy = torch.randn(sum(SPLITS), 64)
    caches = [WeightCache() for _ in SPLITS]
    y = grouped_linear(x, SPLITS, weights, quantizers=_mx_quantizers(len(SPLITS)), weight_caches=caches,
                       is_first_microbatch=True)
    saved_x, saved_w = y.grad_fn.saved
    assert len(saved_x) == len(saved_w) == 3  # the expert without rows saves nothing
    for t in saved_x + saved_w:
        assert isinstance(t, MXFP8TensorStorage) and t.rowwise_data is None and t.columnwise_data is not None
    assert all(caches[i].quantized.rowwise_data is not None for i in (0, 2, 3))  # the cached weights stay whole
    y.backward(dy)

    xs = [part.detach().requires_grad_() for part in torch.split(x.detach(), SPLITS)]
    ws = [w.detach().clone().requires_grad_() for w in weights]
    q = _mx_quantizers(1)[0]
    ys = [fp8_linear(part, w, quantizers=q) for part, w in zip(xs, ws)]
    for yi, dyi in zip(ys, torch.split(dy, SPLITS)):
        yi.backward(dyi)
    assert torch.equal(y, torch.cat(ys)) and torch.equal(x.grad, torch.cat([p.grad for p in xs]))
    for i in (0, 2, 3):
        assert torch.equal(weights[i].grad, ws[i].grad)


def _trained_experts(recipe, x, dy, prepare=None, **attributes):
    """Fresh experts with `attributes` set (and `prepare` run on them), after one forward and backward of x
    under `recipe` (high precision when None): (experts, output, the input that took the gradient)."""
    FP8GlobalStateManager.reset()
    grouped, _ = _experts()
    for name, value in attributes.items():
        setattr(grouped, name, value)
    if prepare is not None:
        prepare(grouped)
    xr = x.clone().requires_grad_()
    with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        y = grouped(xr, SPLITS)
    y.backward(dy)
    return grouped, y, xr


@pytest.mark.parametrize("name", ["high precision", "delayed/hybrid"])
def test_main_grad_fusion_accumulates_in_float32(name):
    recipe = RECIPES[name]
    x, dy = torch.randn(sum(SPLITS), 128), torch.randn(sum(SPLITS), 64)
    grads = []
    for fuse in (False, True):
        def main_grads(grouped):
            for w in grouped.weights:
                w.main_grad = torch.full_like(w, 0.5)
                w.grad_added_to_main_grad = False  # as Megatron's DDP marks its parameters

        grouped, _, _ = _trained_experts(recipe, x, dy, prepare=main_grads, fuse_wgrad_accumulation=fuse)
        grads.append([w.grad if not fuse else w.main_grad for w in grouped.weights])
        if fuse:  # TransformerEngine's placeholder .grad beside the flag, for the expert without rows too
            assert all(w.grad_added_to_main_grad and w.grad.shape == w.shape for w in grouped.weights)
    for plain, fused in zip(*grads):
        assert torch.equal(plain + 0.5, fused)


def test_calibration_records_each_experts_amax():
    grouped, _ = _experts()
    x = torch.randn(sum(SPLITS), 128)
    with fp8_autocast(enabled=False, calibrating=True, fp8_recipe=DelayedScaling(amax_history_len=1)):
        y = grouped(x, SPLITS)
    assert torch.equal(y, grouped(x, SPLITS))  # calibration runs in high precision
    scale = grouped.fp8_states[0].scale
    n = len(SPLITS)  # TE's grouped layout: every expert's input, then every weight
    for i, rows in enumerate(torch.split(x, SPLITS)):
        if rows.shape[0]:
            assert scale[i].item() == pytest.approx(448.0 / rows.abs().max().item(), rel=1e-6)
            assert scale[n + i].item() == pytest.approx(448.0 / grouped.weights[i].abs().max().item(), rel=1e-6)
        else:
            assert scale[i].item() == scale[n + i].item() == 1.0


def test_high_precision_experts_leave_the_amax_reduction_to_fp8_modules():
    """With FP8 grouped GEMMs off, the experts running first must not take the first-module flag: the FP8
    linear after them still reduces the backward amaxes."""
    experts = GroupedLinear(2, 32, 16, use_fp8_gemm=False)
    linear = Linear(16, 8)
    x = torch.randn(6, 32)
    with fp8_autocast(fp8_recipe=DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=1)):
        y = linear(experts(x, [2, 4]))
    y.backward(torch.full_like(y, 2.0))
    assert experts.fp8_states is None
    assert linear.fp8_states[1].scale[0].item() == 57344.0 / 2


def test_bad_m_splits_and_empty_experts():
    grouped, _ = _experts()
    with pytest.raises(ValueError, match="m_splits"):
        grouped(torch.randn(10, 128), [5, 5, 5, 5])
    with pytest.raises(ValueError, match="m_splits"):
        grouped(torch.randn(10, 128), [5, 5])
    out = grouped(torch.randn(0, 128), [0, 0, 0, 0])
    assert out.shape == (0, 64)


def test_backward_amax_reduction_after_every_expert():
    grouped, _ = _experts()
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=2)
    x = torch.randn(sum(SPLITS), 128, requires_grad=True)
    with fp8_autocast(fp8_recipe=recipe):
        y = grouped(x, SPLITS)
    y.backward(torch.ones_like(y) * 4.0)
    bwd = grouped.fp8_states[1]
    # grad_output quantizers (slots 0..3, TE's grouped layout) of the three non-empty experts saw amax 4:
    # scale 57344 / 4 for each.
    assert bwd.scale[[0, 2, 3]].tolist() == [57344.0 / 4] * 3
    assert bwd.scale[1].item() == 1.0 and not bwd.amax_history[0].any()


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


TP_TOLERANCES = {  # exact: delayed reduces amaxes over the group, block/MX tiles line up with 128-wide shards
    "high precision": 2e-6, "delayed/hybrid": 2e-6, "blockwise/e4m3": 2e-6, "mxfp8/e4m3": 2e-6,
    "tensorwise/hif8": 2 * 2**-3,  # per-shard scales
}
WIDTH = 512


def _train_experts(layer, recipe_name, x, dy, group):
    FP8GlobalStateManager.reset()
    x = x.clone().requires_grad_()
    for _ in range(2):
        layer.zero_grad()
        fp8_recipe = recipe(recipe_name)
        with fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe, fp8_group=group):
            y = layer(x, SPLITS)
        y.backward(dy)
    return y.detach(), x.grad, layer.weight2.grad.clone()


def _tp_data():
    g = torch.Generator().manual_seed(5)
    return torch.randn(sum(SPLITS), WIDTH, generator=g), torch.randn(sum(SPLITS), WIDTH, generator=g)


def _tp_worker(rank: int, world: int) -> dict:
    group = torch.distributed.new_group(list(range(world)))
    x, dy = _tp_data()
    out = {}
    for name in TP_TOLERANCES:
        for mode in ("column", "row"):
            full, _ = _experts(seed=3, k=WIDTH, n=WIDTH)
            layer = GroupedLinear(len(SPLITS), WIDTH, WIDTH, parallel_mode=mode, tp_group=group)
            dim = 0 if mode == "column" else 1
            with torch.no_grad():
                for i in range(len(SPLITS)):
                    layer.weights[i].copy_(full.weights[i].chunk(world, dim)[rank])
                    layer.biases[i].copy_(full.biases[i].chunk(world, 0)[rank] if mode == "column"
                                          else full.biases[i])
            x_local = x if mode == "column" else x.chunk(world, 1)[rank]
            dy_local = dy.chunk(world, 1)[rank] if mode == "column" else dy
            out[(name, mode)] = _train_experts(layer, name, x_local, dy_local, group)
    return out


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_expert_tensor_parallel_matches_single_process(world):
    results = run_distributed(_tp_worker, world)
    x, dy = _tp_data()
    for name, tol in TP_TOLERANCES.items():
        full, _ = _experts(seed=3, k=WIDTH, n=WIDTH)
        y, dx, dw = _train_experts(full, name, x, dy, None)
        for rank, res in enumerate(results):
            col_y, col_dx, col_dw = res[(name, "column")]
            assert _rel(col_y, y.chunk(world, 1)[rank]) <= tol, name
            assert _rel(col_dw, dw.chunk(world, 0)[rank]) <= tol, name
            # The column input is replicated; its gradient is all-reduced over the group.
            assert _rel(col_dx, dx) <= tol, name
            row_y, row_dx, row_dw = res[(name, "row")]
            assert _rel(row_y, y) <= tol, name
            assert _rel(row_dx, dx.chunk(world, 1)[rank]) <= tol, name
            assert _rel(row_dw, dw.chunk(world, 1)[rank]) <= tol, name


@pytest.mark.parametrize("name", ["tensorwise/hif8", "blockwise/e4m3", "mxfp8/e4m3", "delayed/hybrid"])
def test_save_original_input_gives_the_same_results(name):
    """GroupedLinear(save_original_input=True) (Megatron sets it for moe_act recompute and offloading): the
    experts' inputs are quantized again in backward (delayed scaling: with the forward's scales, see
    tests/test_save_original_input.py); outputs and gradients equal the default's bit for bit."""
    recipe = RECIPES[name]
    x, dy = torch.randn(sum(SPLITS), 128), torch.randn(sum(SPLITS), 64)
    results = []
    for save in (False, True):
        grouped, y, xr = _trained_experts(recipe, x, dy, save_original_input=save)
        results.append([y.detach(), xr.grad] + [w.grad for w in grouped.weights])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_joined_rows_spans_only_row_blocks_in_order_of_one_buffer():
    """`joined_rows` is what lets one kernel read all experts' rows: it must view exactly the split blocks,
    and refuse anything that a view cannot span (another order, a gap, another buffer, a transposed block)."""
    from mindspeed_te.tensor import joined_rows

    x = torch.arange(40.0).reshape(10, 4).clone()  # a base of its own, as a GEMM output
    blocks = list(torch.split(x, [3, 0, 5, 2]))
    joined = joined_rows(blocks)
    assert joined is not None and joined.data_ptr() == x.data_ptr() and torch.equal(joined, x)
    assert torch.equal(joined_rows(blocks[2:]), x[3:])
    assert joined_rows([blocks[2], blocks[0]]) is None  # out of order
    assert joined_rows([blocks[0], blocks[3]]) is None  # a gap
    assert joined_rows([blocks[0], x[3:8].clone()]) is None  # another buffer
    assert joined_rows([x[:4, :2], x[4:8, :2]]) is None  # column slices: not contiguous
    assert joined_rows([x.t()[:2], x.t()[2:]]) is None
    assert joined_rows([x.t()]) is None and joined_rows([x[:, :2]]) is None  # a lone block is checked too
    assert joined_rows([]) is None
    assert joined_rows(blocks) is x and joined_rows([x]) is x  # the base itself, not a view of it
    assert joined_rows([x[:]]) is x  # one block spanning its base (one expert with rows): the base too
    assert joined_rows(blocks[2:])._base is x  # a part of the base: a view


@pytest.mark.parametrize("splits, fp8", [([64], False), ([0, 64], True), ([5, 37, 22], True)])
def test_grouped_linear_output_can_be_modified_in_place(splits, fp8):
    """Megatron scales the experts' output by the router's probabilities, possibly in place: the output must not
    be a view made inside the autograd function (which autograd refuses to modify in place), whether the
    experts' rows come back as one GEMM output (one expert here) or from several."""
    from mindspeed_te import fp8_autocast

    layer = GroupedLinear(len(splits), 64, 32, bias=False)
    x = torch.randn(sum(splits), 64, requires_grad=True)
    with fp8_autocast(enabled=fp8, fp8_recipe=DelayedScaling()):
        y = layer(x, splits)
    y.mul_(0.5)
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_expert_weights_are_row_blocks_of_one_buffer_in_order():
    """GroupedLinear lays its experts' weights out as Megatron's parameter buffer does (there in reverse), so
    that the NPU path can quantize them in one pass: weight i + 1 is the row block right after weight i. They
    stay separate leaf parameters: each takes its own gradient and in-place update, and the initial values are
    those each expert's weight gets on its own (the same init calls in the same order)."""
    from mindspeed_te.tensor import rows_follow

    torch.manual_seed(0)
    layer = GroupedLinear(3, 64, 32, bias=True)
    torch.manual_seed(0)
    alone = [torch.nn.init.kaiming_uniform_(torch.empty(32, 64), a=5 ** 0.5) for _ in range(3)]
    weights = layer.weights
    assert all(rows_follow(a, b) for a, b in zip(weights, weights[1:]))
    assert all(w.is_leaf and w.requires_grad for w in weights)
    for w, want in zip(weights, alone):
        assert torch.equal(w, want)
    y = layer(torch.randn(6, 64), [2, 0, 4])
    y.sum().backward()
    assert torch.count_nonzero(weights[1].grad) == 0 and torch.count_nonzero(weights[2].grad) > 0
    before = weights[1].detach().clone()
    with torch.no_grad():
        weights[0].add_(1.0)
    assert torch.equal(weights[1], before)
    with fp8_model_init(recipe=DelayedScaling()):
        quantized = GroupedLinear(2, 64, 32, bias=False)
    assert all(isinstance(w, QuantizedTensor) for w in quantized.weights)
