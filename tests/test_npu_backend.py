"""The NPU backend, run on CPU through the torch_npu simulator (which enforces the kernels' contract), must
give the reference backend's results bit for bit, launch few kernels and never synchronize the host."""
import math

import pytest
import torch

from mindspeed_te import (
    DelayedScaling,
    Float8BlockScaling,
    Format,
    FP8GlobalStateManager,
    MXFP8BlockScaling,
    QParams,
    RecipeState,
)
from mindspeed_te.diagnostics import HostSyncCounter
from mindspeed_te.kernels import get_backend, requested_backend
from mindspeed_te.kernels.npu import NpuBackend
from mindspeed_te.ops import LinearQuantizers, fp8_linear
from mindspeed_te.testing.npu_sim import make_release_simulator, make_simulator
from mindspeed_te.testing.npu_sim.releases import RELEASES
from tests.recipes import recipes

NO_POW2 = QParams(power_2_scale=False)
POW2 = QParams(power_2_scale=True)
RECIPES = {
    **recipes("delayed/hybrid", "delayed/hif8", "tensorwise/e4m3", "tensorwise/hybrid", "tensorwise/hif8"),
    "blockwise/e4m3": Float8BlockScaling(fp8_quant_fwd_inp=NO_POW2, fp8_quant_fwd_weight=NO_POW2,
                                         fp8_quant_bwd_grad=NO_POW2),
    **recipes("blockwise/hif8"),  # HiF8's default: the block kernel's scales
    "blockwise pow2/hif8": Float8BlockScaling(
        fp8_format=Format.HIF8, fp8_quant_fwd_inp=POW2, fp8_quant_fwd_weight=POW2, fp8_quant_bwd_grad=POW2),
    "blockwise pow2/e4m3": Float8BlockScaling(),
    "blockwise pow2/hybrid": Float8BlockScaling(fp8_format=Format.HYBRID),
    **recipes("mxfp8/hybrid"),
    "mxfp8/e4m3 floor": MXFP8BlockScaling(scale_rounding="floor"),
}


def _quantizers(recipe):
    fwd = RecipeState.create(recipe, forward=True, num_quantizers=3)
    bwd = RecipeState.create(recipe, forward=False, num_quantizers=2)
    if isinstance(recipe, DelayedScaling):
        fwd.scale.fill_(recipe.target_max(True) / 3.0)
        bwd.scale.fill_(recipe.target_max(False) / 0.5)
    f, b = fwd.make_quantizers(), bwd.make_quantizers()
    return LinearQuantizers(f[0], f[1], b[0])


def _simulator_without_dual_axis():
    """A simulated Ascend 950PR whose torch_npu lacks npu_dynamic_mx_quant_with_dual_axis (`hasattr` is False), so
    that both MX layouts take one npu_dynamic_mx_quant each, as float32 inputs always do."""
    from mindspeed_te.testing.npu_sim import NpuSimulator

    class WithoutDualAxis(NpuSimulator):
        def __getattribute__(self, name):
            if name == "npu_dynamic_mx_quant_with_dual_axis":
                raise AttributeError(name)
            return super().__getattribute__(name)

    return WithoutDualAxis("Ascend950PR")


def _step(use_backend, backend_name, monkeypatch, recipe, sim=None, dtype=torch.bfloat16, shape=(64, 192, 128),
          main_grad=None):
    """One forward and backward of fp8_linear; shape = (tokens, in, out); the weight gradient is added into a
    copy of `main_grad` (default float32 zeros)."""
    use_backend(backend_name)
    if sim is not None:
        monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(sim))
    g = torch.Generator().manual_seed(0)
    m, k, n = shape
    x = (torch.randn(m, k, generator=g) * 2).to(dtype).requires_grad_()
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype).requires_grad_()
    b = torch.randn(n, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(dtype)
    w.main_grad = torch.zeros(n, k) if main_grad is None else main_grad.clone()
    y = fp8_linear(x, w, b, quantizers=_quantizers(recipe), fuse_wgrad_accumulation=True)
    y.backward(dy)
    return y.detach(), x.grad, w.main_grad, b.grad


def _grouped_step(use_backend, backend_name, monkeypatch, recipe, splits, sim=None, dtype=torch.bfloat16):
    """(output, input grad, weight grads) of one forward and backward of GroupedLinear(len(splits), 128, 256)."""
    from mindspeed_te import fp8_autocast
    from mindspeed_te.modules import GroupedLinear

    use_backend(backend_name)
    if sim is not None:
        monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(sim))
    torch.manual_seed(0)
    layer = GroupedLinear(len(splits), 128, 256, params_dtype=dtype)
    x = (torch.randn(sum(splits), 128) * 3).to(dtype).requires_grad_()
    with fp8_autocast(fp8_recipe=recipe):
        y = layer(x, splits)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype))
    return [y.detach(), x.grad] + [w.grad for w in layer.weights]


@pytest.mark.parametrize("name", list(RECIPES))
def test_npu_backend_matches_reference_bit_for_bit(name, monkeypatch, use_backend):
    recipe = RECIPES[name]
    sim = make_simulator()
    got = _step(use_backend, "npu", monkeypatch, recipe, sim)
    want = _step(use_backend, "reference", monkeypatch, recipe)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert sim.launch_counts["npu_quant_matmul"] >= 2  # the GEMMs really went through the kernel
    # the quantize kernel of the longest prefix of the name and its least calls. HiF8 power-of-2 tiles, which no
    # quantize kernel makes, are cast by npu_quantize where k is whole tiles: only grad_output's two layouts here
    # (x and the weight are 192 wide: the quantizer's torch ops).
    quantize_kernel = {"delayed": ("npu_quantize", 3), "tensorwise": ("npu_dynamic_quant", 3),
                       "blockwise/": ("npu_dynamic_block_quant", 3), "blockwise pow2": ("npu_dynamic_mx_quant", 3),
                       "blockwise pow2/hif8": ("npu_quantize", 2), "mxfp8": ("npu_dynamic_mx_quant_with_dual_axis", 3)}
    kernel, calls = quantize_kernel[max((p for p in quantize_kernel if name.startswith(p)), key=len)]
    assert sim.launch_counts[kernel] >= calls


@pytest.mark.parametrize("name", ["delayed/hybrid", "tensorwise/e4m3"])
def test_npu_backend_matches_reference_bit_for_bit_with_one_or_two_tokens(name, monkeypatch, use_backend):
    """float32 GEMMs of one or two rows: torch.mm may then sum in another order when an operand's layout differs,
    so the simulator decodes a transposed x2 into a transposed result, as the reference's operands are laid out
    (decoding it into a row-major copy gave results one float32 ulp apart for some of these seeds)."""
    sim = make_simulator()

    def step(backend_name: str, seed: int, tokens: int) -> list[torch.Tensor]:
        use_backend(backend_name)
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(tokens, 64, generator=g) * 8).requires_grad_()
        w = torch.randn(48, 64, generator=g).requires_grad_()
        y = fp8_linear(x, w, None, quantizers=_quantizers(RECIPES[name]))
        y.backward(torch.randn(tokens, 48, generator=g))
        return [y.detach(), x.grad, w.grad]

    monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(sim))
    for seed in range(16):
        for tokens in (1, 2):
            got, want = step("npu", seed, tokens), step("reference", seed, tokens)
            for g, w in zip(got, want):
                assert torch.equal(g, w), (seed, tokens)
    assert sim.launch_counts["npu_quant_matmul"] == 16 * 2 * 3


@pytest.mark.parametrize("name", ["delayed/hif8", "tensorwise/e4m3", "blockwise pow2/e4m3", "mxfp8/e4m3 floor"])
def test_npu_backend_matches_reference_bit_for_bit_on_the_bf16_gemm(name, monkeypatch, use_backend):
    """GEMMs of 2^24 multiply-adds, large enough that both sides sum FP8 products on oneDNN's bf16 kernel (the
    small ones above take the float32 kernel): the results still agree bit for bit."""
    sim = make_simulator()
    got = _step(use_backend, "npu", monkeypatch, RECIPES[name], sim, shape=(256, 256, 256))
    want = _step(use_backend, "reference", monkeypatch, RECIPES[name], shape=(256, 256, 256))
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("name", [n for n in RECIPES if n.startswith(("delayed", "tensorwise"))])
def test_float32_inputs_match_the_reference_bit_for_bit(name, monkeypatch, use_backend):
    """float32 inputs: delayed scaling divides by the float32 1/scale, tensorwise takes the float32 path
    around npu_quantize (npu_dynamic_quant takes only float16/bfloat16)."""
    sim = make_simulator()
    got = _step(use_backend, "npu", monkeypatch, RECIPES[name], sim, dtype=torch.float32)
    want = _step(use_backend, "reference", monkeypatch, RECIPES[name], dtype=torch.float32)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert sim.launch_counts["npu_quantize"] == 3 and "npu_dynamic_quant" not in sim.launch_counts


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2", "HIF8"])
@pytest.mark.parametrize("backend_name", ["reference", "npu"])
def test_bfloat16_delayed_convention_against_oracles(fmt, backend_name, monkeypatch):
    """A bfloat16 input under delayed scaling is divided by 1/scale rounded to bfloat16 (prepared at the
    update), in float32, rounded once to the format; that rounded divisor is the stored scale_inv. Checked
    against ml_dtypes' bfloat16 rounding and ml_dtypes/en_dtypes casts, after a real per-step update."""
    import ml_dtypes
    import numpy as np

    from mindspeed_te.formats import FP8Dtype
    from mindspeed_te.recipe_state import DelayedScalingRecipeState, update_delayed_states
    from tests.oracles import np_cast

    monkeypatch.setenv("MINDSPEED_TE_BACKEND", backend_name)
    monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(make_simulator()))
    recipe = DelayedScaling(fp8_format=Format.HIF8 if fmt == "HIF8" else Format.HYBRID)
    state = DelayedScalingRecipeState(recipe, mode="forward" if fmt != "E5M2" else "backward", num_quantizers=2)
    state.amax_history[0] = torch.tensor([3.3, 0.7])  # -> scales target / amax, 1/scale not bf16-exact
    update_delayed_states([state])
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(48, 64, generator=g) * 3).bfloat16()
    out = get_backend(x.device).quantize(state.make_quantizers()[0], x)
    scale = np.float32(state.scale[0].item())
    divisor = np.float32((np.float32(1.0) / scale).astype(ml_dtypes.bfloat16))
    assert divisor != np.float32(1.0) / scale  # the rounding matters for this scale
    assert out.scale_inv.dtype == torch.float32 and out.scale_inv.item() == divisor
    codes = np_cast(x.float().numpy() / divisor, fmt)
    np.testing.assert_array_equal(out.data.view(torch.uint8).numpy(), codes)
    assert FP8Dtype[fmt] is out.fp8_dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["delayed/hybrid", "delayed/hif8"])
def test_delayed_scaling_keeps_npu_quantize_where_torch_npu_has_npu_quant_max(name, dtype, monkeypatch, use_backend):
    """torch_npu's npu_quant_max casts and takes the amax in one launch, but it multiplies x by the scale, where
    delayed scaling divides by the 1/scale prepared at the update (bfloat16-rounded for bfloat16 inputs): the
    codes differ at the format's ties (x / 1.75 = 0.78125 for x = 1.3671875, an E4M3 tie that x * (1 / 1.75)
    leaves upwards). So a torch_npu that has it changes nothing: the reference's bits, npu_quantize's launches."""
    from mindspeed_te.formats import FP8Dtype
    from mindspeed_te.kernels.reference import ReferenceBackend
    from mindspeed_te.quantizers import Float8Quantizer
    from mindspeed_te.testing.npu_sim import make_simulator_with_quant_max

    sim = make_simulator_with_quant_max()
    got = _step(use_backend, "npu", monkeypatch, RECIPES[name], sim, dtype=dtype)
    want = _step(use_backend, "reference", monkeypatch, RECIPES[name], dtype=dtype)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert "npu_quant_max" not in sim.launch_counts and sim.launch_counts["npu_quantize"] == 3
    x = torch.tensor([1.3671875, 2.734375, 5.46875, -3.171875, 0.5], dtype=dtype)
    fmt = FP8Dtype.HIF8 if name.endswith("hif8") else FP8Dtype.E4M3
    outs = [backend.quantize(Float8Quantizer(torch.tensor([1 / 1.75]), torch.zeros(1), fmt), x)
            for backend in (NpuBackend(sim), ReferenceBackend())]
    assert torch.equal(outs[0].data.view(torch.uint8), outs[1].data.view(torch.uint8))
    assert torch.equal(outs[0].scale_inv, outs[1].scale_inv)
    if fmt is FP8Dtype.E4M3 and dtype == torch.bfloat16:  # the divisor is 1.75: the ties go down to even
        assert outs[0].data[:4].float().tolist() == [0.75, 1.5, 3.0, -1.75]


def test_kernels_used_and_launch_counts(monkeypatch):
    """Delayed HiF8: forward = quantize input + GEMM with the step's weight already quantized; backward =
    quantize grad + dgrad + wgrad."""
    sim = make_simulator()
    backend = NpuBackend(sim)
    q = _quantizers(RECIPES["delayed/hif8"])
    x = torch.randn(32, 64).requires_grad_()
    w = torch.randn(48, 64).requires_grad_()
    qw = backend.quantize(q.weight, w)  # once per step (is_first_microbatch)
    sim.reset_counts()
    qx = backend.quantize(q.input, x)
    backend.gemm(qx, qw)
    forward = sim.total_launches()
    sim.reset_counts()
    qdy = backend.quantize(q.grad_output, torch.randn(32, 48))
    backend.gemm(qdy, qw, b_columnwise=True)
    backend.gemm(qdy, qx, a_columnwise=True, b_columnwise=True)
    backward = sim.total_launches()
    assert (forward, backward) == (2, 3)
    assert sim.launch_counts == {"npu_quantize": 1, "npu_quant_matmul": 2}


def test_no_host_sync_through_the_npu_path(monkeypatch, use_backend):
    sim = make_simulator()
    for name in ("delayed/hif8", "tensorwise/hif8", "mxfp8/hybrid"):
        with HostSyncCounter() as counter:
            _step(use_backend, "npu", monkeypatch, RECIPES[name], sim)
        assert counter.total == 0, (name, dict(counter.counts))


def test_backend_selection_and_errors(monkeypatch, use_backend):
    use_backend("fast")
    with pytest.raises(ValueError, match="MINDSPEED_TE_BACKEND='fast' is not valid; allowed: auto, npu, torch"):
        requested_backend()
    use_backend("auto")
    assert get_backend("cpu").name == "reference"
    use_backend("torch")
    assert get_backend("cpu").name == "torch"
    a2 = NpuBackend(make_simulator("Ascend910B3"))
    ok, reason = a2.available()
    assert not ok and "Ascend 950" in reason


