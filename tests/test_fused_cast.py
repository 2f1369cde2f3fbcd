"""The fused C quantize kernels against the oracles (ml_dtypes / en_dtypes) and against the torch-op path."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mindspeed_te import formats, fused_cast
from mindspeed_te.formats import FP8Dtype
from tests.oracles import np_cast



@pytest.fixture(autouse=True)
def _switched_on(monkeypatch):
    monkeypatch.setenv("MINDSPEED_TE_FUSED_CAST", "1")

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
def test_scaled_cast_matches_oracle_on_edges(fmt, scale_inv):
    x = _edge_values()
    table = formats._table("encode_sat", torch.device("cpu")) if fmt == "hif8" else None
    got = fused_cast.scaled_cast(torch.from_numpy(x), torch.tensor([scale_inv]), fmt, table).numpy()
    want = _oracle(x, scale_inv, fmt)
    np.testing.assert_array_equal(_nan_agnostic(got, fmt), _nan_agnostic(want, fmt))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "hif8"])
@pytest.mark.parametrize("numel", [1, 31, 33, 1000, 3 * 65536 + 17])  # tails of the 32-wide loop, threads
def test_scaled_cast_bfloat16_and_sizes(fmt, numel):
    g = torch.Generator().manual_seed(numel)
    x = (torch.randn(numel, generator=g) * torch.exp2(torch.randint(-20, 12, (numel,), generator=g))).bfloat16()
    scale_inv = torch.tensor([0.37])
    table = formats._table("encode_sat", torch.device("cpu")) if fmt == "hif8" else None
    got = fused_cast.scaled_cast(x, scale_inv, fmt, table)
    want = _oracle(x.float().numpy(), 0.37, fmt)
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_formats_give_the_same_bits_with_and_without_the_extension(monkeypatch, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 257, generator=g) * 50).to(dtype)
    x.view(-1)[::97] = float("nan")
    x.view(-1)[5::101] = float("inf")
    scale_inv = torch.tensor([0.11])
    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv("MINDSPEED_TE_FUSED_CAST", switch)
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
