"""The fused CPU kernels' FP4 paths, bit for bit against ml_dtypes' E2M1 cast, the oracles' block rules (TE's for
NVFP4, OCP's for MXFP4) and the torch-op quantizers: MXFP4 (quantize_tiles with E2M1 codes, dequantize_tiles of
unpacked codes) and NVFP4 (quantize_nvfp4, dequantize_nvfp4, hadamard_columns)."""
import ml_dtypes
import numpy as np
import pytest
import torch

from mindspeed_te import fused_cast
from mindspeed_te.fp4 import (
    NVFP4_DEQUANT_FACTOR,
    RHT_SIGN_MASK,
    e2m1_decode_table,
    nvfp4_block_factors,
    nvfp4_global_encode_scale,
    random_hadamard_transform,
    unpack_fp4,
)
from mindspeed_te.quantizers import MXFP4Quantizer, NVFP4Quantizer
from tests.oracles import e2m1_stochastic_codes, nvfp4_dequantize_reference, nvfp4_reference

pytestmark = pytest.mark.skipif(not fused_cast.available(), reason="the fused CPU kernels are not built")


@pytest.fixture(params=["scalar", "avx2", "avx512"])
def simd(request):
    """Each vector level the E2M1 cast has (capped; a CPU without it runs the lower one)."""
    yield fused_cast.set_simd(request.param)
    fused_cast.set_simd("avx512")


def test_fused_e2m1_codes_are_ml_dtypes_over_every_bfloat16(simd):
    """Blocks of 32 bfloat16 values, each led by a 6, so that each block's scale is 1 (2^(floor(log2 6) - 2)):
    the codes are ml_dtypes' round-to-nearest-even cast of every bfloat16 value in [-6, 6]."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    values = bits[bits.abs() <= 6]
    values = torch.nn.functional.pad(values, (0, -values.numel() % 31)).reshape(-1, 31)
    x = torch.cat((torch.full((values.shape[0], 1), 6.0), values), dim=1).bfloat16()
    codes, scales, _, _ = fused_cast.quantize_tiles(x, "e2m1", None, mode="floor", tile_rows=1, block=32,
                                                    rowwise=True, columnwise=False, fp8_max=6.0, emax=2)
    assert (scales == 127).all()
    want = x.float().numpy().astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    assert np.array_equal(codes.numpy(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rounding", ["floor", "ceil"])
def test_fused_mxfp4_quantize_and_dequantize_are_the_torch_ops(dtype, rounding, simd, monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(96, 160, generator=g) * torch.logspace(-30, 30, 160)).to(dtype)
    x[3, 7], x[40, 100], x[64:96, 32:64] = float("nan"), float("-inf"), 0.0  # NaN, Inf and all-zero blocks
    q = MXFP4Quantizer(rounding=rounding)
    fused = q.quantize(x)
    monkeypatch.setattr(fused_cast, "enabled", False)
    plain = q.quantize(x)
    for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        assert torch.equal(getattr(fused, name), getattr(plain, name)), name
    for columnwise in (False, True):
        for out in (torch.float32, torch.bfloat16):
            want = plain.dequantize(out, columnwise=columnwise)
            monkeypatch.setattr(fused_cast, "enabled", True)
            got = fused.dequantize(out, columnwise=columnwise)
            monkeypatch.setattr(fused_cast, "enabled", False)
            assert torch.equal(got.isnan(), want.isnan()), (columnwise, out)
            assert torch.equal(got.nan_to_num(), want.nan_to_num()), (columnwise, out)


def test_unpack_is_the_nibbles():
    packed = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    codes = unpack_fp4(packed)
    assert torch.equal(codes[:, 0::2], packed & 0xF) and torch.equal(codes[:, 1::2], packed >> 4)


# NVFP4 (quantize_nvfp4, dequantize_nvfp4, hadamard_columns) -----------------------------------------------------
def _nvfp4_factors(amax: float) -> torch.Tensor:
    return nvfp4_block_factors(nvfp4_global_encode_scale(torch.tensor([amax]))).reshape(2)


def _bf16_blocks_led_by_6() -> torch.Tensor:
    """Every bfloat16 value in [-6, 6] in blocks of 16 led by a 6: under the global amax 2688 (S_enc = 1) each
    block's E4M3 scale is 1 and its encode multiplier 1, so the codes are the values' own."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    values = bits[bits.abs() <= 6]
    values = torch.nn.functional.pad(values, (0, -values.numel() % 15)).reshape(-1, 15)
    return torch.cat((torch.full((values.shape[0], 1), 6.0), values), dim=1).bfloat16()