def test_chip_without_fp8_is_refused_by_the_kernel():
    backend = NpuBackend(make_simulator("Ascend910B3"))
    q = _quantizers(RECIPES["delayed/hybrid"])
    with pytest.raises(RuntimeError, match="950"):
        backend.quantize(q.input, torch.randn(4, 32))


def test_fp8_availability_reports_the_chip(monkeypatch, use_backend):
    use_backend("npu")
    monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend",
                        lambda: NpuBackend(make_simulator("Ascend910B3")))
    ok, reason = FP8GlobalStateManager.is_fp8_available()
    assert not ok and "Ascend910B3" in reason
    from mindspeed_te import fp8_autocast

    with pytest.raises(RuntimeError, match="FP8 is not available: the NPU is Ascend910B3"):
        with fp8_autocast():
            pass
    assert not FP8GlobalStateManager.is_fp8_enabled()


def test_rms_norm_runs_the_fused_kernel(monkeypatch, use_backend):
    from mindspeed_te.modules import RMSNorm

    sim = make_simulator()
    norm = RMSNorm(64, eps=1e-6, zero_centered_gamma=True)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(8, 3, 64, requires_grad=True)
    use_backend("reference")
    want = norm(x)
    use_backend("npu")
    monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(sim))
    got = norm(x)
    assert sim.launch_counts["npu_rms_norm"] == 1
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    got.sum().backward()  # the kernel's output is differentiable
    assert x.grad is not None and norm.weight.grad is not None


@pytest.mark.parametrize("name", ["delayed/hybrid", "delayed/hif8", "tensorwise/hif8", "mxfp8/hybrid",
                                  "blockwise/e4m3", "blockwise/hif8"])
def test_grouped_linear_through_npu_grouped_matmul(name, monkeypatch, use_backend):
    """MoE experts: per-tensor recipes and MXFP8 use one npu_grouped_matmul per GEMM kind (MXFP8 its M-split and
    K-split MX modes), blockwise one for fprop and one for dgrad (its G-B mode); results equal the reference."""
    from mindspeed_te import fp8_autocast
    from mindspeed_te.modules import GroupedLinear

    def run(backend_name, sim=None):
        use_backend(backend_name)
        if sim is not None:
            monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(sim))
        torch.manual_seed(0)
        layer = GroupedLinear(3, 64, 128).bfloat16()
        for w in layer.weights:
            w.main_grad = torch.zeros(128, 64)
        layer.fuse_wgrad_accumulation = True
        x = torch.randn(128, 64).bfloat16().requires_grad_()
        with fp8_autocast(fp8_recipe=RECIPES[name]):
            y = layer(x, [64, 0, 64])
        y.backward(torch.randn(128, 128, generator=torch.Generator().manual_seed(1)).bfloat16())
        return [y.detach(), x.grad] + [w.main_grad for w in layer.weights]

    sim = make_simulator()
    got = run("npu", sim)
    want = run("reference")
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    if name.startswith(("delayed", "tensorwise", "mxfp8")):
        # fprop, dgrad, wgrad: one call each (MXFP8's wgrad the K-split MX mode)
        assert sim.launch_counts["npu_grouped_matmul"] == 3 and "npu_quant_matmul" not in sim.launch_counts
    else:
        assert sim.launch_counts["npu_grouped_matmul"] == 2  # fprop, dgrad; the wgrad takes one GEMM per expert
    if name.startswith("delayed"):
        # the two experts' inputs, and their grad_outputs, each in one call; the weights one by one
        assert sim.launch_counts["npu_quantize"] == 4


@pytest.mark.parametrize("name", ["delayed/hybrid", "delayed/hif8", "mxfp8/hybrid", "blockwise/hif8",
                                  "blockwise/e4m3", "blockwise pow2/e4m3", "blockwise pow2/hif8"])
def test_expert_weights_in_one_buffer_quantize_together(name, monkeypatch, use_backend):
    """Expert weights that are row blocks of one buffer, in order (as GroupedLinear lays them out) or in
    reverse (Megatron's contiguous parameter buffer, --use-distributed-optimizer, no biases), are quantized as
    one tensor where the rowwise form is row-local or per-tensor with a divisor per row: delayed scaling, one
    npu_quantize for all of them (and one for the inputs), MXFP8 one dual-axis quantize of all weights (whole
    64-row pairs each), 128x128 tiles (each expert whole tiles) one quantize. Results equal the reference bit for
    bit, and those of the same layer with its weights apart (each in storage of its own)."""
    from mindspeed_te import fp8_autocast
    from mindspeed_te.bench.launches import GROUPED_LAYOUTS
    from mindspeed_te.modules import GroupedLinear

    def run(backend_name, layout: str, sim=None):
        use_backend(backend_name)
        if sim is not None:
            monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(sim))
        torch.manual_seed(0)
        layer = GroupedLinear(4, 128, 128, bias=False, params_dtype=torch.bfloat16)
        if GROUPED_LAYOUTS[layout] is not None:
            GROUPED_LAYOUTS[layout](layer)
        x = torch.randn(128, 128).bfloat16().requires_grad_()
        for _ in range(2):  # the second step with real delayed scales
            with fp8_autocast(fp8_recipe=RECIPES[name]):
                y = layer(x, [32, 32, 32, 32])
            y.backward(torch.randn(128, 128, generator=torch.Generator().manual_seed(1)).bfloat16())
        return [y.detach(), x.grad] + [w.grad for w in layer.weights]

    sims = {layout: make_simulator() for layout in GROUPED_LAYOUTS}
    results = {layout: run("npu", layout, sim) for layout, sim in sims.items()}
    want = run("reference", "megatron")
    for got in results.values():
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    apart = sims.pop("apart").launch_counts
    for sim in sims.values():
        launches = dict(sim.launch_counts)
        if name == "blockwise pow2/hif8":  # no kernel makes these scales: one npu_quantize of all 128x128 tiles
            # per step: the weights; the inputs' rowwise forms and each expert's columnwise one; the grad_outputs
            # alike (32 tokens an expert: each columnwise tile cut short)
            assert launches["npu_quantize"] == 2 * (1 + (1 + 4) + (1 + 4)), launches
            assert launches["npu_quantize"] == apart["npu_quantize"] - 2 * 3, launches
        elif name.startswith("blockwise"):  # the experts' 128x128 tiles: one quantize per step

            def quantizes(counts: dict) -> int:
                return sum(n for kernel, n in counts.items() if kernel.startswith("npu_dynamic"))
            assert quantizes(launches) == quantizes(apart) - 2 * 3, launches
        if name.startswith("delayed"):
            assert launches["npu_quantize"] == 2 * 3 < apart["npu_quantize"]  # per step: inputs, weights, grad_outputs
        if name.startswith("mxfp8"):
            # per step: both forms of the weights (128 rows each: whole 64-row pairs, one part) in one dual-axis
            # call (apart: one each); for the inputs and grad_outputs (32 rows each) the rowwise forms in one call
            # and the columnwise ones one by one
            def quantizes(counts: dict) -> int:
                return counts["npu_dynamic_mx_quant"] + counts["npu_dynamic_mx_quant_with_dual_axis"]
            assert launches["npu_dynamic_mx_quant_with_dual_axis"] == 2, launches
            assert launches["npu_dynamic_mx_quant"] == 2 * (5 + 5), launches
            assert quantizes(launches) == quantizes(apart) - 2 * 3, (launches, apart)


# (weights, inputs and grad_outputs alike): (parts their columnwise MX forms take, runs their rowwise forms take)
@pytest.mark.parametrize("splits, rows, weights, activations", [
    ([64, 128, 32], 128, (1, 1), (1, 1)),  # all in whole pairs: one call for each form
    ([64, 128, 32], 96, (3, 1), (1, 1)),  # weights of 96 rows (1.5 pairs): each ends its part
    ([64, 0, 96], 128, (2, 2), (1, 1)),  # the weights of the experts with tokens are not neighbours
    ([32, 64, 32], 128, (1, 1), (2, 1)),  # the first expert's 32 tokens end their part: [32], [64, 32]
    ([64, 32, 64, 96, 64], 128, (1, 1), (3, 1)),  # parts [64, 32], [64, 96], [64]
])
@pytest.mark.parametrize("chip", ["Ascend950PR", "Ascend950DT", "without dual-axis"])
def test_mx_experts_take_one_quantize_per_part_of_whole_pairs(splits, rows, weights, activations, chip,
                                                               monkeypatch, use_backend):
    """MX columnwise forms are quantized along the rows (axis -2, or the dual-axis kernel with the rowwise
    form), so row blocks of one buffer (the experts' weights as GroupedLinear lays them out; their
    inputs and grad_outputs) take one call for a part of blocks that each start at a whole pair of 32-row blocks:
    the columnwise scales come in (ceil(M / 64), K, 2) pairs, so a block cut there owns whole pairs (the last one
    padded with 0 when it ends on an odd 32-block, as the kernel pads a tensor of its own). A block that is not
    whole pairs ends its part. The rowwise forms of a run take one call; a run of one part takes one dual-axis call
    for both forms. Results equal the reference bit for bit either way."""
    from mindspeed_te import fp8_autocast
    from mindspeed_te.modules import GroupedLinear

    def run(backend_name, sim=None):
        use_backend(backend_name)
        if sim is not None:
            monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(sim))
        torch.manual_seed(0)
        layer = GroupedLinear(len(splits), 64, rows, bias=False, params_dtype=torch.bfloat16)
        x = torch.randn(sum(splits), 64).bfloat16().requires_grad_()
        with fp8_autocast(fp8_recipe=RECIPES["mxfp8/hybrid"]):
            y = layer(x, splits)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).bfloat16())
        return [y.detach(), x.grad] + [w.grad for w in layer.weights]

    sim = _simulator_without_dual_axis() if chip == "without dual-axis" else make_simulator(chip)
    got = run("npu", sim)
    for g, w in zip(got, run("reference")):
        assert torch.equal(g, w)
    def calls(parts_runs: tuple[int, int], dual: bool) -> tuple[int, int]:
        """(dual-axis calls, npu_dynamic_mx_quant calls) of one set of row blocks: a run of one part takes one
        dual-axis call; a run of several parts (or any run without the kernel) one rowwise call and one
        columnwise call per part."""
        parts, runs = parts_runs
        return (runs, 0) if dual and parts == runs else (0, parts + runs)

    dual = chip != "without dual-axis"
    want = [w + 2 * a for w, a in zip(calls(weights, dual), calls(activations, dual))]
    got = [sim.launch_counts["npu_dynamic_mx_quant_with_dual_axis"], sim.launch_counts["npu_dynamic_mx_quant"]]
    assert got == want, sim.launch_counts


@pytest.mark.parametrize("chip", ["Ascend950PR", "Ascend950DT"])
@pytest.mark.parametrize("name", ["mxfp8/hybrid", "mxfp8/e4m3 floor", "blockwise pow2/e4m3"])
def test_wgrad_over_an_odd_number_of_32_blocks_stays_on_the_mx_gemm(name, chip, monkeypatch, use_backend):
    """Experts, and linears, whose token count is an odd multiple of 32 give the wgrad an odd number of 32-blocks
    along k: their E8M0 scales fill the last pair (the quantize kernels pad theirs with 0, the dual-axis kernel's
    come padded) and the GEMM stays in the MX mode (the experts' wgrad the grouped GEMM's K-split MX mode,
    which reads each group's ceil(K_i / 64) pairs; blockwise 1x128 tiles as four 32-blocks each), with the
    reference's results bit for bit."""
    splits = [32, 96, 0, 160]
    sim = make_simulator(chip)
    got = _grouped_step(use_backend, "npu", monkeypatch, RECIPES[name], splits, sim)
    for g, w in zip(got, _grouped_step(use_backend, "reference", monkeypatch, RECIPES[name], splits)):
        assert torch.equal(g, w)
    assert "npu_quant_matmul" not in sim.launch_counts
    assert sim.launch_counts["npu_grouped_matmul"] == 3  # fprop, dgrad and wgrad of all experts
    sim = make_simulator(chip)
    got = _step(use_backend, "npu", monkeypatch, RECIPES[name], sim, shape=(96, 128, 256))
    for g, w in zip(got, _step(use_backend, "reference", monkeypatch, RECIPES[name], shape=(96, 128, 256))):
        assert torch.equal(g, w)
    assert sim.launch_counts["npu_quant_matmul"] == 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", [n for n in RECIPES if n.startswith(("blockwise", "mxfp8"))])
def test_experts_rowwise_forms_from_one_quantize_equal_the_reference(name, dtype, monkeypatch, use_backend):
    """On the 950PR the experts' inputs and grad_outputs, row blocks of one tensor, get their rowwise forms
    (1x128 tiles, MX blocks: row-local) from one quantize of the joined rows and their columnwise forms one by
    one; every result equals the reference's bit for bit, an empty expert and float32 inputs included."""
    splits, recipe = [64, 0, 32, 160], RECIPES[name]
    got = _grouped_step(use_backend, "npu", monkeypatch, recipe, splits, make_simulator("Ascend950PR"), dtype)
    for g, w in zip(got, _grouped_step(use_backend, "reference", monkeypatch, recipe, splits, dtype=dtype)):
        assert torch.equal(g, w)


@pytest.mark.parametrize("chip, name", [("Ascend950PR", "tensorwise/e4m3"), ("Ascend950PR", "delayed/hif8"),
                                        ("Ascend950PR", "blockwise pow2/e4m3"), ("Ascend950PR", "mxfp8/hybrid"),
                                        ("Ascend950DT", "mxfp8/hybrid")])
def test_wgrad_over_more_tokens_than_the_kernel_takes(chip, name, monkeypatch, use_backend):
    """npu_quant_matmul takes last dims up to 65535 ("x1与x2最后一维的shape大小不能超过65535"): the wgrad of a
    micro-batch of more tokens is summed over parts of the token dim, each an npu_quant_matmul; the result is
    the reference's up to the float32 rounding of the parts' sum (per-tensor scales apply within each part)."""
    sim = make_simulator(chip)
    shape = (65536 + 128, 128, 128)
    got = _step(use_backend, "npu", monkeypatch, RECIPES[name], sim, shape=shape)
    want = _step(use_backend, "reference", monkeypatch, RECIPES[name], shape=shape)
    for g, w in zip(got[:2] + got[3:], want[:2] + want[3:]):  # y, x.grad, bias grad: k is 128 there
        assert torch.equal(g, w)
    # the weight gradient, summed in parts: float32 sums of the same exact products, rounded in another order
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=1e-6 * want[2].abs().max().item())
    assert sim.launch_counts["npu_quant_matmul"] == 4  # fprop, dgrad and the wgrad's two parts


