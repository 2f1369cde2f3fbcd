"""The extension's bfloat16 GEMM (csrc/gemm_bf16.c) against a NumPy emulation of its documented summation order,
and its use by the reference backend and the simulated cube."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mindspeed_te import fused_cast
from mindspeed_te.formats import FP8Dtype
from mindspeed_te.kernels.reference import BF16_KERNEL_MIN_MACS, ReferenceBackend
from mindspeed_te.quantizers import Float8Quantizer
from mindspeed_te.testing.npu_sim import NpuSimulator, make_simulator
from mindspeed_te.testing.npu_sim.cube import set_bf16_matmul
from tests.oracles import np_decode

pytestmark = pytest.mark.skipif(not fused_cast.gemm_bf16_applies(),
                                reason="gemm_bf16 needs the extension and a CPU with AVX-512 BF16 (and no AMX)")


def ordered_sum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a · bᵀ as gemm_bf16 documents it: one float32 accumulator per output adds the product of k + 1, then that
    of k, for k = 0, 2, 4, ..., each addition rounded to float32 (the products of bfloat16 values are exact)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    acc = np.zeros((a.shape[0], b.shape[0]), np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for k in range(0, a.shape[1], 2):
            for kk in (k + 1, k):
                if kk < a.shape[1]:
                    acc = (acc + np.outer(a[:, kk], b[:, kk])).astype(np.float32)
    return acc


def bf16_values(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """bfloat16 values over a wide range of exponents, so that the order of the sums shows in the bits."""
    spread = torch.exp2(torch.randint(-12, 12, shape, generator=gen).float())
    return (torch.randn(shape, generator=gen) * spread).bfloat16()


def layouts(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """t as rows along k, as the transpose of a contiguous (K, rows) tensor, and with k every other element."""
    spaced = torch.zeros(t.shape[0], 2 * t.shape[1], dtype=t.dtype)
    spaced[:, ::2] = t
    return {"rows": t, "columns": t.t().contiguous().t(), "strided": spaced[:, ::2]}


# (M, K, N): odd and even K, K over one block of 256, edges of the 12 x 32 tiles, sizes split over threads
SHAPES = [(4, 1, 4), (5, 3, 100), (12, 32, 32), (13, 600, 37), (97, 513, 70), (200, 300, 130), (33, 1025, 4)]


@pytest.mark.parametrize("shape", SHAPES)
def test_bfloat16_and_float32_operands_sum_in_the_documented_order(shape):
    m, k, n = shape
    gen = torch.Generator().manual_seed(m * k * n)
    a, b = bf16_values((m, k), gen), bf16_values((n, k), gen)
    expected = ordered_sum(a.float().numpy(), b.float().numpy())
    for a_name, a_view in layouts(a).items():
        for b_name, b_view in layouts(b).items():
            got = fused_cast.gemm_bf16(a_view, b_view)
            assert np.array_equal(got.numpy(), expected), (a_name, b_name)
    # float32 tensors holding bfloat16 values, in both layouts
    got = fused_cast.gemm_bf16(a.float(), b.float().t().contiguous().t())
    assert np.array_equal(got.numpy(), expected)


def test_the_sum_does_not_depend_on_threads():
    gen = torch.Generator().manual_seed(3)
    a, b = bf16_values((300, 700), gen), bf16_values((260, 700), gen)
    kept = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused_cast.gemm_bf16(a, b)
        torch.set_num_threads(2)
        two = fused_cast.gemm_bf16(a, b)
    finally:
        torch.set_num_threads(kept)
    assert torch.equal(one, two)


def special_codes(fmt: str, kind) -> np.ndarray:
    """The codes of `fmt` whose values are `kind` (np.isnan, np.isinf)."""
    return np.flatnonzero(kind(np_decode(np.arange(256, dtype=np.uint8), fmt)))


def finite_codes(shape: tuple[int, int], fmt: str, gen: torch.Generator) -> torch.Tensor:
    codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    finite = torch.from_numpy(np.isfinite(np_decode(codes.numpy(), fmt)))
    return torch.where(finite, codes, torch.zeros_like(codes))


@pytest.mark.parametrize("a_fmt,b_fmt", [("E4M3", "E4M3"), ("HIF8", "HIF8"), ("E4M3", "E5M2"), ("HIF8", "E5M2")])
@pytest.mark.parametrize("shape", [(13, 600, 37), (97, 513, 70)])
def test_codes_are_read_through_their_values(a_fmt, b_fmt, shape):
    """Codes with their format's values (decoded here by ml_dtypes / en_dtypes), NaN and Inf codes included:
    the sum of the decoded values in the documented order, NaN where it is NaN."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(k)
    a_codes, b_codes = finite_codes((m, k), a_fmt, gen), finite_codes((n, k), b_fmt, gen)
    a_codes[0, 5] = int(special_codes(a_fmt, np.isnan)[0])
    b_codes[1, 7] = int(special_codes(b_fmt, np.isinf)[0]) if special_codes(b_fmt, np.isinf).size else 0
    tables = {fmt: torch.from_numpy(np_decode(np.arange(256, dtype=np.uint8), fmt)) for fmt in (a_fmt, b_fmt)}
    expected = ordered_sum(np_decode(a_codes.numpy(), a_fmt), np_decode(b_codes.numpy(), b_fmt))
    assert np.isnan(expected).any() and not np.isnan(expected).all()
    for a_view in layouts(a_codes).values():
        for b_view in layouts(b_codes).values():
            got = fused_cast.gemm_bf16(a_view, b_view, tables[a_fmt], tables[b_fmt]).numpy()
            np.testing.assert_array_equal(got, expected)  # NaN where expected is NaN, the same bits elsewhere
    # float8 dtypes are read as their bytes
    got = fused_cast.gemm_bf16(a_codes.view(torch.float8_e4m3fn), b_codes, tables[a_fmt], tables[b_fmt])
    np.testing.assert_array_equal(got.numpy(), expected)


