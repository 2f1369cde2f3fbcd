"""The fused C quantize kernels against the oracles (ml_dtypes / en_dtypes) and against the torch-op path."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

from mindspeed_te import formats, fused_cast
from mindspeed_te.formats import FP8Dtype
from mindspeed_te.recipe import DelayedScaling, Float8CurrentScaling, Format, QParams
from mindspeed_te.recipe_state import RecipeState
from tests.oracles import FLT_MAX, NP_DTYPES, np_cast
from tests.oracles import current_scale_inv as oracle_scale_inv


@pytest.fixture(autouse=True)
def _switched_on(monkeypatch):
    """The extension on, and tensors split over threads from the kernels' own granularity (64 Ki elements)
    rather than the default (several million in a build without OpenMP), so that these sizes cover the
    thread splits."""
    monkeypatch.setattr(fused_cast, "enabled", True)
    monkeypatch.setattr(fused_cast, "SPLIT_MIN_ELEMENTS", 0)


@pytest.fixture(params=list(fused_cast.SIMD_LEVELS))
def simd(request):
    """Each vector level of the kernels (scalar, AVX2, AVX-512) in turn: all of them must give the torch path's
    bits, and a machine with AVX-512 thereby also tests the paths of CPUs without it."""
    if fused_cast.set_simd(request.param) != request.param:
        fused_cast.set_simd("avx512")
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    fused_cast.set_simd("avx512")


def test_set_simd_names_the_levels():
    with pytest.raises(ValueError, match="limit must be one of"):
        fused_cast.set_simd("sse9")
    assert fused_cast.set_simd("scalar") == "scalar" == fused_cast.simd_level()
    assert fused_cast.set_simd("avx512") in fused_cast.SIMD_LEVELS
    assert fused_cast.simd_level() == fused_cast.set_simd("avx512")


def test_small_tensors_run_on_the_calling_thread(monkeypatch):
    monkeypatch.setattr(fused_cast, "SPLIT_MIN_ELEMENTS", 1 << 22)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert fused_cast._threads((1 << 22) - 1) == 1 and fused_cast._threads(1 << 22) == 2


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="lists the loaded libraries from Linux's /proc")
@pytest.mark.skipif(fused_cast._ext is None, reason="the extension is not built")
def test_the_kernels_share_torchs_openmp_runtime():
    """Built with OpenMP, the extension must bind to the OpenMP runtime torch loaded (whose workers it reuses),
    not map a second one whose threads would compete with torch's for the cores. A fresh interpreter
    imports only torch and the extension, in the package's order, and lists the OpenMP runtimes mapped."""
    script = ("import re, torch\n"
              "from mindspeed_te import fused_cast\n"
              "paths = {line.split()[-1] for line in open('/proc/self/maps') if '/' in line}\n"
              "print(fused_cast._ext.openmp, len({p for p in paths if re.search(r'/lib(g|i|i5)?omp[^/]*\\.so', p)}))")
    built_with, runtimes = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                                          text=True).stdout.split()
    assert runtimes == "1" if built_with == "1" else int(runtimes) <= 1


FORMATS = {"e4m3": "E4M3", "e5m2": "E5M2", "hif8": "HIF8"}


def test_extension_is_built():
    # scripts/test.sh installs the package, which compiles the extension; a missing build is a defect here
    assert fused_cast._ext is not None, "mindspeed_te._fused_cast is not built: run `pip install -e .`"


def _edge_values() -> np.ndarray:
    """Every float32 from 2^-28 to 2^17 whose low 16 bits are near a rounding boundary of any of the
    formats, plus signed zeros, infinities, NaNs with both signs and payloads, and float32 subnormals."""
    high = np.arange(0x3000, 0x4800, dtype=np.uint32) << 16  # the top 16 bits of 2^-31 .. 2^17
    offsets = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x0F_FFF, 0x10_000, 0x7_FFFF, 0x8_0000,
                        0x8_0001], dtype=np.uint32)
    boundary = (high[:, None] + offsets[None, :]).reshape(-1)
    mid = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
                    0xFF800001, 0x7FBFFFFF, 0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF], dtype=np.uint32)
    positive = np.concatenate([boundary, mid]).view(np.float32)
    return np.concatenate([positive, -positive])


def _oracle(x32: np.ndarray, scale_inv: float, fmt: str) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return np_cast(x32 / np.float32(scale_inv), FORMATS[fmt])


def _nan_agnostic(codes: np.ndarray, fmt: str) -> np.ndarray:
    """Codes with every NaN code mapped to one value: the oracles do not agree on a NaN's sign."""
    nan = {"e4m3": (codes & 0x7F) == 0x7F, "e5m2": (codes & 0x7F) > 0x7C, "hif8": codes == 0x80}[fmt]
    return np.where(nan, 0xFF, codes)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "hif8"])