def test_experts_without_tokens_and_quantizers_holding_tensors(monkeypatch, use_backend):
    """A rank whose experts all received no tokens runs on the NPU path as on the reference (zeros); quantizers
    that hold tensors (TE's Float8Quantizer(scale, amax, ...)) meet the experts' row-block batching without a
    host sync."""
    from mindspeed_te.formats import FP8Dtype
    from mindspeed_te.quantizers import Float8Quantizer

    splits, recipe = [0, 0, 0], MXFP8BlockScaling()
    got = _grouped_step(use_backend, "npu", monkeypatch, recipe, splits, make_simulator("Ascend950PR"))
    for g, w in zip(got, _grouped_step(use_backend, "reference", monkeypatch, recipe, splits)):
        assert torch.equal(g, w)
    backend = NpuBackend(make_simulator("Ascend950PR"))
    parts = list(torch.split(torch.randn(96, 64, dtype=torch.bfloat16), [32, 0, 64]))
    quantizers = [Float8Quantizer(torch.ones(1) * s, torch.zeros(1), FP8Dtype.E4M3) for s in (1.0, 2.0, 4.0)]
    with HostSyncCounter() as syncs:
        backend.quantize_many(quantizers, parts)
    assert syncs.total == 0, dict(syncs.counts)


@pytest.mark.parametrize("splits", [[160], [0, 160], [64, 96], [16, 32]])
def test_grouped_linear_on_the_npu_path_takes_any_input_layout(splits, monkeypatch, use_backend):
    """A transposed input, quantized by torch ops that keep its strides (current scaling with power-of-2
    scales), gives the codes of a contiguous one: the grouped GEMM must read a lone expert's codes in their
    real layout, and the output must stay modifiable in place. Fewer than 128 tokens in all take one wgrad
    GEMM per expert (the K-split grouped form reads its scales in other modes there)."""
    from mindspeed_te import fp8_autocast
    from mindspeed_te.modules import GroupedLinear
    from mindspeed_te.recipe import Float8CurrentScaling, QParams

    sim = make_simulator()
    use_backend("npu")
    monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(sim))
    pow2 = QParams(power_2_scale=True)
    recipe = Float8CurrentScaling(fp8_quant_fwd_inp=pow2, fp8_quant_fwd_weight=pow2, fp8_quant_bwd_grad=pow2)

    def run(contiguous: bool):
        torch.manual_seed(0)
        layer = GroupedLinear(len(splits), 64, 32, bias=False)
        base = torch.randn(64, sum(splits))
        x = (base.t().contiguous() if contiguous else base.t()).requires_grad_()
        with fp8_autocast(fp8_recipe=recipe):
            y = layer(x, splits)
        y.mul_(1.0)
        y.backward(torch.ones_like(y))
        return [y.detach(), x.grad] + [w.grad for w in layer.weights if w.grad is not None]

    for got, want in zip(run(False), run(True)):
        assert torch.equal(got, want)
    experts = sum(1 for m in splits if m)
    if sum(splits) >= 128:
        assert sim.launch_counts["npu_grouped_matmul"] == 6  # fprop, dgrad, wgrad of each of the two runs
    else:
        assert sim.launch_counts["npu_grouped_matmul"] == 4 and sim.launch_counts["npu_quant_matmul"] == 2 * experts


def _high_precision_experts(use_backend, backend_name, monkeypatch, splits, width, dtype, variant, sim=None,
                            layout="apart"):
    """(output, input grad, weight grads or main_grads) of one forward and backward of GroupedLinear(len(splits),
    width, width) outside FP8 regions, in `dtype`; variant "bias" adds biases, "main_grad" accumulates the weight
    gradients into float32 main_grads (Megatron's --gradient-accumulation-fusion), each its own (`layout`
    "apart"), or slices of one buffer in expert order ("in order") or in reverse (Megatron's grad buffer)."""
    from mindspeed_te.modules import GroupedLinear

    use_backend(backend_name)
    if sim is not None:
        monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(sim))
    torch.manual_seed(0)
    layer = GroupedLinear(len(splits), width, width, bias=variant == "bias", params_dtype=dtype,
                          fuse_wgrad_accumulation=variant == "main_grad")
    buffer = torch.full((len(splits), width, width), 0.5)
    for i, w in enumerate(layer.weights):
        w.main_grad = {"apart": torch.full(w.shape, 0.5), "in order": buffer[i], "reverse": buffer[-1 - i]}[layout]
    x = torch.randn(sum(splits), width).to(dtype).requires_grad_()
    y = layer(x, splits)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype))
    grads = [w.main_grad if variant == "main_grad" else w.grad for w in layer.weights]
    return [y.detach(), x.grad, *grads, *(b.grad for b in layer.biases or ())]


@pytest.mark.parametrize("chip", ["Ascend950PR", "Ascend910B3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits, width", [([64, 0, 96, 32], 128), ([256, 512], 256)])
@pytest.mark.parametrize("variant", ["plain", "bias"])
def test_high_precision_experts_take_one_grouped_launch_per_gemm(chip, dtype, splits, width, variant, monkeypatch,
                                                                  use_backend):
    """Experts outside FP8 (bfloat16 / float16; Megatron's --no-use-gmm-fp8 too): fprop, dgrad and wgrad are one
    npu_grouped_matmul each in its non-quantized mode, on the 950 and Atlas A2, with the reference's results bit
    for bit (float32 sums rounded once to x's dtype; the larger shape takes the bfloat16-output GEMM on both sides).
    The mode's output is x's dtype only: with biases the fprop keeps its float32 sum (the bias added to it), one
    GEMM per expert."""
    sim = make_simulator(chip)
    got = _high_precision_experts(use_backend, "npu", monkeypatch, splits, width, dtype, variant, sim)
    want = _high_precision_experts(use_backend, "reference", monkeypatch, splits, width, dtype, variant)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert sim.launch_counts == {"npu_grouped_matmul": 3 if variant == "plain" else 2}


@pytest.mark.parametrize("chip", ["Ascend950PR", "Ascend910B3"])
@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("layout", ["apart", "in order", "reverse"])
@pytest.mark.parametrize("splits, width", [([64, 0, 96, 32], 128), ([256, 512], 256)])
def test_high_precision_experts_wgrad_into_main_grads(chip, release, layout, splits, width, monkeypatch,
                                                      use_backend):
    """bfloat16 / float16 experts' wgrad added into float32 main_grads (--gradient-accumulation-fusion) is one
    npu_grouped_matmul_add_ where the installed binding's kernel runs on the chip: Atlas A2/A3 on every release
    (aclnnGroupedMatmulAdd), the 950 from op-plugin 26.0.0 (aclnnGroupedMatmulAddV2; 2.14's binding calls the
    first kernel, which the 950 lacks). It adds into main_grads that lie in expert order in one buffer, and into
    zeros otherwise (then one multi-tensor add). Without it, a float32 GEMM per expert of the joined rows cast
    once. Either way the reference's bits: each expert's float32 sum added once."""
    for dtype in (torch.bfloat16, torch.float16):
        sim = make_release_simulator(chip, release)
        got = _high_precision_experts(use_backend, "npu", monkeypatch, splits, width, dtype, "main_grad", sim, layout)
        want = _high_precision_experts(use_backend, "reference", monkeypatch, splits, width, dtype, "main_grad",
                                       layout=layout)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        fused = chip == "Ascend910B3" or release != "2.14"
        assert sim.launch_counts == {"npu_grouped_matmul": 2, **({"npu_grouped_matmul_add_": 1} if fused else {})}


def _dense_wgrad_into_main_grad(use_backend, backend_name, monkeypatch, dtype, sim=None):
    """(output, input grad, main_grad) of Linear(256, 192, bias) outside FP8 regions in `dtype`, its wgrad added
    into a float32 main_grad (--gradient-accumulation-fusion)."""
    from mindspeed_te.modules import Linear

    use_backend(backend_name)
    if sim is not None:
        monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(sim))
    torch.manual_seed(0)
    layer = Linear(256, 192, bias=True, params_dtype=dtype, fuse_wgrad_accumulation=True)
    layer.weight.main_grad = torch.full((192, 256), 0.5)
    x = torch.randn(300, 256).to(dtype).requires_grad_()
    y = layer(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype))
    return [y.detach(), x.grad, layer.weight.main_grad]


@pytest.mark.parametrize("chip", ["Ascend950PR", "Ascend910B3"])
@pytest.mark.parametrize("release", RELEASES)
def test_high_precision_linear_wgrad_into_main_grad(chip, release, monkeypatch, use_backend):
    """A bfloat16 / float16 Linear's wgrad added into a float32 main_grad is npu_grouped_matmul_add_ with one
    group where the installed binding's kernel runs on the chip (as for experts); elsewhere the float32 GEMM
    and an add, as the reference. Either way the reference's bits: the float32 sum added once."""
    for dtype in (torch.bfloat16, torch.float16):
        sim = make_release_simulator(chip, release)
        got = _dense_wgrad_into_main_grad(use_backend, "npu", monkeypatch, dtype, sim)
        want = _dense_wgrad_into_main_grad(use_backend, "reference", monkeypatch, dtype)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        fused = chip == "Ascend910B3" or release != "2.14"
        assert sim.launch_counts == ({"npu_grouped_matmul_add_": 1} if fused else {})


def _attention_case(s_q=8, s_k=8, d_v=16, groups=2):
    """query [s_q, 2, 4, 16] and key/value with `groups` heads (value head dim d_v), needing gradients."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s_q, 2, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(s_k, 2, groups, 16, generator=g, requires_grad=True)
    v = torch.randn(s_k, 2, groups, d_v, generator=g, requires_grad=True)
    return q, k, v


def _attention_on_both(attn, qkv, mask, monkeypatch, use_backend):
    """(NPU-path output, reference output, the simulator) of one attention call."""
    use_backend("reference")
    want = attn(*qkv, attention_mask=mask)
    sim = make_simulator()
    use_backend("npu")
    monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(sim))
    return attn(*qkv, attention_mask=mask), want, sim


@pytest.mark.parametrize("mask_type, groups", [("causal", 4), ("padding_causal", 2), ("no_mask", 1)])
def test_attention_runs_npu_fusion_attention(mask_type, groups, monkeypatch, use_backend):
    from mindspeed_te.modules import DotProductAttention

    attn = DotProductAttention(4, 16, num_gqa_groups=groups, attn_mask_type=mask_type)
    q, k, v = _attention_case(groups=groups)
    mask = torch.zeros(2, 1, 1, 8, dtype=torch.bool)
    mask[1, ..., 6:] = True
    got, want, sim = _attention_on_both(attn, (q, k, v), mask, monkeypatch, use_backend)
    assert sim.launch_counts["npu_fusion_attention"] == 1 and torch.equal(got, want)
    got.sum().backward()
    assert q.grad is not None and k.grad is not None


@pytest.mark.parametrize("mask_type, window, s_q, s_k, mode", [
    ("causal", None, 8, 8, 2), ("causal", None, 5, 8, 2), ("causal_bottom_right", None, 5, 8, 3),
    ("causal_bottom_right", None, 8, 5, 3), ("causal", (2, 0), 8, 8, 4), ("no_mask", (3, 1), 6, 8, 4),
    ("causal_bottom_right", (1, 0), 8, 5, 4), ("causal", (2, 0), 5, 8, None)])
def test_causal_and_window_masks_take_the_kernels_sparse_modes(mask_type, window, s_q, s_k, mode, monkeypatch,
                                                               use_backend):
    """A causal or sliding-window mask alone reaches npu_fusion_attention as sparse_mode 2 (from the top-left
    corner), 3 (from the bottom-right) or 4 (a band around the bottom-right diagonal) on the compressed 2048x2048
    mask, with no matrix of the sequence's size; a top-left causal window over unequal lengths, which is no such
    band, keeps the explicit matrix. Outputs and gradients equal the reference's bit for bit; after the first call a
    forward is the one kernel launch and its backward the one grad kernel."""
    from mindspeed_te.diagnostics import LaunchCounter
    from mindspeed_te.modules import DotProductAttention

    attn = DotProductAttention(4, 16, num_gqa_groups=2, attn_mask_type=mask_type, window_size=window)
    qkv = _attention_case(s_q=s_q, s_k=s_k)
    got, want, sim = _attention_on_both(attn, qkv, None, monkeypatch, use_backend)
    assert torch.equal(got, want)
    dy = torch.randn(got.shape, generator=torch.Generator().manual_seed(4))
    want_grads = torch.autograd.grad(want, qkv, dy)
    got_grads = torch.autograd.grad(got, qkv, dy)
    assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads))
    seen = []
    kernel = sim.npu_fusion_attention
    monkeypatch.setattr(sim, "npu_fusion_attention", lambda *a, **kw: seen.append(kw) or kernel(*a, **kw))
    with LaunchCounter(sim) as forward:
        out = attn(*qkv)
    with LaunchCounter(sim) as backward:
        torch.autograd.grad(out, qkv, dy)
    assert seen[0].get("sparse_mode", 0) == (mode or 0)
    if mode is None:
        assert seen[0]["atten_mask"].shape == (s_q, s_k)
        return
    assert seen[0]["atten_mask"].shape == (2048, 2048)
    assert forward.counts == {"torch_npu.npu_fusion_attention": 1}
    assert backward.counts == {"torch_npu.npu_fusion_attention_grad": 1}


def _npu_attention_calls(monkeypatch, use_backend) -> tuple:
    """Switch to the NPU backend on a fresh simulator; returns it and the list its npu_fusion_attention calls
    append (input_layout, keyword arguments) to."""
    sim = make_simulator()
    use_backend("npu")
    monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(sim))
    seen = []
    kernel = sim.npu_fusion_attention
    monkeypatch.setattr(sim, "npu_fusion_attention", lambda *a, **kw: seen.append((a[4], kw)) or kernel(*a, **kw))
    return sim, seen


@pytest.mark.parametrize("mask_type, padded", [("padding_causal", False), ("padding", False),
                                              ("padding_causal", True), ("padding", True)])
def test_packed_sequences_take_the_varlen_mode(mask_type, padded, monkeypatch, use_backend):
    """Packed sequences (thd) reach npu_fusion_attention as input_layout "TND" with the cumulative lengths
    ("actual_seq_qlen"/"actual_seq_kvlen"), causal by sparse_mode 2 on the compressed mask: no [t, t] matrix. The
    lengths are read to the host once per cu_seqlens tensor, not once per layer. With padded offsets each padding
    stretch is a sequence of its own for the kernel and its rows are zeroed after it (one masked_fill each way).
    Outputs and gradients equal the reference's bit for bit; after the first call a forward is the one kernel
    launch and its backward the one grad kernel (plus the zeroing when padded)."""
    from mindspeed_te.diagnostics import HostSyncCounter, LaunchCounter
    from mindspeed_te.modules import DotProductAttention

    attn = DotProductAttention(4, 16, num_gqa_groups=2, attn_mask_type=mask_type, qkv_format="thd")
    g = torch.Generator().manual_seed(6)
    qkv = (torch.randn(16, 4, 16, generator=g, requires_grad=True),
           *(torch.randn(16, 2, 16, generator=g, requires_grad=True) for _ in range(2)))
    cu = torch.tensor([0, 3, 9, 10, 14 if padded else 16], dtype=torch.int32)
    packed = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu)
    if padded:
        offsets = torch.tensor([0, 4, 10, 12, 16], dtype=torch.int32)
        packed.update(cu_seqlens_q_padded=offsets, cu_seqlens_kv_padded=offsets)
    use_backend("reference")
    want = attn(*qkv, **packed)
    dy = torch.randn(want.shape, generator=g)
    want_grads = torch.autograd.grad(want, qkv, dy)
    sim, seen = _npu_attention_calls(monkeypatch, use_backend)
    with HostSyncCounter() as syncs:
        got = attn(*qkv, **packed)
        attn(*qkv, **packed)  # the next layer: the same cu_seqlens
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(got, qkv, dy), want_grads))
    layout, kwargs = seen[0]
    # Padded: sequences [0, 3), [4, 10), [10, 11), [12, 16), padding [3, 4) and [11, 12)
    ends = [3, 4, 10, 11, 12, 16] if padded else [3, 9, 10, 16]
    assert layout == "TND" and kwargs["actual_seq_qlen"] == kwargs["actual_seq_kvlen"] == ends
    assert kwargs.get("sparse_mode", 0) == (2 if "causal" in mask_type else 0)
    assert sum(syncs.counts.values()) == (2 if padded else 1), dict(syncs.counts)
    with LaunchCounter(sim) as forward:
        out = attn(*qkv, **packed)
    with LaunchCounter(sim) as backward:
        torch.autograd.grad(out, qkv, dy)
    zeroing = {"aten.masked_fill": 1} if padded else {}
    assert forward.counts == {"torch_npu.npu_fusion_attention": 1, **zeroing}
    assert backward.counts == {"torch_npu.npu_fusion_attention_grad": 1, **zeroing}


def test_padded_packed_sequences_train_after_an_inference_call(monkeypatch, use_backend):
    """The padding rows made once per micro-batch are made apart under inference mode (say an evaluation
    forward on the same cu_seqlens): autograd cannot save an inference tensor, which the zeroing's backward
    would."""
    from mindspeed_te.modules import DotProductAttention

    attn = DotProductAttention(2, 16, attn_mask_type="padding_causal", qkv_format="thd")
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(8, 2, 16, generator=g, requires_grad=True) for _ in range(3))
    cu, slots = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 8], dtype=torch.int32)
    packed = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=slots, cu_seqlens_kv_padded=slots)
    use_backend("reference")
    want = torch.autograd.grad(attn(q, k, v, **packed).sum(), (q, k, v))
    _, seen = _npu_attention_calls(monkeypatch, use_backend)
    with torch.inference_mode():
        attn(q, k, v, **packed)
    got = torch.autograd.grad(attn(q, k, v, **packed).sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert [layout for layout, _ in seen] == ["TND", "TND"]


def test_packed_sequences_padded_unlike_their_keys_keep_the_matrix(monkeypatch, use_backend):
    """Queries padded where their keys are not: a padding stretch would be a sequence of its own on one side
    only, so the kernel takes the explicit matrix (sparse_mode 0), and the result still equals the reference's."""
    from mindspeed_te.modules import DotProductAttention

    attn = DotProductAttention(2, 16, attn_mask_type="padding_causal", qkv_format="thd")
    g = torch.Generator().manual_seed(7)
    q = torch.randn(12, 2, 16, generator=g)
    k, v = (torch.randn(10, 2, 16, generator=g) for _ in range(2))
    packed = dict(cu_seqlens_q=torch.tensor([0, 4, 10], dtype=torch.int32),
                  cu_seqlens_q_padded=torch.tensor([0, 6, 12], dtype=torch.int32),
                  cu_seqlens_kv=torch.tensor([0, 4, 10], dtype=torch.int32),
                  cu_seqlens_kv_padded=torch.tensor([0, 4, 10], dtype=torch.int32))
    use_backend("reference")
    want = attn(q, k, v, **packed)
    sim, seen = _npu_attention_calls(monkeypatch, use_backend)
    assert torch.equal(attn(q, k, v, **packed), want)
    assert seen[0][0] == "SBH" and seen[0][1]["atten_mask"].shape == (12, 10)


