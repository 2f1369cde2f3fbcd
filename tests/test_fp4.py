"""FP4 (issue 32): E2M1 elements bit-exact against ml_dtypes, TE's nibble order, NVFP4 (TransformerEngine's rules)
and MXFP4 (the OCP MX rule) against the independent oracles of tests/oracles.py, the random Hadamard transform,
stochastic rounding, the recipes' fields and environment switches, and a Linear trained under each FP4 recipe on
the reference backend within a closed-form error bound."""
import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

import mindspeed_te as te
from mindspeed_te import fp4, fused_cast
from mindspeed_te.fp4 import (
    RHT_SIGN_MASK,
    FP4Dtype,
    e2m1_decode,
    e2m1_encode,
    inverse_hadamard_transform,
    pack_fp4,
    random_hadamard_transform,
    rht_matrix,
    unpack_fp4,
)
from mindspeed_te.kernels.reference import ReferenceBackend
from mindspeed_te.quantizers import MXFP8Quantizer
from mindspeed_te.recipe import Format, FP4Format, QParams, recipe_from_config, recipe_to_config
from tests.oracles import (
    TE_RHT_SIGNS,
    e2m1_codes,
    e2m1_stochastic_codes,
    e2m1_values,
    hadamard_reference,
    mxfp4_reference,
    nvfp4_dequantize_reference,
    nvfp4_reference,
)

F32 = np.float32
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _sample(shape, seed=0, spread=1.0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * spread)).to(dtype)


def _codes(packed: torch.Tensor) -> np.ndarray:
    return unpack_fp4(packed.reshape(-1, packed.shape[-1])).numpy()


# E2M1 elements ------------------------------------------------------------------------------------------------
def _patterns_of_interest() -> np.ndarray:
    """Every E2M1 value, every midpoint between neighbours, their float32 neighbours, around saturation, float32
    subnormals and extremes, Inf, with both signs; plus a sweep over the float32 bit patterns."""
    points = set(GRID) | {(a + b) / 2 for a, b in zip(GRID, GRID[1:])} | {6.5, 7.0, 8.0, 1e3, 1e30}
    values = []
    for p in points:
        p = F32(p)
        values += [p, np.nextafter(p, F32(np.inf)), np.nextafter(p, F32(-np.inf))]
    tiny = np.array([1, 2, 0x7FFFFF, 0x800000], np.uint32).view(np.float32)  # subnormals, smallest normal
    values += list(tiny) + [F32(np.finfo(F32).max), F32(np.inf), F32(0.0)]
    values = np.array(values, F32)
    sweep = np.arange(0, 2**32, 8191, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([values, -values, sweep])


def test_e2m1_encode_is_bit_exact_against_ml_dtypes():
    x = _patterns_of_interest()
    finite_or_inf = ~np.isnan(x)
    got = e2m1_encode(torch.from_numpy(x)).numpy()
    with np.errstate(invalid="ignore"):
        expected = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    assert np.array_equal(got[finite_or_inf], expected[finite_or_inf])
    assert (got[~finite_or_inf] == 0x7).all() and (~finite_or_inf).sum() > 1000  # NaN: TE's satfinite, +6
    # Every bfloat16 (all 2^16 patterns, exact in float32).
    bf16 = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    xf = bf16.float().numpy()
    keep = ~np.isnan(xf)
    assert np.array_equal(e2m1_encode(bf16).numpy()[keep], e2m1_codes(xf)[keep])


def test_e2m1_rounding_ties_saturation_and_signs():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0001, 6.0, 7.0, float("inf"), -0.0, -0.1, -1e-45,
                      float("-inf"), float("nan")])
    values = e2m1_decode(e2m1_encode(x)).tolist()
    assert values[:11] == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 6.0]  # ties to even, saturation
    assert [math.copysign(1, v) for v in values[11:14]] == [-1, -1, -1] and values[14] == -6.0 and values[15] == 6.0


def test_e2m1_decode_is_ml_dtypes_and_te_table():
    codes = torch.arange(16, dtype=torch.uint8)
    te_table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]  # TE's LUT
    got = e2m1_decode(codes).numpy()
    assert np.array_equal(got.view(np.uint32), np.array(te_table, F32).view(np.uint32))
    assert np.array_equal(got.view(np.uint32), e2m1_values(codes.numpy()).view(np.uint32))
    assert FP4Dtype.E2M1.max == float(ml_dtypes.finfo(ml_dtypes.float4_e2m1fn).max) and FP4Dtype.E2M1.emax == 2


def test_oracle_follows_te_reference_intervals():
    """The oracle against the decision intervals of TE's reference cast (cast_to_fp4x2): [0, 0.25] -> 0,
    (0.25, 0.75) -> 0.5, [0.75, 1.25] -> 1, (1.25, 1.75) -> 1.5, [1.75, 2.5] -> 2, (2.5, 3.5) -> 3, [3.5, 5] -> 4,
    above 5 -> 6; negatives alike (TE's reference gives -0.0 code 0, ml_dtypes and we code 8)."""
    intervals = [(0.0, 0.25, 0), (0.2500001, 0.7499999, 1), (0.75, 1.25, 2), (1.2500001, 1.7499999, 3),
                 (1.75, 2.5, 4), (2.5000002, 3.4999998, 5), (3.5, 5.0, 6), (5.0000005, 1e6, 7)]
    for low, high, code in intervals:
        for v in np.linspace(low, high, 7, dtype=F32):
            assert e2m1_codes(np.array([v]))[0] == code, v
            assert e2m1_codes(np.array([-v]))[0] == code | 8, v