@pytest.mark.parametrize("scale_inv", [1.0, 0.0078125, 3.7, 1e-30, 6.5e33])
def test_scaled_cast_matches_oracle_on_edges(fmt, scale_inv, simd):
    x = _edge_values()
    table = formats.quantize_table(FP8Dtype(fmt), torch.device("cpu"))
    got = fused_cast.scaled_cast(torch.from_numpy(x), torch.tensor([scale_inv]), fmt, table).view(torch.uint8).numpy()
    want = _oracle(x, scale_inv, fmt)
    np.testing.assert_array_equal(_nan_agnostic(got, fmt), _nan_agnostic(want, fmt))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "hif8"])
@pytest.mark.parametrize("numel", [1, 31, 33, 1000, 3 * 65536 + 17])  # tails of the 32-wide loop, threads
def test_scaled_cast_bfloat16_and_sizes(fmt, numel, simd):
    g = torch.Generator().manual_seed(numel)
    x = (torch.randn(numel, generator=g) * torch.exp2(torch.randint(-20, 12, (numel,), generator=g))).bfloat16()
    scale_inv = torch.tensor([0.37])
    table = formats.quantize_table(FP8Dtype(fmt), torch.device("cpu"))
    got = fused_cast.scaled_cast(x, scale_inv, fmt, table)
    assert got.dtype == {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "hif8": torch.uint8}[fmt]
    want = _oracle(x.float().numpy(), 0.37, fmt)
    np.testing.assert_array_equal(got.view(torch.uint8).numpy(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_formats_give_the_same_bits_with_and_without_the_extension(monkeypatch, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 257, generator=g) * 50).to(dtype)
    x.view(-1)[::97] = float("nan")
    x.view(-1)[5::101] = float("inf")
    scale_inv = torch.tensor([0.11])
    results = []
    for switch in (True, False):
        monkeypatch.setattr(fused_cast, "enabled", switch)
        results.append([formats.scaled_cast(x, scale_inv, f).view(torch.uint8) for f in FP8Dtype]
                       + [formats.hif8_encode(x, saturate=s) for s in (False, True)]
                       + [formats.cast_to_fp8(x, f).view(torch.uint8) for f in FP8Dtype])
    for fused, plain in zip(*results):
        assert torch.equal(fused, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", [0, 7, 4097, 2 * 65536 + 5])
def test_amax(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    x = (torch.randn(numel, generator=g) * 3).to(dtype)
    want = x.float().abs().max() if numel else torch.tensor(0.0)
    assert torch.equal(fused_cast.amax(x), want)
    if numel:
        x[numel // 2] = -float("inf")
        assert fused_cast.amax(x).item() == float("inf")
        x[numel - 1] = float("nan")  # a NaN anywhere, even after an Inf, shows
        assert torch.isnan(fused_cast.amax(x))
        x.fill_(-0.0)
        assert fused_cast.amax(x).item() == 0.0


def test_outside_the_hot_path_the_torch_ops_take_over():
    x = torch.randn(64, 64)
    assert fused_cast.scaled_cast(x.half(), torch.ones(1), "e4m3") is None  # float16 input
    assert fused_cast.scaled_cast(x.t(), torch.ones(1), "e4m3") is None  # not contiguous
    assert fused_cast.scaled_cast(x, torch.ones(64, 1), "e4m3") is None  # per-row scales
    assert fused_cast.scaled_cast(x, torch.ones(1, dtype=torch.float64), "e4m3") is None
    assert fused_cast.amax(x.t()) is None
    # and the formats functions still give the oracle's bits there
    half = x.half()
    want = np_cast(half.float().numpy() / np.float32(0.5), "E4M3")
    got = formats.scaled_cast(half, torch.tensor([0.5]), FP8Dtype.E4M3).view(torch.uint8).numpy()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "hif8"])
@pytest.mark.parametrize("numel", [256, 3 * 65536 + 5])
def test_decode_matches_oracle(fmt, numel, simd):
    codes = torch.arange(numel, dtype=torch.int64).remainder(256).to(torch.uint8)
    got = fused_cast.decode(codes, formats.decode_table(FP8Dtype(fmt), torch.device("cpu"))).numpy()
    want = codes.numpy().view(NP_DTYPES[FORMATS[fmt]]).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])
    assert np.array_equal(np.isnan(got), np.isnan(want))


@pytest.mark.parametrize("bf16_table", [False, True])
def test_decode_of_random_codes_is_the_table_lookup(bf16_table, simd):
    """Any 256-entry table, random codes: the byte-permute decode (bfloat16-valued tables on AVX-512) and the
    gather (other tables) give values[codes] in place, vector tails included."""
    g = torch.Generator().manual_seed(3)
    values = torch.randn(256, generator=g) * torch.exp2(torch.randint(-60, 60, (256,), generator=g).float())
    if bf16_table:
        values = values.bfloat16().float()
    codes = torch.randint(0, 256, (3 * 65536 + 77,), generator=g, dtype=torch.uint8)
    got = fused_cast.decode(codes, values)
    assert torch.equal(got.view(torch.int32), values[codes.long()].view(torch.int32))
    scales = torch.exp2(torch.randint(-20, 20, (7, 11), generator=g).float())
    tiles = fused_cast.dequantize_tiles(codes[:7 * 330].reshape(7, 330), values, scales, 1, 32)
    want = values[codes[:7 * 330].long()].reshape(7, 330) * scales.repeat_interleave(32, dim=1)[:, :330]
    assert torch.equal(tiles.view(torch.int32), want.view(torch.int32))