@pytest.mark.parametrize("softmax_type, mask_type", [("off-by-one", "causal"), ("learnable", "causal"),
                                                     ("learnable", "padding")])
def test_softmax_offset_is_the_kernels_sink(softmax_type, mask_type, monkeypatch, use_backend):
    """TE's off-by-one and learnable softmax add one logit per head to every softmax's denominator: on the NPU the
    fused kernel's sink ("每个注意力头的偏置。shape为[head_num]，数据类型仅支持float32"), with the causal mode or an
    explicit mask as without it, where the reference appends a zero-valued key. Outputs and the gradients of q, k,
    v and the learnable offset equal the reference's (float32, to rounding); one launch each way."""
    from mindspeed_te.diagnostics import LaunchCounter
    from mindspeed_te.modules import DotProductAttention

    attn = DotProductAttention(4, 16, num_gqa_groups=2, attn_mask_type=mask_type, softmax_type=softmax_type)
    if softmax_type == "learnable":
        with torch.no_grad():
            attn.softmax_offset.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    qkv = _attention_case()
    mask = None
    if mask_type == "padding":
        mask = torch.zeros(2, 1, 1, 8, dtype=torch.bool)
        mask[1, ..., 6:] = True
    params = [attn.softmax_offset] if softmax_type == "learnable" else []
    use_backend("reference")
    want = attn(*qkv, attention_mask=mask)
    dy = torch.randn(want.shape, generator=torch.Generator().manual_seed(8))
    want_grads = torch.autograd.grad(want, [*qkv, *params], dy)
    sim = make_simulator()
    use_backend("npu")
    monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(sim))
    seen = []
    kernel = sim.npu_fusion_attention
    monkeypatch.setattr(sim, "npu_fusion_attention", lambda *a, **kw: seen.append(kw) or kernel(*a, **kw))
    attn(*qkv, attention_mask=mask)
    with LaunchCounter(sim) as forward:
        got = attn(*qkv, attention_mask=mask)
    with LaunchCounter(sim) as backward:
        got_grads = torch.autograd.grad(got, [*qkv, *params], dy)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    sink = seen[-1]["sink"]
    assert sink.dtype == torch.float32 and sink.shape == (4,)
    assert seen[-1].get("sparse_mode", 0) == (2 if mask_type == "causal" else 0)
    assert forward.counts["torch_npu.npu_fusion_attention"] == 1 and "aten.cat" not in forward.counts
    assert backward.counts["torch_npu.npu_fusion_attention_grad"] == 1


def test_attention_dropout_runs_in_the_kernel_under_the_rng_tracker(monkeypatch, use_backend):
    """Attention dropout is npu_fusion_attention's keep_prob: the kernel draws its mask from the default generator,
    whose state Megatron's RNG tracker forks, so the same tracker state gives the same mask; the backward is the
    one grad kernel; in eval mode keep_prob is 1 and the output equals the reference bit for bit."""
    from mindspeed_te.diagnostics import LaunchCounter
    from mindspeed_te.megatron.misc import TECudaRNGStatesTracker
    from mindspeed_te.modules import DotProductAttention

    tracker = TECudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 7)
    attn = DotProductAttention(4, 16, num_gqa_groups=2, attention_dropout=0.25, attn_mask_type="causal",
                               get_rng_state_tracker=lambda: tracker)
    qkv = _attention_case()
    attn.eval()
    use_backend("reference")
    want = attn(*qkv)
    sim = make_simulator()
    use_backend("npu")
    monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(sim))
    assert torch.equal(attn(*qkv), want)
    attn.train()
    seen = []
    kernel = sim.npu_fusion_attention
    monkeypatch.setattr(sim, "npu_fusion_attention", lambda *a, **kw: seen.append(kw["keep_prob"]) or kernel(*a, **kw))
    states = tracker.get_states()
    with LaunchCounter(sim) as forward:
        a = attn(*qkv)
    tracker.set_states(states)
    b = attn(*qkv)
    c = attn(*qkv)
    assert seen == [0.75] * 3 and torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, want)
    assert forward.counts == {"torch_npu.npu_fusion_attention": 1}
    dy = torch.ones_like(a)
    with LaunchCounter(sim) as backward:
        torch.autograd.grad(a, qkv, dy)
    assert backward.counts == {"torch_npu.npu_fusion_attention_grad": 1}


def test_blockwise_gemm_never_passes_a_bias_to_the_kernel(monkeypatch, use_backend):
    """aclnnQuantMatmulV5 (Ascend 950): of the G-B, B-B and mx modes only mx takes a bias, so a blockwise
    GEMM with a bias adds it after the kernel; the result still equals the reference bit for bit."""
    sim = make_simulator()
    calls = []
    kernel = sim.npu_quant_matmul
    monkeypatch.setattr(sim, "npu_quant_matmul", lambda *a, **k: calls.append(k) or kernel(*a, **k),
                        raising=False)
    got = _step(use_backend, "npu", monkeypatch, RECIPES["blockwise/e4m3"], sim)
    want = _step(use_backend, "reference", monkeypatch, RECIPES["blockwise/e4m3"])
    blockwise = [k for k in calls if k.get("group_sizes") == [1, 128, 128]]
    assert blockwise and all(k.get("bias") is None for k in blockwise)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def _fields(t) -> dict:
    names = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
    return {n: getattr(t, n) for n in names if getattr(t, n) is not None}


def _assert_same_bits(got, want) -> None:
    """The two quantized storages hold the same layouts with equal codes (as bytes) and equal float32 scales."""
    got_f, want_f = _fields(got), _fields(want)
    assert got_f.keys() == want_f.keys()
    for name, g_t in got_f.items():
        w_t = want_f[name]
        if g_t.dtype != torch.float32:
            g_t, w_t = g_t.view(torch.uint8), w_t.view(torch.uint8)
        assert torch.equal(g_t, w_t), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
@pytest.mark.parametrize("dim", [1, 2])
def test_blockwise_power_2_quantize_equals_reference(dtype, fmt, dim):
    """TE's default power-of-2 block scales on the NPU path come from npu_dynamic_mx_quant (scale_alg=1); codes
    and scales equal the reference quantizer's bit for bit, except the stored scale of an all-zero tile: 2^-127
    (the kernel's E8M0 byte 0) where the reference keeps TE's 1. Its codes are 0 either way."""
    from mindspeed_te.formats import FP8Dtype
    from mindspeed_te.quantizers import Float8BlockQuantizer

    fp8 = FP8Dtype[fmt]
    sim = make_simulator()
    backend = NpuBackend(sim)
    g = torch.Generator().manual_seed(3)
    for shape in ((256, 384), (128, 200), (384, 128)):
        x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-40, 40, (shape[0], 1), generator=g).float())
        x[:, -1] = fp8.max * 2.0**-3  # tiles whose amax is exactly fmt_max * 2^k: scale 2^k, nothing saturates
        x[5] = 0.0  # all-zero 1x128 tiles
        x = x.to(dtype)
        q = Float8BlockQuantizer(fp8, fp8.max, block_scaling_dim=dim)
        sim.reset_counts()
        got, want = backend.quantize(q, x), q.quantize(x)
        kernel_path = dtype == torch.bfloat16 or (shape[1] % 128 == 0 and shape[0] % 128 == 0)
        if dim == 2:
            kernel_path = kernel_path and shape[0] % 128 == 0 and shape[1] % 128 == 0
        assert (sim.launch_counts["npu_dynamic_mx_quant"] > 0) == kernel_path, shape
        assert got.power_2_scale and want.power_2_scale  # either path: the GEMMs may take E8M0 exponents
        got_f, want_f = _fields(got), _fields(want)
        assert got_f.keys() == want_f.keys()
        for name, g_t in got_f.items():
            w_t = want_f[name]
            if g_t.dtype == torch.float32:
                zero = w_t == 1.0
                zero &= torch.as_tensor(g_t == 2.0**-127)
                if kernel_path and dim == 1 and name == "rowwise_scale_inv":
                    assert zero.any()  # the all-zero row's tiles
                assert torch.equal(torch.where(zero, 1.0, g_t), w_t), name
            else:
                assert torch.equal(g_t.view(torch.uint8), w_t.view(torch.uint8)), name
        assert torch.equal(got.dequantize(), want.dequantize())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("target", [15.0, 224.0])
@pytest.mark.parametrize("dim", [1, 2])
def test_blockwise_power_2_hif8_quantize_equals_reference(dtype, target, dim):
    """HiF8 with power-of-2 tile scales (no kernel makes them): whole 128-tiles are cast by npu_quantize, one
    tile per row of the (rows * k / 128, 128) view, and give the reference quantizer's codes and scales bit for
    bit, all-zero tiles and tiles holding NaN/Inf included, the 1x128 columnwise tiles of rows that are not
    whole tiles too (their transposed copy zero-padded); a k of partial tiles, and 128x128 tiles over rows that
    are not whole tiles, stay on the quantizer's torch ops."""
    from mindspeed_te.formats import FP8Dtype
    from mindspeed_te.quantizers import Float8BlockQuantizer

    sim = make_simulator()
    backend = NpuBackend(sim)
    g = torch.Generator().manual_seed(5)
    for shape in ((256, 384), (384, 128), (128, 200), (100, 256)):
        x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-40, 40, (shape[0], 1), generator=g).float())
        x[:, -1] = target * 2.0**-3  # tiles whose amax is exactly target * 2^k
        x[5] = 0.0  # all-zero tiles
        x[9, 3], x[70, 1], x[3, 100] = math.nan, math.inf, -math.inf
        x = x.to(dtype)
        q = Float8BlockQuantizer(FP8Dtype.HIF8, target, block_scaling_dim=dim)
        sim.reset_counts()
        got, want = backend.quantize(q, x), q.quantize(x)
        kernel = shape[1] % 128 == 0 and (dim == 1 or shape[0] % 128 == 0)
        assert (sim.launch_counts.get("npu_quantize", 0) > 0) == kernel, shape
        got_f, want_f = _fields(got), _fields(want)
        assert got_f.keys() == want_f.keys()
        for name, g_t in got_f.items():
            w_t = want_f[name]
            if g_t.dtype == torch.float32:
                assert torch.equal(g_t.nan_to_num(-1.0), w_t.nan_to_num(-1.0)), name
                assert torch.equal(g_t.isnan(), w_t.isnan()), name
            else:
                assert torch.equal(g_t.view(torch.uint8), w_t.view(torch.uint8)), name