def test_a_float32_nan_stays_nan_whatever_its_payload():
    """A float32 NaN whose payload lies in its low 16 bits only is still NaN (its top half alone is Inf)."""
    a = torch.zeros(4, 6)
    a.view(torch.int32)[1, 2] = 0x7F800001
    a.view(torch.int32)[2, 4] = -0x007FFFFF  # 0xFF800001: a negative NaN
    got = fused_cast.gemm_bf16(a, torch.ones(5, 6))
    assert got[1].isnan().all() and got[2].isnan().all() and (got[[0, 3]] == 0).all()


def test_operands_it_does_not_take_give_none():
    x = torch.ones(4, 8, dtype=torch.bfloat16)
    values = torch.arange(512, dtype=torch.float32)
    assert fused_cast.gemm_bf16(x.half(), x) is None  # float16
    assert fused_cast.gemm_bf16(x, x[:, :4]) is None  # k differs
    assert fused_cast.gemm_bf16(x.to(torch.uint8), x.to(torch.uint8)) is None  # codes without their values
    assert fused_cast.gemm_bf16(x.to(torch.uint8), x.to(torch.uint8), values[::2], values[::2]) is None
    assert fused_cast.gemm_bf16(x[None], x) is None  # not 2-D
    assert fused_cast.gemm_bf16(x[:3], x) is None and fused_cast.gemm_bf16(x, x[:3]) is None  # matrix-vector
    empty = fused_cast.gemm_bf16(torch.ones(4, 0, dtype=torch.bfloat16), torch.ones(5, 0, dtype=torch.bfloat16))
    assert torch.equal(empty, torch.zeros(4, 5))


def test_the_simd_cap_turns_it_off():
    """set_simd below AVX-512 runs what a CPU without it runs: not this GEMM."""
    x = torch.ones(4, 8, dtype=torch.bfloat16)
    try:
        fused_cast.set_simd("avx2")
        assert not fused_cast.gemm_bf16_applies() and fused_cast.gemm_bf16(x, x) is None
    finally:
        fused_cast.set_simd("avx512")
    assert fused_cast.gemm_bf16(x, x) is not None


def _per_tensor(x: torch.Tensor, fmt: FP8Dtype, scale: float):
    quantizer = Float8Quantizer(torch.tensor([scale]), torch.zeros(1), fmt, rowwise=True, columnwise=True)
    return quantizer.quantize(x)


@pytest.mark.parametrize("fmt", [FP8Dtype.E4M3, FP8Dtype.HIF8])
def test_reference_per_tensor_gemm_reads_the_codes(fmt):
    """A per-tensor GEMM of 2^22 multiply-adds or more is the documented sum of the decoded codes, then the
    scales, in each layout a Linear uses (forward, dgrad, wgrad)."""
    gen = torch.Generator().manual_seed(7)
    x, w, dy = (torch.randn(s, generator=gen) for s in ((128, 256), (192, 256), (128, 192)))
    assert 128 * 256 * 192 >= BF16_KERNEL_MIN_MACS
    qx, qw, qdy = _per_tensor(x, fmt, 8.0), _per_tensor(w, fmt, 32.0), _per_tensor(dy, fmt, 4.0)
    name = {FP8Dtype.E4M3: "E4M3", FP8Dtype.HIF8: "HIF8"}[fmt]
    decoded = {id(q): np_decode(q.data.view(torch.uint8).numpy(), name) for q in (qx, qw, qdy)}
    backend = ReferenceBackend()
    cases = [(qx, qw, False, False, decoded[id(qx)], decoded[id(qw)], 8.0 * 32.0),
             (qdy, qw, False, True, decoded[id(qdy)], decoded[id(qw)].T, 4.0 * 32.0),
             (qdy, qx, True, True, decoded[id(qdy)].T, decoded[id(qx)].T, 4.0 * 8.0)]
    for a, b, a_col, b_col, a_values, b_values, scale in cases:
        got = backend.gemm(a, b, a_columnwise=a_col, b_columnwise=b_col, out_dtype=torch.float32)
        # scale_inv are powers of 2 here, so applying them rounds nothing
        expected = ordered_sum(a_values, b_values) / np.float32(scale)
        np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize("m", [16, 2])