def test_fused_nvfp4_codes_are_ml_dtypes_over_every_bfloat16(simd):
    x = _bf16_blocks_led_by_6()
    data, scales = fused_cast.quantize_nvfp4(x, _nvfp4_factors(2688.0), None, 1)
    assert (scales.float() == 1.0).all()
    want = x.float().numpy().astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    assert np.array_equal(unpack_fp4(data).numpy(), want)


def test_fused_nvfp4_stochastic_codes_are_tes_rule_over_every_bfloat16(simd):
    x = _bf16_blocks_led_by_6()
    rbits = torch.randint(0, 256, x.shape, generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    data, _ = fused_cast.quantize_nvfp4(x, _nvfp4_factors(2688.0), rbits, 1)
    assert np.array_equal(unpack_fp4(data).numpy(), e2m1_stochastic_codes(x.float().numpy(), rbits.numpy()))


@pytest.mark.parametrize("global_amax", [0.0, 1e-40, 3e-30, 1.0, 2688.0, 6e37, float("inf")])
def test_fused_nvfp4_block_scales_are_tes_rule_over_every_block_amax(global_amax, simd, monkeypatch):
    """Blocks whose amax is each positive bfloat16 value (subnormals, Inf and NaN included), each with the values
    below it that make its codes span the grid, under global amaxes that give subnormal, normal, saturated and
    the special S_enc: the scale bytes and codes of the torch ops, and on every 97th block TE's rule (oracle)."""
    amax = torch.arange(1, 0x7FC1, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    x = (amax[:, None] * torch.linspace(-1.0, 1.0, 16)).bfloat16()
    x[:, 0] = amax.bfloat16()  # the block's amax itself, exactly
    factors = _nvfp4_factors(global_amax)
    data, scales = fused_cast.quantize_nvfp4(x, factors, None, 1)
    monkeypatch.setattr(fused_cast, "enabled", False)
    q = NVFP4Quantizer(columnwise=False)
    want_data, want_scales = q._quantize_2d(x, torch.tensor([global_amax]))
    assert torch.equal(scales.view(torch.uint8), want_scales.view(torch.uint8))
    assert torch.equal(data, want_data)
    finite = torch.isfinite(amax).nonzero().flatten()[::97]
    codes, scale_bytes, _ = nvfp4_reference(x[finite].float().numpy(), amax=global_amax)
    assert np.array_equal(unpack_fp4(data[finite]).numpy(), codes)
    assert np.array_equal(scales[finite].view(torch.uint8).numpy(), scale_bytes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("two_d, rht, sr", [(False, False, False), (True, False, False), (False, True, True),
                                            (True, True, True), (False, False, True)])
def test_fused_nvfp4_quantize_and_dequantize_are_the_torch_ops(dtype, two_d, rht, sr, simd, monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(96, 160, generator=g) * torch.logspace(-30, 30, 160)).to(dtype)
    x[3, 7], x[40, 100], x[64:80, 32:48] = float("nan"), float("-inf"), 0.0  # NaN, Inf and all-zero blocks
    q = NVFP4Quantizer(with_2d_quantization=two_d, with_rht=rht, stochastic_rounding=sr)

    def quantize():
        q.generator = torch.Generator().manual_seed(7)
        return q.quantize(x)

    fused = quantize()
    monkeypatch.setattr(fused_cast, "enabled", False)
    plain = quantize()
    for name in ("rowwise_data", "columnwise_data"):
        assert torch.equal(getattr(fused, name), getattr(plain, name)), name
    for name in ("rowwise_scale_inv", "columnwise_scale_inv"):
        assert torch.equal(getattr(fused, name).view(torch.uint8), getattr(plain, name).view(torch.uint8)), name
    for columnwise in (False, True):
        want = plain.dequantize(torch.float32, columnwise=columnwise)
        monkeypatch.setattr(fused_cast, "enabled", True)
        got = fused.dequantize(torch.float32, columnwise=columnwise)
        monkeypatch.setattr(fused_cast, "enabled", False)
        assert torch.equal(got.isnan(), want.isnan()), columnwise
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), columnwise


@pytest.mark.parametrize("amax", [0.0, 1e-40, 0.75, 2688.0, 3e38, float("inf")])
def test_fused_nvfp4_dequantize_is_tes_rule_over_every_code_and_scale(amax, simd):
    """Every packed byte under every E4M3 scale byte (NaN ones included): TE's dequantize (oracle)."""
    data = torch.arange(256, dtype=torch.uint8).repeat(256, 8)  # (256, 2048): each row every byte, 8 times
    scales = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, 256).contiguous()
    got = fused_cast.dequantize_nvfp4(data, scales.view(torch.float8_e4m3fn), torch.tensor([amax]),
                                      e2m1_decode_table(data.device), NVFP4_DEQUANT_FACTOR)
    want = nvfp4_dequantize_reference(unpack_fp4(data).numpy(), scales.numpy(), amax)
    assert np.array_equal(np.isnan(got.numpy()), np.isnan(want))
    assert np.array_equal(np.nan_to_num(got.numpy()), np.nan_to_num(want))
    # bfloat16 out: the same products rounded as torch's cast rounds them (its NaNs keep their sign, ours not)
    bf16 = fused_cast.dequantize_nvfp4(data, scales.view(torch.float8_e4m3fn), torch.tensor([amax]),
                                       e2m1_decode_table(data.device), NVFP4_DEQUANT_FACTOR, torch.bfloat16)
    cast = got.to(torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16.isnan(), cast.isnan())
    assert torch.equal(bf16.nan_to_num(), cast.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sign_mask", [RHT_SIGN_MASK, 0])
def test_fused_hadamard_columns_is_the_torch_ops(dtype, sign_mask, simd, monkeypatch):
    """The columnwise transform and both amaxes in one pass, against the torch ops (float64 sums, the wide runs
    redone exactly) and tensor amaxes: 41 strips of 16 rows (split over two threads, an odd count), 207 columns
    (8 a vector, then 4, then 3 alone), runs spread over 60 binades, NaN, Inf, zero and negative zero runs."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(16 * 41, 207, generator=g) * torch.exp(torch.randn(16 * 41, 207, generator=g) * 2)
    x[:, 190:] *= torch.exp(torch.randn(16 * 41, 17, generator=g) * 14)  # runs the float64 sum cannot take
    x = x.to(dtype)
    x[3, 7], x[40, 100], x[41, 100], x[200, 206] = float("nan"), float("inf"), float("-inf"), float("-inf")
    x[64:80, 32:48], x[80:96, 32:48] = 0.0, -0.0
    assert x.numel() >= fused_cast.SPLIT_MIN_ELEMENTS or not getattr(fused_cast._ext, "openmp", 0)
    col, col_amax, x_amax = fused_cast.hadamard_columns(x, sign_mask)
    assert col_amax.isnan().item() and x_amax.isnan().item()
    finite = x.nan_to_num(0.0, 0.0, 0.0)  # no NaN, no Inf: amaxes of numbers
    finite_col, finite_col_amax, finite_amax = fused_cast.hadamard_columns(finite, sign_mask)
    assert torch.equal(finite_col_amax, finite_col.float().abs().amax().reshape(1))
    assert torch.equal(finite_amax, finite.float().abs().amax().reshape(1))
    monkeypatch.setattr(fused_cast, "enabled", False)
    want = random_hadamard_transform(x.t(), sign_mask)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert col.dtype == dtype and torch.equal(col.view(bits), want.view(bits))


def test_fused_hadamard_columns_feeds_the_nvfp4_quantizer_without_an_amax_pass(monkeypatch):
    """With the transform, the quantizer takes both amaxes from the kernel's read."""
    calls = []
    monkeypatch.setattr(fused_cast, "amax", lambda x: calls.append(x) or None)
    q = NVFP4Quantizer(with_rht=True)(torch.randn(64, 48, dtype=torch.bfloat16))
    assert not calls and q.amax_rowwise.numel() == q.amax_columnwise.numel() == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_nvfp4_tiles_in_both_layouts_are_the_transposes(dtype, simd):
    """16x16 tiles rounded to nearest even, both layouts from one read: the columnwise pair is quantize_nvfp4 of
    the transpose. 3 strips (two threads), 258 tiles a strip (two chunks of scales), NaN, Inf and zero tiles."""
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(48, 4128, generator=g) * torch.logspace(-20, 20, 4128)).to(dtype)
    x[3, 7], x[40, 100], x[16:32, 32:48] = float("nan"), float("-inf"), 0.0
    factors = _nvfp4_factors(x.float().abs().nan_to_num(0.0, 0.0, 0.0).amax().item())
    data, scale, col_data, col_scale = fused_cast.quantize_nvfp4(x, factors, None, 16, columnwise=True)
    want_data, want_scale = fused_cast.quantize_nvfp4(x, factors, None, 16)
    want_col, want_col_scale = fused_cast.quantize_nvfp4(x.t().contiguous(), factors, None, 16)
    assert torch.equal(data, want_data) and torch.equal(col_data, want_col)
    assert torch.equal(scale.view(torch.uint8), want_scale.view(torch.uint8))
    assert torch.equal(col_scale.view(torch.uint8), want_col_scale.view(torch.uint8))


def test_fused_nvfp4_checks_what_it_passes():
    x = torch.zeros(16, 32)
    with pytest.raises(ValueError, match="rbits"):
        fused_cast.quantize_nvfp4(x, _nvfp4_factors(1.0), torch.zeros(16, 16, dtype=torch.uint8), 1)
    with pytest.raises(ValueError, match="factors"):
        fused_cast.quantize_nvfp4(x, torch.ones(3), None, 1)
    with pytest.raises(ValueError, match="divisible"):
        fused_cast.quantize_nvfp4(torch.zeros(8, 32), _nvfp4_factors(1.0), None, 16)
    for tile, rbits in ((1, None), (16, torch.zeros(16, 32, dtype=torch.uint8))):
        with pytest.raises(ValueError, match="columnwise"):
            fused_cast.quantize_nvfp4(x, _nvfp4_factors(1.0), rbits, tile, columnwise=True)
    with pytest.raises(ValueError, match="runs of 16"):
        fused_cast.hadamard_columns(torch.zeros(24, 16), RHT_SIGN_MASK)
    with pytest.raises(ValueError, match="sign_mask"):
        fused_cast.hadamard_columns(x, 1 << 16)
    with pytest.raises(ValueError, match="scales"):
        fused_cast.dequantize_nvfp4(torch.zeros(16, 16, dtype=torch.uint8),
                                    torch.zeros(16, 1, dtype=torch.float8_e4m3fn), torch.ones(1),
                                    e2m1_decode_table(torch.device("cpu")), NVFP4_DEQUANT_FACTOR)