@pytest.mark.parametrize("fmt,target", [("E4M3", 448.0), ("HIF8", 15.0), ("HIF8", 56.0), ("HIF8", 224.0),
                                        ("HIF8", 32768.0)])
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blockwise_kernel_scales_equal_reference(fmt, target, dim, dtype):
    """Block scales amax / target (power_2_scale off: the rule npu_dynamic_block_quant computes, and HiF8's
    default) go through that kernel for bfloat16 and float32 inputs (aclnnDynamicBlockQuantV2 takes FLOAT32 x)
    and give the reference quantizer's codes and scales bit for bit, partial and all-zero tiles included, for
    every HiF8 target the kernel takes."""
    from mindspeed_te.formats import FP8Dtype
    from mindspeed_te.quantizers import Float8BlockQuantizer

    sim = make_simulator()
    backend = NpuBackend(sim)
    g = torch.Generator().manual_seed(7)
    for shape in ((256, 384), (200, 130)):
        x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-60, 60, (shape[0], 1), generator=g).float())
        x[5] = 0.0
        x = x.to(dtype)
        q = Float8BlockQuantizer(FP8Dtype[fmt], target, block_scaling_dim=dim, power_2_scale=False)
        sim.reset_counts()
        got, want = backend.quantize(q, x), q.quantize(x)
        assert sim.launch_counts == {"npu_dynamic_block_quant": 1 if dim == 2 else 2}
        _assert_same_bits(got, want)


def _edge_amaxes(target: float, dtype: torch.dtype) -> torch.Tensor:
    """Tile amaxes at the edges of the power-of-2 rule, as `dtype` values: 0, the smallest subnormals, around
    target * 2^-128 (where target / amax leaves float32), the neighbours of target * 2^k (where the power of 2
    changes), 1, the largest finite values."""
    f32 = torch.float32
    tiny = torch.finfo(dtype).smallest_normal
    values = [0.0, 2.0**-149, 2.0**-133, tiny, tiny / 3, 1.0, torch.finfo(dtype).max, torch.finfo(f32).max]
    for k in (-128, -127, -126, -40, -3, 0, 5, 100, 112):
        values.append(target * 2.0**k)
    base = torch.tensor(values, dtype=torch.float64).to(f32)
    up, down = torch.nextafter(base, torch.tensor(math.inf)), torch.nextafter(base, torch.tensor(0.0))
    edges = torch.cat([base, up, down]).to(dtype)
    return edges[torch.isfinite(edges)]


def _edge_tiles(target: float, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, amax): rows of 256 `dtype` values, one edge amax of `_edge_amaxes` per row (the edges, then random
    repeats up to a whole number of 128-row tiles), each row's two 1x128 tiles holding +amax and -amax exactly
    and smaller values elsewhere."""
    g = torch.Generator().manual_seed(seed)
    edges = _edge_amaxes(target, dtype)
    rows = -(-len(edges) // 128) * 128
    amax = torch.cat([edges, edges[torch.randint(len(edges), (rows - len(edges),), generator=g)]])
    x = torch.rand(rows, 256, generator=g) * 1.8 - 0.9  # |x| < amax within each row
    x = (x.double() * amax.double()[:, None]).to(dtype)
    x[:, 0], x[:, 200] = amax, -amax  # the amax of each row's two 1x128 tiles, exactly
    return x, amax


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("target", [15.0, 224.0, 100.0])
def test_blockwise_power_2_hif8_scales_at_the_rule_edges(dtype, target):
    """The NPU path's scale rule for HiF8 power-of-2 tiles (NaN/Inf and 0 replaced by the target before the one
    division) equals the reference quantizer's at every edge of the rule: tiles whose amax is 0, subnormal,
    makes target / amax overflow, sits next to target * 2^k, or is the largest finite value; in all three
    layouts (1x128 rowwise and columnwise, 128x128), for a target no quantize kernel takes (100) too."""
    from mindspeed_te.formats import FP8Dtype
    from mindspeed_te.quantizers import Float8BlockQuantizer

    sim = make_simulator()
    backend = NpuBackend(sim)
    x, amax = _edge_tiles(target, dtype, seed=11)
    x[:, 128:][amax == 0] = 0.0
    for dim in (1, 2):
        q = Float8BlockQuantizer(FP8Dtype.HIF8, target, block_scaling_dim=dim)
        sim.reset_counts()
        got, want = backend.quantize(q, x), q.quantize(x)
        assert sim.launch_counts["npu_quantize"] == (1 if dim == 2 else 2)
        _assert_same_bits(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [32, 96, 200])
def test_power_2_hif8_columnwise_tiles_cut_short_stay_on_the_kernel(dtype, rows):
    """HiF8 power-of-2 1x128 tiles over a number of rows that is not whole tiles (an expert's tokens): the
    columnwise layout's last tile along the rows ends short. Its transposed copy is zero-padded to whole
    tiles in the same one op, so the tiles' amaxes and codes are their own values': one npu_quantize per
    layout and the reference quantizer's codes and scales bit for bit, an all-zero row included (instead of
    the quantizer's torch ops, about 17 launches a layout)."""
    from mindspeed_te.diagnostics import LaunchCounter
    from mindspeed_te.formats import FP8Dtype
    from mindspeed_te.quantizers import Float8BlockQuantizer

    sim = make_simulator()
    backend = NpuBackend(sim)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=g) * torch.exp2(torch.randint(-30, 30, (rows, 1), generator=g).float())
    x[3] = 0.0
    x = x.to(dtype)
    q = Float8BlockQuantizer(FP8Dtype.HIF8, 224.0, block_scaling_dim=1)
    with LaunchCounter(sim) as counter:
        got = backend.quantize(q, x)
    want = q.quantize(x)
    assert sim.launch_counts == {"npu_quantize": 2}
    _assert_same_bits(got, want)
    whole = torch.randn(256, 256, generator=g).to(dtype)
    with LaunchCounter(sim) as whole_tiles:
        backend.quantize(q, whole)
    # the pad takes the transposed copy's place; the codes of the padded rows are cut off in one more op
    assert counter.total == whole_tiles.total + 1, (counter.counts, whole_tiles.counts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("target", [15.0, 224.0])
def test_blockwise_hif8_kernel_scales_at_the_rule_edges(dtype, target):
    """HiF8's default block rule (scale_inv = amax / target, npu_dynamic_block_quant) at the edges of the
    division: tiles whose amax is 0, subnormal, so small that amax / target falls below 1/FLT_MAX, next to
    target * 2^k, or the largest finite value; kernel and reference agree bit for bit in all three layouts."""
    from mindspeed_te.formats import FP8Dtype
    from mindspeed_te.quantizers import Float8BlockQuantizer

    sim = make_simulator()
    backend = NpuBackend(sim)
    x, _ = _edge_tiles(target, dtype, seed=13)
    for dim in (1, 2):
        q = Float8BlockQuantizer(FP8Dtype.HIF8, target, block_scaling_dim=dim, power_2_scale=False)
        sim.reset_counts()
        got, want = backend.quantize(q, x), q.quantize(x)
        assert sim.launch_counts == {"npu_dynamic_block_quant": 1 if dim == 2 else 2}
        _assert_same_bits(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blockwise_hif8_kernel_scales_nonfinite_tiles_and_other_targets(dtype):
    """A tile holding NaN/Inf: its stored scale_inv is NaN on both paths, so it dequantizes to NaN everywhere
    (its codes are not specified: the kernel documents no NaN/Inf behaviour); every other tile is bit-equal.
    A target npu_dynamic_block_quant does not take (dst_type_max: 15, 56, 224, 32768) quantizes with the
    quantizer's torch ops, the same rule."""
    from mindspeed_te.formats import FP8Dtype
    from mindspeed_te.quantizers import Float8BlockQuantizer

    sim = make_simulator()
    backend = NpuBackend(sim)
    x = torch.randn(256, 384, generator=torch.Generator().manual_seed(17))
    x[9, 3], x[70, 130], x[3, 300] = math.nan, math.inf, -math.inf
    x = x.to(dtype)
    bad_rows = torch.zeros(256, 3, dtype=torch.bool)  # the 1x128 tiles holding NaN/Inf
    bad_rows[9, 0] = bad_rows[70, 1] = bad_rows[3, 2] = True
    for dim in (1, 2):
        q = Float8BlockQuantizer(FP8Dtype.HIF8, 15.0, block_scaling_dim=dim, power_2_scale=False)
        got, want = backend.quantize(q, x), q.quantize(x)
        bad = bad_rows if dim == 1 else bad_rows.reshape(2, 128, 3).any(dim=1)
        g_s, w_s = got.rowwise_scale_inv, want.rowwise_scale_inv
        assert torch.equal(g_s.isnan(), bad) and torch.equal(w_s.isnan(), bad)
        assert torch.equal(g_s[~bad], w_s[~bad])
        deq_g, deq_w = got.dequantize(), want.dequantize()
        assert torch.equal(deq_g.isnan(), deq_w.isnan()) and torch.equal(deq_g.nan_to_num(), deq_w.nan_to_num())
        assert int(deq_g.isnan().sum()) == (3 * 128 if dim == 1 else 3 * 128 * 128)
    q = Float8BlockQuantizer(FP8Dtype.HIF8, 100.0, power_2_scale=False)
    sim.reset_counts()
    got, want = backend.quantize(q, x.nan_to_num(0.0, 0.0, 0.0)), q.quantize(x.nan_to_num(0.0, 0.0, 0.0))
    assert "npu_dynamic_block_quant" not in sim.launch_counts
    assert torch.equal(got.rowwise_data, want.rowwise_data)
    assert torch.equal(got.rowwise_scale_inv, want.rowwise_scale_inv)


@pytest.mark.parametrize("fmt", ["HYBRID", "HIF8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blockwise_power_2_linear_equals_reference_with_128x128_weight_kernel(dtype, fmt, monkeypatch, use_backend):
    """Whole tiles everywhere, so the weight's 128x128 tiles and float32 inputs take the kernel path too; the
    1x128 x 1x128 wgrad runs in the MX mode of npu_quant_matmul (HiF8, which the MX mode lacks: dequantized)."""
    sim = make_simulator()
    calls = []
    real = sim.npu_quant_matmul
    monkeypatch.setattr(sim, "npu_quant_matmul", lambda *a, **k: calls.append(k.get("group_sizes")) or real(*a, **k))
    results = []
    for name in ("npu", "reference"):
        use_backend(name)
        monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(sim))
        g = torch.Generator().manual_seed(1)
        x = (torch.randn(256, 256, generator=g) * 3).to(dtype).requires_grad_()
        w = (torch.randn(128, 256, generator=g) * 0.05).to(dtype).requires_grad_()
        b = torch.randn(128, generator=g).to(dtype).requires_grad_()
        recipe = Float8BlockScaling(fp8_format=Format[fmt], fp8_quant_fwd_inp=POW2, fp8_quant_fwd_weight=POW2,
                                    fp8_quant_bwd_grad=POW2)  # HiF8's default is not power-of-2
        y = fp8_linear(x, w, b, quantizers=_quantizers(recipe))
        y.backward(torch.randn(256, 128, generator=g).to(dtype))
        results.append((y.detach(), x.grad, w.grad, b.grad))
    for g_t, w_t in zip(*results):
        assert torch.equal(g_t, w_t)
    assert calls == [[1, 128, 128], [1, 128, 128]] + [[1, 1, 32]] * (fmt != "HIF8")  # fprop, dgrad, wgrad


@pytest.mark.parametrize("chip", ["Ascend950PR", "Ascend950DT"])
@pytest.mark.parametrize("name", ["mxfp8/hybrid", "mxfp8/e4m3 floor"])
def test_mxfp8_dual_axis_matches_reference(name, chip, monkeypatch, use_backend):
    """On an Ascend 950PR or 950DT (aclnnDynamicMxQuantWithDualAxis: "Ascend 950PR/Ascend 950DT：支持") a bf16
    tensor needing both MX layouts takes one npu_dynamic_mx_quant_with_dual_axis; the quantized storage and the
    linear's results equal the reference's bit for bit."""
    from mindspeed_te.formats import FP8Dtype
    from mindspeed_te.quantizers import MXFP8Quantizer

    sim = make_simulator(chip)
    got = _step(use_backend, "npu", monkeypatch, RECIPES[name], sim)
    want = _step(use_backend, "reference", monkeypatch, RECIPES[name])
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert sim.launch_counts["npu_dynamic_mx_quant_with_dual_axis"] == 3 and not sim.launch_counts[
        "npu_dynamic_mx_quant"]
    rounding = "floor" if "floor" in name else "ceil"
    x = (torch.randn(96, 160, generator=torch.Generator().manual_seed(4)) * 5).bfloat16()
    x[:32, :32] = 0.0
    q = MXFP8Quantizer(FP8Dtype.E4M3, rounding=rounding)
    a, b = NpuBackend(sim).quantize(q, x), q.quantize(x)
    for field in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        assert torch.equal(getattr(a, field).view(torch.uint8), getattr(b, field).view(torch.uint8)), field
    assert a.columnwise_scale_pairs is not None
    a.update_usage(columnwise=False)
    assert a.columnwise_scale_pairs is None


def test_mxfp8_dual_axis_not_without_the_kernel_or_for_float32():
    """The dual-axis kernel takes float16/bfloat16 input only, and a torch_npu may lack it (`hasattr`): then each
    MX layout is one npu_dynamic_mx_quant, with the same bits."""
    from mindspeed_te.formats import FP8Dtype
    from mindspeed_te.quantizers import MXFP8Quantizer

    q = MXFP8Quantizer(FP8Dtype.E4M3)
    x = torch.randn(96, 64)
    dual = NpuBackend(make_simulator("Ascend950DT")).quantize(q, x.bfloat16())
    for sim, dtype in ((_simulator_without_dual_axis(), torch.bfloat16),
                       (make_simulator("Ascend950PR"), torch.float32)):
        out = NpuBackend(sim).quantize(q, x.to(dtype))
        assert sim.launch_counts == {"npu_dynamic_mx_quant": 2}
        # its columnwise form is the dual-axis kernel's: quantized along the rows of x as x lies (axis -2)
        assert out.columnwise_data.t().is_contiguous() and out.columnwise_scale_pairs.shape == (2, 64, 2)
        if dtype == torch.bfloat16:
            for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_pairs"):
                assert torch.equal(getattr(out, name).view(torch.uint8), getattr(dual, name).view(torch.uint8))


@pytest.mark.parametrize("chip", ["Ascend950PR", "Ascend950DT"])
@pytest.mark.parametrize("name", ["delayed/hybrid", "tensorwise/e4m3", "blockwise/e4m3", "blockwise pow2/e4m3",
                                  "blockwise/hif8", "mxfp8/hybrid"])
def test_a_linear_without_tokens_matches_the_reference(name, chip, monkeypatch, use_backend):
    """A rank without tokens (0 rows): aclnnQuantMatmulV5 takes empty operands only in m or n ("当输入参数x1为m=0
    的空tensor或x2为n=0的空tensor时，输出为空tensor"; k = 0, the wgrad's sum over no tokens, is refused) and
    aclnnDynamicBlockQuantV2 none ("不支持空Tensor"), which the simulator enforces: the NPU path still runs and gives
    the reference's empty output and zero gradients."""
    sim = make_simulator(chip)
    got = _step(use_backend, "npu", monkeypatch, RECIPES[name], sim, shape=(0, 128, 128))
    want = _step(use_backend, "reference", monkeypatch, RECIPES[name], shape=(0, 128, 128))
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w)
    assert got[0].shape == (0, 128) and not got[2].any()


@pytest.mark.parametrize("case", ["key padding", "query rows without keys", "bottom-right, more queries",
                                  "value heads narrower", "no queries"])
def test_attention_masks_the_kernel_takes_and_rows_without_keys(case, monkeypatch, use_backend):
    """npu_fusion_attention takes masks "BNSS格式、B1SS格式、11SS格式、SS格式" only, so a key-padding mask
    [b, 1, 1, s_k] is broadcast first; rows whose keys are all masked need its invalid-row computation
    ("inner_precise ... 2为开启无效行计算"; the simulator writes NaN there without it), and "key和value的shape必须
    一致" sends narrower value heads to the reference, as "S：sequence length，取值范围1~1M" does a call without
    queries. Every case equals the reference, zeros included."""
    from mindspeed_te.modules import DotProductAttention

    mask_type, kwargs, mask = "padding", {}, None
    if case == "key padding":
        mask = torch.zeros(2, 1, 1, 8, dtype=torch.bool)
        mask[1, ..., 5:] = True
    elif case == "query rows without keys":
        mask = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(1)) < 0.3
        mask[1, :, 4, :] = True
    elif case == "bottom-right, more queries":
        mask_type, kwargs = "causal_bottom_right", dict(s_q=8, s_k=5)
    elif case == "no queries":
        mask_type, kwargs = "causal", dict(s_q=0)
    else:
        mask_type, kwargs = "causal", dict(d_v=8)
    attn = DotProductAttention(4, 16, num_gqa_groups=2, attn_mask_type=mask_type)
    got, want, sim = _attention_on_both(attn, _attention_case(**kwargs), mask, monkeypatch, use_backend)
    assert torch.equal(got, want)
    fused = case not in ("value heads narrower", "no queries")  # "S：sequence length，取值范围1~1M"
    assert sim.launch_counts["npu_fusion_attention"] == int(fused)
    if case == "query rows without keys":
        assert not got[4, 1].any() and torch.isfinite(got).all()
    if case == "bottom-right, more queries":
        assert not got[:3].any() and torch.isfinite(got).all()


def test_rms_norm_keeps_a_float32_gamma_for_bfloat16_inputs(monkeypatch, use_backend):
    """aclnnRmsNorm takes x BFLOAT16 with gamma FLOAT32: the zero-centred gamma 1 + w, computed in float32, reaches
    the kernel unrounded (bfloat16 would keep about 2 distinct values of 1 + 1e-3 · randn), so the NPU path equals
    the reference bit for bit."""
    from mindspeed_te.modules import RMSNorm

    norm = RMSNorm(64, eps=1e-6, zero_centered_gamma=True)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=torch.Generator().manual_seed(2)) * 1e-3)
    x = torch.randn(8, 3, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    use_backend("reference")
    want = norm(x)
    sim = make_simulator()
    use_backend("npu")
    monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(sim))
    got = norm(x)
    assert sim.launch_counts["npu_rms_norm"] == 1 and got.dtype == torch.bfloat16
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["delayed/hybrid", "tensorwise/e4m3", "blockwise/e4m3", "blockwise pow2/e4m3",
                                  "blockwise/hif8", "mxfp8/hybrid"])