def test_packing_puts_the_even_element_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 8, 0, 7]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x8F, 0x70]]
    # TE's unpacking (its tests): byte & 0x0F is element 2i, byte >> 4 element 2i + 1.
    repeated = packed.repeat_interleave(2, dim=1)
    repeated[:, 0::2] &= 0x0F
    repeated[:, 1::2] >>= 4
    assert torch.equal(repeated, codes) and torch.equal(unpack_fp4(packed), codes)
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


# Stochastic rounding -----------------------------------------------------------------------------------------
def test_stochastic_rounding_matches_oracle_for_every_random_byte():
    x = np.array([0.1, 0.3, 0.74, 1.1, 1.9, 2.2, 3.7, 4.5, 5.9, 6.0, 6.5, 100.0, 0.0, -0.0, -2.9, -5.1, np.nan], F32)
    xs = np.repeat(x[:, None], 256, axis=1)
    rbits = np.tile(np.arange(256, dtype=np.uint8), (len(x), 1))
    got = e2m1_encode(torch.from_numpy(xs), torch.from_numpy(rbits)).numpy()
    assert np.array_equal(got, e2m1_stochastic_codes(xs, rbits))


def test_stochastic_rounding_is_unbiased_to_the_resolution_of_its_bits():
    """Averaged over all 256 random bytes, SR of |x| <= 6 is x up to spacing / 256 (8-bit randomness)."""
    x = torch.linspace(-6.0, 6.0, 2001)
    rbits = torch.arange(256, dtype=torch.uint8).repeat(len(x), 1)
    mean = e2m1_decode(e2m1_encode(x[:, None].expand(-1, 256).contiguous(), rbits)).double().mean(dim=1)
    spacing = torch.where(x.abs() < 2, 0.5, torch.where(x.abs() < 4, 1.0, 2.0)).double()
    assert ((mean - x.double()).abs() <= spacing / 256 + 1e-7).all()
    rn = e2m1_decode(e2m1_encode(x)).double()
    assert (mean - x.double()).abs().mean() < 0.05 * (rn - x.double()).abs().mean()


# NVFP4 -------------------------------------------------------------------------------------------------------
def _check_nvfp4_form(codes_packed, scales, amax, source: np.ndarray, tile_rows: int):
    codes, scale_bytes, oracle_amax = nvfp4_reference(source, tile_rows)
    assert amax.item() == oracle_amax
    assert np.array_equal(_codes(codes_packed), codes)
    assert np.array_equal(scales.view(torch.uint8).numpy(), scale_bytes)
    return codes, scale_bytes, oracle_amax