def test_decode_takes_float8_data_and_keeps_the_shape():
    x = torch.randn(3, 5, 7).to(torch.float8_e4m3fn)
    got = fused_cast.decode(x, formats.decode_table(FP8Dtype.E4M3, torch.device("cpu")))
    assert got.shape == x.shape and torch.equal(got, x.float())


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
@pytest.mark.parametrize("fp8_max", [448.0, 57344.0, 15.0, 224.0])
def test_current_scale_inv_matches_the_scale_oracle(pow2, eps, fp8_max):
    amaxes = [0.0, float("nan"), float("inf"), 1e-45, 1e-38, 2.5e-4, 1e-3, 0.37, 1.0, 448.0, 3.1e5, 3e38, FLT_MAX]
    amaxes += list(np.exp(np.random.default_rng(0).uniform(-80, 80, 200)).astype(np.float32))
    for amax in amaxes:
        got = fused_cast.current_scale_inv(torch.tensor([amax], dtype=torch.float32), fp8_max, eps, pow2)
        want = oracle_scale_inv(float(np.float32(amax)), fp8_max, eps, pow2)
        assert got.numpy().view(np.uint32)[0] == np.float32(want).view(np.uint32), (amax, got.item(), want)


@pytest.mark.parametrize("recipe", [
    DelayedScaling(fp8_format=Format.HYBRID), DelayedScaling(fp8_format=Format.HIF8),
    Float8CurrentScaling(fp8_format=Format.E4M3), Float8CurrentScaling(fp8_format=Format.HIF8),
    Float8CurrentScaling(fp8_format=Format.HYBRID, fp8_quant_fwd_inp=QParams(True, 1e-2),
                         fp8_quant_bwd_grad=QParams(True, 1e-2)),
], ids=lambda r: f"{type(r).__name__}-{r.fp8_format.name}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_tensor_quantizers_agree_with_the_torch_path(monkeypatch, recipe, dtype):
    """One fused call (amax, scale, cast) gives the data, scale_inv and delayed amax of the torch ops."""
    g = torch.Generator().manual_seed(1)
    inputs = [(torch.randn(40, 96, generator=g) * 30).to(dtype), torch.zeros(8, 32, dtype=dtype),
              torch.full((4, 4), float("nan"), dtype=dtype), (torch.randn(3, 5, 7, generator=g) * 1e-3).to(dtype)]
    results = []
    for switch in (True, False):
        monkeypatch.setattr(fused_cast, "enabled", switch)
        fwd = RecipeState.create(recipe, forward=True, num_quantizers=3)
        bwd = RecipeState.create(recipe, forward=False, num_quantizers=2)
        if isinstance(recipe, DelayedScaling):  # non-trivial scales
            fwd.scale.copy_(torch.tensor([3.5, 0.25, 7.0]))
        quantizers = fwd.make_quantizers() + bwd.make_quantizers()
        out = []
        for i, x in enumerate(inputs):
            q = quantizers[i % len(quantizers)]
            t = q(x)
            out.append((t.data.view(torch.uint8), t.scale_inv, t.shape, t.dtype))
        amaxes = fwd.amax_history.clone() if isinstance(recipe, DelayedScaling) else None
        results.append((out, amaxes))
    (fused, fused_amax), (plain, plain_amax) = results
    for (d1, s1, sh1, dt1), (d2, s2, sh2, dt2) in zip(fused, plain):
        assert torch.equal(d1, d2) and sh1 == sh2 and dt1 == dt2
        assert s1.shape == s2.shape and torch.allclose(s1, s2, rtol=0, atol=0, equal_nan=True)  # NaN: NaN/Inf input
    if fused_amax is not None:
        assert torch.equal(fused_amax.nan_to_num(-1.0), plain_amax.nan_to_num(-1.0))
        assert torch.isnan(fused_amax).any()  # the NaN input's amax reached the history (the update skips it)


def _tiled_input(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows spread over 80 binades, with NaN, Inf, zeros, a float32 subnormal and a huge value in some blocks."""
    gen = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-40, 40, (m, 1), generator=gen).float())
    x[0, :5] = torch.tensor([float("nan"), 0.0, -0.0, 1e-45, 3e38])
    x[m - 1, k // 2] = float("inf")
    x[m // 2, :] = 0.0
    return x.to(dtype)


def _fields_equal(a, b) -> None:
    for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        got, want = getattr(a, name), getattr(b, name)
        assert (got is None) == (want is None), name
        if got is not None:
            assert got.shape == want.shape and got.dtype == want.dtype, name
            if got.dtype == torch.float32:  # NaN scales mark non-finite tiles; compare them as NaN
                torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
            else:
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


def _fused_equals_torch_path(monkeypatch, q, x: torch.Tensor) -> None:
    fused = q(x)
    monkeypatch.setattr(fused_cast, "enabled", False)
    _fields_equal(fused, q(x))
    monkeypatch.setattr(fused_cast, "enabled", True)


def _amaxes_at_edges(fmt: FP8Dtype, j: torch.Tensor, extra: list[float]) -> torch.Tensor:
    """fp8_max * 2^j and `extra`, each also one float32 ulp up and down; the positive finite ones."""
    edge = torch.tensor(fmt.max, dtype=torch.float64) * torch.exp2(j)
    amaxes = torch.cat([edge.float(), torch.tensor(extra)])
    up, down = torch.nextafter(amaxes, torch.tensor(1e39)), torch.nextafter(amaxes, torch.tensor(0.0))
    amaxes = torch.cat([amaxes, up, down])
    return amaxes[torch.isfinite(amaxes) & (amaxes > 0)]


def _block_quantizers(fmt: FP8Dtype, m: int, k: int) -> list:
    from mindspeed_te.quantizers import Float8BlockQuantizer, MXFP8Quantizer

    target = 15.0 if fmt is FP8Dtype.HIF8 else fmt.max
    qs = [Float8BlockQuantizer(fmt, target, block_scaling_dim=dim, power_2_scale=pow2, amax_epsilon=eps, block_len=bl)
          for dim, pow2, eps, bl in ((1, True, 0.0, 128), (2, True, 0.0, 128), (1, False, 0.0, 128),
                                     (2, False, 1e-3, 128), (1, True, 0.0, 64), (2, True, 0.0, 48))]
    if fmt is not FP8Dtype.HIF8 and m % 32 == 0 and k % 32 == 0:
        qs += [MXFP8Quantizer(fmt, rounding=r) for r in ("ceil", "floor")]
    return qs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 256), (130, 300), (1, 128)])
@pytest.mark.parametrize("fmt", list(FP8Dtype))
def test_block_and_mx_kernels_equal_torch_path(monkeypatch, simd, dtype, shape, fmt):
    """Blockwise (1x128, 128x128, power-of-2 or not) and MX (ceil / floor) quantize in one C call, every
    layout combination, bit for bit as the torch ops give it (checked against the oracles in test_quantizers)."""
    x = _tiled_input(*shape, dtype)
    for q in _block_quantizers(fmt, *shape):
        for rowwise, columnwise in ((True, False), (False, True), (True, True)):
            q.set_usage(rowwise=rowwise, columnwise=columnwise)
            _fused_equals_torch_path(monkeypatch, q, x)


def test_block_kernel_used_when_available(monkeypatch):
    from mindspeed_te.quantizers import MXFP8Quantizer

    calls = []
    original = fused_cast._ext.quantize_tiles
    monkeypatch.setattr(fused_cast, "_ext", type("Ext", (), {"quantize_tiles": staticmethod(
        lambda *a: calls.append(a) or original(*a))})())
    MXFP8Quantizer(FP8Dtype.E4M3)(torch.randn(64, 64))
    assert len(calls) == 1  # both layouts from one call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_and_mx_kernels_equal_torch_path_across_chunks_strips_and_threads(monkeypatch, simd, dtype):
    """Shapes spanning several column chunks, 128-row strips and threads, with a ragged last block."""
    x = _tiled_input(416, 2600, dtype)
    for shape in ((416, 2600), (384, 2592)):
        part = x[: shape[0], : shape[1]].contiguous()
        for q in _block_quantizers(FP8Dtype.E4M3, *shape):
            q.set_usage(rowwise=True, columnwise=True)
            fused = q(part)
            monkeypatch.setattr(fused_cast, "enabled", False)
            _fields_equal(fused, q(part))
            monkeypatch.setattr(fused_cast, "enabled", True)


def test_block_and_mx_kernels_equal_torch_path_on_a_large_tensor(monkeypatch, simd):
    """2^22 elements: the size from which the AVX-512 tiles write their codes with streaming stores."""
    from mindspeed_te.quantizers import Float8BlockQuantizer, MXFP8Quantizer

    x = _tiled_input(2048, 2048, torch.float32)
    for q in (Float8BlockQuantizer(FP8Dtype.E4M3, FP8Dtype.E4M3.max, rowwise=True, columnwise=True),
              Float8BlockQuantizer(FP8Dtype.E4M3, FP8Dtype.E4M3.max, block_scaling_dim=2),
              MXFP8Quantizer(FP8Dtype.E4M3, rowwise=True, columnwise=True)):
        _fused_equals_torch_path(monkeypatch, q, x)


@pytest.mark.parametrize("fmt", [FP8Dtype.E4M3, FP8Dtype.E5M2])
def test_mx_scale_exponents_at_binade_edges(monkeypatch, simd, fmt):
    """Block amaxes exactly at fp8_max * 2^j, one float32 ulp either side, powers of two and float32
    subnormals: the kernel's exponent from bits equals the torch path's (ceil and floor rules)."""
    from mindspeed_te.quantizers import MXFP8Quantizer

    j = torch.arange(-140, 110, 10, dtype=torch.float64)
    amaxes = _amaxes_at_edges(fmt, j, torch.exp2(j).float().tolist() + [1e-45, 3e-42, 1.1754942e-38, 3e38])
    rows = -(-amaxes.numel() // 32) * 32
    x = torch.zeros(rows, 32)
    x[: amaxes.numel(), 0] = amaxes  # one amax per rowwise block
    x[: amaxes.numel(), 1] = -amaxes * 0.75
    for rounding in ("ceil", "floor"):
        q = MXFP8Quantizer(fmt, rounding=rounding)
        _fused_equals_torch_path(monkeypatch, q, x)


@pytest.mark.parametrize("fmt", [FP8Dtype.E4M3, FP8Dtype.E5M2])
def test_block_scales_at_edges(monkeypatch, simd, fmt):
    """1x128 / 128x128 block amaxes at fp8_max * 2^j and one float32 ulp either side, float32 subnormals, the
    largest floats and eps itself, with and without power-of-2 scales and eps: the kernel's scales (computed
    16 at a time on AVX-512) and codes equal the torch path's."""
    from mindspeed_te.quantizers import Float8BlockQuantizer

    amaxes = _amaxes_at_edges(fmt, torch.arange(-140, 120, 10, dtype=torch.float64),
                              [1e-45, 3e-42, 1.1754942e-38, 1e-3, 3e38, 3.4028235e38])
    x = torch.zeros(256, 384)
    x.view(-1, 128)[: amaxes.numel(), 0] = amaxes  # one amax per 1x128 block, spread over the 128x128 tiles
    x.view(-1, 128)[: amaxes.numel(), 5] = -amaxes * 0.6
    for dim in (1, 2):
        for pow2, eps in ((True, 0.0), (False, 0.0), (True, 1e-3), (False, 1e-3)):
            q = Float8BlockQuantizer(fmt, fmt.max, block_scaling_dim=dim, power_2_scale=pow2, amax_epsilon=eps,
                                     rowwise=True, columnwise=True)
            _fused_equals_torch_path(monkeypatch, q, x)


@pytest.mark.parametrize("fmt", [FP8Dtype.E4M3, FP8Dtype.E5M2])
def test_mx_scale_exponents_of_random_amaxes(monkeypatch, simd, fmt):
    """Block amaxes drawn uniformly from the positive finite float32 bit patterns (subnormals included):
    the kernel's exponents, scales and codes equal the torch path's in both layouts, both rules."""
    from mindspeed_te.quantizers import MXFP8Quantizer

    g = torch.Generator().manual_seed(7)
    amaxes = torch.randint(1, 0x7F800000, (4096,), generator=g, dtype=torch.int32).view(torch.float32)
    signs = torch.where(torch.rand(4096, 31, generator=g) < 0.5, -1.0, 1.0)
    x = torch.cat([amaxes[:, None], amaxes[:, None] * torch.rand(4096, 31, generator=g) * signs], dim=1)
    for rounding in ("ceil", "floor"):
        q = MXFP8Quantizer(fmt, rounding=rounding, rowwise=True, columnwise=True)
        _fused_equals_torch_path(monkeypatch, q, x)


@pytest.mark.parametrize("fmt", list(FP8Dtype))
@pytest.mark.parametrize("shape,rows,cols", [((130, 300), 1, 128), ((130, 300), 128, 128), ((64, 96), 1, 32),
                                             ((600, 512), 1, 128), ((5, 330), 1, 32)])
@pytest.mark.parametrize("e8m0", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dequantize_tiles_equals_decode_times_expanded_scales(fmt, shape, rows, cols, e8m0, out_dtype, simd):
    """One pass of values[codes] * tile scale, as the oracle's decode times the repeated scales, NaN where either
    is; the scales as float32 or as E8M0 bytes (every byte, 0 = 2^-127 and 0xFF = NaN included, decoded by
    ml_dtypes). bfloat16 output: those float32 products rounded to nearest even by ml_dtypes (products below
    float32's normal range are not all bfloat16 values: the rounding is checked there too)."""
    g = torch.Generator().manual_seed(shape[0])
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    scale_shape = (-(-shape[0] // rows), -(-shape[1] // cols))
    if e8m0:
        stored = torch.randint(0, 256, scale_shape, generator=g, dtype=torch.uint8)
        stored.view(-1)[:3] = torch.tensor([0, 255, 254], dtype=torch.uint8)
        scales = torch.from_numpy(stored.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32))
    else:
        scales = stored = torch.exp2(torch.randint(-130, 120, scale_shape, generator=g).float())
        scales[0, 0] = float("nan")
        scales[-1, -1] = 2.0**-133  # products far below float32's normal range, some not bfloat16 values
    got = fused_cast.dequantize_tiles(codes, formats.decode_table(fmt, torch.device("cpu")), stored, rows, cols,
                                      out_dtype)
    decoded = torch.from_numpy(codes.numpy().view(NP_DTYPES[FORMATS[fmt.value]]).astype(np.float32))
    want = decoded * scales.repeat_interleave(rows, 0)[: shape[0]].repeat_interleave(cols, 1)[:, : shape[1]]
    assert got.dtype == out_dtype
    if out_dtype == torch.bfloat16:
        rounded = want.numpy().astype(ml_dtypes.bfloat16)
        nan = np.isnan(rounded)
        assert np.array_equal(torch.isnan(got).numpy(), nan)
        np.testing.assert_array_equal(got.view(torch.int16).numpy()[~nan], rounded.view(np.int16)[~nan])
        return
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fmt", list(FP8Dtype))
@pytest.mark.parametrize("e8m0", [False, True])
def test_bfloat16_dequantize_at_the_edges_of_exact_power_of_2_scales(fmt, e8m0, simd):
    """bfloat16 output of power-of-2 tile scales: where every product is a normal number the AVX-512 path adds
    the scale's exponent to each value's bits instead of multiplying; at the shifts that take the format's
    smallest value below float32's normal range or its largest above its finite range (and one inside each
    edge) it must still give ml_dtypes' rounding of the float32 product. Every code in every tile."""
    finite = [v for v in formats.decode_table(fmt, torch.device("cpu")).tolist() if v != 0 and math.isfinite(v)]
    low, high = min(math.frexp(abs(v))[1] for v in finite) - 1, max(math.frexp(abs(v))[1] for v in finite) - 1
    shifts = [-126 - low - 1, -126 - low, 127 - high, 127 - high + 1, 0, -127]  # -127: E8M0's byte 0, 2^-127
    codes = torch.arange(256, dtype=torch.uint8).repeat(2 * len(shifts), 1)  # rows of all 256 codes
    if e8m0:
        stored = torch.tensor([[d + 127 if d + 127 in range(255) else 0] * 8 for d in shifts for _ in range(2)],
                              dtype=torch.uint8)
        scales = torch.from_numpy(stored.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32))
    else:
        scales = stored = torch.tensor([[2.0**d] * 8 for d in shifts for _ in range(2)], dtype=torch.float32)
    got = fused_cast.dequantize_tiles(codes, formats.decode_table(fmt, torch.device("cpu")), stored, 1, 32,
                                      torch.bfloat16)
    decoded = torch.from_numpy(codes.numpy().view(NP_DTYPES[FORMATS[fmt.value]]).astype(np.float32))
    want = (decoded * scales.repeat_interleave(32, 1)).numpy().astype(ml_dtypes.bfloat16)
    nan = np.isnan(want)
    assert np.array_equal(torch.isnan(got).numpy(), nan)
    np.testing.assert_array_equal(got.view(torch.int16).numpy()[~nan], want.view(np.int16)[~nan])
    assert (got.view(torch.int16)[torch.isnan(got)] == 0x7FC0).all()  # NaN as torch's cast writes it


def test_dequantize_tiles_of_no_rows_is_empty():
    """An expert that got no tokens has (0, K) codes and (0, K / 32) scales: an empty result, not an error."""
    got = fused_cast.dequantize_tiles(torch.empty(0, 64, dtype=torch.uint8),
                                      formats.decode_table(FP8Dtype.E4M3, torch.device("cpu")),
                                      torch.empty(0, 2), 1, 32)
    assert got is not None and got.shape == (0, 64) and got.dtype == torch.float32


def _epilogue_oracle(acc: np.ndarray, sb: float, sa: float, bias) -> np.ndarray:
    """(acc * sb) * sa + bias, each operation rounded to float32 on its own."""
    y = (acc * np.float32(sb)).astype(np.float32) * np.float32(sa)
    return (y + bias).astype(np.float32) if bias is not None else y.astype(np.float32)


def _assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    nan = np.isnan(want.astype(np.float32))
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [(3, 5), (33, 45), (700, 384)])
def test_gemm_epilogue_rounds_each_step_and_casts_like_numpy(out_dtype, with_bias, shape, simd):
    """Scale by x2's scale, then x1's, add the bias, round to bfloat16 to nearest even: the oracle's float32 steps
    and ml_dtypes' cast, bit for bit, with ties, overflow to Inf and NaN among the sums."""
    g = torch.Generator().manual_seed(5)
    acc = torch.randn(shape, generator=g) * 1e3
    acc.view(-1)[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.0e38, 1.00390625, 1.01171875])
    sb, sa = torch.tensor([0.7310586]), torch.tensor([1.3])
    bias = torch.randn(shape[1], generator=g) if with_bias else None
    want = _epilogue_oracle(acc.numpy().copy(), sb.item(), sa.item(), None if bias is None else bias.numpy())
    got = fused_cast.gemm_epilogue(acc.clone(), sb, sa, bias, out_dtype)
    assert got.dtype == out_dtype and got.shape == acc.shape
    if out_dtype == torch.bfloat16:
        _assert_same_bits(got.view(torch.int16).numpy(), want.astype(ml_dtypes.bfloat16).view(np.int16))
    else:
        _assert_same_bits(got.numpy().view(np.int32), want.view(np.int32))


