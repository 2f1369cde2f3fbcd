"""The FP8 linear autograd function: each GEMM uses the right operands, layouts and formats, and the
gradients match a float64 reference within bounds derived from the formats' precision."""
import math

import pytest
import torch

from mindspeed_te import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    RecipeState,
)
from mindspeed_te.ops import LinearQuantizers, WeightCache, fp8_linear
from tests.recipes import NAMES, recipes

IDS = [name for name in NAMES if name != "high precision"]
RECIPES = list(recipes(*IDS).values())

# Relative rounding error bound of one element: 2^-(mantissa bits + 1). HiF8 keeps 3 bits for scaled
# magnitudes in [2^-3, 2^4) (forward target 15) and 2 bits up to 2^8 (backward target 224).
UNIT = {"E4M3": 2**-4, "E5M2": 2**-3, "HIF8_fwd": 2**-4, "HIF8_bwd": 2**-3}


def _unit(recipe, forward: bool) -> float:
    dtype = recipe.fp8_dtype(forward).name
    return UNIT[f"HIF8_{'fwd' if forward else 'bwd'}"] if dtype == "HIF8" else UNIT[dtype]


def _quantizers(recipe):
    fwd = RecipeState.create(recipe, forward=True, num_quantizers=3)
    bwd = RecipeState.create(recipe, forward=False, num_quantizers=2)
    if isinstance(recipe, DelayedScaling):
        # Scales as a previous step would have left them for data of these magnitudes.
        fwd.scale.copy_(torch.tensor([recipe.target_max(True) / 4.0] * 3))
        bwd.scale.copy_(torch.tensor([recipe.target_max(False) / 4.0] * 2))
    f, b = fwd.make_quantizers(), bwd.make_quantizers()
    return LinearQuantizers(f[0], f[1], b[0]), (fwd, bwd)