def test_bfloat16_main_grad_matches_the_reference(name, monkeypatch, use_backend):
    """--grad-reduce-in-bf16: the weight gradient is added into a bfloat16 main_grad, the kernel's float32 sum and
    main_grad rounded once, as on the reference."""
    sim = make_simulator()
    start = torch.randn(128, 192, generator=torch.Generator().manual_seed(9)).bfloat16()
    got = _step(use_backend, "npu", monkeypatch, RECIPES[name], sim, main_grad=start)
    want = _step(use_backend, "reference", monkeypatch, RECIPES[name], main_grad=start)
    assert got[2].dtype == torch.bfloat16
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_fresh_amax_slot_is_written_once_then_accumulated(monkeypatch, use_backend):
    """The NPU path writes a tensor's amax straight into its history slot when nothing has written the slot
    since it was cleared (the step's first quantize: one launch fewer) and max-accumulates otherwise. The
    input's slot must hold max |x| over every input quantized since the last update: two forwards in one
    region, a checkpoint taken after a forward and loaded into a new module, and HIF8DelayedScaling's steps
    between updates. Writing where it should accumulate would leave the smaller, later amax."""
    from mindspeed_te import HIF8DelayedScaling, Linear, fp8_autocast

    use_backend("npu")
    g = torch.Generator().manual_seed(0)
    big = (torch.randn(16, 64, generator=g) * 8).bfloat16()
    small = (torch.randn(16, 64, generator=g) / 8).bfloat16()
    amax_big = big.abs().max().float()

    def input_slot(layer: torch.nn.Module) -> torch.Tensor:
        return layer.fp8_states[0].amax_history[0, 0]  # forward state, column 0: the input

    layer = Linear(64, 64, params_dtype=torch.bfloat16)
    with fp8_autocast(fp8_recipe=DelayedScaling()):
        layer(big)
        assert input_slot(layer) == amax_big  # written into the fresh slot
        saved = layer.state_dict()
        layer(small)
        assert input_slot(layer) == amax_big
    with fp8_autocast(fp8_recipe=DelayedScaling()):
        layer(small)
        assert input_slot(layer) == small.abs().max().float()  # the update cleared the slot

    loaded = Linear(64, 64, params_dtype=torch.bfloat16)
    loaded.load_state_dict(saved)
    with fp8_autocast(fp8_recipe=DelayedScaling()):
        loaded(small)
        assert input_slot(loaded) == amax_big  # the checkpoint's slot 0 is accumulated into

    # HiF8: each state counts its own steps. `late` joins a step after `early`, so at the end of step 2 only
    # `early` updates, and `late` keeps its step-1 amax through its step 2.
    hif8 = HIF8DelayedScaling(amax_collect_interval=0, scale_update_interval=2)  # updates after steps 2, 4, ...
    early, late = Linear(64, 64, params_dtype=torch.bfloat16), Linear(64, 64, params_dtype=torch.bfloat16)
    for layers, x in (((early,), small), ((early, late), big), ((early, late), small)):
        with fp8_autocast(fp8_recipe=hif8):
            for layer in layers:
                layer(x)
            kept = input_slot(late).clone() if late in layers else None
    assert kept == amax_big


def test_fresh_amax_slot_is_not_taken_after_writes_the_library_did_not_make(monkeypatch, use_backend):
    """The fresh-slot write relies on slot 0 being clear since the update. A write the library did not make
    (through fp8_meta, as TE code may do; a TE-style quantizer holding views of the state's tensors) shows in
    the history's version counter, and the NPU path then max-accumulates, as the reference does. One quantizer
    given two tensors in one call accumulates both, so each tensor's decode scale is marked by its own amax
    (an Inf in the second leaves the first finite). A state pickled without the freshness fields loads."""
    import copy

    from mindspeed_te import Float8Quantizer, FP8Dtype, Linear, fp8_autocast
    from mindspeed_te.recipe_state import update_delayed_states

    use_backend("npu")
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    layer = Linear(64, 64, params_dtype=torch.bfloat16)
    with fp8_autocast(fp8_recipe=DelayedScaling()):
        layer(x)
    history = layer.fp8_meta["scaling_fwd"].amax_history
    history[0, layer.fp8_meta_index("input")] = 1000.0  # after the update, before the next quantize
    with fp8_autocast(fp8_recipe=DelayedScaling()):
        layer(x)
        assert history[0, 0] == 1000.0

    state = RecipeState.create(DelayedScaling(), forward=True, num_quantizers=3)
    update_delayed_states([state])
    te_style = Float8Quantizer(state.scale[0:1], state.amax_history[0][0:1], FP8Dtype.E4M3)
    get_backend().quantize(te_style, torch.full((4, 64), 50.0).bfloat16())
    get_backend().quantize(state.make_quantizers()[0], torch.ones(4, 64).bfloat16())
    assert state.amax_history[0, 0] == 50.0

    q = state.make_quantizers()[1]
    update_delayed_states([state])
    with_inf = torch.ones(4, 64).bfloat16()
    with_inf[0, 0] = float("inf")
    first, second = get_backend().quantize_many([q, q], [torch.ones(4, 64).bfloat16(), with_inf])
    assert first.scale_inv.isfinite().all() and not second.scale_inv.isfinite().all()

    pickled = copy.copy(state.__getstate__())
    for name in ("fresh", "fresh_epoch", "own_watch"):
        pickled.pop(name, None)
    pickled["amax_history"][0, 0] = 50.0  # pickled between a quantize and the update
    old = object.__new__(type(state))
    old.__setstate__(pickled)
    get_backend().quantize(old.make_quantizers()[0], torch.full((4, 64), 2.0).bfloat16())
    assert old.amax_history[0, 0] == 50.0  # the copy's slot 0, accumulated into


# Fused norm / activation + quantize (docs/npu.md, "Fused norm and activation quantize") ---------------------------
def _fused_npu(use_backend, monkeypatch, chip="Ascend950PR"):
    """The NPU backend on a simulated torch_npu that has npu_rms_norm_dynamic_mx_quant and
    npu_swiglu_mx_quant_with_dual_axis; returns the simulator."""
    from mindspeed_te.testing.npu_sim import make_simulator_with_fused_quant

    sim = make_simulator_with_fused_quant(chip)
    use_backend("npu")
    monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(sim))
    return sim


def _mx(rounding="ceil", rowwise=True, columnwise=False, fmt="E4M3"):
    from mindspeed_te import FP8Dtype
    from mindspeed_te.quantizers import MXFP8Quantizer

    return MXFP8Quantizer(FP8Dtype[fmt], rounding=rounding, rowwise=rowwise, columnwise=columnwise)


def _same_mx(a, b, columnwise):
    """Both MXFP8 storages hold the same codes and E8M0 scales in the layouts asked for."""
    assert torch.equal(a.rowwise_data.view(torch.uint8), b.rowwise_data.view(torch.uint8))
    assert torch.equal(a.rowwise_scale_inv, b.rowwise_scale_inv)
    if columnwise:
        assert torch.equal(a.columnwise_data.view(torch.uint8), b.columnwise_data.view(torch.uint8))
        assert torch.equal(a.columnwise_scale_inv, b.columnwise_scale_inv)
    else:
        assert a.columnwise_data is None and b.columnwise_data is None