def test_gemm_epilogue_unit_scales_are_exact_and_it_accumulates():
    """No scales: the sum unchanged (then cast); with `out`: out += (acc * sb) * sa, in place."""
    acc = torch.randn(300, 260) * 100
    assert torch.equal(fused_cast.gemm_epilogue(acc.clone(), None, None, None, torch.float32), acc)
    out = torch.randn(300, 260)
    want = out.numpy() + _epilogue_oracle(acc.numpy(), 0.25, 3.0, None)
    got = fused_cast.gemm_epilogue(acc, torch.tensor(0.25), torch.tensor([3.0]), None, torch.float32, out=out)
    assert got is out
    np.testing.assert_array_equal(out.numpy(), want.astype(np.float32))


def test_gemm_epilogue_declines_what_it_does_not_cover():
    acc = torch.ones(4, 8)
    assert fused_cast.gemm_epilogue(acc, None, None, None, torch.float16) is None
    assert fused_cast.gemm_epilogue(acc.t(), None, None, None, torch.float32) is None
    assert fused_cast.gemm_epilogue(acc, None, None, torch.ones(8, dtype=torch.bfloat16), torch.float32) is None
    assert fused_cast.gemm_epilogue(acc, None, None, torch.ones(8), torch.float32, out=torch.ones(4, 8)) is None