def _data(m=64, k=128, n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.5
    b = torch.randn(n, generator=g)
    dy = torch.randn(m, n, generator=g) * 0.25
    return x, w, b, dy


def _run(recipe, x, w, b, dy, **kwargs):
    q, states = _quantizers(recipe)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    y = fp8_linear(xr, wr, br, quantizers=q, **kwargs)
    y.backward(dy)
    return y.detach(), xr.grad, wr.grad, br.grad, states


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_gemms_are_exact_on_the_quantized_operands(recipe):
    """fprop/dgrad/wgrad equal float64 GEMMs of independently quantized operands in the expected layouts."""
    x, w, b, dy = _data()
    y, dx, dw, db, _ = _run(recipe, x, w, b, dy)
    q, _ = _quantizers(recipe)
    for quantizer in (q.input, q.weight, q.grad_output):
        quantizer.set_usage(rowwise=True, columnwise=True)
    qx, qw, qdy = q.input(x), q.weight(w), q.grad_output(dy)
    d = lambda t, col=False: t.dequantize(torch.float64, columnwise=col)  # noqa: E731
    ref_y = d(qx) @ d(qw).t() + b.double()
    ref_dx = d(qdy) @ d(qw, col=True)
    ref_dw = d(qdy, col=True).t() @ d(qx, col=True)
    for got, ref in ((y, ref_y), (dx, ref_dx), (dw, ref_dw)):
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.allclose(db.double(), dy.double().sum(0), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_gradients_within_format_precision_of_float64(recipe):
    x, w, b, dy = _data(seed=1)
    y, dx, dw, _, _ = _run(recipe, x, w, b, dy)
    xd, wd, dyd = x.double(), w.double(), dy.double()
    uf, ub = _unit(recipe, True), _unit(recipe, False)
    # Elementwise bound for a·b with relative errors ua, ub per element: (ua + ub + ua·ub) Σ|a||b|, plus
    # a small absolute allowance for elements that land in the formats' subnormal range.
    cases = [
        (y, xd @ wd.t() + b.double(), xd.abs() @ wd.abs().t(), uf, uf),
        (dx, dyd @ wd, dyd.abs() @ wd.abs(), ub, uf),
        (dw, dyd.t() @ xd, dyd.abs().t() @ xd.abs(), ub, uf),
    ]
    for got, ref, mag, ua, ubb in cases:
        bound = (ua + ubb + ua * ubb) * mag + 1e-3 * mag.max()
        assert ((got.double() - ref).abs() <= bound).all()
        rel = ((got.double() - ref).norm() / ref.norm()).item()
        assert rel < math.sqrt(2) * max(ua, ubb)  # and the typical error is far below the worst case


def test_hybrid_gradients_use_e5m2_and_forward_e4m3():
    """HYBRID differs from E4M3 only in the backward GEMMs."""
    x, w, b, dy = _data(seed=2)
    e4 = _run(Float8CurrentScaling(fp8_format=Format.E4M3), x, w, b, dy)
    hy = _run(Float8CurrentScaling(fp8_format=Format.HYBRID), x, w, b, dy)
    assert torch.equal(e4[0], hy[0])
    assert not torch.equal(e4[1], hy[1]) and not torch.equal(e4[2], hy[2])


def test_high_precision_wgrad_and_main_grad_fusion():
    recipe = Float8CurrentScaling(fp8_format=Format.E4M3)
    x, w, b, dy = _data(seed=3)
    _, _, dw, _, _ = _run(recipe, x, w, b, dy, fp8_wgrad=False)
    assert torch.allclose(dw, dy.t() @ x, rtol=1e-5, atol=1e-4)  # wgrad saw the real, unquantized operands
    # Accumulation into main_grad: two micro-batches add up. As TransformerEngine does, a weight carrying
    # Megatron's `grad_added_to_main_grad` gets it set and a placeholder .grad of its shape (Megatron's
    # --overlap-grad-reduce hook requires a grad); one without the attribute gets no .grad.
    wr = w.clone().requires_grad_()
    wr.main_grad = torch.ones_like(w)
    wr.grad_added_to_main_grad = False
    plain = w.clone().requires_grad_()
    plain.main_grad = torch.zeros_like(w)
    fp8_linear(x, plain, None, quantizers=_quantizers(recipe)[0], fuse_wgrad_accumulation=True).backward(dy)
    assert plain.grad is None and not hasattr(plain, "grad_added_to_main_grad")
    for _ in range(2):
        q, _ = _quantizers(recipe)
        fp8_linear(x, wr, None, quantizers=q, fuse_wgrad_accumulation=True).backward(dy)
    q.grad_output.set_usage(rowwise=True, columnwise=True)
    q.input.set_usage(rowwise=True, columnwise=True)
    one = q.grad_output(dy).dequantize(columnwise=True).t() @ q.input(x).dequantize(columnwise=True)
    assert wr.grad_added_to_main_grad and wr.grad.shape == w.shape
    assert torch.allclose(wr.main_grad, 1 + 2 * one, rtol=1e-5, atol=1e-4)
    wr.grad, wr.zero_out_wgrad = None, True  # a weight whose placeholder Megatron adds (shared embeddings)
    fp8_linear(x, wr, None, quantizers=_quantizers(recipe)[0], fuse_wgrad_accumulation=True).backward(dy)
    assert torch.equal(wr.grad, torch.zeros_like(w))


def test_weight_quantized_once_per_step_across_microbatches():
    recipe = DelayedScaling(fp8_format=Format.HYBRID)
    x, w, b, dy = _data(seed=4)
    q, (fwd, _) = _quantizers(recipe)
    cache = WeightCache()
    wr = w.clone().requires_grad_()
    y1 = fp8_linear(x, wr, None, quantizers=q, weight_cache=cache, is_first_microbatch=True)
    first = cache.quantized
    with torch.no_grad():
        wr.mul_(2.0)  # a changed weight is NOT re-quantized within the step
    y2 = fp8_linear(x, wr, None, quantizers=q, weight_cache=cache, is_first_microbatch=False)
    assert cache.quantized is first and torch.equal(y1, y2)
    y3 = fp8_linear(x, wr, None, quantizers=q, weight_cache=cache, is_first_microbatch=True)
    assert not torch.equal(y1, y3)


def test_saves_only_quantized_operands():
    """Bytes kept for backward: about half of what a bf16 linear keeps (its input and weight)."""
    x, w, _, _ = _data(m=256, k=256, n=256)
    for recipe in (DelayedScaling(fp8_format=Format.HIF8), Float8BlockScaling(), MXFP8BlockScaling()):
        q, _ = _quantizers(recipe)
        packed = []

        def pack(t, packed=packed):
            packed.append(t)
            return t

        xr, wr = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = fp8_linear(xr, wr, None, quantizers=q)
        saved = y.grad_fn.saved  # the autograd function keeps quantized storages on ctx
        nbytes = sum(s.nbytes() for s in saved)
        assert not packed  # no high-precision tensor went through save_for_backward
        assert nbytes <= 0.55 * (xr.numel() + wr.numel()) * 2


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="in_features"):
        fp8_linear(torch.ones(2, 3), torch.ones(4, 5))


@pytest.mark.parametrize("fp8_wgrad", [True, False], ids=["fp8 wgrad", "high-precision wgrad"])
@pytest.mark.parametrize("name", ["delayed/e4m3", "tensorwise/hybrid", "blockwise/e4m3", "mxfp8/e4m3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_wgrad_accumulates_into_a_half_precision_main_grad(name, dtype, fp8_wgrad):
    """Megatron's --grad-reduce-in-bf16 (and --fp16) hand bfloat16/float16 main_grads: the float32 weight gradient
    is added into them rounded once, main_grad.float() + dW in float32 (TransformerEngine accumulates in main_grad's
    own dtype); the float32 dW is what the same GEMM adds into a float32 zero buffer."""
    recipe = recipes(name)[name]
    x, w, b, dy = _data(seed=4)
    start = (torch.randn(w.shape, generator=torch.Generator().manual_seed(5)) * 4).to(dtype)
    sums = {}
    for main_dtype in (torch.float32, dtype):
        wr = w.clone().requires_grad_()
        wr.main_grad = torch.zeros(w.shape) if main_dtype == torch.float32 else start.clone()
        q, _ = _quantizers(recipe)
        fp8_linear(x, wr, None, quantizers=q, fp8_wgrad=fp8_wgrad, fuse_wgrad_accumulation=True).backward(dy)
        sums[main_dtype] = wr.main_grad
    assert sums[dtype].dtype == dtype
    assert torch.equal(sums[dtype], (start.float() + sums[torch.float32]).to(dtype))


@pytest.mark.parametrize("name", ["tensorwise/hybrid", "blockwise/e4m3", "mxfp8/e4m3", "tensorwise/hif8",
                                  "delayed/e4m3", "delayed/hif8"])
def test_save_original_input_saves_the_input_and_gives_the_same_gradients(name):
    """TransformerEngine's save_original_input (Megatron sets it on shared experts and for recompute): backward
    holds the input itself, not its quantized columnwise copy, and quantizes it there; the outputs and gradients
    are those of the default, bit for bit. Delayed scaling too, unlike TE: with the forward's scale, recording no
    amax (tests/test_save_original_input.py: across scale updates)."""
    recipe = recipes(name)[name]
    x, w, b, dy = _data(seed=6)
    runs = {}
    for save in (False, True):
        runs[save] = _run(recipe, x, w, b, dy, save_original_input=save)[:4]
        q, _ = _quantizers(recipe)
        y = fp8_linear(x, w.clone().requires_grad_(), None, quantizers=q, save_original_input=save)
        held = y.grad_fn.saved[0]  # what the autograd node keeps of the input for the wgrad
        assert (isinstance(held, torch.Tensor) and torch.equal(held, x)) == save, type(held)
    for a, c in zip(runs[False], runs[True]):
        assert torch.equal(a, c)


def test_fused_wgrad_placeholders_are_kept_for_a_bounded_number_of_shapes():
    """The placeholder .grad a weight gets after accumulating into main_grad is one weight-sized buffer per shape:
    over many shapes no more than DUMMY_WGRADS_KEPT of them stay alive once the callers drop them, and every one
    has its weight's shape (zeros when the weight asks for zero_out_wgrad)."""
    import gc
    import weakref

    from mindspeed_te.ops import linear

    bound = getattr(linear, "DUMMY_WGRADS_KEPT", 8)
    alive: list[weakref.ref] = []
    for i in range(3 * bound):
        w = torch.empty(8 + i, 16).requires_grad_()
        w.grad_added_to_main_grad, w.zero_out_wgrad = False, True
        dummy = linear._finish_fused_wgrad(w)
        assert w.grad_added_to_main_grad and torch.equal(dummy, torch.zeros(8 + i, 16))
        alive.append(weakref.ref(dummy))
        del dummy
        gc.collect()
        assert sum(ref() is not None for ref in alive) <= bound, f"placeholders of {i + 1} shapes all kept"


def test_fused_wgrad_accumulation_is_exact_across_more_shapes_than_are_kept():
    """Cycling through more weight shapes than placeholders are kept, twice: main_grad gains exactly dYᵀ·X each time
    (high precision: float32 addmm against the float64 product) and the .grad Megatron's hook sees is zeros."""
    from mindspeed_te.ops import linear

    shapes = [(12 + 4 * i, 24) for i in range(getattr(linear, "DUMMY_WGRADS_KEPT", 8) + 3)]
    g = torch.Generator().manual_seed(7)
    weights = []
    for n, k in shapes:
        w = torch.randn(n, k, generator=g).requires_grad_()
        w.main_grad = torch.zeros(n, k)
        w.grad_added_to_main_grad, w.zero_out_wgrad = False, True
        weights.append(w)
    want = [torch.zeros(n, k, dtype=torch.float64) for n, k in shapes]
    for _ in range(2):
        for w, total in zip(weights, want):
            x = torch.randn(10, w.shape[1], generator=g)
            dy = torch.randn(10, w.shape[0], generator=g)
            w.grad = None
            fp8_linear(x, w, None, fuse_wgrad_accumulation=True).backward(dy)
            total += dy.double().t() @ x.double()
            assert torch.equal(w.grad, torch.zeros(w.shape))
            assert torch.allclose(w.main_grad.double(), total, rtol=1e-5, atol=1e-5)