def test_a_nan_code_changes_no_other_output_on_the_simulator(m, monkeypatch):
    """A per-tensor GEMM with a NaN code: the simulated kernel and the reference give NaN in its row and the
    same bits elsewhere (the simulator takes the same engine whether or not a NaN is present; with 2 rows the
    engine declines on both sides)."""
    from mindspeed_te.kernels.npu import NpuBackend

    gen = torch.Generator().manual_seed(0)
    x, w = (torch.randn(s, generator=gen) * torch.exp2(torch.randint(-6, 6, s, generator=gen).float())
            for s in ((m, 256), (32, 256)))
    qx, qw = _per_tensor(x, FP8Dtype.E4M3, 1.0), _per_tensor(w, FP8Dtype.E4M3, 1.0)
    qx.data.view(torch.uint8)[0, 3] = 0x7F  # E4M3's NaN
    want = ReferenceBackend().gemm(qx, qw, out_dtype=torch.float32)
    got = NpuBackend(make_simulator()).gemm(qx, qw, out_dtype=torch.float32)
    assert want[0].isnan().all() and want[1:].isfinite().all()
    assert got[0].isnan().all() and torch.equal(got[1:], want[1:])


def test_a_per_tensor_linear_decodes_nothing(monkeypatch):
    """Forward and backward of a per-tensor FP8 Linear (small GEMMs included) read the codes: no decode."""
    from mindspeed_te import Float8CurrentScaling, Linear, fp8_autocast
    from mindspeed_te.kernels import reference

    calls = []
    monkeypatch.setattr(reference, "cast_from_fp8", lambda data, fmt: calls.append(data.shape))
    layer = Linear(32, 48)
    x = torch.randn(64, 32, requires_grad=True)
    with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        y = layer(x)
    y.backward(torch.randn_like(y))
    assert calls == [] and x.grad is not None and layer.weight.grad is not None


@pytest.mark.parametrize("engine", ["gemm_bf16", "off"])
@pytest.mark.parametrize("recipe_format", ["E4M3", "HYBRID"])
def test_simulated_cube_sums_as_the_reference_backend(recipe_format, engine, monkeypatch):
    """The NPU backend on the simulator hands the cube the reference backend's GEMM: a per-tensor Linear gives
    the reference's bits, forward and backward. With oneDNN's sums in the cube only, the two differ (inputs
    over a wide range of exponents make the float32 sums round). With the GEMM off for both (as on a CPU
    without it), both sum on oneDNN and agree again."""
    from mindspeed_te import Linear, fp8_autocast
    from mindspeed_te.recipe import DelayedScaling, Format

    recipe = DelayedScaling(fp8_format=Format[recipe_format])

    def run(backend_name: str) -> tuple[torch.Tensor, ...]:
        monkeypatch.setenv("MINDSPEED_TE_BACKEND", backend_name)
        monkeypatch.setenv("MINDSPEED_TE_NPU_SIMULATOR", "1")
        from mindspeed_te.state import FP8GlobalStateManager

        FP8GlobalStateManager.reset()
        torch.manual_seed(0)
        layer = Linear(256, 256, bias=False)
        x = (torch.randn(128, 256) * torch.exp2(torch.randint(-6, 6, (128, 256)).float())).requires_grad_()
        with fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = layer(x)
        y.backward(torch.randn_like(y))
        FP8GlobalStateManager.reset()
        return y.detach(), x.grad, layer.weight.grad

    if engine == "off":
        monkeypatch.setattr(fused_cast, "_gemm_bf16_cpu", False)
    reference = run("reference")
    npu = run("npu")
    for got, want in zip(npu, reference):
        assert torch.equal(got, want)
    if engine == "off":
        return
    monkeypatch.setattr(NpuSimulator, "set_bf16_matmul", staticmethod(lambda engine: set_bf16_matmul(None)))
    try:
        onednn = run("npu")
    finally:
        set_bf16_matmul(fused_cast.gemm_bf16)
    assert not all(torch.equal(got, want) for got, want in zip(onednn, reference))