@pytest.mark.parametrize("shape, spread", [((32, 64), 1.0), ((48, 128), 3.0), ((2, 16, 32), 0.5)])
@pytest.mark.parametrize("two_d", [False, True])
def test_nvfp4_matches_oracle(shape, spread, two_d):
    x = _sample(shape, seed=len(shape) + int(spread), spread=spread)
    x2d = x.reshape(-1, x.shape[-1])
    x2d[:16, :16] = 0.0  # an all-zero block
    q = te.NVFP4Quantizer(with_2d_quantization=two_d)(x)
    assert q.rowwise_data.shape == (*shape[:-1], shape[-1] // 2) and q.rowwise_data.dtype == torch.uint8
    assert q.rowwise_scale_inv.dtype == torch.float8_e4m3fn
    assert q.columnwise_data.shape == (shape[-1], x2d.shape[0] // 2)
    tile = 16 if two_d else 1
    codes, scales, amax = _check_nvfp4_form(q.rowwise_data, q.rowwise_scale_inv, q.amax_rowwise, x2d.numpy(), tile)
    _check_nvfp4_form(q.columnwise_data, q.columnwise_scale_inv, q.amax_columnwise, x2d.t().contiguous().numpy(), tile)
    expected = nvfp4_dequantize_reference(codes, scales, amax)
    assert np.array_equal(q.dequantize().reshape(x2d.shape).numpy(), expected)
    if two_d:  # 16x16 tiles: the columnwise form is the exact transpose, each tile's 16 rows share a scale
        assert torch.equal(unpack_fp4(q.columnwise_data), unpack_fp4(q.rowwise_data.reshape(x2d.shape[0], -1)).t())
        assert torch.equal(q.dequantize(columnwise=True), q.dequantize())
        s = q.rowwise_scale_inv.view(torch.uint8)
        assert torch.equal(s, s[::16].repeat_interleave(16, dim=0))


def test_nvfp4_global_and_block_scale_rules():
    """Hand-checked: amax 2688 gives S_enc = 1, so a block of amax 2688 gets the E4M3 scale 448 and codes +-6; an
    all-zero tensor gets S_enc = 1 (TE's kernel rule) and codes 0; an E4M3 scale rounds to nearest even."""
    x = torch.zeros(16, 32)
    x[0, 0], x[0, 1], x[0, 16] = 2688.0, -1344.0, 6.0 * 13.0  # block (0, 1): amax 78 -> scale 13 (exact E4M3)
    q = te.NVFP4Quantizer(columnwise=False)(x)
    assert fp4.nvfp4_global_encode_scale(q.amax_rowwise).item() == 1.0
    assert q.rowwise_scale_inv[0].float().tolist() == [448.0, 13.0]
    assert e2m1_decode(unpack_fp4(q.rowwise_data))[0, [0, 1, 16]].tolist() == [6.0, -3.0, 6.0]
    assert q.dequantize()[0, [0, 1, 16]].tolist() == [2688.0, -1344.0, 78.0]
    zero = te.NVFP4Quantizer()(torch.zeros(16, 16))
    assert fp4.nvfp4_global_encode_scale(zero.amax_rowwise).item() == 1.0 and not zero.dequantize().any()
    assert fp4.nvfp4_global_encode_scale(torch.tensor([float("inf")])).item() == 1.0
    assert fp4.nvfp4_global_encode_scale(torch.tensor([1e-40])).item() == torch.finfo(torch.float32).max


def test_nvfp4_nan_and_inf_reach_the_output():
    x = _sample((32, 32), seed=5)
    x[3, 5] = float("nan")
    q = te.NVFP4Quantizer()(x)
    deq = q.dequantize()
    assert torch.isnan(deq[3, :16]).all() and torch.isnan(q.nonfinite_scales()).all()
    assert torch.isnan(q.rowwise_scale_inv.float()[3, 0])
    x[3, 5] = float("inf")
    assert not torch.isfinite(te.NVFP4Quantizer()(x).dequantize()).all()


def test_nvfp4_rejects_shapes_not_divisible_by_16():
    with pytest.raises(ValueError, match="divisible by 16"):
        te.NVFP4Quantizer()(torch.zeros(8, 32))
    with pytest.raises(ValueError, match="divisible by 16"):
        te.NVFP4Quantizer()(torch.zeros(16, 24))


# The random Hadamard transform --------------------------------------------------------------------------------
def test_rht_matrix_is_tes_signed_sylvester_matrix():
    signs = [-1 if RHT_SIGN_MASK >> i & 1 else 1 for i in range(16)]
    assert tuple(signs) == TE_RHT_SIGNS
    m = rht_matrix()
    assert torch.equal(m @ m.t(), torch.eye(16))
    eye = np.eye(16, dtype=F32)
    assert np.array_equal(m.numpy(), hadamard_reference(eye).astype(F32))  # row i of I transformed: row i of M
    x = _sample((8, 64), seed=9)
    assert torch.allclose(inverse_hadamard_transform(random_hadamard_transform(x)), x, atol=1e-6)
    assert torch.equal(rht_matrix(0), rht_matrix(0).t())  # no signs: the symmetric Hadamard matrix


def test_nvfp4_rht_columnwise_matches_oracle_bf16():
    """As TE: the columnwise form is quantized from RHT(xᵀ) rounded to bfloat16, its amax taken after the
    transform; the rowwise form is untouched."""
    x = _sample((64, 48), seed=11, spread=1.5, dtype=torch.bfloat16)
    q = te.NVFP4Quantizer(with_rht=True)(x)
    transformed = hadamard_reference(x.float().t().numpy()).astype(ml_dtypes.bfloat16).astype(F32)
    _check_nvfp4_form(q.columnwise_data, q.columnwise_scale_inv, q.amax_columnwise, transformed, 1)
    _check_nvfp4_form(q.rowwise_data, q.rowwise_scale_inv, q.amax_rowwise, x.float().numpy(), 1)
    assert q.columnwise_rht_sign_mask == RHT_SIGN_MASK
    assert np.array_equal(q.columnwise_hadamard_values().numpy(),
                          nvfp4_dequantize_reference(*nvfp4_reference(transformed)))
    plain = te.NVFP4Quantizer(with_rht=True, with_random_sign_mask=False)(x)
    assert plain.columnwise_rht_sign_mask == 0
    transformed = hadamard_reference(x.float().t().numpy(), signs=[1] * 16).astype(ml_dtypes.bfloat16).astype(F32)
    _check_nvfp4_form(plain.columnwise_data, plain.columnwise_scale_inv, plain.amax_columnwise, transformed, 1)


def _nearest_float32(q: Fraction) -> float:
    """The float32 nearest to the rational q, ties to the even significand, +-Inf from the midpoint between
    FLT_MAX and 2^128 on (IEEE round to nearest): the two neighbours of float32(float(q)) compared exactly."""
    if abs(q) >= 2**128 - 2**103:
        return math.copysign(math.inf, q)
    guess = F32(float(q))
    neighbours = {guess, np.nextafter(guess, F32(np.inf)), np.nextafter(guess, F32(-np.inf))}
    return float(min((v for v in neighbours if np.isfinite(v)),
                     key=lambda v: (abs(Fraction(float(v)) - q), int(np.array(v, F32).view(np.uint32)) & 1)))


def _exact_hadamard(x: np.ndarray, signs=TE_RHT_SIGNS) -> np.ndarray:
    """The transform of each 16-run along x's last dim, each output's exact sum (Fractions) rounded once to float32,
    an exact zero as +0; a run holding NaN or Inf as IEEE has it whatever the order (hadamard_reference's)."""
    runs = np.asarray(x, np.float64).reshape(-1, 16)
    with np.errstate(over="ignore"):
        out = hadamard_reference(runs, signs).astype(F32)
    for r, run in enumerate(runs):
        if np.isfinite(run).all():
            terms = [Fraction(float(v)) for v in run]
            out[r] = [_nearest_float32(sum(signs[t] * (-1) ** bin(t & i).count("1") * terms[t] for t in range(16)) / 4)
                      for i in range(16)]
    return out.reshape(np.shape(x))


def _awkward_runs(dtype: torch.dtype) -> torch.Tensor:
    """13 rows of four 16-runs that the float64 sum does not round exactly, or that test its edges: exponents
    spread past its 53 bits (cancellation included), around the bound of exactness, subnormals, a sum past
    FLT_MAX, zeros of both signs, NaN, opposite and lone infinities; and random runs over 60 binades."""
    special = torch.zeros(8, 16, dtype=torch.float64)
    special[0, :4] = torch.tensor([2.0**100, 1.0, -(2.0**100), 2.0**-60])
    special[1, :3] = torch.tensor([1.0, 2.0**-41, 2.0**-42])
    special[2, :3] = torch.tensor([3.0, 2.0**-130, -3.0])
    special[3] = 2.0**127
    special[4, 1::2] = -0.0
    special[5, 3], special[6, :2], special[7, 5] = math.nan, torch.tensor([math.inf, -math.inf]), -math.inf
    g = torch.Generator().manual_seed(5)
    wild = torch.randn(44, 16, generator=g, dtype=torch.float64) * torch.exp(
        torch.randn(44, 16, generator=g, dtype=torch.float64) * 14)
    return torch.cat([special, wild]).to(dtype).reshape(13, 16 * 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("path", ["torch", "scalar", "avx2", "avx512"])
def test_random_hadamard_transform_rounds_the_exact_sum(dtype, path, monkeypatch):
    """Each output is the exact sum rounded once to float32 (then to bfloat16), an exact zero +0 and NaN the one
    quiet NaN, on the torch ops and on each vector level of the fused kernel (13 columns: 8 a vector, 4, 1)."""
    if path != "torch" and not fused_cast.available():
        pytest.skip("the fused CPU kernels are not built")
    monkeypatch.setattr(fused_cast, "enabled", path != "torch")
    runs = _awkward_runs(dtype)
    fused_cast.set_simd("avx512" if path == "torch" else path)
    try:
        got = random_hadamard_transform(runs.t().contiguous().t())  # a transposed view: the columnwise source
    finally:
        fused_cast.set_simd("avx512")
    want = _exact_hadamard(runs.double().numpy())
    if dtype == torch.bfloat16:
        want = want.astype(ml_dtypes.bfloat16).astype(F32)  # float32 -> bfloat16, round to nearest even
    got32 = got.float().numpy()
    assert np.array_equal(np.isnan(got32), np.isnan(want)) and np.isnan(want).any()
    finite = ~np.isnan(want)
    assert np.array_equal(got32[finite].view(np.uint32), want[finite].view(np.uint32))
    view = got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    assert (view[got.isnan()] == (0x7FC0 if dtype == torch.bfloat16 else 0x7FC00000)).all()


def test_reference_gemm_contracts_two_transformed_forms_and_undoes_a_lone_one():
    backend = ReferenceBackend()
    dy, x = _sample((64, 32), seed=1), _sample((64, 48), seed=2)
    q_dy = te.NVFP4Quantizer(with_rht=True)(dy)
    q_x = te.NVFP4Quantizer(with_rht=True)(x)
    dw = backend.gemm(q_dy, q_x, a_columnwise=True, b_columnwise=True)
    stored = q_dy.columnwise_hadamard_values() @ q_x.columnwise_hadamard_values().t()
    assert torch.allclose(dw, stored, rtol=1e-5, atol=1e-5 * stored.abs().max().item())  # float32 sums apart
    plain_x = te.NVFP4Quantizer()(x)
    mixed = backend.gemm(q_dy, plain_x, a_columnwise=True, b_columnwise=True)
    undone = inverse_hadamard_transform(q_dy.columnwise_hadamard_values())
    assert torch.allclose(mixed, undone @ plain_x.dequantize(columnwise=True), rtol=1e-5, atol=1e-5)
    exact = dy.t().double() @ x.double()
    for got in (dw, mixed):
        assert ((got.double() - exact).norm() / exact.norm()).item() < 0.25


def _nvfp4_float64(q, columnwise: bool) -> tuple[np.ndarray, float]:
    """A stored NVFP4 form decoded independently in float64, (rows, k) as the GEMM reads it: (ml_dtypes' E2M1 code
    values times the E4M3 block scales, the per-tensor factor amax / (6 * 448))."""
    if columnwise:
        packed, scales, amax = q.columnwise_data, q.columnwise_scale_inv, q.amax_columnwise
    else:
        packed, scales, amax = q.rowwise_data, q.rowwise_scale_inv, q.amax_rowwise
    codes = _codes(packed).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    block = scales.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return codes * np.repeat(block, 16, axis=1), float(amax) / (6 * 448)


def _float32_sum_bound(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """How far a float32 sum of exact products may be from a · bᵀ: k roundings of the running sum, plus slack for
    the few float32 roundings of the per-tensor factors and their products, (k + 8) 2^-24 |a| |b|ᵀ."""
    return (a.shape[1] + 8) * 2.0**-24 * (np.abs(a) @ np.abs(b).T)


def _nvfp4_linear_operands():
    """The three GEMMs of an NVFP4 Linear under the default recipe's quantizers, as (a, b, a_columnwise,
    b_columnwise): fprop x · wᵀ, dgrad dy · w (the 16x16-tiled weight's columnwise form), wgrad dyᵀ · x (both
    columnwise forms Hadamard-transformed, dy's stochastically rounded)."""
    x, w, dy = _sample((32, 64), seed=41, spread=1.5), _sample((48, 64), seed=42), _sample((32, 48), seed=43)
    qx = te.NVFP4Quantizer(with_rht=True)(x)
    qw = te.NVFP4Quantizer(with_2d_quantization=True)(w)
    qdy = te.NVFP4Quantizer(with_rht=True, stochastic_rounding=True, generator=torch.Generator().manual_seed(7))(dy)
    return {"fprop": (qx, qw, False, False), "dgrad": (qdy, qw, False, True), "wgrad": (qdy, qx, True, True)}


@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
def test_nvfp4_gemm_is_the_product_of_its_codes_and_scales(gemm):
    """The reference NVFP4 GEMM (code * block scale in a bf16 GEMM, its float32 sum times both per-tensor factors)
    against the float64 product of the operands decoded independently, within float32 summation; the bias, the
    bfloat16 output and the accumulation into `out` as the GEMM documents them."""
    a, b, a_col, b_col = _nvfp4_linear_operands()[gemm]
    backend = ReferenceBackend()
    got = backend.gemm(a, b, a_columnwise=a_col, b_columnwise=b_col)
    (a_block, a_factor), (b_block, b_factor) = _nvfp4_float64(a, a_col), _nvfp4_float64(b, b_col)
    a64, b64 = a_block * a_factor, b_block * b_factor
    exact = a64 @ b64.T
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert (np.abs(got.double().numpy() - exact) <= _float32_sum_bound(a64, b64)).all()

    bias = _sample((got.shape[1],), seed=44)
    assert torch.equal(backend.gemm(a, b, a_columnwise=a_col, b_columnwise=b_col, bias=bias), got + bias)
    rounded = backend.gemm(a, b, a_columnwise=a_col, b_columnwise=b_col, bias=bias.bfloat16(),
                           out_dtype=torch.bfloat16)
    assert torch.equal(rounded, (got + bias.bfloat16().float()).bfloat16())
    for dtype in (torch.float32, torch.bfloat16):
        main_grad = _sample(got.shape, seed=45).to(dtype)
        out = main_grad.clone()
        assert backend.gemm(a, b, a_columnwise=a_col, b_columnwise=b_col, out=out) is out
        assert torch.equal(out, (main_grad.float() + got).to(dtype))


@pytest.mark.parametrize("gemm", ["fprop", "wgrad"])
def test_nvfp4_gemm_bf16_route_and_float32_routes_agree(gemm, monkeypatch):
    """The bf16 GEMM route (the extension's gemm_bf16 on a CPU with AVX-512 BF16), the float32 GEMM of the same
    block-scaled values (the extension capped below AVX-512, or off) and the dequantize + float32 GEMM agree to
    float32 summation; the block-scaled bfloat16 values are the same bits on every path."""
    a, b, a_col, b_col = _nvfp4_linear_operands()[gemm]
    backend = ReferenceBackend()
    routes, values = {}, {}
    for name, simd in (("bf16", "avx512"), ("avx2", "avx2"), ("scalar", "scalar")):
        try:
            fused_cast.set_simd(simd)
            routes[name] = backend.gemm(a, b, a_columnwise=a_col, b_columnwise=b_col)
            values[name] = a.block_scaled_values(a_col)[0]
        finally:
            fused_cast.set_simd("avx512")
    monkeypatch.setattr(fused_cast, "enabled", False)
    routes["torch"] = backend.gemm(a, b, a_columnwise=a_col, b_columnwise=b_col)
    values["torch"] = a.block_scaled_values(a_col)[0]
    if a_col:  # both forms Hadamard-transformed: their stored values' product
        dequantized = a.columnwise_hadamard_values() @ b.columnwise_hadamard_values().t()
    else:
        dequantized = torch.mm(a.dequantize(torch.float32), b.dequantize(torch.float32).t())
    (a_block, a_factor), (b_block, b_factor) = _nvfp4_float64(a, a_col), _nvfp4_float64(b, b_col)
    bound = 2 * _float32_sum_bound(a_block * a_factor, b_block * b_factor)
    for name, got in (*routes.items(), ("dequantized", dequantized)):
        assert (np.abs(got.double().numpy() - routes["bf16"].double().numpy()) <= bound).all(), name
    for name, v in values.items():
        assert v.dtype == torch.bfloat16 and np.array_equal(v.double().numpy(), a_block), name


def test_nvfp4_gemm_of_a_nan_tensor_is_nan():
    """A NaN in x makes its amax, hence its per-tensor factor, NaN: every output, as the dequantized values give."""
    x = _sample((32, 32), seed=46)
    x[3, 5] = float("nan")
    qx, qw = te.NVFP4Quantizer()(x), te.NVFP4Quantizer()(_sample((16, 32), seed=47))
    assert torch.isnan(ReferenceBackend().gemm(qx, qw)).all()
    assert torch.isnan(torch.mm(qx.dequantize(), qw.dequantize().t())).all()


# Stochastic rounding in the quantizers ---------------------------------------------------------------------------
def _draws(g: torch.Generator, shape: tuple[int, int]) -> np.ndarray:
    """The documented bits: the little-endian bytes of full-range 64-bit draws, 8 elements a draw."""
    words = torch.empty(shape[0] * shape[1] // 8, dtype=torch.int64).random_(-(1 << 63), None, generator=g)
    return np.frombuffer(words.numpy().astype("<i8").tobytes(), dtype=np.uint8).reshape(shape).astype(np.int32)


def test_nvfp4_stochastic_rounding_matches_oracle_with_the_generators_bits():
    x = _sample((32, 32), seed=4)
    q = te.NVFP4Quantizer(stochastic_rounding=True, generator=torch.Generator().manual_seed(123))(x)
    g = torch.Generator().manual_seed(123)  # the documented order: rowwise bytes, then columnwise
    row_bits, col_bits = (_draws(g, (32, 32)) for _ in range(2))
    codes, _, _ = nvfp4_reference(x.numpy(), rbits=row_bits)
    assert np.array_equal(_codes(q.rowwise_data), codes)
    codes, _, _ = nvfp4_reference(x.t().contiguous().numpy(), rbits=col_bits)
    assert np.array_equal(_codes(q.columnwise_data), codes)


def test_stochastic_rounding_is_reproducible_and_hookable():
    x = _sample((32, 64), seed=6)

    def run(**kwargs):
        return te.NVFP4Quantizer(stochastic_rounding=True, **kwargs)(x).rowwise_data

    seeded = lambda seed: run(generator=torch.Generator().manual_seed(seed))  # noqa: E731
    assert torch.equal(seeded(1), seeded(1)) and not torch.equal(seeded(1), seeded(2))
    torch.manual_seed(5)  # without a generator: the device's default one, as TE's kernels (Megatron's tracker forks it)
    first = run()
    torch.manual_seed(5)
    assert torch.equal(run(), first)
    hooked = torch.Generator().manual_seed(1)
    try:
        fp4.set_stochastic_rounding_generator(lambda device: hooked)
        assert torch.equal(run(), seeded(1))
    finally:
        fp4.set_stochastic_rounding_generator(None)


def test_stochastic_rounding_averages_closer_than_round_to_nearest():
    """TE's own SR check (test_nvfp4_sr_quantize.py): the mean of many SR quantizations is closer to x than RN."""
    x = _sample((32, 64), seed=8)
    g = torch.Generator().manual_seed(0)
    quantizer = te.NVFP4Quantizer(stochastic_rounding=True, generator=g, columnwise=False)
    mean = sum(quantizer(x).dequantize() for _ in range(64)) / 64
    rn = te.NVFP4Quantizer(columnwise=False)(x).dequantize()
    rmse = lambda t: (t - x).pow(2).mean().sqrt().item()  # noqa: E731
    assert rmse(mean) < 0.5 * rmse(rn)


# MXFP4 -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rounding", ["floor", "ceil"])
@pytest.mark.parametrize("spread", [0.5, 4.0])
def test_mxfp4_matches_the_ocp_rule(rounding, spread):
    x = _sample((64, 96), seed=13, spread=spread)
    x[:, :32] *= 1e-30  # tiny blocks
    x[1, 32:64] = 0.0
    q = te.MXFP4Quantizer(rounding=rounding)(x)
    for data, scale, source in ((q.rowwise_data, q.rowwise_scale_inv, x), (q.columnwise_data, q.columnwise_scale_inv,
                                                                             x.t().contiguous())):
        codes, exps = mxfp4_reference(source.numpy(), rounding)
        assert np.array_equal(_codes(data), codes) and np.array_equal(scale.numpy(), exps)
    codes, exps = mxfp4_reference(x.numpy(), rounding)
    expected = e2m1_values(codes) * np.repeat(np.exp2(exps.astype(np.float64) - 127), 32, axis=1).astype(F32)
    assert np.array_equal(q.dequantize().numpy(), expected)


def test_mxfp4_scale_examples_and_nonfinite_blocks():
    x = torch.zeros(32, 64)
    x[0, :4] = torch.tensor([6.0, 7.9, 1.0, 0.5])  # amax 7.9: scale 2^0, 7.9 saturates to 6
    x[1, :2] = torch.tensor([8.0, 3.0])  # amax 8: scale 2, codes 4 and 1.5
    x[2, :1] = 0.75  # amax 0.75: floor(log2) - 2 = -3, 0.75 * 8 = 6
    x[3, 40] = float("nan")
    q = te.MXFP4Quantizer(columnwise=False)(x)
    assert q.rowwise_scale_inv[:4, 0].tolist() == [127, 128, 124, 0] and q.rowwise_scale_inv[3, 1].item() == 0xFF
    deq = q.dequantize()
    assert deq[0, :4].tolist() == [6.0, 6.0, 1.0, 0.5] and deq[1, :2].tolist() == [8.0, 3.0] and deq[2, 0] == 0.75
    assert torch.isnan(deq[3, 32:]).all() and not torch.isnan(deq[3, :32]).any()
    assert q.nonfinite_scales().dtype == torch.uint8
    with pytest.raises(ValueError, match="divisible by 32"):
        te.MXFP4Quantizer()(torch.zeros(16, 32))


def test_mxfp4_rht_and_stochastic_rounding():
    x = _sample((64, 64), seed=21, dtype=torch.bfloat16)  # bfloat16: the transform is exact before its rounding
    q = te.MXFP4Quantizer(with_rht=True, stochastic_rounding=True, generator=torch.Generator().manual_seed(3))(x)
    assert q.columnwise_rht_sign_mask == RHT_SIGN_MASK
    g = torch.Generator().manual_seed(3)
    transformed = hadamard_reference(x.float().t().numpy()).astype(ml_dtypes.bfloat16).astype(F32)
    for data, source in ((q.rowwise_data, x.float().numpy()), (q.columnwise_data, transformed)):
        bits = _draws(g, (64, 64))
        exps = mxfp4_reference(source)[1]
        scaled = source / np.repeat(np.exp2(exps.astype(np.float64) - 127), 32, axis=1).astype(F32)
        assert np.array_equal(_codes(data), e2m1_stochastic_codes(scaled, bits))


# Recipes -----------------------------------------------------------------------------------------------------
NVFP4_ENV = ("NVTE_NVFP4_DISABLE_RHT", "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "NVTE_NVFP4_DISABLE_2D_QUANTIZATION",
             "NVTE_NVFP4_ROW_SCALED_ACTIVATION", "NVTE_NVFP4_4OVER6", "NVTE_NVFP4_4OVER6_E4M3_USE_256",
             "NVTE_NVFP4_4OVER6_ERR_MODE", "NVTE_BACKWARD_OVERRIDE")


@pytest.fixture
def clean_env(monkeypatch):
    for name in NVFP4_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_nvfp4_recipe_fields_and_defaults_match_transformer_engine(clean_env):
    r = te.NVFP4BlockScaling()
    assert (r.disable_rht, r.disable_stochastic_rounding, r.disable_2d_quantization, r.row_scaled_activation) == (
        False, False, False, False)
    assert (r.nvfp4_4over6, r.nvfp4_4over6_e4m3_use_256, r.nvfp4_4over6_err_mode, r.backward_override) == (
        "none", "all", "MAE", None)
    assert r.fp4_format is Format.E2M1 and r.fp8_format is Format.E4M3 and (r.fp8_dpa, r.fp8_mha) == (False, False)
    assert r.fp4_quant_fwd_inp == QParams(random_hadamard_transform=True)
    assert r.fp4_quant_fwd_weight == QParams(fp4_2d_quantization=True)
    assert r.fp4_quant_bwd_grad == QParams(random_hadamard_transform=True, stochastic_rounding=True)
    assert r.nvfp4() and not r.mxfp8() and te.MXFP4BlockScaling().mxfp4()
    assert Format.E2M1 is FP4Format.E2M1 and Format.E2M1.max_fwd == 6.0 and Format.E2M1 not in list(Format)
    assert te.NVFP4BlockScaling(True).disable_rht  # TE's positional order


def test_nvfp4_recipe_environment_switches(clean_env):
    for name in NVFP4_ENV[:3]:
        clean_env.setenv(name, "1")
    r = te.NVFP4BlockScaling()
    assert (r.fp4_quant_fwd_inp, r.fp4_quant_fwd_weight, r.fp4_quant_bwd_grad) == (QParams(),) * 3
    clean_env.setenv("NVTE_NVFP4_4OVER6_ERR_MODE", "mse")
    assert te.NVFP4BlockScaling().nvfp4_4over6_err_mode == "MSE"
    for name, value, field in (("NVTE_NVFP4_ROW_SCALED_ACTIVATION", "1", "row_scaled_activation"),
                               ("NVTE_NVFP4_4OVER6", "weights", "nvfp4_4over6"),
                               ("NVTE_BACKWARD_OVERRIDE", "dequantized", "backward_override")):
        clean_env.setenv(name, value)
        with pytest.raises(ValueError, match=f"{field}=.*not implemented"):
            te.NVFP4BlockScaling()
        clean_env.delenv(name)


@pytest.mark.parametrize("make, match", [
    (lambda: te.NVFP4BlockScaling(fp8_format=Format.HYBRID), "fp8_format"),
    (lambda: te.NVFP4BlockScaling(fp4_format=Format.E4M3), "fp4_format"),
    (lambda: te.NVFP4BlockScaling(nvfp4_4over6="some"), "nvfp4_4over6"),
    (lambda: te.NVFP4BlockScaling(fwd_target_max=4.0), "fwd_target_max"),
    (lambda: te.MXFP4BlockScaling(scale_rounding="even"), "scale_rounding"),
    (lambda: te.MXFP4BlockScaling(fp8_activations=True, stochastic_rounding=True), "fp8_activations"),
    (lambda: te.MXFP4BlockScaling(fp8_format=Format.HIF8), "fp8_format"),
])
def test_invalid_fp4_recipes_raise_naming_the_field(clean_env, make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_fp4_recipe_keys_and_configs(clean_env):
    r = te.NVFP4BlockScaling()
    assert recipe_from_config(recipe_to_config(r)) == r
    assert recipe_from_config(recipe_to_config(te.MXFP4BlockScaling(stochastic_rounding=True))).stochastic_rounding
    before = r.key()
    r.fp4_quant_fwd_inp = QParams()  # as TE's tests customize a recipe
    assert r.key() != before and recipe_to_config(r) is None
    assert te.Float8CurrentScaling().key().count("QParams(power_2_scale=False, amax_epsilon=0.0)") == 3


def test_recipe_states_build_tes_quantizers(clean_env):
    fwd = te.RecipeState.create(te.NVFP4BlockScaling(), mode="forward", num_quantizers=3)
    inp, weight, out = fwd.make_quantizers()
    assert isinstance(inp, te.NVFP4Quantizer) and inp.with_rht and not inp.stochastic_rounding
    assert weight.with_2d_quantization and not weight.with_rht and out.with_rht
    bwd = te.RecipeState.create(te.NVFP4BlockScaling(), mode="backward", num_quantizers=2)
    assert all(q.with_rht and q.stochastic_rounding and not q.with_2d_quantization for q in bwd.make_quantizers())
    mixed = te.MXFP4BlockScaling(fp8_activations=True, fp8_format=Format.HYBRID)
    inp, weight, _ = te.RecipeState.create(mixed, mode="forward", num_quantizers=3).make_quantizers()
    grad = te.RecipeState.create(mixed, mode="backward", num_quantizers=2).make_quantizers()[0]
    assert isinstance(inp, MXFP8Quantizer) and inp.fp8_dtype is te.FP8Dtype.E4M3 and inp.rounding == "floor"
    assert isinstance(weight, te.MXFP4Quantizer) and grad.fp8_dtype is te.FP8Dtype.E5M2


# A Linear under each FP4 recipe ------------------------------------------------------------------------------
# The bound. In scaled units y = x / X (X a block's decode scale), round to nearest on E2M1 errs by at most half
# the spacing: 0.25 below 2, 0.5 <= |y| / 4 in [2, 4), 1 <= |y| / 4 in [4, 6]; saturation of |y| <= 8 errs by
# |y| - 6 <= |y| / 4. So |x̂ - x| <= max(|x| / 4, X / 4), stochastic rounding (error below one spacing) twice that.
# X: NVFP4, an E4M3 scale of block_amax * S_enc / 6 rounded (relative error <= 2^-4 while it is a normal E4M3,
# checked), times S_dec = 1 / S_enc: X <= block_amax * (1 + 2^-4) / 6 (and |y| <= 6 / (1 - 2^-4) < 8). MXFP4
# floor: X = 2^(floor(log2 b) - 2) <= b / 4 (|y| < 8). MXFP8 E4M3 floor: X <= b / 256, relative error 2^-4 of
# a normal, 2^-10 X below, saturation of |y| < 512 at 448 <= |y| / 8: |x̂ - x| <= max(|x| / 8, X 2^-10).
# A GEMM of perturbed operands then errs by at most δA·|B|ᵀ + |A|·δBᵀ + δA·δBᵀ, plus float32 sums (1e-5 relative).
def _element_bound(t: np.ndarray, kind: str, block: int, tile_rows: int = 1, sr: bool = False) -> np.ndarray:
    rows, cols = t.shape
    a = np.abs(t)
    b = a.reshape(rows // tile_rows, tile_rows, cols // block, block).max(axis=(1, 3))
    b = np.repeat(np.repeat(b, tile_rows, axis=0), block, axis=1)
    if kind == "nvfp4":
        assert (448 * b / a.max() >= 2**-6).all(), "the bound assumes normal E4M3 block scales"
        unit = b * (1 + 2**-4) * (1 + 1e-6) / 6
    elif kind == "mxfp4":
        unit = b / 4
    else:
        return np.maximum(a / 8, b / 256 * 2**-10)
    bound = np.maximum(a / 4, unit / 4)
    return 2 * bound if sr else bound


def _gemm_bound(a, da, b, db):
    """|Â B̂ᵀ - A Bᵀ| <= δA |B|ᵀ + |A| δBᵀ + δA δBᵀ, plus float32 summation slack."""
    a, b = np.abs(a), np.abs(b)
    return da @ b.T + a @ db.T + da @ db.T + 1e-5 * ((a + da) @ (b + db).T) + 1e-30


FP4_CASES = {
    "nvfp4": lambda: te.NVFP4BlockScaling(),
    "nvfp4/no-stabilisers": lambda: te.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                                                          disable_2d_quantization=True),
    "mxfp4": lambda: te.MXFP4BlockScaling(),
    "mxfp4/rht+sr": lambda: te.MXFP4BlockScaling(random_hadamard_transform=True, stochastic_rounding=True),
    "mxfp4/fp8-activations": lambda: te.MXFP4BlockScaling(fp8_activations=True),
}


@pytest.mark.parametrize("case", list(FP4_CASES))
@pytest.mark.parametrize("autocast", ["fp8_autocast", "autocast"])
def test_linear_trains_under_fp4_recipes_within_the_bound(clean_env, case, autocast):
    torch.manual_seed(0)
    recipe = FP4_CASES[case]()
    m, k, n = 64, 96, 64
    linear = te.Linear(k, n, params_dtype=torch.float32)
    x = _sample((2, m // 2, k), seed=31).requires_grad_()
    dy = _sample((2, m // 2, n), seed=32)
    region = (te.fp8_autocast(fp8_recipe=recipe) if autocast == "fp8_autocast" else te.autocast(recipe=recipe))
    with region:
        y = linear(x)
    y.backward(dy)
    for grad in (x.grad, linear.weight.grad, linear.bias.grad):
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0

    xd, w, dyd = x.detach().reshape(m, k).double().numpy(), linear.weight.detach().double().numpy(), \
        dy.reshape(m, n).double().numpy()
    nv = isinstance(recipe, te.NVFP4BlockScaling)
    kind, block = ("nvfp4", 16) if nv else ("mxfp4", 32)
    q = recipe.fp4_quant_fwd_inp, recipe.fp4_quant_fwd_weight, recipe.fp4_quant_bwd_grad
    w_tile = 16 if q[1].fp4_2d_quantization else 1
    act = "e4m3" if getattr(recipe, "fp8_activations", False) else kind
    bound_x = lambda t: _element_bound(t, act, 32 if act == "e4m3" else block)  # noqa: E731
    bound_g = lambda t: _element_bound(t, act, 32 if act == "e4m3" else block, sr=q[2].stochastic_rounding)  # noqa: E731

    # The forward is the dequantize + float32 GEMM of the role quantizers' forms (no SR in the forward): exactly for
    # MXFP4; for NVFP4, whose per-tensor factors scale the float32 sum instead, to float32 summation.
    quantize_x, quantize_w, _ = te.RecipeState.create(recipe, mode="forward", num_quantizers=3).make_quantizers()
    xq, wq = quantize_x(x.detach().reshape(m, k)).dequantize(), quantize_w(linear.weight.detach()).dequantize()
    expected = torch.mm(xq, wq.t()) + linear.bias.detach()
    if nv:
        slack = 2 * _float32_sum_bound(xq.double().numpy(), wq.double().numpy()) + 2.0**-23 * expected.abs().numpy()
        assert (np.abs(y.detach().reshape(m, n).double().numpy() - expected.double().numpy()) <= slack).all()
    else:
        assert torch.equal(y.detach().reshape(m, n), expected)

    y_ref = xd @ w.T + linear.bias.detach().double().numpy()
    bound = _gemm_bound(xd, bound_x(xd), w, _element_bound(w, kind, block, w_tile))
    error = np.abs(y.detach().reshape(m, n).double().numpy() - y_ref)
    assert (error <= bound).all() and error.max() > 1e-3 * np.abs(y_ref).max()  # quantized, within the bound

    dx_ref = dyd @ w  # dgrad contracts over n: the weight's columnwise form (tiles along n)
    bound = _gemm_bound(dyd, bound_g(dyd), w.T, _element_bound(w.T.copy(), kind, block, w_tile))
    assert (np.abs(x.grad.reshape(m, k).double().numpy() - dx_ref) <= bound).all()

    # wgrad contracts over the tokens, in the Hadamard domain when both operands were transformed (Q Qᵀ = I).
    a, b = dyd.T.copy(), xd.T.copy()
    if q[0].random_hadamard_transform:
        a, b = hadamard_reference(a), hadamard_reference(b)
    dw_ref = dyd.T @ xd
    bound = _gemm_bound(a, bound_g(a), b, bound_x(b))
    assert (np.abs(linear.weight.grad.double().numpy() - dw_ref) <= bound + 1e-5 * np.abs(dw_ref)).all()
    assert np.allclose(linear.bias.grad.double().numpy(), dyd.sum(axis=0), rtol=1e-5, atol=1e-5)