# What the kernels read and write at raw addresses is checked first ------------------------------------------
def _hif8_table() -> torch.Tensor:
    return formats.quantize_table(FP8Dtype.HIF8, torch.device("cpu"))


def _values(fmt: FP8Dtype = FP8Dtype.E4M3) -> torch.Tensor:
    return formats.decode_table(fmt, torch.device("cpu"))


def _guarded(shape: tuple[int, ...], fill: float, guard: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous view of `shape` in the middle of a larger float32 buffer whose other elements hold -7 (the
    guards), and the buffer."""
    n = math.prod(shape)
    buffer = torch.full((n + 2 * guard,), -7.0)
    view = buffer[guard: guard + n].view(shape)
    view.fill_(fill)
    return view, buffer


def _guards_untouched(buffer: torch.Tensor, n: int, guard: int = 16) -> bool:
    return bool((buffer[:guard] == -7.0).all() and (buffer[guard + n:] == -7.0).all())


@pytest.mark.parametrize("call", ["scaled_cast", "quantize_current", "quantize_delayed", "quantize_tiles"])
def test_hif8_quantizers_refuse_a_wrong_encode_table(call):
    """HiF8 codes come from a 65536-entry uint8 table indexed by a 16-bit key: a shorter table (the kernel would
    read past it), another dtype or none at all is refused naming the argument; a strided one is declined."""
    x = torch.randn(64, 64)

    def run(table):
        if call == "scaled_cast":
            return fused_cast.scaled_cast(x, torch.ones(1), "hif8", table)
        if call == "quantize_current":
            return fused_cast.quantize_current(x, "hif8", table, 32768.0, 0.0, False)
        if call == "quantize_delayed":
            return fused_cast.quantize_delayed(x, "hif8", table, torch.zeros(1), torch.ones(1))
        return fused_cast.quantize_tiles(x, "hif8", table, mode="block", tile_rows=1, block=32, rowwise=True,
                                         columnwise=True, fp8_max=32768.0)

    arg = "hif8_table" if call == "scaled_cast" else "table"
    good = _hif8_table()
    assert run(good) is not None
    with pytest.raises(ValueError, match=f"{arg} must have 65536 elements"):
        run(good[:-1].clone())
    with pytest.raises(TypeError, match=f"{arg} must be .*uint8"):
        run(good.to(torch.int16))
    with pytest.raises(TypeError, match=f"{arg} must be"):
        run(None)
    assert run(torch.stack([good, good], dim=1)[:, 0]) is None  # right, but strided: the torch ops


def test_quantizers_refuse_an_unknown_format_mode_or_tile():
    x = torch.randn(64, 64)
    with pytest.raises(ValueError, match="fmt must be one of"):
        fused_cast.scaled_cast(x, torch.ones(1), "e3m4")
    with pytest.raises(ValueError, match="fmt must be one of"):
        fused_cast.quantize_current(x, "int8", None, 448.0, 0.0, False)
    tiles = dict(rowwise=True, columnwise=False, fp8_max=448.0)
    with pytest.raises(ValueError, match="mode must be one of"):
        fused_cast.quantize_tiles(x, "e4m3", None, mode="round", tile_rows=1, block=32, **tiles)
    with pytest.raises(ValueError, match="tile_rows 1 or block"):
        fused_cast.quantize_tiles(x, "e4m3", None, mode="block", tile_rows=64, block=32, **tiles)
    with pytest.raises(ValueError, match="block must be an integer >= 1"):
        fused_cast.quantize_tiles(x, "e4m3", None, mode="block", tile_rows=1, block=0, **tiles)


@pytest.mark.parametrize("call", ["decode", "dequantize_tiles", "gemm_bf16"])
def test_decoders_refuse_wrong_code_values(call):
    """The codes index a format's 256 float32 values: fewer (the kernel would read past them) or another dtype
    is refused naming the argument; a strided table is declined (None)."""
    codes = torch.randint(0, 256, (32, 64), dtype=torch.uint8)
    if call == "gemm_bf16" and not fused_cast.gemm_bf16_applies():
        pytest.skip("gemm_bf16 does not run on this CPU")

    def run(values):
        if call == "decode":
            return fused_cast.decode(codes, values)
        if call == "dequantize_tiles":
            return fused_cast.dequantize_tiles(codes, values, torch.ones(32, 2), 1, 32)
        return fused_cast.gemm_bf16(codes, codes, values, _values())

    arg = "a_values" if call == "gemm_bf16" else "values"
    good = _values()
    assert run(good) is not None
    with pytest.raises(ValueError, match=f"{arg} must have 256 elements"):
        run(good[:255].clone())
    with pytest.raises(TypeError, match=f"{arg} must be .*float32"):
        run(good.double())
    assert run(torch.stack([good, good], dim=1)[:, 0]) is None


def test_gemm_bf16_refuses_code_values_with_operands_that_are_not_codes():
    if not fused_cast.gemm_bf16_applies():
        pytest.skip("gemm_bf16 does not run on this CPU")
    x = torch.ones(8, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="b must hold 1-byte codes"):
        fused_cast.gemm_bf16(x.to(torch.uint8), x, _values(), _values())


def test_dequantize_tiles_refuses_an_empty_tile():
    codes = torch.zeros(4, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="rows .* must be an integer >= 1"):
        fused_cast.dequantize_tiles(codes, _values(), torch.ones(1, 1), 0, 4)
    with pytest.raises(ValueError, match="cols .* must be an integer >= 1"):
        fused_cast.dequantize_tiles(codes, _values(), torch.ones(1, 1), 4, -1)


def test_gemm_epilogue_refuses_an_out_of_another_size_and_writes_only_its_buffers():
    """`out` receives acc's m x n sums: one of fewer elements is refused (a view of a larger buffer, whose other
    elements stay as they were); in-bounds views of larger buffers, as out and as acc (written over), get exactly
    (acc * sb) * sa (+ out), and the elements around them are never written."""
    acc_values = torch.randn(6, 10, generator=torch.Generator().manual_seed(3))
    sb, sa = torch.tensor([0.5]), torch.tensor([4.0])
    small, small_buffer = _guarded((5, 10), 1.0)
    with pytest.raises(ValueError, match=r"out must have acc's shape \(6, 10\)"):
        fused_cast.gemm_epilogue(acc_values.clone(), sb, sa, None, torch.float32, out=small)
    assert _guards_untouched(small_buffer, 50) and bool((small == 1.0).all())
    out, out_buffer = _guarded((6, 10), 1.0)
    got = fused_cast.gemm_epilogue(acc_values.clone(), sb, sa, None, torch.float32, out=out)
    assert got is out and torch.equal(out, 1.0 + acc_values * 2.0)  # products by powers of two: exact
    assert _guards_untouched(out_buffer, 60)
    acc, acc_buffer = _guarded((6, 10), 0.0)
    acc.copy_(acc_values)
    bias = torch.arange(10, dtype=torch.float32)
    got = fused_cast.gemm_epilogue(acc, sb, sa, bias, torch.float32)
    assert torch.equal(got, acc_values * 2.0 + bias)
    assert _guards_untouched(acc_buffer, 60)


def test_quantize_delayed_writes_only_its_one_element_amax():
    """The delayed quantize max-accumulates into the one float32 at `amax`: a view of one element inside a larger
    buffer gets max(old, max |x|) and its neighbours stay as they were; an amax of more elements is declined."""
    x = torch.tensor([[1.5, -3.0], [2.0, 0.25]])
    amax, buffer = _guarded((1,), 2.0)
    data, scale_inv = fused_cast.quantize_delayed(x, "e4m3", None, amax, torch.tensor([0.5]))
    assert amax.item() == 3.0 and scale_inv.item() == 0.5 and data.shape == x.shape
    assert _guards_untouched(buffer, 1)
    assert fused_cast.quantize_delayed(x, "e4m3", None, torch.zeros(2), torch.tensor([0.5])) is None