@pytest.mark.parametrize("chip", ["Ascend950PR", "Ascend950DT"])
@pytest.mark.parametrize("rounding", ["ceil", "floor"])
@pytest.mark.parametrize("dtype,gamma_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                               (torch.bfloat16, torch.float32)])
def test_fused_rms_norm_mx_quantize_is_the_norm_then_the_quantize(chip, rounding, dtype, gamma_dtype, monkeypatch,
                                                                   use_backend):
    """npu_rms_norm_dynamic_mx_quant gives the rowwise MXFP8 form of the norm's output bit for bit (the reference:
    rms_norm, then quantize), and its stand-in output carries the same gradients to x and gamma."""
    from mindspeed_te.kernels.reference import ReferenceBackend

    sim = _fused_npu(use_backend, monkeypatch, chip)
    npu = get_backend()
    g = torch.Generator().manual_seed(0)
    x0 = (torch.randn(64, 96, generator=g) * 3).to(dtype)
    gamma0 = (torch.randn(96, generator=g) + 1).to(gamma_dtype)
    dy = torch.randn(64, 96, generator=g).to(dtype)
    results = []
    for backend in (npu, ReferenceBackend()):
        x, gamma = x0.clone().requires_grad_(), gamma0.clone().requires_grad_()
        q = _mx(rounding)
        assert backend.fuses_norm_quantize("RMSNorm", x, gamma, q) == (backend is npu)
        y, quantized = backend.norm_quantize("RMSNorm", x, gamma, None, 1e-5, q)
        assert y.shape == x.shape and y.dtype == x.dtype
        y.backward(dy)
        results.append((quantized, x.grad, gamma.grad))
    (got, *got_grads), (want, *want_grads) = results
    _same_mx(got, want, columnwise=False)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
    assert sim.launch_counts["npu_rms_norm_dynamic_mx_quant"] == 1 and "npu_rms_norm" not in sim.launch_counts
    assert sim.launch_counts["npu_rms_norm_backward"] == 1


@pytest.mark.parametrize("chip", ["Ascend950PR", "Ascend950DT"])
@pytest.mark.parametrize("rounding", ["ceil", "floor"])
@pytest.mark.parametrize("columnwise", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_swiglu_mx_quantize_is_the_activation_then_the_quantize(chip, rounding, columnwise, dtype, monkeypatch,
                                                                       use_backend):
    """npu_swiglu_mx_quant_with_dual_axis gives both MXFP8 layouts of TE's swiglu (silu of the first half times the
    second, in float32, x's dtype out) bit for bit: the reference computes the activation, then quantizes it."""
    from mindspeed_te.kernels.reference import ReferenceBackend
    from mindspeed_te.ops.activation import activation_function

    sim = _fused_npu(use_backend, monkeypatch, chip)
    npu = get_backend()
    x = (torch.randn(96, 256, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    fn = activation_function("swiglu")
    outs = []
    for backend in (npu, ReferenceBackend()):
        q = _mx(rounding, columnwise=columnwise)
        assert backend.fuses_activation_quantize("swiglu", x, q) == (backend is npu)
        outs.append(backend.activation_quantize("swiglu", x, q, fn))
    assert tuple(outs[0].shape) == tuple(outs[1].shape) == (96, 128)
    _same_mx(*outs, columnwise=columnwise)
    assert sim.launch_counts == {"npu_swiglu_mx_quant_with_dual_axis": 1}


def test_fused_quantize_only_where_the_kernel_takes_it_and_keeps_the_recipes_rule(monkeypatch, use_backend):
    """The fused kernels serve MXFP8 alone (their scales are MX's), RMSNorm and SwiGLU alone, float16/bfloat16,
    whole 32-blocks; the norm's kernel makes no columnwise form, and returns its rstd only for an x that requires
    grad. A torch_npu without the kernels (the default simulator) fuses nothing."""
    from mindspeed_te import FP8Dtype
    from mindspeed_te.quantizers import Float8BlockQuantizer, Float8CurrentScalingQuantizer

    _fused_npu(use_backend, monkeypatch)
    npu = get_backend()
    x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    gamma = torch.ones(128, dtype=torch.bfloat16, requires_grad=True)
    assert npu.fuses_norm_quantize("RMSNorm", x, gamma, _mx())
    assert npu.fuses_activation_quantize("swiglu", x, _mx(columnwise=True))
    refused_norm = [("LayerNorm", x, gamma, _mx()), ("RMSNorm", x, gamma, _mx(columnwise=True)),
                    ("RMSNorm", x.float(), gamma.float(), _mx()), ("RMSNorm", x[:48], gamma, _mx()),
                    ("RMSNorm", x.detach(), gamma, _mx()),  # no rstd for dgamma
                    ("RMSNorm", x, gamma, Float8BlockQuantizer(FP8Dtype.E4M3, 448.0, columnwise=False)),
                    ("RMSNorm", x, gamma, Float8CurrentScalingQuantizer(FP8Dtype.E4M3, 448.0, columnwise=False))]
    for args in refused_norm:
        assert not npu.fuses_norm_quantize(*args), args
    for name, t in (("geglu", x), ("clamped_swiglu", x), ("swiglu", x.float()), ("swiglu", x[:, :96]),
                    ("swiglu", x[:40])):
        assert not npu.fuses_activation_quantize(name, t, _mx()), (name, tuple(t.shape))
    assert not npu.fuses_activation_quantize("swiglu", x, Float8BlockQuantizer(FP8Dtype.E4M3, 448.0))
    monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(make_simulator()))
    use_backend("npu")
    assert not get_backend().fuses_norm_quantize("RMSNorm", x, gamma, _mx())
    assert not get_backend().fuses_activation_quantize("swiglu", x, _mx())


def _module_step(kind, recipe, frozen, normalization="RMSNorm", activation="swiglu", zero_centered_gamma=False):
    """(output, input grad, parameter grads) of two training steps of LayerNormMLP(128, 128) or
    LayerNormLinear(128, 96) in bfloat16, with frozen linear weights when asked."""
    from mindspeed_te import fp8_autocast
    from mindspeed_te.modules import LayerNormLinear, LayerNormMLP

    torch.manual_seed(0)
    if kind == "mlp":
        layer = LayerNormMLP(128, 128, normalization=normalization, activation=activation,
                             params_dtype=torch.bfloat16, zero_centered_gamma=zero_centered_gamma)
        weights = [layer.fc1_weight, layer.fc2_weight]
    else:
        layer = LayerNormLinear(128, 96, normalization=normalization, params_dtype=torch.bfloat16,
                                zero_centered_gamma=zero_centered_gamma)
        weights = [layer.weight]
    with torch.no_grad():
        layer.layer_norm_weight.add_(torch.randn(128) * 0.1)
    for w in weights:
        w.requires_grad_(not frozen)
    x = (torch.randn(2, 32, 128, generator=torch.Generator().manual_seed(1)) * 2).bfloat16().requires_grad_()
    for step in range(2):
        with fp8_autocast(fp8_recipe=recipe):
            y = layer(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(2 + step)).bfloat16())
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters() if p.requires_grad]


@pytest.mark.parametrize("chip", ["Ascend950PR", "Ascend950DT"])
@pytest.mark.parametrize("rounding", ["ceil", "floor"])
@pytest.mark.parametrize("kind,frozen,zero_centered_gamma", [("mlp", False, False), ("mlp", True, True),
                                                              ("linear", True, False), ("linear", True, True),
                                                              ("linear", False, False)])
def test_modules_take_the_fused_kernels_with_the_references_bits(chip, rounding, kind, frozen, zero_centered_gamma,
                                                                 monkeypatch, use_backend):
    """LayerNormMLP (swiglu) takes npu_swiglu_mx_quant_with_dual_axis for FC2's input, and the RMSNorm's kernel
    takes FC1's (LayerNormLinear's) input where the linear needs no columnwise input (a frozen weight: no wgrad);
    outputs and gradients are the reference backend's, bit for bit, over two steps."""
    recipe = MXFP8BlockScaling(scale_rounding=rounding)
    sim = _fused_npu(use_backend, monkeypatch, chip)
    got = _module_step(kind, recipe, frozen, zero_centered_gamma=zero_centered_gamma)
    use_backend("reference")
    want = _module_step(kind, recipe, frozen, zero_centered_gamma=zero_centered_gamma)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert sim.launch_counts["npu_swiglu_mx_quant_with_dual_axis"] == (2 if kind == "mlp" else 0)
    assert sim.launch_counts["npu_rms_norm_dynamic_mx_quant"] == (2 if frozen else 0)
    assert sim.launch_counts["npu_rms_norm"] == (0 if frozen else 2)


@pytest.mark.parametrize("normalization,activation", [("LayerNorm", "geglu"), ("RMSNorm", "gelu")])
def test_modules_without_a_fused_kernel_keep_the_unfused_path(normalization, activation, monkeypatch, use_backend):
    """LayerNorm and activations other than swiglu have no fused MX kernel: the unfused path, the same bits."""
    recipe = MXFP8BlockScaling()
    sim = _fused_npu(use_backend, monkeypatch)
    got = _module_step("mlp", recipe, True, normalization, activation)
    use_backend("reference")
    want = _module_step("mlp", recipe, True, normalization, activation)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert "npu_swiglu_mx_quant_with_dual_axis" not in sim.launch_counts
    assert ("npu_rms_norm_dynamic_mx_quant" in sim.launch_counts) == (normalization == "RMSNorm")


def test_an_operand_observer_or_another_recipe_keeps_the_unfused_path(monkeypatch, use_backend):
    """The numerics report's observer reads the linear's high-precision input, which a fused kernel does not
    make; per-tensor and blockwise recipes have no fused kernel of their rule."""
    from mindspeed_te import Float8BlockScaling, Float8CurrentScaling

    sim = _fused_npu(use_backend, monkeypatch)
    seen = []
    FP8GlobalStateManager.set_operand_observer(lambda weight, role, hp, q: seen.append(role))
    try:
        _module_step("mlp", MXFP8BlockScaling(), True)
    finally:
        FP8GlobalStateManager.set_operand_observer(None)
    assert seen and not {"npu_swiglu_mx_quant_with_dual_axis", "npu_rms_norm_dynamic_mx_quant"} & set(sim.launch_counts)
    for recipe in (DelayedScaling(), Float8CurrentScaling(), Float8BlockScaling()):
        _module_step("mlp", recipe, True)
    assert not {"npu_swiglu_mx_quant_with_dual_axis", "npu_rms_norm_dynamic_mx_quant"} & set(sim.launch_counts)


def test_a_prequantized_input_refuses_another_usage():
    """fp8_linear must ask the fused kernel's storage for the usage it was made with, once."""
    from mindspeed_te.ops.prequantized import PrequantizedQuantizer

    q = _mx(columnwise=True)
    storage = q.quantize(torch.randn(32, 64))
    pre = PrequantizedQuantizer(q, storage)
    pre.set_usage(rowwise=True, columnwise=True)
    with pytest.raises(RuntimeError, match="columnwise=False"):
        pre.set_usage(rowwise=True, columnwise=False)
    with pytest.raises(RuntimeError, match="not the tensor"):
        pre.quantize(torch.randn(32, 32))
    assert pre.quantize(torch.randn(32, 64)) is storage
    with pytest.raises(RuntimeError, match="taken already"):
        pre.quantize(torch.randn(32, 64))


# The weight-gradient kernels of op-plugin 26.0.0 and later (npu_add_quant_matmul_, npu_grouped_dynamic_mx_quant,
# npu_add_quant_gmm_), taken only where torch_npu has them ------------------------------------------------------
def _wgrad_sim(chip="Ascend950PR"):
    from mindspeed_te.testing.npu_sim import make_simulator_with_fused_wgrad

    return make_simulator_with_fused_wgrad(chip)


@pytest.mark.parametrize("name, fused", [("mxfp8/e4m3", True), ("mxfp8/hybrid", True), ("mxfp8/e4m3 floor", True),
                                         ("delayed/hif8", False), ("tensorwise/hif8", False),
                                         ("tensorwise/e4m3", False), ("blockwise pow2/e4m3", True),
                                         ("blockwise/hif8", False)])
def test_wgrad_accumulates_into_main_grad_in_the_gemm(name, fused, monkeypatch, use_backend):
    """Megatron's gradient-accumulation fusion: with npu_add_quant_matmul_ in torch_npu, the MXFP8 wgrad adds its
    float32 sum into the float32 main_grad in the GEMM (one rounding, as the unfused GEMM + add and the
    reference), bit for bit the reference's; so does the power-of-2 blockwise wgrad in the MX mode (its 1x128
    columnwise codes quantized along the tokens, as the kernel reads them). HiF8 per-tensor (its T-T mode cuts
    x1Scale * x2Scale to 19 bits), E4M3/E5M2 per-tensor (no such mode) and HiF8 blockwise (no MX mode) keep
    npu_quant_matmul + add, or the dequantize + matmul."""
    recipe = RECIPES.get(name) or recipes(name)[name]
    sim = _wgrad_sim()
    start = torch.randn(128, 192, generator=torch.Generator().manual_seed(9)) * 50
    got = _step(use_backend, "npu", monkeypatch, recipe, sim, main_grad=start)
    want = _step(use_backend, "reference", monkeypatch, recipe, main_grad=start)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert sim.launch_counts["npu_add_quant_matmul_"] == int(fused)
    # fprop, dgrad and the unfused wgrad (HiF8 1x128 x 1x128 tiles: dequantize + matmul, no kernel)
    assert sim.launch_counts["npu_quant_matmul"] == 2 + (not fused and name != "blockwise/hif8")
    # a bfloat16 main_grad (--grad-reduce-in-bf16), which the kernel does not take ("self ... float32"): unfused
    sim = _wgrad_sim()
    got = _step(use_backend, "npu", monkeypatch, recipe, sim, main_grad=start.bfloat16())
    want = _step(use_backend, "reference", monkeypatch, recipe, main_grad=start.bfloat16())
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and "npu_add_quant_matmul_" not in sim.launch_counts


def test_fused_mx_wgrad_takes_any_number_of_tokens(monkeypatch, use_backend):
    """npu_add_quant_matmul_ states no limit on k (op_api CheckMKN: "the K dimension ... must be positive"), so a
    wgrad over more tokens than npu_quant_matmul's 65535 is one fused launch, no parts: the reference's bits."""
    sim = _wgrad_sim()
    shape = (65536 + 128, 64, 32)
    got = _step(use_backend, "npu", monkeypatch, RECIPES["mxfp8/hybrid"], sim, shape=shape)
    want = _step(use_backend, "reference", monkeypatch, RECIPES["mxfp8/hybrid"], shape=shape)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert sim.launch_counts["npu_add_quant_matmul_"] == 1 and sim.launch_counts["npu_quant_matmul"] == 2


@pytest.mark.parametrize("name", ["mxfp8/hybrid", "blockwise pow2/e4m3"])
def test_wgrad_past_the_kernels_k_limit_sums_its_parts(name, monkeypatch, use_backend):
    """npu_quant_matmul takes k up to 65535 ("x1与x2最后一维的shape大小不能超过65535"): a wgrad over more tokens
    (its operands the transposed views of tokens-major codes, their scale pairs alike) runs as GEMMs over parts
    of whole 128-tiles and E8M0 pairs, summed in float32. The sum's order differs from one GEMM's, so the weight
    gradient agrees with the reference's to float32 rounding of its terms; the rest is bit for bit."""
    sim = make_simulator()
    shape = (65536 + 128, 64, 32)
    got = _step(use_backend, "npu", monkeypatch, RECIPES[name], sim, shape=shape)
    want = _step(use_backend, "reference", monkeypatch, RECIPES[name], shape=shape)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[3], want[3])
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-3)
    assert sim.launch_counts["npu_quant_matmul"] == 2 + 2  # fprop, dgrad, the wgrad's two parts


def _grouped_mx_step(use_backend, backend_name, monkeypatch, splits, layout, sim=None, save_original_input=False,
                     recipe=None):
    """(output, input grad, each expert's main_grad) of GroupedLinear(len(splits), 128, 96) with fused wgrad
    accumulation into float32 main_grads that lie as `layout` says: "apart" (each its own), "in order" (slices
    of one (g, 96, 128) buffer, expert 0 first) or "reverse" (Megatron's grad buffer: the last expert first)."""
    from mindspeed_te import fp8_autocast
    from mindspeed_te.modules import GroupedLinear

    use_backend(backend_name)
    if sim is not None:
        monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(sim))
    torch.manual_seed(0)
    n = len(splits)
    layer = GroupedLinear(n, 128, 96, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True,
                          save_original_input=save_original_input)
    start = torch.randn(n, 96, 128, generator=torch.Generator().manual_seed(2))
    order = {"apart": None, "in order": list(range(n)), "reverse": list(range(n))[::-1]}[layout]
    buffer = start.clone()
    for i, w in enumerate(layer.weights):
        w.main_grad = start[i].clone() if order is None else buffer[order[i]]
        if order is not None:
            w.main_grad.copy_(start[i])
    x = (torch.randn(sum(splits), 128) * 3).bfloat16().requires_grad_()
    with fp8_autocast(fp8_recipe=recipe or MXFP8BlockScaling()):
        y = layer(x, splits)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).bfloat16())
    return [y.detach(), x.grad] + [w.main_grad.clone() for w in layer.weights]


