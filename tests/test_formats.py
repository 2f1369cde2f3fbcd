"""Formats against independent oracles: en_dtypes (HiF8), ml_dtypes (E4M3/E5M2), closed-form values."""
import en_dtypes
import ml_dtypes
import numpy as np
import pytest
import torch

from mindspeed_te.formats import (
    HIF8_MAX,
    Format,
    FP8Dtype,
    cast_from_fp8,
    cast_to_fp8,
    hif8_decode,
    hif8_encode,
    scaled_cast,
)

HIF8 = en_dtypes.hifloat8


def oracle(values: np.ndarray) -> np.ndarray:
    """en_dtypes' HiF8 codes of float32 values (non-saturating, round half away from zero)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(values, dtype=np.float32).astype(HIF8).view(np.uint8)


def assert_codes_equal(x: np.ndarray, saturate: bool = False) -> None:
    ours = hif8_encode(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), saturate=saturate).numpy()
    ref_in = np.where(np.isnan(x), x, np.clip(x, -HIF8_MAX, HIF8_MAX)) if saturate else x
    ref = oracle(ref_in)
    bad = np.nonzero(ours != ref)[0]
    assert bad.size == 0, [(float(x[i]), hex(ours[i]), hex(ref[i])) for i in bad[:5]]


def finite_hif8_values() -> np.ndarray:
    values = np.arange(256, dtype=np.uint8).view(HIF8).astype(np.float64)
    return np.unique(values[np.isfinite(values)])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16bit_value(dtype):
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype).float().numpy()
    assert_codes_equal(x)
    assert_codes_equal(x, saturate=True)


def test_million_random_float32_log_uniform():
    rng = np.random.default_rng(0)
    mag = np.exp2(rng.uniform(-30, 20, 1_000_000))
    x = (mag * rng.choice([-1.0, 1.0], mag.size)).astype(np.float32)
    assert_codes_equal(x)
    assert_codes_equal(x, saturate=True)


def test_ties_between_adjacent_codes_and_their_neighbours():
    values = finite_hif8_values()
    positive = values[values >= 0]
    ties = ((positive[:-1] + positive[1:]) / 2).astype(np.float32)
    assert np.all(ties.astype(np.float64) == (positive[:-1] + positive[1:]) / 2)  # exact in float32
    near = np.concatenate([ties, np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(0))])
    x = np.concatenate([near, -near, values.astype(np.float32)])
    assert_codes_equal(x)


def test_overflow_underflow_and_special_edges():
    f32 = np.float32
    edges = [40960.0, np.nextafter(f32(40960), f32(0)), 32768.0, 49152.0, 65536.0, 2.0**-23,
             np.nextafter(f32(2.0**-23), f32(0)), 2.0**-22, 1.5 * 2.0**-22, 2.0**-24, 1e-45, 1e-40,
             0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, 1.0625, 1.03125, 15.0, 224.0]
    x = np.array(edges + [-e for e in edges], dtype=np.float32)
    assert_codes_equal(x)
    assert_codes_equal(x, saturate=True)
    codes = hif8_encode(torch.tensor([40960.0, -40960.0, 1e-7, -0.0, float("nan")])).tolist()
    assert codes == [0x6F, 0xEF, 0x00, 0x00, 0x80]
    assert hif8_encode(torch.tensor([float("inf"), 1e9]), saturate=True).tolist() == [0x6E, 0x6E]


def test_nan_payload_below_the_top_16_bits_stays_nan():
    payloads = torch.tensor([0x7F800001, 0xFF800001 - 2**32, 0x7F80FFFF, 0x7FC00000], dtype=torch.int32)
    x = payloads.view(torch.float32)
    assert hif8_encode(x).tolist() == [0x80] * 4
    assert hif8_encode(x, saturate=True).tolist() == [0x80] * 4


def test_decode_all_codes():
    codes = torch.arange(256, dtype=torch.uint8)
    ours = hif8_decode(codes).numpy()
    ref = codes.numpy().view(HIF8).astype(np.float32)
    assert np.array_equal(ours, ref, equal_nan=True)
    assert np.isfinite(ours).sum() == 253  # 256 codes minus NaN and +-Inf
    assert len(finite_hif8_values()) == 253  # all distinct: 0x00 is the only zero
    finite = torch.from_numpy(finite_hif8_values().astype(np.float32))
    assert torch.equal(hif8_decode(hif8_encode(finite)), finite)
    assert np.nanmax(ours) == np.inf and ours[np.isfinite(ours)].max() == 32768.0
    with pytest.raises(TypeError, match="uint8"):
        hif8_decode(torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("fp8_dtype, ref", [(FP8Dtype.E4M3, ml_dtypes.float8_e4m3fn),
                                            (FP8Dtype.E5M2, ml_dtypes.float8_e5m2)])
def test_fp8_casts_match_ml_dtypes(fp8_dtype, ref):
    rng = np.random.default_rng(1)
    x = (np.exp2(rng.uniform(-20, 18, 200_000)) * rng.choice([-1, 1], 200_000)).astype(np.float32)
    x = np.concatenate([x, np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 448.0, 464.0, 57344.0, 61440.0],
                                    dtype=np.float32)])
    sat = cast_to_fp8(torch.from_numpy(x), fp8_dtype, saturate=True)
    clipped = np.where(np.isnan(x), x, np.clip(x, -fp8_dtype.max, fp8_dtype.max))
    number = ~np.isnan(x)  # E5M2 has several NaN patterns; torch and ml_dtypes pick different ones
    assert np.array_equal(sat.view(torch.uint8).numpy()[number], clipped.astype(ref).view(np.uint8)[number])
    back = cast_from_fp8(sat, fp8_dtype).numpy()
    assert np.array_equal(back, clipped.astype(ref).astype(np.float32), equal_nan=True)
    finite = x[np.isfinite(x) & (np.abs(x) <= fp8_dtype.max)]
    plain = cast_to_fp8(torch.from_numpy(finite), fp8_dtype, saturate=False)
    assert np.array_equal(plain.view(torch.uint8).numpy(), finite.astype(ref).view(np.uint8))


@pytest.mark.parametrize("fp8_dtype", list(FP8Dtype))
@pytest.mark.parametrize("shape", [(7,), (1000, 1003), (3, 700_001)])
def test_scaled_cast_equals_cast_of_quotient(fp8_dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 100
    for scale_inv in (torch.tensor([0.37]), torch.tensor(3.0e-3)):
        got = scaled_cast(x, scale_inv, fp8_dtype)
        want = cast_to_fp8(torch.from_numpy(x.numpy() / scale_inv.numpy()), fp8_dtype, saturate=True)
        assert got.dtype == fp8_dtype.storage_dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_scaled_cast_block_scales_non_contiguous_and_bf16():
    x = torch.randn(64, 4, 32)
    scale_inv = torch.rand(64, 4, 1) / 10
    for fp8_dtype in FP8Dtype:
        got = scaled_cast(x, scale_inv, fp8_dtype).view(torch.uint8)
        want = cast_to_fp8(torch.from_numpy(x.numpy() / scale_inv.numpy()), fp8_dtype).view(torch.uint8)
        assert torch.equal(got, want)
    big = torch.randn(2048, 600).t()  # non-contiguous, larger than one chunk
    s = torch.tensor([0.3])
    want = torch.from_numpy(big.numpy() / np.float32(0.3))
    assert torch.equal(scaled_cast(big, s, FP8Dtype.HIF8), cast_to_fp8(want, FP8Dtype.HIF8))
    xb = torch.randn(1 << 20, dtype=torch.bfloat16)
    assert torch.equal(scaled_cast(xb, s, FP8Dtype.E4M3).view(torch.uint8),
                       cast_to_fp8(torch.from_numpy(xb.float().numpy() / np.float32(0.3)),
                                   FP8Dtype.E4M3).view(torch.uint8))


def test_format_members_and_names():
    assert (Format.HYBRID.fwd_dtype, Format.HYBRID.bwd_dtype) == (FP8Dtype.E4M3, FP8Dtype.E5M2)
    assert (Format.HIF8.max_fwd, Format.HIF8.max_bwd) == (15.0, 224.0)
    assert (Format.E4M3.max_fwd, Format.E5M2.max_bwd) == (448.0, 57344.0)
    assert Format.from_name("HiF8") is Format.HIF8 and Format.from_name("hybrid") is Format.HYBRID
    with pytest.raises(ValueError, match="allowed: e4m3, e5m2, hybrid, hif8"):
        Format.from_name("fp8")
    assert [d.max for d in FP8Dtype] == [448.0, 57344.0, 32768.0]
    assert FP8Dtype.HIF8.storage_dtype is torch.uint8
