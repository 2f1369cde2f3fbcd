"""The reference GEMM: exact products summed in float32, whichever oneDNN kernel computes them.

Where every operand value is a bfloat16 value (FP8/HiF8 codes times power-of-2 scales), the reference lets
oneDNN run its bfloat16 kernel; elsewhere a bfloat16 rounding of the inputs would be an error of about 2^-9.
Checked against a float64 matmul of the dequantized operands with float32's summation bound."""
from __future__ import annotations

import pytest
import torch

from mindspeed_te.formats import FP8Dtype
from mindspeed_te.kernels.reference import ReferenceBackend
from mindspeed_te.quantizers import Float8BlockQuantizer, Float8CurrentScalingQuantizer, MXFP8Quantizer


def _check_float32_sum(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """|got - a·bᵀ| within float32's bound for a k-term sum (k·2^-24 of Σ|a||b|, the products being exact)."""
    exact = a.double() @ b.double().t()
    bound = a.shape[1] * 2.0**-24 * (a.double().abs() @ b.double().abs().t()) + 1e-30
    assert ((got.double() - exact).abs() <= bound).all()


def _operands(scale_rows: bool):
    g = torch.Generator().manual_seed(11)
    a = torch.randn(256, 384, generator=g)
    b = torch.randn(192, 384, generator=g)
    if scale_rows:  # tiles of very different magnitudes, so that their scales are unrelated
        a = a * torch.exp2(torch.randint(-8, 8, (256, 1), generator=g).float())
    return a, b


@pytest.mark.parametrize("quantizer", [
    Float8CurrentScalingQuantizer(FP8Dtype.E4M3, 448.0),
    Float8CurrentScalingQuantizer(FP8Dtype.HIF8, 2.0**15),
    Float8BlockQuantizer(FP8Dtype.E4M3, 448.0, power_2_scale=True),
    Float8BlockQuantizer(FP8Dtype.E4M3, 448.0, power_2_scale=False),
    Float8BlockQuantizer(FP8Dtype.HIF8, 2.0**15, power_2_scale=False),
    MXFP8Quantizer(FP8Dtype.E5M2),
], ids=["tensor-e4m3", "tensor-hif8", "block-pow2", "block-e4m3-fp32-scales", "block-hif8-fp32-scales", "mx"])
def test_reference_gemm_sums_exact_products_in_float32(quantizer):
    """Every recipe's GEMM is the float32 sum of the dequantized operands' exact products, including operands
    whose float32 scales make values no bfloat16 can hold."""
    a, b = _operands(scale_rows=True)
    qa, qb = quantizer.quantize(a), quantizer.quantize(b)
    got = ReferenceBackend().gemm(qa, qb, out_dtype=torch.float32)
    _check_float32_sum(got, qa.dequantize(torch.float32), qb.dequantize(torch.float32))


def test_reference_gemm_leaves_the_matmul_precision_setting_as_it_was():
    a, b = _operands(scale_rows=False)
    q = Float8CurrentScalingQuantizer(FP8Dtype.E4M3, 448.0)
    flags = torch.backends.mkldnn.matmul
    kept = flags.fp32_precision
    try:
        for setting in ("ieee", "none"):
            flags.fp32_precision = setting
            ReferenceBackend().gemm(q.quantize(a), q.quantize(b))
            assert flags.fp32_precision == setting
    finally:
        flags.fp32_precision = kept


@pytest.mark.parametrize("quantizer", [
    Float8BlockQuantizer(FP8Dtype.E4M3, 448.0, power_2_scale=True),
    Float8BlockQuantizer(FP8Dtype.E4M3, 448.0, power_2_scale=True, block_scaling_dim=2),
    MXFP8Quantizer(FP8Dtype.E4M3),
], ids=["block-1x128", "block-128x128", "mx"])
@pytest.mark.parametrize("columnwise", [False, True], ids=["fprop", "wgrad-layout"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bf16-bias"])
def test_bfloat16_output_is_the_float32_sum_rounded_once(quantizer, columnwise, with_bias):
    """Block-scaled operands holding bfloat16 values, a bfloat16 output and nothing or a bfloat16 bias to add:
    the GEMM runs as a bfloat16 GEMM whose kernel rounds its own float32 sum (plus the bias) once. At this size
    oneDNN blocks k alike for both output dtypes, so its bits are those of the float32 sum (the same kernel,
    through mm_float32) plus the bias, cast to bfloat16; and that sum is within float32's bound of the exact
    one."""
    a, b = _operands(scale_rows=True)
    quantizer.set_usage(rowwise=True, columnwise=True)
    if columnwise:  # contract the first dim: the wgrad form, a (K, M) and b (K, N) given transposed
        a, b = a.t().contiguous(), b.t().contiguous()
    qa, qb = quantizer.quantize(a), quantizer.quantize(b)
    n = b.shape[1] if columnwise else b.shape[0]
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).bfloat16() if with_bias else None
    backend = ReferenceBackend()
    got = backend.gemm(qa, qb, a_columnwise=columnwise, b_columnwise=columnwise, out_dtype=torch.bfloat16,
                       bias=bias)
    as_float32 = backend.gemm(qa, qb, a_columnwise=columnwise, b_columnwise=columnwise, out_dtype=torch.float32)
    want = as_float32 + bias.float() if with_bias else as_float32
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())
    a_values = qa.dequantize(torch.float32, columnwise=columnwise)
    b_values = qb.dequantize(torch.float32, columnwise=columnwise)
    if columnwise:
        a_values, b_values = a_values.t(), b_values.t()
    _check_float32_sum(as_float32, a_values, b_values)


def test_read_twice_decodes_a_per_tensor_operand_once_with_the_same_results(monkeypatch):
    """Within `read_twice(dy)` the dgrad and the wgrad share dy's decoded codes (both layouts are views of
    them): one decode instead of two, the same bits, and nothing kept after the block. (Where the extension's
    bf16 GEMM applies it reads the codes and nothing is decoded: test_gemm_bf16.py; here it is off.)"""
    from mindspeed_te import fused_cast
    from mindspeed_te.kernels import reference

    monkeypatch.setattr(fused_cast, "gemm_bf16", lambda *args: None)

    g = torch.Generator().manual_seed(5)
    dy, w, x = (torch.randn(*shape, generator=g) for shape in ((64, 48), (48, 32), (64, 32)))
    q = Float8CurrentScalingQuantizer(FP8Dtype.E4M3, 448.0)
    qdy, qw, qx = q.quantize(dy), q.quantize(w), q.quantize(x)
    backend = ReferenceBackend()

    def backward() -> tuple[torch.Tensor, torch.Tensor]:
        dx = backend.gemm(qdy, qw, b_columnwise=True)
        dw = backend.gemm(qdy, qx, a_columnwise=True, b_columnwise=True)
        return dx, dw

    want = backward()
    decoded = []
    real = reference.cast_from_fp8
    monkeypatch.setattr(reference, "cast_from_fp8", lambda data, fmt: decoded.append(data) or real(data, fmt))
    with backend.read_twice(qdy):
        got = backward()
    assert sum(d is qdy.data for d in decoded) == 1 and len(decoded) == 3
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not backend._kept_decodes
    decoded.clear()
    backward()
    assert sum(d is qdy.data for d in decoded) == 2


def test_linear_backward_decodes_grad_output_once(monkeypatch):
    """A per-tensor FP8 linear on the reference backend decodes x and w in the forward, then grad_output once
    for both backward GEMMs, w and x: five decodes, not six. (With the extension's bf16 GEMM, which is off
    here, none: test_gemm_bf16.py.)"""
    from mindspeed_te import Float8CurrentScaling, Linear, fp8_autocast, fused_cast
    from mindspeed_te.kernels import reference

    monkeypatch.setattr(fused_cast, "gemm_bf16", lambda *args: None)

    layer = Linear(32, 48)
    x = torch.randn(64, 32, requires_grad=True)
    calls = []
    real = reference.cast_from_fp8
    monkeypatch.setattr(reference, "cast_from_fp8", lambda data, fmt: calls.append(data.shape) or real(data, fmt))
    with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        y = layer(x)
    y.backward(torch.randn_like(y))
    assert calls == [(64, 32), (48, 32), (64, 48), (48, 32), (64, 32)]