@pytest.mark.parametrize("splits", [[32, 96, 64], [160, 0, 288, 32], [96], [32] * 5, [5, 37, 22], [130, 0, 1, 257]])
@pytest.mark.parametrize("layout", ["apart", "in order", "reverse"])
@pytest.mark.parametrize("name", ["mxfp8/e4m3", "blockwise pow2/e4m3", "blockwise pow2/hybrid"])
def test_block_scaled_experts_wgrad_is_one_grouped_launch(name, splits, layout, monkeypatch, use_backend):
    """The MXFP8 experts' wgrad is one K-split npu_grouped_matmul in the MX mode, with or without torch_npu's
    newer kernels, bit for bit the reference's (one GEMM per expert there): its scales come from the experts'
    own columnwise quantizes laid out in the grouped layout by one concatenation per operand, or, with
    npu_grouped_dynamic_mx_quant, from one grouped quantize per operand, as they lie. So is the wgrad of
    power-of-2 1x128 experts (TE's blockwise default): each expert's columnwise form is quantized along its
    tokens (128-blocks, the tile after its last whole one cut short), each tile's byte repeated for its four
    32-blocks. Accumulation into main_grads in one buffer in expert order is the GEMM's own (npu_add_quant_gmm_);
    in other layouts (an expert without tokens between, Megatron's reverse order) one multi-tensor add follows
    the grouped GEMM. An expert's tokens need not be whole 32-blocks: its last block is short, in the quantizes
    and in the GEMM ("支持最后的切片长度不足gsK")."""
    recipe = RECIPES.get(name) or recipes(name)[name]
    active = sum(1 for m in splits if m)
    want = _grouped_mx_step(use_backend, "reference", monkeypatch, splits, layout, recipe=recipe)
    for newer in (False, True):
        sim = _wgrad_sim() if newer else make_simulator()
        got = _grouped_mx_step(use_backend, "npu", monkeypatch, splits, layout, sim, recipe=recipe)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        counts = sim.launch_counts
        assert "npu_quant_matmul" not in counts  # no GEMM per expert
        # the experts with tokens' main_grads one (g, 96, 128) tensor: in order, no expert left out between
        in_kernel = newer and (active == 1 or (layout == "in order" and 0 not in splits))
        assert counts["npu_add_quant_gmm_"] == int(in_kernel)
        assert counts["npu_grouped_matmul"] == 3 - int(in_kernel)  # fprop, dgrad (, wgrad)
        if name.startswith("blockwise"):  # one columnwise quantize per expert with tokens, input and grad_output
            assert counts["npu_dynamic_mx_quant"] >= 2 * active and "npu_grouped_dynamic_mx_quant" not in counts
            continue
        # the experts' input (forward) and grad_output (backward) MX columnwise forms: one grouped call each (one
        # expert: one dual-axis call makes both forms)
        assert counts["npu_grouped_dynamic_mx_quant"] == (2 if newer and len(splits) > 1 else 0)
        if not newer:  # per expert, or per run of whole 64-row pairs; one part: both forms in one dual-axis call
            calls = counts["npu_dynamic_mx_quant"] + counts["npu_dynamic_mx_quant_with_dual_axis"]
            assert calls >= (2 if len(splits) == 1 else 2 + active), counts


@pytest.mark.parametrize("tokens", [128, 256, 384])
def test_float32_blockwise_columnwise_tiles_along_the_tokens(tokens, monkeypatch, use_backend):
    """float32 inputs take the MX kernel's 32-blocks (its 128-blocks are float16/bfloat16 only): a 128-tile's byte
    is the largest of its four, kept one tile per row (no pad to the kernel's pairs), and the wgrad takes them as
    it takes bfloat16's, in the MX mode and into main_grad in the GEMM: the reference's bits."""
    recipe = Float8BlockScaling()
    start = torch.randn(128, 192, generator=torch.Generator().manual_seed(9)) * 50
    for sim in (make_simulator(), _wgrad_sim()):
        got = _step(use_backend, "npu", monkeypatch, recipe, sim, dtype=torch.float32, shape=(tokens, 192, 128),
                    main_grad=start)
        want = _step(use_backend, "reference", monkeypatch, recipe, dtype=torch.float32, shape=(tokens, 192, 128),
                     main_grad=start)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        wgrad = sim.launch_counts["npu_add_quant_matmul_"] + sim.launch_counts["npu_quant_matmul"] - 2
        assert wgrad == 1 and "mm" not in sim.launch_counts, sim.launch_counts


@pytest.mark.parametrize("chip", ["Ascend950PR", "Ascend950DT"])
@pytest.mark.parametrize("save_original_input", [False, True])
def test_mx_experts_with_the_grouped_quantize(chip, save_original_input, monkeypatch, use_backend):
    """npu_grouped_dynamic_mx_quant on both chips (the dual-axis call makes both forms where all experts but the
    last are whole 64-token pairs, and the grouped one is taken otherwise), with the inputs
    quantized again in backward (save_original_input: columnwise only, noted for the non-finite flags from its
    scales), and the E5M2 grad_outputs of HYBRID: the reference's bits."""
    recipe = MXFP8BlockScaling(fp8_format=Format.HYBRID)
    for splits, grouped in (([32, 64, 96], True), ([64, 128, 32], False)):
        want = _grouped_mx_step(use_backend, "reference", monkeypatch, splits, "apart",
                                save_original_input=save_original_input, recipe=recipe)
        sim = _wgrad_sim(chip)
        got = _grouped_mx_step(use_backend, "npu", monkeypatch, splits, "apart", sim,
                               save_original_input=save_original_input, recipe=recipe)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        # inputs (forward, or backward with save_original_input) and grad_outputs; with the dual-axis call the inputs
        # quantized again in backward (columnwise only: no dual-axis call) still take the grouped one
        calls = sim.launch_counts["npu_grouped_dynamic_mx_quant"]
        assert calls == (2 if grouped else int(save_original_input)), sim.launch_counts


def test_grouped_quantize_notes_nonfinite_columnwise_forms(monkeypatch, use_backend):
    """Columnwise-only MX forms from the grouped quantize are noted for the non-finite flag (their scales read
    as the kernel laid them out): a NaN in one expert's grad_output sets the flag as on the reference."""
    from mindspeed_te.formats import FP8Dtype
    from mindspeed_te.quantizers import MXFP8Quantizer

    backend = NpuBackend(_wgrad_sim())
    x = torch.randn(160, 64, dtype=torch.bfloat16)
    x[100, 3] = float("nan")
    parts = list(torch.split(x, [32, 96, 32]))
    qs = [MXFP8Quantizer(FP8Dtype.E4M3, rowwise=False, columnwise=True) for _ in parts]
    for q in qs:
        q.nonfinite = torch.zeros(1)
    outs = backend.quantize_row_blocks(qs, parts, len(parts))
    assert backend.npu.launch_counts == {"npu_grouped_dynamic_mx_quant": 1}
    flags = [bool(q.nonfinite.isnan().item()) for q in qs]
    assert flags == [False, True, False]
    for out, part in zip(outs, parts):
        want = MXFP8Quantizer(FP8Dtype.E4M3, rowwise=False, columnwise=True).quantize(part)
        assert out.rowwise_data is None
        assert torch.equal(out.dequantize(torch.float32, columnwise=True).nan_to_num(),
                           want.dequantize(torch.float32, columnwise=True).nan_to_num())


@pytest.mark.parametrize("tokens", [5, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_linear_of_any_tokens(tokens, dtype, monkeypatch, use_backend):
    """An MXFP8 Linear over tokens not whole 32-blocks: the wgrad's last block along them is short in the quantize
    and in the GEMM ("支持最后的切片长度不足gsK"), with no fallback to a dequantize + matmul: the reference's bits."""
    want = _step(use_backend, "reference", monkeypatch, MXFP8BlockScaling(), dtype=dtype, shape=(tokens, 192, 128))
    for release in ("2.14", "26.1"):
        sim = make_release_simulator("Ascend950PR", release)
        got = _step(use_backend, "npu", monkeypatch, MXFP8BlockScaling(), sim, dtype=dtype,
                    shape=(tokens, 192, 128))
        for g, w in zip(got, want):
            assert torch.equal(g, w), release
        gemms = sim.launch_counts["npu_quant_matmul"] + sim.launch_counts["npu_add_quant_matmul_"]
        assert gemms == 3 and "mm" not in sim.launch_counts, sim.launch_counts


@pytest.mark.parametrize("release", ["2.14", "26.1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mx_experts_of_any_tokens_quantize_as_the_reference(release, dtype):
    """Experts of 5, 37 and 22 tokens (no padding): each one's MX forms, rowwise and columnwise (its last block along
    the tokens short), are the reference quantizer's values. Under 32 float32 tokens take the quantizer's own ops
    (aclnnDynamicMxQuant: "x的类型为FLOAT时，...量化轴的维度不能小于32"); bfloat16 on 26.1 takes one grouped
    quantize for the columnwise forms and one for the rowwise ones."""
    from mindspeed_te.formats import FP8Dtype
    from mindspeed_te.quantizers import MXFP8Quantizer

    backend = NpuBackend(make_release_simulator("Ascend950PR", release))
    parts = list(torch.split((torch.randn(64, 64, generator=torch.Generator().manual_seed(4)) * 5).to(dtype),
                             [5, 37, 22]))
    qs = [MXFP8Quantizer(FP8Dtype.E4M3) for _ in parts]
    for q in qs:
        q.nonfinite = torch.zeros(1)
    outs = backend.quantize_row_blocks(qs, parts, len(parts))
    for out, part in zip(outs, parts):
        want = MXFP8Quantizer(FP8Dtype.E4M3).quantize(part)
        for columnwise in (False, True):
            assert torch.equal(out.dequantize(torch.float32, columnwise=columnwise),
                               want.dequantize(torch.float32, columnwise=columnwise))
    if release == "26.1" and dtype == torch.bfloat16:
        assert backend.npu.launch_counts == {"npu_grouped_dynamic_mx_quant": 1, "npu_dynamic_mx_quant": 1}


def _padded_grouped_step(use_backend, backend_name, monkeypatch, recipe, splits, sim=None):
    """(output, input grad, weight grads, padded splits) of GroupedLinear(len(splits), 128, 256) between
    Megatron's Fp8Padding and Fp8Unpadding (TEGroupedMLP's order), their alignment the active recipe's."""
    from mindspeed_te import fp8_autocast
    from mindspeed_te.megatron.misc import Fp8Padding, Fp8Unpadding
    from mindspeed_te.modules import GroupedLinear

    use_backend(backend_name)
    if sim is not None:
        monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(sim))
    torch.manual_seed(0)
    layer = GroupedLinear(len(splits), 128, 256, params_dtype=torch.bfloat16)
    x = (torch.randn(sum(splits), 128) * 3).bfloat16().requires_grad_()
    with fp8_autocast(fp8_recipe=recipe):
        padded, padded_splits = Fp8Padding(len(splits))(x, splits)
        y = Fp8Unpadding(len(splits))(layer(padded, padded_splits), splits)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).bfloat16())
    return [y.detach(), x.grad] + [w.grad for w in layer.weights], padded_splits


@pytest.mark.parametrize("name", ["delayed/hif8", "tensorwise/e4m3", "tensorwise/hif8", "mxfp8/hybrid",
                                  "blockwise pow2/e4m3", "blockwise/e4m3", "blockwise/hif8", "blockwise pow2/hif8"])
def test_npu_experts_pad_to_what_their_kernels_need(name, monkeypatch, use_backend):
    """npu_grouped_matmul takes any rows per group (aclnnGroupedMatmulV4), so under per-tensor recipes Megatron's
    Fp8Padding pads nothing on the NPU, where TE's GEMMs want 16 rows per expert (the reference backend pads).
    Nor under blockwise and MXFP8 where the kernels take a short last block along an expert's tokens: the K-split
    MX wgrad ("支持最后的切片长度不足gsK") and npu_grouped_dynamic_mx_quant. MX experts take 64 rows without that
    quantize (torch_npu 2.14): every expert then starts at a whole 64-row pair of its columnwise scales, and one
    quantize call makes all the experts' forms. No E4M3 / MX expert falls back to a dequantize + matmul (HiF8
    and non-power-of-2 1x128 wgrads take one anyway, at any rows). The results are the reference's padded run's
    bit for bit, since padding rows are zeros (and a short block's scale is that of its zero-padded whole)."""
    from mindspeed_te.diagnostics import LaunchCounter

    splits = [5, 0, 37, 22]
    want, reference_splits = _padded_grouped_step(use_backend, "reference", monkeypatch, RECIPES[name], splits)
    assert reference_splits == ([32, 0, 64, 32] if name.startswith("mxfp8") else [16, 0, 48, 32])
    for release in ("2.14", "26.1"):
        sim = make_release_simulator("Ascend950PR", release)
        with LaunchCounter(sim) as counter:
            got, npu_splits = _padded_grouped_step(use_backend, "npu", monkeypatch, RECIPES[name], splits, sim)
        assert npu_splits == ([64, 0, 64, 64] if name.startswith("mxfp8") and release == "2.14" else splits)
        if name not in ("blockwise/e4m3", "blockwise/hif8", "blockwise pow2/hif8"):  # (no MX mode for their wgrad)
            assert "aten.mm" not in counter.counts and "aten.matmul" not in counter.counts, counter.counts
        for g, w in zip(got, want):
            assert torch.equal(g, w), release


def test_the_simulator_takes_a_torch_npu_release(monkeypatch):
    """MINDSPEED_TE_NPU_SIMULATOR=<chip>@<release>: that chip with the kernels of that torch_npu release (26.1 has
    the grouped MX quantize, the fused wgrad GEMMs, the fused norm / SwiGLU quantizes and npu_quant_max, 2.14 none);
    an unknown release is refused by name."""
    from mindspeed_te.kernels.npu import load_torch_npu

    newer = ("npu_grouped_dynamic_mx_quant", "npu_add_quant_gmm_", "npu_rms_norm_dynamic_mx_quant", "npu_quant_max")
    for value, chip, has in (("Ascend950DT@26.1", "Ascend950DT", True), ("Ascend950DT", "Ascend950DT", False),
                             ("1", "Ascend950PR", False), ("Ascend950PR@2.14", "Ascend950PR", False)):
        monkeypatch.setenv("MINDSPEED_TE_NPU_SIMULATOR", value)
        npu = load_torch_npu()
        assert npu.soc_name == chip and all(hasattr(npu, name) == has for name in newer), value
    monkeypatch.setenv("MINDSPEED_TE_NPU_SIMULATOR", "Ascend950PR@26.9")
    with pytest.raises(ValueError, match="torch_npu release '26.9' is not simulated; choose one of 2.14, 26.1"):
        load_torch_npu()
