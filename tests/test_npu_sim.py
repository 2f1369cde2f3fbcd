"""The torch_npu simulator: kernel results against independent numpy computations (ml_dtypes / en_dtypes casts,
float64 matmuls), the argument contract (every violation raises, naming the argument), launch counting."""
from __future__ import annotations

import ast
import inspect
import math
import pathlib
import sys
import types

import ml_dtypes
import numpy as np
import pytest
import torch

from mindspeed_te.testing.npu_sim import (
    NpuContractError,
    NpuSimNotImplemented,
    NpuSocError,
    NpuTypeError,
    NpuValueError,
    codecs,
    make_release_simulator,
    make_simulator,
)
from tests.dist_utils import run_distributed
from tests.oracles import FMT_MAX, NP_DTYPES, np_cast, np_decode

EMAX = {"E4M3": 8, "E5M2": 15}
TORCH_FP8 = {"E4M3": torch.float8_e4m3fn, "E5M2": torch.float8_e5m2}


@pytest.fixture
def sim():
    return make_simulator()


def npu_dtype(sim, fmt):
    return {"E4M3": torch.float8_e4m3fn, "E5M2": torch.float8_e5m2, "HIF8": sim.hifloat8}[fmt]


# Oracles (the element casts are tests/oracles.py's np_cast / np_decode) -----------------------------------------
def raw(t):
    """The bytes of an 8-bit tensor as a numpy uint8 array."""
    return t.contiguous().view(torch.uint8).numpy()


def f32(t):
    return t.float().numpy()


def random_codes(shape, fmt, seed, scale=4.0):
    """A tensor of valid data in `fmt` (native fp8, or uint8 HiF8 codes) and its float64 values."""
    gen = np.random.default_rng(seed)
    codes = np_cast(gen.standard_normal(shape).astype(np.float32) * scale, fmt)
    t = torch.from_numpy(codes.copy())
    return (t.view(TORCH_FP8[fmt]) if fmt in TORCH_FP8 else t), np_decode(codes, fmt).astype(np.float64)


def mx_scale_byte(amax, fmt, alg, bound=0.0):
    """E8M0 byte of one block, written from the rules: OCP floor rule or round-up rule."""
    if alg == 1:
        amax = max(amax, bound)
    if not math.isfinite(amax):
        return 0xFF
    if amax == 0:
        return 0
    if alg == 0:
        exp = math.floor(math.log2(amax)) - EMAX[fmt]
    else:
        exp = math.ceil(math.log2(amax / FMT_MAX[fmt]))
        while FMT_MAX[fmt] * 2.0 ** (exp - 1) >= amax:
            exp -= 1
        while FMT_MAX[fmt] * 2.0**exp < amax:
            exp += 1
    return min(max(exp + 127, 0), 254)


def mx_reference(x, fmt, alg, block=32, bound=0.0):
    """Row-wise MX quantization of a 2-D float32 array: (codes, byte per block (rows, blocks))."""
    rows, n = x.shape
    nb = -(-n // block)
    codes = np.zeros((rows, n), np.uint8)
    scales = np.zeros((rows, nb), np.int64)
    for r in range(rows):
        for b in range(nb):
            seg = x[r, b * block:(b + 1) * block]
            byte = mx_scale_byte(float(np.abs(seg).max()), fmt, alg, bound)
            scales[r, b] = byte
            codes[r, b * block:(b + 1) * block] = np_cast(seg.astype(np.float64) / 2.0 ** (byte - 127), fmt)
    return codes, scales


def pair_blocks(scales):
    """(rows, blocks) bytes -> (rows, ceil(blocks / 2), 2), padding an odd block count with 0."""
    rows, nb = scales.shape
    if nb % 2:
        scales = np.concatenate([scales, np.zeros((rows, 1), scales.dtype)], axis=1)
    return scales.reshape(rows, -1, 2)


def assert_raises(fn, exc, *words):
    with pytest.raises(exc) as info:
        fn()
    assert isinstance(info.value, RuntimeError)  # like torch_npu's own errors
    for word in words:
        assert word in str(info.value), str(info.value)


# Module-likeness --------------------------------------------------------------------------------------------
def test_module_object_dtypes_and_device_name(monkeypatch):
    sim = make_simulator("Ascend950DT")
    assert isinstance(sim, types.ModuleType)
    assert (sim.hifloat8, sim.float8_e5m2, sim.float8_e4m3fn, sim.float8_e8m0fnu, sim.float4_e2m1fn_x2) == (
        290, 291, 292, 293, 296)
    assert sim.npu.get_device_name() == "Ascend950DT" and sim.supports_fp8
    assert not make_simulator("Ascend910B3").supports_fp8
    monkeypatch.setitem(sys.modules, "torch_npu", sim)
    import torch_npu

    assert torch_npu is sim


def test_signatures_match_torch_npu_2_14():
    sim = make_simulator()
    expected = {
        "npu_quantize": ["input", "scales", "zero_points", "dtype", "axis", "div_mode"],
        "npu_dynamic_quant": ["input", "smooth_scales", "group_index", "dst_type", "quant_mode", "dst_type_max"],
        "npu_dynamic_block_quant": ["x", "min_scale", "round_mode", "dst_type", "row_block_size",
                                    "col_block_size", "dst_type_max"],
        "npu_dynamic_mx_quant": ["input", "axis", "round_mode", "dst_type", "block_size", "scale_alg",
                                 "dst_type_max", "max_low_bound"],
        "npu_quant_matmul": ["x1", "x2", "scale", "offset", "pertoken_scale", "bias", "output_dtype", "x1_dtype",
                             "x2_dtype", "pertoken_scale_dtype", "scale_dtype", "group_sizes", "y_scale"],
        "npu_grouped_matmul": ["x", "weight", "bias", "scale", "offset", "antiquant_scale", "antiquant_offset",
                               "per_token_scale", "group_list", "activation_input", "activation_quant_scale",
                               "activation_quant_offset", "split_item", "group_type", "group_list_type",
                               "act_type", "tuning_config", "output_dtype", "x_dtype", "weight_dtype",
                               "scale_dtype", "per_token_scale_dtype"],
        "npu_dtype_cast": ["input", "dtype", "input_dtype"],
        "npu_rms_norm": ["input", "gamma", "epsilon"],
        "npu_rms_norm_backward": ["dy", "input", "gamma", "rstd"],
        "npu_fusion_attention": ["query", "key", "value", "head_num", "input_layout", "pse", "padding_mask",
                                 "atten_mask", "scale", "keep_prob", "pre_tockens", "next_tockens", "inner_precise",
                                 "prefix", "actual_seq_qlen", "actual_seq_kvlen", "sparse_mode", "gen_mask_parallel",
                                 "sync", "softmax_layout", "sink", "dropout_mask", "seed", "offset"],
        "npu_fusion_attention_grad": ["query", "key", "value", "dy", "head_num", "input_layout", "pse",
                                      "padding_mask", "atten_mask", "softmax_max", "softmax_sum", "softmax_in",
                                      "attention_in", "scale_value", "keep_prob", "pre_tockens", "next_tockens",
                                      "inner_precise", "seed", "offset", "numels", "prefix", "actual_seq_qlen",
                                      "actual_seq_kvlen", "sparse_mode", "gen_mask_parallel", "sync",
                                      "softmax_layout", "sink"],
        "npu_moe_token_permute": ["tokens", "indices", "num_out_tokens", "padded_mode"],
        "npu_moe_token_permute_grad_v2": ["grad_permuted_tokens", "sorted_indices", "tokens_size_0", "tokens_dtype",
                                          "num_topK", "padded_mode"],
        "npu_moe_token_unpermute": ["permuted_tokens", "sorted_indices", "probs", "padded_mode", "restore_shape"],
        "npu_moe_token_unpermute_grad_v2": ["grad_unpermuted_tokens", "sorted_indices", "permuted_tokens_size_0",
                                            "permuted_tokens_dtype", "probs", "padded_mode", "restore_shape",
                                            "permuted_tokens"],
        "npu_rotary_mul": ["input", "r1", "r2", "rotary_mode", "rotate"],
        "npu_rotary_mul_backward": ["grad", "input", "r1", "r2", "rotary_mode"],
    }
    for name, params in expected.items():
        assert list(inspect.signature(getattr(sim, name)).parameters) == params, name
    sig = inspect.signature(sim.npu_dynamic_mx_quant).parameters
    assert sig["dst_type"].default == 296 and sig["axis"].kind is inspect.Parameter.KEYWORD_ONLY
    x = torch.randn(2, 8)
    with pytest.raises(TypeError):  # the real schema calls it `self`: pass the first tensor positionally
        sim.npu_rms_norm(input=x, gamma=torch.ones(8))
    with pytest.raises(TypeError):  # npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, ...) likewise
        sim.npu_rotary_mul(input=x, r1=x, r2=x)
    with pytest.raises(TypeError):  # keyword-only options
        sim.npu_quant_matmul(x, x, x, None)


# npu_quantize -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["E4M3", "E5M2", "HIF8"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_quantize_divides_by_scales(sim, fmt, per_channel):
    gen = np.random.default_rng(1)
    x = torch.from_numpy(gen.standard_normal((6, 40)).astype(np.float32) * 30)
    s = torch.from_numpy(gen.uniform(0.01, 0.5, 40 if per_channel else 1).astype(np.float32))
    y = sim.npu_quantize(x, s, None, npu_dtype(sim, fmt), axis=-1)
    expected = np_cast(f32(x) / f32(s), fmt)  # float32 division, saturating cast
    np.testing.assert_array_equal(raw(y), expected)
    assert y.dtype == (torch.bits8 if fmt == "HIF8" else TORCH_FP8[fmt])


def test_quantize_bf16_input_axis0(sim):
    x = torch.randn(8, 5, dtype=torch.bfloat16) * 100
    s = torch.rand(8, dtype=torch.bfloat16) + 0.1
    y = sim.npu_quantize(x, s, None, torch.float8_e4m3fn, axis=0)
    np.testing.assert_array_equal(raw(y), np_cast(f32(x) / f32(s)[:, None], "E4M3"))


def test_quantize_contract(sim):
    x = torch.randn(4, 8)
    s = torch.ones(1)
    q = sim.npu_quantize
    assert_raises(lambda: q(x, s, None, torch.float16), NpuTypeError, "dtype")
    assert_raises(lambda: q(x, s, None, None), NpuTypeError, "dtype")
    assert_raises(lambda: q(x, s, None, 999), NpuTypeError, "dtype")
    assert_raises(lambda: q(x.bfloat16(), s, None, torch.float8_e4m3fn), NpuTypeError, "scales")
    assert_raises(lambda: q(x, torch.ones(3), None, torch.float8_e4m3fn, axis=-1), NpuValueError, "scales")
    assert_raises(lambda: q(x, torch.ones(1, 8), None, torch.float8_e4m3fn, axis=-1), NpuValueError, "scales")
    assert_raises(lambda: q(x, s, None, sim.hifloat8, axis=2), NpuValueError, "axis")
    assert_raises(lambda: q(x, s, None, torch.float8_e5m2, div_mode=False), NpuValueError, "div_mode")
    assert_raises(lambda: q(x.int(), s, None, torch.float8_e5m2), NpuTypeError, "input")
    assert_raises(lambda: make_simulator("Ascend910B3").npu_quantize(x, s, None, sim.hifloat8), NpuSocError,
                  "Ascend910B3")
    with pytest.raises(NpuSimNotImplemented):
        q(x, s, None, torch.qint8)
    with pytest.raises(NpuSimNotImplemented):
        q(x, s, torch.zeros(1), torch.float8_e4m3fn)


# npu_dynamic_quant ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,mode,target", [
    ("E4M3", "pertoken", 0.0), ("E5M2", "perchannel", 0.0), ("HIF8", "pertensor", 15.0),
    ("HIF8", "pertoken", 224.0), ("HIF8", "pertensor", 0.0), ("E4M3", "pertensor", 0.0),
])
def test_dynamic_quant(sim, fmt, mode, target):
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16) * 7
    x[0, 1] = 0  # an all-zero row
    y, scale = sim.npu_dynamic_quant(x, dst_type=npu_dtype(sim, fmt), quant_mode=mode, dst_type_max=target)
    xf = f32(x)
    axis = {"pertoken": -1, "perchannel": -2, "pertensor": None}[mode]
    amax = np.abs(xf).max(axis=axis, keepdims=True) if axis is not None else np.abs(xf).max().reshape(1, 1, 1)
    expected_scale = np.where(amax == 0, 1, amax / np.float32(target or FMT_MAX[fmt])).astype(np.float32)
    q = (xf / expected_scale).astype(np.float32)
    np.testing.assert_array_equal(raw(y), np_cast(q, fmt))
    shape = {"pertoken": (3, 5), "perchannel": (3, 64), "pertensor": (1,)}[mode]
    assert scale.dtype == torch.float32 and tuple(scale.shape) == shape
    np.testing.assert_array_equal(scale.numpy(), expected_scale.reshape(shape))
    if mode == "pertoken":
        assert scale[0, 1] == 1 and not raw(y)[0, 1].any()


def test_dynamic_quant_smooth_scales(sim):
    x = torch.randn(6, 16, dtype=torch.float16)
    smooth = torch.rand(2, 16, dtype=torch.float16) + 0.5
    group_index = torch.tensor([2, 6], dtype=torch.int32)
    y, scale = sim.npu_dynamic_quant(x, smooth_scales=smooth, group_index=group_index,
                                     dst_type=torch.float8_e4m3fn)
    xs = f32(x) * np.repeat(f32(smooth), [2, 4], axis=0)
    expected_scale = (np.abs(xs).max(-1, keepdims=True) / np.float32(448)).astype(np.float32)
    np.testing.assert_array_equal(scale.numpy(), expected_scale[:, 0])
    np.testing.assert_array_equal(raw(y), np_cast(xs / expected_scale, "E4M3"))


def test_dynamic_quant_contract(sim):
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    dq = sim.npu_dynamic_quant
    assert_raises(lambda: dq(x.float(), dst_type=sim.hifloat8), NpuTypeError, "input")
    assert_raises(lambda: dq(x[0], dst_type=sim.hifloat8), NpuValueError, "input")
    assert_raises(lambda: dq(x, dst_type=torch.float16), NpuTypeError, "dst_type")
    assert_raises(lambda: dq(x, dst_type=sim.hifloat8, quant_mode="perblock"), NpuValueError, "quant_mode")
    assert_raises(lambda: dq(x, dst_type=sim.hifloat8, dst_type_max=40000.0), NpuValueError, "dst_type_max")
    assert_raises(lambda: dq(x, dst_type=torch.float8_e4m3fn, dst_type_max=15.0), NpuValueError, "dst_type_max")
    assert_raises(lambda: dq(x, dst_type=sim.hifloat8, dst_type_max=float("nan")), NpuTypeError, "dst_type_max")
    assert_raises(lambda: dq(x, dst_type=sim.hifloat8, smooth_scales=torch.ones(8)), NpuTypeError, "smooth_scales")
    assert_raises(lambda: dq(x, dst_type=sim.hifloat8, smooth_scales=torch.ones(7, dtype=torch.bfloat16)),
                  NpuValueError, "smooth_scales")
    assert_raises(lambda: dq(x, dst_type=sim.hifloat8, group_index=torch.tensor([4], dtype=torch.int32)),
                  NpuValueError, "group_index")
    with pytest.raises(NpuSimNotImplemented):
        dq(x)  # int8 (the default) is valid but not simulated


# npu_dynamic_block_quant ------------------------------------------------------------------------------------
def block_reference(x, rows, cols, fmt, target, min_scale=0.0):
    """Tile-by-tile loop: scale = amax / target (1 for an all-zero tile), capped at 1 / min_scale when min_scale > 0
    (aclnnDynamicBlockQuantV2: "scaleOut = min(input_max / DST_TYPE_MAX, 1/minScale)"), codes of x / scale."""
    *batch, m, n = x.shape
    flat = x.reshape(-1, m, n)
    codes = np.zeros(flat.shape, np.uint8)
    scales = np.zeros((flat.shape[0], -(-m // rows), -(-n // cols)), np.float32)
    for b in range(flat.shape[0]):
        for i in range(scales.shape[1]):
            for j in range(scales.shape[2]):
                tile = flat[b, i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
                amax = np.float32(np.abs(tile).max())
                scale = np.float32(1.0) if amax == 0 else np.float32(amax / np.float32(target))
                if min_scale > 0:
                    scale = min(scale, np.float32(1.0 / min_scale))
                codes[b, i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = np_cast(
                    (tile / scale).astype(np.float32), fmt)
                scales[b, i, j] = scale
    return codes.reshape(x.shape), scales.reshape(*batch, *scales.shape[1:])


@pytest.mark.parametrize("fmt,shape,rows,cols,target,min_scale", [
    ("E4M3", (130, 200), 1, 128, 0.0, 0.0),
    ("E5M2", (2, 40, 70), 1, 64, 0.0, 0.0),
    ("HIF8", (130, 300), 128, 128, 15.0, 0.0),
    ("HIF8", (3, 64), 256, 192, 224.0, 0.0),
    ("E4M3", (4, 256), 1, 256, 0.0, 0.05),
    ("E4M3", (4, 256), 1, 256, 0.0, 100.0),  # the 1/min_scale cap binds: values beyond 4.48 saturate
])
def test_dynamic_block_quant(sim, fmt, shape, rows, cols, target, min_scale):
    x = torch.randn(shape, dtype=torch.bfloat16) * 3
    x[..., 0, :cols] = 0  # an all-zero tile in the (1 x cols) cases
    round_mode = "round" if fmt == "HIF8" else "rint"
    y, scale = sim.npu_dynamic_block_quant(x, min_scale=min_scale, round_mode=round_mode,
                                           dst_type=npu_dtype(sim, fmt), row_block_size=rows,
                                           col_block_size=cols, dst_type_max=target)
    codes, scales = block_reference(f32(x), rows, cols, fmt, target or FMT_MAX[fmt], min_scale)
    np.testing.assert_array_equal(raw(y), codes)
    np.testing.assert_array_equal(scale.numpy(), scales)
    assert y.dtype == (torch.uint8 if fmt == "HIF8" else TORCH_FP8[fmt])


def test_dynamic_block_quant_contract(sim):
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    bq = sim.npu_dynamic_block_quant
    e4m3, hif8 = torch.float8_e4m3fn, sim.hifloat8
    assert_raises(lambda: bq(x, dst_type=hif8), NpuValueError, "round_mode")
    assert_raises(lambda: bq(x, dst_type=hif8, round_mode="hybrid"), NpuValueError, "round_mode")
    assert_raises(lambda: bq(x, dst_type=e4m3, round_mode="round"), NpuValueError, "round_mode")
    assert_raises(lambda: bq(x, dst_type=e4m3, row_block_size=64), NpuValueError, "row_block_size")
    assert_raises(lambda: bq(x, dst_type=e4m3, col_block_size=32), NpuValueError, "col_block_size")
    assert_raises(lambda: bq(x, dst_type=e4m3, col_block_size=128.0), NpuTypeError, "col_block_size")
    assert_raises(lambda: bq(x, dst_type=hif8, round_mode="round", dst_type_max=448.0), NpuValueError,
                  "dst_type_max")
    assert_raises(lambda: bq(x, dst_type=e4m3, dst_type_max=15.0), NpuValueError, "dst_type_max")
    assert_raises(lambda: bq(x, dst_type=e4m3, min_scale=-1.0), NpuValueError, "min_scale")
    assert_raises(lambda: bq(x[None, None], dst_type=e4m3), NpuValueError, "x")
    assert_raises(lambda: bq(x.double(), dst_type=e4m3), NpuTypeError, "x")
    assert_raises(lambda: bq(x), NpuTypeError, "dst_type")  # int8, the A2/A3 default, is not a 950 output


def test_dynamic_block_quant_takes_float32(sim):
    """aclnnDynamicBlockQuantV2 (Ascend 950): x "FLOAT16、BFLOAT16、FLOAT32"."""
    x = torch.randn(3, 130) * 7
    y, scale = sim.npu_dynamic_block_quant(x, dst_type=torch.float8_e5m2)
    codes, scales = block_reference(f32(x), 1, 128, "E5M2", FMT_MAX["E5M2"])
    np.testing.assert_array_equal(raw(y), codes)
    np.testing.assert_array_equal(scale.numpy(), scales)


# npu_dynamic_mx_quant ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,alg,n", [("E4M3", 0, 96), ("E5M2", 0, 64), ("E4M3", 1, 160), ("E5M2", 1, 40)])
def test_dynamic_mx_quant_rowwise(sim, fmt, alg, n):
    x = torch.randn(5, n, dtype=torch.bfloat16) * 50
    x[1, :32] = 0
    x[2, :32] = 1e-38  # tiny block amax: the scale exponent clamps at 2^-127
    y, scale = sim.npu_dynamic_mx_quant(x, dst_type=npu_dtype(sim, fmt), scale_alg=alg)
    codes, scales = mx_reference(f32(x), fmt, alg)
    np.testing.assert_array_equal(raw(y), codes)
    assert scale.dtype == torch.uint8 and tuple(scale.shape) == (5, -(-n // 64), 2)
    np.testing.assert_array_equal(scale.numpy(), pair_blocks(scales))


def test_dynamic_mx_quant_columnwise_interleaves_block_pairs(sim):
    x = torch.randn(96, 7, dtype=torch.float16) * 3
    y, scale = sim.npu_dynamic_mx_quant(x, axis=0, dst_type=sim.float8_e4m3fn, scale_alg=1)
    codes, scales = mx_reference(f32(x).T.copy(), "E4M3", 1)  # column j of x is row j here
    np.testing.assert_array_equal(raw(y), codes.T)
    assert tuple(scale.shape) == (2, 7, 2)
    np.testing.assert_array_equal(scale.numpy(), pair_blocks(scales).transpose(1, 0, 2))


def test_dynamic_mx_quant_max_low_bound_and_fp32(sim):
    x = torch.randn(2, 64) * 1e-3
    _, scale = sim.npu_dynamic_mx_quant(x, dst_type=sim.float8_e4m3fn, scale_alg=1, max_low_bound=448.0)
    assert (scale == 127).all()  # amax raised to 448 -> scale 1
    y, scale = sim.npu_dynamic_mx_quant(x, dst_type=torch.float8_e5m2)
    codes, scales = mx_reference(f32(x), "E5M2", 0)
    np.testing.assert_array_equal(raw(y), codes)


def test_dynamic_mx_quant_contract(sim):
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    mq = sim.npu_dynamic_mx_quant
    e4m3 = sim.float8_e4m3fn
    assert_raises(lambda: mq(x, dst_type=e4m3, round_mode="round"), NpuValueError, "round_mode")
    assert_raises(lambda: mq(x, dst_type=e4m3, block_size=48), NpuValueError, "block_size")
    assert_raises(lambda: mq(x, dst_type=e4m3, block_size=2048), NpuValueError, "block_size")
    assert_raises(lambda: mq(x, dst_type=e4m3, scale_alg=2), NpuValueError, "scale_alg")
    assert_raises(lambda: mq(x, dst_type=e4m3, dst_type_max=6.0), NpuValueError, "dst_type_max")
    assert_raises(lambda: mq(x, dst_type=e4m3, max_low_bound=1.0), NpuValueError, "max_low_bound")
    assert_raises(lambda: mq(x, dst_type=e4m3, scale_alg=1, max_low_bound=-1.0), NpuValueError, "max_low_bound")
    assert_raises(lambda: mq(x, dst_type=sim.hifloat8), NpuTypeError, "dst_type")
    assert_raises(lambda: mq(x, dst_type=e4m3, axis=2), NpuValueError, "axis")
    assert_raises(lambda: mq(x.float(), dst_type=e4m3, block_size=64), NpuValueError, "block_size")
    assert_raises(lambda: mq(x.int(), dst_type=e4m3), NpuTypeError, "input")
    assert_raises(lambda: make_simulator("Ascend910_9392").npu_dynamic_mx_quant(x, dst_type=e4m3), NpuSocError)
    with pytest.raises(NpuSimNotImplemented):
        mq(x, scale_alg=2)  # FP4 (the default dst_type) with scale_alg 2 is valid but not simulated


# npu_quant_matmul -------------------------------------------------------------------------------------------
def close(actual, expected, rtol=2e-6):
    np.testing.assert_allclose(actual.double().numpy(), expected, rtol=rtol, atol=rtol * np.abs(expected).max())


@pytest.mark.parametrize("f1,f2", [("E4M3", "E4M3"), ("E5M2", "E4M3"), ("E4M3", "E5M2"), ("HIF8", "HIF8")])
def test_quant_matmul_per_tensor_and_channel(sim, f1, f2):
    m, k, n = 7, 48, 24
    x1, v1 = random_codes((m, k), f1, 1)
    w, vw = random_codes((n, k), f2, 2)  # weight stored (n, k); x2 is its transposed view
    scale = torch.rand(n) + 0.5
    pertoken = torch.rand(m) + 0.5
    bias = torch.randn(n)
    kw = dict(x1_dtype=sim.hifloat8, x2_dtype=sim.hifloat8) if f1 == "HIF8" else {}
    out = sim.npu_quant_matmul(x1, w.t(), scale, pertoken_scale=pertoken, bias=bias, output_dtype=torch.float32,
                               **kw)
    expected = (v1 @ vw.T) * f32(scale) * f32(pertoken)[:, None] + f32(bias)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    close(out, expected)
    out = sim.npu_quant_matmul(x1, w.t().contiguous(), scale[:1], output_dtype=torch.bfloat16, **kw)
    expected = torch.from_numpy((v1 @ vw.T) * float(scale[0])).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)


def test_quant_matmul_batch_broadcast(sim):
    x1, v1 = random_codes((2, 3, 5, 32), "E4M3", 3)
    x2, v2 = random_codes((32, 8), "E4M3", 4)
    out = sim.npu_quant_matmul(x1, x2, torch.tensor([0.5]), output_dtype=torch.float16)
    assert out.shape == (2, 3, 5, 8) and out.dtype == torch.float16
    torch.testing.assert_close(out.float(), torch.from_numpy(0.5 * (v1 @ v2)).float(), rtol=2e-3, atol=1e-2)


@pytest.mark.parametrize("groups", [[1, 128, 128], [128, 128, 128]])
def test_quant_matmul_blockwise(sim, groups):
    m, k, n = 130, 320, 200
    gm = groups[0]
    x1, v1 = random_codes((m, k), "E4M3", 5)
    w, vw = random_codes((n, k), "E4M3", 6)
    gen = np.random.default_rng(7)
    s1 = gen.uniform(0.5, 2, (-(-m // gm), 3)).astype(np.float32)
    s2 = gen.uniform(0.5, 2, (2, 3)).astype(np.float32)  # stored (ceil(n/128), ceil(k/128)) like the weight
    out = sim.npu_quant_matmul(x1, w.t(), torch.from_numpy(s2).t(), pertoken_scale=torch.from_numpy(s1),
                               output_dtype=torch.float32, group_sizes=groups)
    a = v1 * np.repeat(np.repeat(s1, gm, 0)[:m], 128, 1)[:, :k]
    b = vw * np.repeat(np.repeat(s2, 128, 0)[:n], 128, 1)[:, :k]
    close(out, a @ b.T, rtol=5e-6)


def test_quant_matmul_mx(sim):
    m, k, n = 6, 160, 10
    x = torch.randn(m, k, dtype=torch.bfloat16) * 10
    w = torch.randn(n, k, dtype=torch.bfloat16)
    q1, s1 = sim.npu_dynamic_mx_quant(x, dst_type=sim.float8_e4m3fn)
    q2, s2 = sim.npu_dynamic_mx_quant(w.t().contiguous(), axis=0, dst_type=sim.float8_e5m2, scale_alg=1)
    out = sim.npu_quant_matmul(q1, q2, s2, pertoken_scale=s1, output_dtype=torch.float32,
                               scale_dtype=sim.float8_e8m0fnu, pertoken_scale_dtype=sim.float8_e8m0fnu,
                               group_sizes=[1, 1, 32])
    pow1 = 2.0 ** (s1.numpy().reshape(m, -1)[:, :5].astype(np.float64) - 127)  # 5 blocks of 32 along k
    pow2 = 2.0 ** (s2.numpy().transpose(0, 2, 1).reshape(-1, n)[:5].astype(np.float64) - 127)
    a = np_decode(raw(q1), "E4M3") * np.repeat(pow1, 32, 1)
    b = np_decode(raw(q2), "E5M2") * np.repeat(pow2, 32, 0)
    close(out, a @ b, rtol=5e-6)
    # the weight-side operands as transposed views: (n, k) data and (n, ceil(k/64), 2) scales, both .t(); the
    # same values (the CPU GEMM may sum the other layout in another order: float32 rounding apart)
    q2t, s2t = sim.npu_dynamic_mx_quant(w, dst_type=sim.float8_e5m2, scale_alg=1)
    out_t = sim.npu_quant_matmul(q1, q2t.t(), s2t.transpose(0, 1), pertoken_scale=s1, output_dtype=torch.float32,
                                 scale_dtype=sim.float8_e8m0fnu, pertoken_scale_dtype=sim.float8_e8m0fnu,
                                 group_sizes=[1, 1, 32])
    close(out_t, a @ b, rtol=5e-6)


def test_quant_matmul_contract(sim):
    m, k, n = 4, 64, 8
    x1, _ = random_codes((m, k), "E4M3", 1)
    x2, _ = random_codes((k, n), "E4M3", 2)
    h1, _ = random_codes((m, k), "HIF8", 3)
    h2, _ = random_codes((k, n), "HIF8", 4)
    s = torch.ones(1)
    qmm = sim.npu_quant_matmul
    out = torch.float32
    hif = dict(x1_dtype=sim.hifloat8, x2_dtype=sim.hifloat8)
    e8 = dict(scale_dtype=sim.float8_e8m0fnu, pertoken_scale_dtype=sim.float8_e8m0fnu, group_sizes=[1, 1, 32])
    assert_raises(lambda: qmm(h1, h2, s, output_dtype=out), NpuTypeError, "x1_dtype")
    assert_raises(lambda: qmm(h1, h2, s, output_dtype=out, x1_dtype=sim.hifloat8), NpuTypeError, "x2_dtype")
    assert_raises(lambda: qmm(x1, x2, s, output_dtype=out, x1_dtype=torch.float8_e4m3fn), NpuTypeError, "x1_dtype")
    assert_raises(lambda: qmm(x1, x2, s, output_dtype=out, x1_dtype=sim.float8_e4m3fn), NpuTypeError, "x1_dtype")
    assert_raises(lambda: qmm(x1, h2, s, output_dtype=out, x2_dtype=sim.hifloat8), NpuTypeError, "x1")
    assert_raises(lambda: qmm(x1, x2, s, output_dtype=out, **hif), NpuTypeError, "x1")
    assert_raises(lambda: qmm(x1.float(), x2, s, output_dtype=out), NpuTypeError, "x1")
    assert_raises(lambda: qmm(x1, x2, s), NpuTypeError, "output_dtype")
    assert_raises(lambda: qmm(x1, x2, s, output_dtype=torch.int8), NpuTypeError, "output_dtype")
    assert_raises(lambda: qmm(x1, x2, torch.ones(n + 1), output_dtype=out), NpuValueError, "scale")
    assert_raises(lambda: qmm(x1, x2, torch.ones(1, n), output_dtype=out), NpuValueError, "scale")
    assert_raises(lambda: qmm(x1, x2, s.double(), output_dtype=out), NpuTypeError, "scale")
    assert_raises(lambda: qmm(x1, x2, s.bfloat16(), output_dtype=out), NpuTypeError, "scale")
    assert_raises(lambda: qmm(x1, x2, s, pertoken_scale=torch.ones(m + 1), output_dtype=out), NpuValueError,
                  "pertoken_scale")
    assert_raises(lambda: qmm(x1, x2, s, offset=torch.zeros(1), output_dtype=out), NpuValueError, "offset")
    assert_raises(lambda: qmm(x1, x2[:32], s, output_dtype=out), NpuValueError, "k")
    assert_raises(lambda: qmm(x1, x2[:, ::2], s, output_dtype=out), NpuValueError, "x2")
    assert_raises(lambda: qmm(x1[0], x2, s, output_dtype=out), NpuValueError, "x1")
    assert_raises(lambda: qmm(x1, x2, s, bias=torch.zeros(2, n), output_dtype=out), NpuValueError, "bias")
    assert_raises(lambda: qmm(x1, x2, s, bias=torch.zeros(n + 1), output_dtype=out), NpuValueError, "bias")
    assert_raises(lambda: qmm(x1, x2, s, bias=torch.zeros(n, dtype=torch.bfloat16), output_dtype=out),
                  NpuTypeError, "bias")
    assert_raises(lambda: qmm(x1, x2, s, bias=torch.zeros(n, dtype=torch.int32), output_dtype=out),
                  NpuTypeError, "bias")
    # group_sizes and the scale shapes they imply
    bs1, bs2 = torch.ones(m, 1), torch.ones(1, 1)
    assert_raises(lambda: qmm(x1, x2, bs2, pertoken_scale=bs1, output_dtype=out, group_sizes=[1, 64, 64]),
                  NpuValueError, "group_sizes")
    assert_raises(lambda: qmm(x1, x2, bs2, pertoken_scale=bs1, output_dtype=out, group_sizes=[128, 128]),
                  NpuValueError, "group_sizes")
    assert_raises(lambda: qmm(x1, x2, bs2, output_dtype=out, group_sizes=[1, 128, 128]), NpuValueError,
                  "pertoken_scale")
    assert_raises(lambda: qmm(x1, x2, bs2, pertoken_scale=torch.ones(m, 2), output_dtype=out,
                              group_sizes=[1, 128, 128]), NpuValueError, "pertoken_scale")
    assert_raises(lambda: qmm(x1, x2, torch.ones(2, 1), pertoken_scale=bs1, output_dtype=out,
                              group_sizes=[1, 128, 128]), NpuValueError, "scale")
    w_t = x2.t().contiguous().t()  # x2 as the transposed view of a contiguous (n, k)
    k_big = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    assert_raises(lambda: qmm(k_big[:m], k_big.t(), torch.ones(2, 2), pertoken_scale=torch.ones(m, 2),
                              output_dtype=out, group_sizes=[1, 128, 128]), NpuValueError, "transposed")
    qmm(x1, w_t, bs2, pertoken_scale=bs1, output_dtype=out, group_sizes=[1, 128, 128])  # 1x1 scale: either layout
    # MX
    ms1, ms2 = torch.full((m, 1, 2), 127, dtype=torch.uint8), torch.full((1, n, 2), 127, dtype=torch.uint8)
    qmm(x1, x2, ms2, pertoken_scale=ms1, output_dtype=out, **e8)
    assert_raises(lambda: qmm(x1, x2, ms2, pertoken_scale=ms1, output_dtype=out, group_sizes=[1, 1, 32]),
                  NpuTypeError, "scale_dtype")
    assert_raises(lambda: qmm(x1, x2, ms2, pertoken_scale=ms1, output_dtype=out, scale_dtype=torch.float8_e8m0fnu,
                              pertoken_scale_dtype=sim.float8_e8m0fnu, group_sizes=[1, 1, 32]),
                  NpuTypeError, "scale_dtype")
    assert_raises(lambda: qmm(x1, x2, ms2, pertoken_scale=torch.full((m, 2), 127, dtype=torch.uint8),
                              output_dtype=out, **e8), NpuValueError, "pertoken_scale")
    assert_raises(lambda: qmm(x1, x2, ms2.float(), pertoken_scale=ms1, output_dtype=out, **e8), NpuTypeError,
                  "scale")
    assert_raises(lambda: qmm(h1, h2, ms2, pertoken_scale=ms1, output_dtype=out, **e8, **hif), NpuTypeError, "MX")
    assert_raises(lambda: qmm(x1, x2, s, output_dtype=out, scale_dtype=sim.float8_e8m0fnu), NpuValueError,
                  "group_sizes")
    assert_raises(lambda: make_simulator("Ascend910B1").npu_quant_matmul(x1, x2, s, output_dtype=out),
                  NpuSocError, "Ascend910B1")
    with pytest.raises(NpuSimNotImplemented):
        qmm(x1.view(torch.int8), x2.view(torch.int8), s, output_dtype=out)


# npu_grouped_matmul -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["E4M3", "HIF8"])
@pytest.mark.parametrize("list_type", [0, 1])
def test_grouped_matmul_fp8_split_m(sim, fmt, list_type):
    m, k, n, sizes = 20, 32, 12, [5, 0, 9]  # 6 trailing rows belong to no group
    x, vx = random_codes((m, k), fmt, 11)
    w, vw = random_codes((3, n, k), fmt, 12)
    gen = np.random.default_rng(13)
    scale = torch.from_numpy(gen.uniform(0.5, 2, (3, n)).astype(np.float32))
    pts = torch.from_numpy(gen.uniform(0.5, 2, m).astype(np.float32))
    group_list = torch.tensor(np.cumsum(sizes) if list_type == 0 else sizes, dtype=torch.int64)
    kw = dict(x_dtype=sim.hifloat8, weight_dtype=sim.hifloat8) if fmt == "HIF8" else {}
    (out,) = sim.npu_grouped_matmul([x], [w.transpose(1, 2)], scale=[scale], per_token_scale=[pts],
                                    group_list=group_list, split_item=3, group_type=0, group_list_type=list_type,
                                    output_dtype=torch.float32, **kw)
    expected = np.zeros((m, n))
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        expected[rows] = (vx[rows] @ vw[g].T) * f32(scale)[g] * f32(pts)[rows, None]
        start += size
    close(out, expected)


def test_grouped_matmul_fp8_split_k(sim):
    m, k, n, sizes = 6, 160, 5, [64, 96]
    xt, vxt = random_codes((k, m), "E5M2", 14)  # x is the transposed view of a contiguous (k, m)
    w, vw = random_codes((k, n), "E4M3", 15)
    scale, pts = torch.tensor([0.5, 2.0]), torch.tensor([4.0, 4.0])
    kwargs = dict(scale=[scale], per_token_scale=[pts], split_item=2, group_type=2, group_list_type=1,
                  output_dtype=torch.bfloat16)
    (out,) = sim.npu_grouped_matmul([xt.t()], [w], group_list=torch.tensor(sizes), **kwargs)
    assert out.shape == (2, m, n) and out.dtype == torch.bfloat16
    expected = np.stack([vxt[:64].T @ vw[:64] * 0.5 * 4, vxt[64:].T @ vw[64:] * 2.0 * 4])
    torch.testing.assert_close(out, torch.from_numpy(expected).to(torch.bfloat16), rtol=0, atol=0)
    # Below k = 128 the kernel picks the scales' modes by M, N and k ("K小于128 ... x则选择pergroup量化"): refused.
    with pytest.raises(NpuSimNotImplemented, match="k = 127"):
        sim.npu_grouped_matmul([xt[:127].t()], [w[:127]], group_list=torch.tensor([64, 63]), **kwargs)


@pytest.mark.parametrize("fmt", ["E4M3", "HIF8"])
@pytest.mark.parametrize("transposed", [True, False])
def test_grouped_matmul_mx_and_gb_split_m(sim, fmt, transposed):
    """The 950's MX and G-B grouped modes (aclnnGroupedMatmulV4, 动态量化（mx量化）/（G-B量化）场景): rows of group i
    times weight i, each element dequantized by its 32-block's E8M0 scale (MX: per_token_scale (M, ceil(K/64), 2),
    scale (g, ceil(K/64), N, 2)) or its tile's float32 scale (G-B: (M, ceil(K/128)) and (g, ceil(K/128),
    ceil(N/128))), against NumPy; the weight and its scales transposed views, or contiguous, together."""
    m, k, n, sizes = 20, 160, 136, [5, 0, 9]  # 6 trailing rows belong to no group; partial 32-blocks and tiles
    x, vx = random_codes((m, k), fmt, 41)
    w, vw = random_codes((3, n, k), fmt, 42)  # (g, n, k): the (g, k, n) weight is its transposed view
    gen = np.random.default_rng(43)
    group_list = torch.tensor(np.cumsum(sizes), dtype=torch.int64)
    weight = w.transpose(1, 2) if transposed else w.transpose(1, 2).contiguous()
    kw = dict(group_list=group_list, split_item=3, group_type=0, output_dtype=torch.float32)
    cases = [("G-B", 128)] + ([("MX", 32)] if fmt == "E4M3" else [])
    for mode, block in cases:
        kb, nb = -(-k // block), -(-n // 128)
        if mode == "MX":
            x_bytes = gen.integers(120, 135, (m, 2 * -(-k // 64))).astype(np.uint8)
            w_bytes = gen.integers(120, 135, (3, n, 2 * -(-k // 64))).astype(np.uint8)
            pts = torch.from_numpy(x_bytes).reshape(m, -1, 2)
            sc = torch.from_numpy(w_bytes).reshape(3, n, -1, 2).transpose(1, 2)  # (g, ceil(k/64), n, 2)
            sx = np.repeat(2.0 ** (x_bytes[:, :kb].astype(np.float64) - 127), 32, 1)[:, :k]
            sw = np.repeat(2.0 ** (w_bytes[:, :, :kb].astype(np.float64) - 127), 32, 2)[:, :, :k]
            extra = dict(scale_dtype=sim.float8_e8m0fnu, per_token_scale_dtype=sim.float8_e8m0fnu)
        else:
            x_tiles = gen.uniform(0.5, 2, (m, kb)).astype(np.float32)
            w_tiles = gen.uniform(0.5, 2, (3, nb, kb)).astype(np.float32)
            pts = torch.from_numpy(x_tiles)
            sc = torch.from_numpy(w_tiles).transpose(1, 2)  # (g, ceil(k/128), ceil(n/128))
            sx = np.repeat(x_tiles.astype(np.float64), 128, 1)[:, :k]
            sw = np.repeat(np.repeat(w_tiles.astype(np.float64), 128, 1)[:, :n], 128, 2)[:, :, :k]
            extra = dict(x_dtype=sim.hifloat8, weight_dtype=sim.hifloat8) if fmt == "HIF8" else {}
        if not transposed:
            sc = sc.contiguous()
        (out,) = sim.npu_grouped_matmul([x], [weight], scale=[sc], per_token_scale=[pts], **kw, **extra)
        expected = np.zeros((m, n))
        start = 0
        for g, size in enumerate(sizes):
            rows = slice(start, start + size)
            expected[rows] = (vx[rows] * sx[rows]) @ (vw[g] * sw[g]).T
            start += size
        close(out, expected)
        # the scale in the other layout than its weight: refused ("transposed view exactly when its data is")
        other = sc.contiguous() if transposed else sc.transpose(1, 2).contiguous().transpose(1, 2)
        assert_raises(lambda other=other, pts=pts, extra=extra: sim.npu_grouped_matmul(
            [x], [weight], scale=[other], per_token_scale=[pts], **kw, **extra), NpuValueError, "scale")


def test_grouped_matmul_mx_and_gb_contract(sim):
    """What the MX and G-B grouped tables refuse: a bias ("以下入参为空：biasOptional" / MX FP8 rows "null"), HiF8
    MX operands (no such row), one E8M0 scale dtype without the other, no per_token_scale, other scale shapes;
    the K-split G-B form, which the library never asks for, is not simulated (the K-split MX form:
    test_grouped_matmul_mx_split_k)."""
    m, k, n = 8, 64, 128
    x, _ = random_codes((m, k), "E4M3", 51)
    w, _ = random_codes((2, k, n), "E4M3", 52)
    e8 = dict(scale_dtype=sim.float8_e8m0fnu, per_token_scale_dtype=sim.float8_e8m0fnu)
    mx = dict(scale=[torch.full((2, 1, n, 2), 127, dtype=torch.uint8)],
              per_token_scale=[torch.full((m, 1, 2), 127, dtype=torch.uint8)], group_list=torch.tensor([3, 8]),
              split_item=3, group_type=0, output_dtype=torch.bfloat16)
    gb = dict(mx, scale=[torch.ones(2, 1, 1)], per_token_scale=[torch.ones(m, 1)])
    gmm = sim.npu_grouped_matmul
    gmm([x], [w], **mx, **e8)
    gmm([x], [w], **gb)
    assert_raises(lambda: gmm([x], [w], **mx, **e8, bias=[torch.zeros(2, n)]), NpuValueError, "bias")
    assert_raises(lambda: gmm([x], [w], **gb, bias=[torch.zeros(2, n)]), NpuValueError, "bias")
    assert_raises(lambda: gmm([x], [w], **mx, scale_dtype=sim.float8_e8m0fnu), NpuTypeError, "per_token_scale_dtype")
    assert_raises(lambda: gmm([x], [w], **dict(mx, per_token_scale=None), **e8), NpuValueError, "per_token_scale")
    assert_raises(lambda: gmm([x], [w], **dict(mx, scale=[torch.full((2, 2, n, 2), 127, dtype=torch.uint8)]),
                              **e8), NpuValueError, "scale")
    assert_raises(lambda: gmm([x], [w], **dict(gb, per_token_scale=[torch.ones(m, 2)])), NpuValueError,
                  "per_token_scale")
    assert_raises(lambda: gmm([x], [w], **dict(gb, scale=[torch.ones(2, 1, 1).double()])), NpuTypeError, "scale")
    h, _ = random_codes((m, k), "HIF8", 53)
    hw, _ = random_codes((2, k, n), "HIF8", 54)
    assert_raises(lambda: gmm([h], [hw], **mx, **e8, x_dtype=sim.hifloat8, weight_dtype=sim.hifloat8),
                  NpuTypeError, "MX")
    xt, _ = random_codes((k * 2, m), "E4M3", 55)
    wk, _ = random_codes((k * 2, n), "E4M3", 56)
    with pytest.raises(NpuSimNotImplemented, match="K-split"):
        gmm([xt.t()], [wk], **dict(gb, scale=[torch.ones(3, 1, 1)], per_token_scale=[torch.ones(3, m)], group_type=2,
                                   group_list=torch.tensor([64, 128])))


def test_grouped_matmul_bf16(sim):
    m, k, n = 10, 16, 6
    x = torch.randn(m, k, dtype=torch.bfloat16)
    w = torch.randn(3, k, n, dtype=torch.bfloat16)
    bias = torch.randn(3, n)
    sizes = [3, 3, 4]
    (out,) = sim.npu_grouped_matmul([x], [w], bias=[bias], group_list=torch.tensor(sizes), split_item=3,
                                    group_type=0, group_list_type=1)
    parts = torch.split(x.float(), sizes)
    expected = torch.cat([p @ w[i].float() + bias[i] for i, p in enumerate(parts)]).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    outs = sim.npu_grouped_matmul([x], list(w.unbind(0)), group_list=[3, 6, 10], split_item=0)
    assert [tuple(o.shape) for o in outs] == [(3, n), (3, n), (4, n)]
    # k-split (weight gradient): x is the transposed view of the (tokens, hidden) activations
    act = torch.randn(m, k, dtype=torch.bfloat16)
    dy = torch.randn(m, n, dtype=torch.bfloat16)
    (wgrad,) = sim.npu_grouped_matmul([act.t()], [dy], group_list=torch.tensor([3, 6, 10]), split_item=3,
                                      group_type=2, group_list_type=0)
    expected = torch.stack([act[a:b].float().t() @ dy[a:b].float() for a, b in ((0, 3), (3, 6), (6, 10))])
    torch.testing.assert_close(wgrad, expected.to(torch.bfloat16), rtol=0, atol=0)
    # several independent GEMMs
    outs = sim.npu_grouped_matmul([x, x[:2]], [w[0], w[1]], group_type=-1)
    torch.testing.assert_close(outs[1], (x[:2].float() @ w[1].float()).to(torch.bfloat16), rtol=0, atol=0)


def test_grouped_matmul_contract(sim):
    m, k, n, g = 8, 32, 4, 2
    x, _ = random_codes((m, k), "E4M3", 1)
    w, _ = random_codes((g, k, n), "E4M3", 2)
    h, _ = random_codes((m, k), "HIF8", 3)
    hw, _ = random_codes((g, k, n), "HIF8", 4)
    gl = torch.tensor([3, 5])
    sc = [torch.ones(g)]
    ok = dict(scale=sc, group_list=gl, split_item=3, group_type=0, group_list_type=1, output_dtype=torch.bfloat16)
    gmm = sim.npu_grouped_matmul

    def call(xs=(x,), ws=(w,), **changes):
        return gmm(list(xs), list(ws), **{**ok, **changes})

    call()
    assert_raises(lambda: call(bias=[torch.zeros(g, n)]), NpuValueError, "bias")
    assert_raises(lambda: call(group_type=None), NpuValueError, "group_type")
    assert_raises(lambda: call(group_type=1), NpuValueError, "group_type")
    assert_raises(lambda: call(split_item=0), NpuValueError, "split_item")
    assert_raises(lambda: call(output_dtype=None), NpuTypeError, "output_dtype")
    assert_raises(lambda: call(output_dtype=torch.float8_e4m3fn), NpuTypeError, "output_dtype")
    assert_raises(lambda: call(xs=(h,), ws=(hw,)), NpuTypeError, "x_dtype")
    assert_raises(lambda: call(xs=(h,), ws=(w,), x_dtype=sim.hifloat8), NpuTypeError, "HiF8")
    assert_raises(lambda: call(xs=(h,), ws=(hw,), x_dtype=sim.hifloat8, weight_dtype=torch.float8_e4m3fn),
                  NpuTypeError, "weight_dtype")
    call(xs=(h,), ws=(hw,), x_dtype=sim.hifloat8, weight_dtype=sim.hifloat8)
    assert_raises(lambda: call(xs=(x, x)), NpuValueError, "single")
    assert_raises(lambda: call(group_list=torch.tensor([8])), NpuValueError, "group_list")
    assert_raises(lambda: call(group_list=torch.tensor([5, 3]), group_list_type=0), NpuValueError, "group_list")
    assert_raises(lambda: call(group_list=torch.tensor([5, 4])), NpuValueError, "group_list")
    assert_raises(lambda: call(group_list=torch.tensor([3, 5], dtype=torch.int32)), NpuTypeError, "group_list")
    assert_raises(lambda: call(group_list=[3, 8]), NpuTypeError, "group_list")
    assert_raises(lambda: call(group_list_type=2), NpuValueError, "group_list_type")
    assert_raises(lambda: call(scale=[torch.ones(g + 1)]), NpuValueError, "scale")
    assert_raises(lambda: call(scale=[torch.ones(g, dtype=torch.bfloat16)]), NpuTypeError, "scale")
    assert_raises(lambda: call(scale=None), NpuValueError, "scale")
    assert_raises(lambda: call(per_token_scale=[torch.ones(m + 1)]), NpuValueError, "per_token_scale")
    assert_raises(lambda: call(offset=[torch.zeros(1)]), NpuValueError, "offset")
    assert_raises(lambda: call(x_dtype=torch.float8_e4m3fn), NpuTypeError, "x_dtype")
    assert_raises(lambda: call(scale_dtype=torch.float8_e8m0fnu), NpuTypeError, "scale_dtype")
    assert_raises(lambda: call(ws=(w[:, :16],)), NpuValueError, "k")
    assert_raises(lambda: call(xs=(x.t().contiguous().t(),)), NpuValueError, "x[0]")
    # k-split layouts: transposed x, contiguous weight
    xt, _ = random_codes((160, m), "E4M3", 5)
    w2, _ = random_codes((160, n), "E4M3", 6)
    ks = dict(group_type=2, group_list=torch.tensor([64, 96]))
    call(xs=(xt.t(),), ws=(w2,), **ks)
    assert_raises(lambda: call(xs=(xt.t().contiguous(),), ws=(w2,), **ks), NpuValueError, "x[0]")
    assert_raises(lambda: call(xs=(xt.t(),), ws=(w2.t().contiguous().t(),), **ks), NpuValueError, "weight[0]")
    assert_raises(lambda: call(xs=(xt.t(),), ws=(w2,), group_type=2, group_list=torch.tensor([64, 97])),
                  NpuValueError, "group_list")
    # bf16 path
    xb, wb = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(g, k, n, dtype=torch.bfloat16)
    bf = dict(group_list=gl, split_item=3, group_type=0, group_list_type=1)
    assert_raises(lambda: gmm([xb], [wb], bias=[torch.zeros(g, n, dtype=torch.float16)], **bf), NpuTypeError,
                  "bias")
    assert_raises(lambda: gmm([xb], [wb.half()], **bf), NpuTypeError, "weight")
    assert_raises(lambda: gmm([xb], [wb], output_dtype=torch.float32, **bf), NpuTypeError, "output_dtype")
    assert_raises(lambda: gmm([xb], [wb], group_list=gl, split_item=3, group_list_type=1), NpuValueError,
                  "group_type")
    assert_raises(lambda: gmm([xb], [wb], split_item=4, group_list=gl, group_type=0), NpuValueError, "split_item")
    # aclnnGroupedMatmulV4, Ascend 950: "actType只支持传入0"; other chips may fuse one (not simulated)
    assert_raises(lambda: gmm([xb], [wb], act_type=1, **bf), NpuValueError, "act_type")
    with pytest.raises(NpuSimNotImplemented):
        make_simulator("Ascend910B3").npu_grouped_matmul([xb], [wb], act_type=1, **bf)


# npu_dtype_cast / npu_rms_norm ------------------------------------------------------------------------------
def test_dtype_cast(sim):
    x = torch.randn(64) * 1000
    x[:4] = torch.tensor([1e5, -5e4, 0.0, float("nan")])
    h = sim.npu_dtype_cast(x, sim.hifloat8)
    assert h.dtype == torch.uint8
    np.testing.assert_array_equal(h.numpy(), np_cast(f32(x), "HIF8", saturate=False))  # overflow -> Inf
    back = sim.npu_dtype_cast(h, torch.float32, input_dtype=sim.hifloat8)
    np.testing.assert_array_equal(back.numpy(), np_decode(h.numpy(), "HIF8"))
    e = sim.npu_dtype_cast(x.bfloat16(), torch.float8_e4m3fn)
    assert torch.equal(e.view(torch.uint8), x.bfloat16().to(torch.float8_e4m3fn).view(torch.uint8))
    assert sim.npu_dtype_cast(e, sim.float8_e5m2).dtype == torch.float8_e5m2  # 291 is torch.float8_e5m2
    assert_raises(lambda: sim.npu_dtype_cast(x, torch.float32, input_dtype=sim.hifloat8), NpuTypeError, "input")
    assert_raises(lambda: sim.npu_dtype_cast(x, 999), NpuTypeError, "dtype")
    assert_raises(lambda: sim.npu_dtype_cast(x, torch.float16, input_dtype=torch.bfloat16), NpuTypeError,
                  "input_dtype")
    assert_raises(lambda: make_simulator("Ascend910B2").npu_dtype_cast(x, sim.hifloat8), NpuSocError)
    assert make_simulator("Ascend910B2").npu_dtype_cast(x, torch.bfloat16).dtype == torch.bfloat16


def test_rms_norm(sim):
    x = torch.randn(3, 4, 32, dtype=torch.bfloat16)
    gamma = torch.randn(32, dtype=torch.bfloat16)
    y, rstd = sim.npu_rms_norm(x, gamma, epsilon=1e-5)
    xf = f32(x).astype(np.float64)
    ref_rstd = 1 / np.sqrt((xf**2).mean(-1, keepdims=True) + 1e-5)
    assert rstd.shape == (3, 4, 1) and rstd.dtype == torch.float32 and y.dtype == torch.bfloat16
    np.testing.assert_allclose(rstd.numpy(), ref_rstd, rtol=1e-6)
    torch.testing.assert_close(y, torch.from_numpy(xf * ref_rstd * f32(gamma)).to(torch.bfloat16), rtol=1e-2,
                               atol=1e-2)
    y2, rstd2 = sim.npu_rms_norm(x.float(), torch.ones(4, 32))
    assert rstd2.shape == (3, 1, 1)
    assert_raises(lambda: sim.npu_rms_norm(x, gamma.half()), NpuTypeError, "gamma")
    assert_raises(lambda: sim.npu_rms_norm(x, gamma[:16]), NpuValueError, "gamma")
    assert_raises(lambda: sim.npu_rms_norm(x[0, 0], gamma), NpuValueError, "input")
    assert_raises(lambda: sim.npu_rms_norm(x.int(), gamma.int()), NpuTypeError, "input")


def _rms_norm_grads(x, gamma, dy, eps):
    """Float64 autograd of y = x / sqrt(mean(x^2) + eps) * gamma: the oracle of dx and dgamma."""
    x64, g64 = (torch.from_numpy(f32(t.detach()).astype(np.float64)).requires_grad_() for t in (x, gamma))
    y = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps) * g64
    return torch.autograd.grad(y, (x64, g64), torch.from_numpy(f32(dy).astype(np.float64)))


@pytest.mark.parametrize("x_dtype, gamma_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                  (torch.float32, torch.float32)])
def test_rms_norm_backward_is_one_kernel_call(sim, x_dtype, gamma_dtype):
    """op-plugin's derivatives.yaml: "npu_rms_norm ... self, gamma: npu_rms_norm_backward(grad, self, gamma,
    result1)" -- one kernel; aclnnRmsNormGrad: dx in dy's dtype, "dgammaOut ... FLOAT32" (autograd then casts it to
    gamma's dtype), by the document's formulas (checked against float64 autograd)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 64, generator=g).to(x_dtype).requires_grad_()
    gamma = (torch.rand(64, generator=g) + 0.5).to(gamma_dtype).requires_grad_()
    dy = torch.randn(3, 4, 64, generator=g).to(x_dtype)
    y, rstd = sim.npu_rms_norm(x, gamma, epsilon=1e-5)
    sim.reset_counts()
    y.backward(dy)
    assert sim.launch_counts == {"npu_rms_norm_backward": 1}
    assert x.grad.dtype == x_dtype and gamma.grad.dtype == gamma_dtype
    dx, dgamma = _rms_norm_grads(x, gamma, dy, 1e-5)
    tol = dict(rtol=1e-5, atol=1e-5) if x_dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x.grad.double(), dx, **tol)
    torch.testing.assert_close(gamma.grad.double(), dgamma, **tol)
    raw_dx, raw_dgamma = sim.npu_rms_norm_backward(dy, x.detach(), gamma.detach(), rstd[..., 0])
    assert raw_dgamma.dtype == torch.float32 and raw_dx.dtype == x_dtype


def test_rms_norm_backward_contract(sim):
    """aclnnRmsNormGrad (Ascend 950): the dtype table (dy and x of one dtype, gamma of theirs or FLOAT32, rstd
    FLOAT32), "x ... shape与入参dy的shape保持一致", "rstd_shape = x_shape[0:n] ... n与gamma的n一致"."""
    x, dy = torch.randn(2, 3, 16, dtype=torch.bfloat16), torch.randn(2, 3, 16, dtype=torch.bfloat16)
    gamma, rstd = torch.ones(16), torch.ones(2, 3)
    sim.npu_rms_norm_backward(dy, x, gamma, rstd)
    sim.npu_rms_norm_backward(dy, x, gamma, rstd[..., None])  # as npu_rms_norm returns it
    assert_raises(lambda: sim.npu_rms_norm_backward(dy, x.float(), gamma, rstd), NpuTypeError, "input")
    assert_raises(lambda: sim.npu_rms_norm_backward(dy, x, gamma.half(), rstd), NpuTypeError, "gamma")
    assert_raises(lambda: sim.npu_rms_norm_backward(dy, x, gamma, rstd.bfloat16()), NpuTypeError, "rstd")
    assert_raises(lambda: sim.npu_rms_norm_backward(dy, x[:1], gamma, rstd), NpuValueError, "input")
    assert_raises(lambda: sim.npu_rms_norm_backward(dy, x, gamma, rstd[:1]), NpuValueError, "rstd")
    assert_raises(lambda: sim.npu_rms_norm_backward(dy, x, torch.ones(8), rstd), NpuValueError, "gamma")


def test_layer_norm_is_torch_npus_kernel_each_way(sim):
    """torch_npu's LayerNorm on NPU tensors (op-plugin's native_layer_norm: mean and rstd in "acc_type", float32
    for a half input; the output like the input): float32 math on a bf16 x, y rounded once, and its backward one
    kernel whose gradients are float32 autograd's (float64 inputs of the same values as the oracle)."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(6, 5, 32, generator=g) * 2 + 3).to(torch.bfloat16).requires_grad_()
    gamma = (torch.rand(32, generator=g) + 0.5).requires_grad_()
    beta = torch.randn(32, generator=g).requires_grad_()
    dy = torch.randn(6, 5, 32, generator=g).to(torch.bfloat16)
    y = sim.aten_native_layer_norm(x, (32,), gamma, beta, 1e-5)
    y.backward(dy)
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and gamma.grad.dtype == torch.float32
    assert sim.launch_counts == {"aten_native_layer_norm": 1, "aten_native_layer_norm_backward": 1}
    x64, g64, b64 = (t.detach().double().requires_grad_() for t in (x, gamma, beta))
    mean = x64.mean(-1, keepdim=True)
    y64 = (x64 - mean) / torch.sqrt(((x64 - mean) ** 2).mean(-1, keepdim=True) + 1e-5) * g64 + b64
    y64.backward(dy.double())
    assert torch.equal(y, y64.to(torch.bfloat16)) or ((y.double() - y64).abs() <= y64.abs() * 2.0**-8 + 1e-6).all()
    torch.testing.assert_close(x.grad, x64.grad.to(torch.bfloat16), rtol=2.0**-7, atol=1e-3)
    torch.testing.assert_close(gamma.grad, g64.grad.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(beta.grad, b64.grad.float(), rtol=1e-5, atol=1e-5)


def test_layer_norm_contract(sim):
    """What the simulator models: a float input, weight of its dtype or float32, bias of the weight's dtype, both
    of the normalized shape."""
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    w, b = torch.ones(16), torch.zeros(16)
    sim.aten_native_layer_norm(x, (16,), w, b, 1e-5)
    sim.aten_native_layer_norm(x, (16,), w.bfloat16(), b.bfloat16(), 1e-5)
    assert_raises(lambda: sim.aten_native_layer_norm(x, (16,), w.half(), b.half(), 1e-5), NpuTypeError, "weight")
    assert_raises(lambda: sim.aten_native_layer_norm(x, (16,), w, b.bfloat16(), 1e-5), NpuTypeError, "bias")
    assert_raises(lambda: sim.aten_native_layer_norm(x, (16,), w, torch.zeros(8), 1e-5), NpuValueError, "bias")
    assert_raises(lambda: sim.aten_native_layer_norm(x, (8,), torch.ones(8), None, 1e-5), NpuValueError, "")
    assert_raises(lambda: sim.aten_native_layer_norm(x.int(), (16,), w, b, 1e-5), NpuTypeError, "input")


# Launch counting --------------------------------------------------------------------------------------------
def test_launch_counts():
    sim, other = make_simulator(), make_simulator()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    q, s = sim.npu_dynamic_quant(x, dst_type=torch.float8_e4m3fn)
    sim.npu_dynamic_quant(x, dst_type=torch.float8_e4m3fn)
    sim.npu_quant_matmul(q, q.t(), torch.ones(1), pertoken_scale=s, output_dtype=torch.bfloat16)
    sim.npu_rms_norm(x, torch.ones(64, dtype=torch.bfloat16))
    with pytest.raises(NpuContractError, match="npu_quant_matmul: output_dtype"):
        sim.npu_quant_matmul(q, q.t(), torch.ones(1))  # rejected calls launch nothing
    assert sim.launch_counts == {"npu_dynamic_quant": 2, "npu_quant_matmul": 1, "npu_rms_norm": 1}
    assert sim.total_launches() == 4
    assert other.total_launches() == 0 and not other.launch_counts
    sim.reset_counts()
    assert sim.total_launches() == 0 and not sim.launch_counts
    sim.npu_dtype_cast(x, sim.hifloat8)
    assert sim.launch_counts["npu_dtype_cast"] == 1


def test_gradients_follow_torch_npu():
    """Quantizer outputs carry no autograd graph; rms_norm and the float grouped GEMM are differentiable."""
    sim = make_simulator()
    x = torch.randn(4, 64, requires_grad=True)
    _, scale = sim.npu_dynamic_quant(x.bfloat16(), dst_type=torch.float8_e4m3fn)
    assert not scale.requires_grad
    gamma = torch.ones(64, requires_grad=True)
    y, _ = sim.npu_rms_norm(x, gamma)
    y.sum().backward()
    assert gamma.grad is not None and x.grad is not None


# The simulator's own codecs against the oracles --------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["E4M3", "E5M2", "HIF8"])
def test_codec_decodes_every_code_as_the_oracle(sim, fmt):
    codes = np.arange(256, dtype=np.uint8)
    got = codecs.decode(torch.from_numpy(codes), npu_dtype(sim, fmt)).double().numpy()
    np.testing.assert_array_equal(got, np_decode(codes, fmt))  # NaN where the oracle has NaN


def _edge_values(fmt):
    """Random values over the whole range plus the rounding edges: ties, overflow, underflow, zeros, specials."""
    gen = np.random.default_rng(11)
    x = gen.standard_normal(20000) * np.exp2(gen.integers(-30, 20, 20000))
    top, below = FMT_MAX[fmt], {"E4M3": 416.0, "E5M2": 49152.0, "HIF8": 24576.0}[fmt]
    edges = [top, (top + below) / 2, top * 1.0625, top * 1.25, top * 1.5, 1e38, 2.0**-23, 2.0**-24, 2.0**-10,
             2.0**-17, 1.0625, 1.03125, 0.0, -0.0, np.inf, -np.inf, np.nan]
    return np.concatenate([x, edges, [-e for e in edges]]).astype(np.float32)


@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("fmt", ["E4M3", "E5M2", "HIF8"])
def test_codec_encodes_as_the_oracle(sim, fmt, saturate):
    x = _edge_values(fmt)
    got = raw(codecs.encode(torch.from_numpy(x), npu_dtype(sim, fmt), saturate=saturate))
    source = np.clip(x, -FMT_MAX[fmt], FMT_MAX[fmt]) if saturate else x
    np.testing.assert_array_equal(np_decode(got, fmt), source.astype(NP_DTYPES[fmt]).astype(np.float64))


def test_codec_e8m0_decodes_as_the_oracle():
    codes = np.arange(256, dtype=np.uint8)
    expected = codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    np.testing.assert_array_equal(codecs.e8m0_values(torch.from_numpy(codes)).double().numpy(), expected)


def test_simulator_imports_nothing_of_the_library():
    """The simulator is a test double: it computes with its own codecs, never with the code it checks."""
    package = pathlib.Path(codecs.__file__).parent
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name.startswith("mindspeed_te"):
                    assert name.startswith("mindspeed_te.testing.npu_sim"), (path.name, name)


# Contract rules quoted from the documents ---------------------------------------------------------------------
@pytest.mark.parametrize("groups", [[1, 128, 128], [128, 128, 128]])
def test_quant_matmul_blockwise_refuses_bias(sim, groups):
    """aclnnQuantMatmulV5 (Ascend 950): "仅mx量化模式下包含bias" - the G-B and B-B modes take no bias."""
    m, k, n = 4, 256, 128
    x1, _ = random_codes((m, k), "E4M3", 1)
    x2, _ = random_codes((k, n), "E4M3", 2)
    s1 = torch.ones(-(-m // groups[0]), 2)
    s2 = torch.ones(2, 1)
    call = lambda **kw: sim.npu_quant_matmul(x1, x2, s2, pertoken_scale=s1, output_dtype=torch.bfloat16,  # noqa: E731
                                             group_sizes=groups, **kw)
    assert_raises(lambda: call(bias=torch.zeros(n)), NpuValueError, "bias", str(groups))
    assert sim.launch_counts["npu_quant_matmul"] == 0  # a refused call launches nothing
    call()


def test_quant_matmul_mx_takes_bias(sim):
    m, k, n = 4, 64, 16
    x = torch.randn(m, k, dtype=torch.bfloat16)
    w = torch.randn(k, n, dtype=torch.bfloat16)
    q1, s1 = sim.npu_dynamic_mx_quant(x, dst_type=sim.float8_e4m3fn)
    q2, s2 = sim.npu_dynamic_mx_quant(w, axis=0, dst_type=sim.float8_e4m3fn)
    bias = torch.randn(n)
    mx = dict(output_dtype=torch.float32, scale_dtype=sim.float8_e8m0fnu, pertoken_scale_dtype=sim.float8_e8m0fnu,
              group_sizes=[1, 1, 32])
    out = sim.npu_quant_matmul(q1, q2, s2, pertoken_scale=s1, bias=bias, **mx)
    pow1 = 2.0 ** (s1.numpy().reshape(m, -1)[:, :2].astype(np.float64) - 127)  # 2 blocks of 32 along k
    pow2 = 2.0 ** (s2.numpy().transpose(0, 2, 1).reshape(-1, n)[:2].astype(np.float64) - 127)
    a = np_decode(raw(q1), "E4M3") * np.repeat(pow1, 32, 1)
    b = np_decode(raw(q2), "E4M3") * np.repeat(pow2, 32, 0)
    close(out, a @ b + f32(bias)[None, :], rtol=5e-6)


@pytest.mark.parametrize("alg", [0, 1])
@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
def test_dynamic_mx_quant_with_dual_axis(fmt, alg):
    sim = make_simulator("Ascend950DT")
    x = torch.randn(2, 96, 70, dtype=torch.bfloat16) * 20
    y1, s1, y2, s2 = sim.npu_dynamic_mx_quant_with_dual_axis(x, dst_type=npu_dtype(sim, fmt), scale_alg=alg)
    # documented shapes: mxscale1 [B, M, ceil(ceil(N/32)/2), 2], mxscale2 [B, ceil(ceil(M/32)/2), N, 2]
    assert tuple(y1.shape) == tuple(y2.shape) == (2, 96, 70) and y1.dtype == TORCH_FP8[fmt]
    assert tuple(s1.shape) == (2, 96, 2, 2) and tuple(s2.shape) == (2, 2, 70, 2) and s1.dtype == torch.uint8
    for b in range(2):
        rows = f32(x[b])
        codes, scales = mx_reference(rows, fmt, alg)
        np.testing.assert_array_equal(raw(y1)[b], codes)
        np.testing.assert_array_equal(s1.numpy()[b], pair_blocks(scales))
        codes, scales = mx_reference(rows.T.copy(), fmt, alg)  # the -2 axis: columns as rows
        np.testing.assert_array_equal(raw(y2)[b], codes.T)
        np.testing.assert_array_equal(s2.numpy()[b], pair_blocks(scales).transpose(1, 0, 2))
    assert sim.launch_counts == {"npu_dynamic_mx_quant_with_dual_axis": 1}  # both layouts from one kernel


def test_dynamic_mx_quant_with_dual_axis_contract():
    """aclnnDynamicMxQuantWithDualAxis, 产品支持情况: "Ascend 950PR/Ascend 950DT：支持", A2/A3 "不支持"."""
    sim = make_simulator("Ascend950DT")
    dq = sim.npu_dynamic_mx_quant_with_dual_axis
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    e4m3 = sim.float8_e4m3fn
    pr = make_simulator("Ascend950PR").npu_dynamic_mx_quant_with_dual_axis(x, dst_type=e4m3)
    dt = make_simulator("Ascend950DT").npu_dynamic_mx_quant_with_dual_axis(x, dst_type=e4m3)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(pr, dt))
    assert_raises(lambda: make_simulator("Ascend910_9391").npu_dynamic_mx_quant_with_dual_axis(x, dst_type=e4m3),
                  NpuSocError, "Ascend910_9391")
    assert_raises(lambda: dq(x.float(), dst_type=e4m3), NpuTypeError, "input")
    assert_raises(lambda: dq(x[0], dst_type=e4m3), NpuValueError, "input")
    assert_raises(lambda: dq(x, dst_type=e4m3, round_mode="floor"), NpuValueError, "round_mode")
    assert_raises(lambda: dq(x, dst_type=e4m3, scale_alg=2), NpuValueError, "scale_alg")
    assert_raises(lambda: dq(x, dst_type=e4m3, dst_type_max=6.0), NpuValueError, "dst_type_max")
    assert_raises(lambda: dq(x, dst_type=sim.hifloat8), NpuTypeError, "dst_type")
    assert sum(sim.launch_counts.values()) == 0
    with pytest.raises(NpuSimNotImplemented):
        dq(x, scale_alg=2)  # FP4 (the default dst_type) with scale_alg 2 is valid but not simulated


# More contract rules quoted from the documents (each: a violation raises, a legal call passes) ------------------
def _fp8_gemm_operands(m=4, k=64, n=8):
    x1, v1 = random_codes((m, k), "E4M3", 21)
    x2, v2 = random_codes((k, n), "E4M3", 22)
    return x1, v1, x2, v2


def test_quant_matmul_fp8_scale_and_bias_dtypes(sim):
    """aclnnQuantMatmulV5 (Ascend 950), FP8/HiF8 rows: x2Scale "FLOAT32", bias "null/FLOAT32" (BFLOAT16 scales and
    BFLOAT16/FLOAT16 biases are INT8-only rows)."""
    x1, v1, x2, v2 = _fp8_gemm_operands()
    qmm = sim.npu_quant_matmul
    pt = torch.ones(4)
    for out in (torch.bfloat16, torch.float16):
        assert_raises(lambda out=out: qmm(x1, x2, torch.ones(1, dtype=torch.bfloat16), output_dtype=out), NpuTypeError,
                      "scale")
        assert_raises(lambda out=out: qmm(x1, x2, torch.ones(1), pertoken_scale=pt, bias=torch.zeros(8, dtype=out),
                                  output_dtype=out), NpuTypeError, "bias")
    out = qmm(x1, x2, torch.tensor([0.5]), pertoken_scale=pt, bias=torch.full((8,), 2.0), output_dtype=torch.float32)
    close(out, (v1 @ v2) * 0.5 + 2.0)


def test_quant_matmul_bias_shape_follows_output_rank(sim):
    """"当out的shape为2维时，bias的shape支持1维(n,)或2维(1, n)。当out的shape为4、5、6维时，bias的shape支持1维(n,)。
    当out的shape为3维时，bias的shape支持1维(n,)或3维(batch, 1, n)。" """
    x1, v1, x2, v2 = _fp8_gemm_operands()
    qmm = sim.npu_quant_matmul
    s, f32out = torch.ones(1), torch.float32
    bias = torch.arange(8, dtype=torch.float32)
    close(qmm(x1, x2, s, bias=bias.reshape(1, 8), output_dtype=f32out), v1 @ v2 + f32(bias))
    x3, v3 = random_codes((3, 4, 64), "E4M3", 23)
    b3 = torch.randn(3, 1, 8)
    close(qmm(x3, x2, s, bias=b3, output_dtype=f32out), v3 @ v2 + f32(b3))
    assert_raises(lambda: qmm(x3, x2, s, bias=bias.reshape(1, 8), output_dtype=f32out), NpuValueError, "bias")
    x4, v4 = random_codes((2, 3, 4, 64), "E4M3", 24)
    assert_raises(lambda: qmm(x4, x2, s, bias=torch.zeros(2, 1, 8), output_dtype=f32out), NpuValueError, "bias")
    close(qmm(x4, x2, s, bias=bias, output_dtype=f32out), v4 @ v2 + f32(bias))


def test_quant_matmul_refuses_y_scale(sim):
    """"yScale仅当x1为FLOAT8_E4M3FN，x2为FLOAT4_E2M1时支持，其他场景暂不支持。" """
    x1, _, x2, _ = _fp8_gemm_operands()
    assert_raises(lambda: sim.npu_quant_matmul(x1, x2, torch.ones(1), output_dtype=torch.float32,
                                               y_scale=torch.ones(1, 8, dtype=torch.int64)), NpuValueError, "y_scale")
    with pytest.raises(NpuSimNotImplemented):  # a batch in the grouped modes is legal, not simulated
        sim.npu_quant_matmul(x1[None], x2[None], torch.ones(1, 1), pertoken_scale=torch.ones(4, 1),
                             output_dtype=torch.float32, group_sizes=[1, 128, 128])


def test_quantize_input_rank_and_scale_dtypes(sim):
    """aclnnQuantize: x "1-8" dims; scales "FLOAT32、FLOAT16、BFLOAT16", "如果`x`的dtype不是FLOAT32，scales的dtype需要和
    `x`的dtype一致。" """
    q = sim.npu_quantize
    x = torch.randn(3, 8) * 10
    s16 = torch.full((8,), 0.25, dtype=torch.float16)
    y = q(x, s16, None, torch.float8_e4m3fn, axis=-1)
    np.testing.assert_array_equal(raw(y), np_cast(f32(x) / np.float32(0.25), "E4M3"))
    assert_raises(lambda: q(x.half(), s16.bfloat16(), None, torch.float8_e4m3fn, axis=-1), NpuTypeError, "scales")
    assert_raises(lambda: q(torch.ones([1] * 9), torch.ones(1), None, torch.float8_e4m3fn), NpuValueError, "input")
    assert q(torch.ones([1] * 8), torch.ones(1), None, torch.float8_e4m3fn, axis=-1).shape == (1,) * 8
    assert_raises(lambda: q(torch.ones(()), torch.ones(1), None, torch.float8_e4m3fn), NpuValueError, "input")


def test_dynamic_quant_hif8_dst_type_max_range(sim):
    """aclnnDynamicQuantV4, dstTypeMax: "当前支持取值0 ~ 32768。仅在dstType为34（hifloat8）场景下生效。" """
    x = torch.randn(4, 64, dtype=torch.bfloat16) * 5
    y, scale = sim.npu_dynamic_quant(x, dst_type=sim.hifloat8, dst_type_max=100.0)
    expected = (np.abs(f32(x)).max(-1, keepdims=True) / np.float32(100.0)).astype(np.float32)
    np.testing.assert_array_equal(scale.numpy(), expected[:, 0])
    np.testing.assert_array_equal(raw(y), np_cast(f32(x) / expected, "HIF8"))
    for bad in (-1.0, 32769.0):
        assert_raises(lambda bad=bad: sim.npu_dynamic_quant(x, dst_type=sim.hifloat8, dst_type_max=bad), NpuValueError,
                      "dst_type_max")


def test_dynamic_quant_rank_and_smooth_scales_per_mode(sim):
    """aclnnDynamicQuantV4: x "2-8" dims; smoothScalesOptional "在perchannel场景下，shape大小是x的倒数第二维的大小"; "当
    quantMode取"pertensor"或"perchannel"时，groupIndexOptional必须是nullptr"; experts "其值不能超过1024"."""
    dq = sim.npu_dynamic_quant
    e4m3 = torch.float8_e4m3fn
    assert_raises(lambda: dq(torch.ones([2] * 9, dtype=torch.bfloat16), dst_type=e4m3), NpuValueError, "input")
    x = torch.randn(2, 6, 16, dtype=torch.bfloat16)
    smooth = torch.rand(6, dtype=torch.bfloat16) + 0.5  # one factor per row of each (6, 16) matrix
    y, scale = dq(x, smooth_scales=smooth, dst_type=e4m3, quant_mode="perchannel")
    xs = f32(x) * f32(smooth)[:, None]
    expected = (np.abs(xs).max(-2, keepdims=True) / np.float32(448)).astype(np.float32)
    np.testing.assert_array_equal(scale.numpy(), expected[:, 0])
    np.testing.assert_array_equal(raw(y), np_cast(xs / expected, "E4M3"))
    assert_raises(lambda: dq(x, smooth_scales=torch.ones(16, dtype=torch.bfloat16), dst_type=e4m3,
                             quant_mode="perchannel"), NpuValueError, "smooth_scales")
    table, gi = torch.ones(2, 16, dtype=torch.bfloat16), torch.tensor([4, 12], dtype=torch.int32)
    for mode in ("pertensor", "perchannel"):
        assert_raises(lambda mode=mode: dq(x, smooth_scales=table, group_index=gi, dst_type=e4m3, quant_mode=mode),
                      NpuValueError, "group_index")
    dq(x, smooth_scales=table, group_index=gi, dst_type=e4m3)  # pertoken takes it
    many = torch.ones(1025, 16, dtype=torch.bfloat16)
    ends = torch.full((1025,), 12, dtype=torch.int32)
    assert_raises(lambda: dq(x, smooth_scales=many, group_index=ends, dst_type=e4m3), NpuValueError, "1024")


def _gmm_fp8(sim, **changes):
    m, k, n, g = 8, 32, 4, 2
    x, vx = random_codes((m, k), "E4M3", 31)
    w, vw = random_codes((g, k, n), "E4M3", 32)
    args = dict(scale=[torch.tensor([0.5, 2.0])], group_list=torch.tensor([3, 5]), split_item=3, group_type=0,
                group_list_type=1, output_dtype=torch.float32)
    args.update(changes)
    return sim.npu_grouped_matmul([x], [w], **args), vx, vw


def test_grouped_matmul_scale_shapes_of_the_950(sim):
    """aclnnGroupedMatmulV4 (Ascend 950): scaleOptional "（g, N）... （g, 1）或（g,）"; perTokenScaleOptional
    groupType 0 "（M,）... （g, 1）或（g,）", groupType 2 "（g, M）... （g, 1）或（g,）"."""
    (out,), vx, vw = _gmm_fp8(sim, scale=[torch.tensor([[0.5], [2.0]])],
                              per_token_scale=[torch.tensor([3.0, 0.25])])
    expected = np.concatenate([vx[:3] @ vw[0] * 0.5 * 3.0, vx[3:] @ vw[1] * 2.0 * 0.25])
    close(out, expected)
    for bad in (torch.ones(1), torch.ones(3)):
        assert_raises(lambda bad=bad: _gmm_fp8(sim, per_token_scale=[bad]), NpuValueError, "per_token_scale")
    assert_raises(lambda: _gmm_fp8(sim, scale=[torch.ones(1)]), NpuValueError, "scale")
    # k split: per-row scales of x for each group
    m, k, n = 3, 160, 5
    xt, vxt = random_codes((k, m), "E5M2", 33)
    w, vw = random_codes((k, n), "E4M3", 34)
    pts = torch.tensor([[1.0, 2.0, 4.0], [0.5, 0.25, 8.0]])
    (out,) = sim.npu_grouped_matmul([xt.t()], [w], scale=[torch.tensor([1.0, 2.0])], per_token_scale=[pts],
                                    group_list=torch.tensor([64, 96]), split_item=3, group_type=2,
                                    group_list_type=1, output_dtype=torch.float32)
    expected = np.stack([vxt[:64].T @ vw[:64] * f32(pts)[0][:, None],
                         vxt[64:].T @ vw[64:] * 2.0 * f32(pts)[1][:, None]])
    close(out, expected)
    assert_raises(lambda: sim.npu_grouped_matmul([xt.t()], [w], scale=[torch.ones(2)], per_token_scale=[torch.ones(1)],
                                                 group_list=torch.tensor([64, 96]), split_item=3, group_type=2,
                                                 group_list_type=1, output_dtype=torch.float32),
                  NpuValueError, "per_token_scale")


def test_grouped_matmul_at_most_1024_groups(sim):
    """"groupListOptional第1维最大支持1024，即最多支持1024个group" """
    xt, _ = random_codes((1025, 2), "E4M3", 35)
    w, _ = random_codes((1025, 3), "E4M3", 36)
    call = lambda g: sim.npu_grouped_matmul(  # noqa: E731
        [xt[: g].t()], [w[: g]], scale=[torch.ones(g)], group_list=torch.ones(g, dtype=torch.int64), split_item=3,
        group_type=2, group_list_type=1, output_dtype=torch.float32)
    assert call(1024)[0].shape == (1024, 2, 3)
    assert_raises(lambda: call(1025), NpuValueError, "1024")


def test_grouped_matmul_float_rules_of_the_950(sim):
    """Ascend 950: x "FLOAT16、BFLOAT16" (no FLOAT32); 非量化 bias "BFLOAT16/FLOAT32/null" for BFLOAT16 x; splitItem
    "0/1" for groupType -1 and "2/3" for groupType 0."""
    m, k, n, g = 6, 8, 4, 2
    xb, wb = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(g, k, n, dtype=torch.bfloat16)
    bias = torch.randn(g, n, dtype=torch.bfloat16)
    bf = dict(group_list=torch.tensor([2, 4]), split_item=3, group_type=0, group_list_type=1)
    (out,) = sim.npu_grouped_matmul([xb], [wb], bias=[bias], **bf)
    expected = torch.cat([xb[:2].float() @ wb[0].float() + bias[0].float(),
                          xb[2:].float() @ wb[1].float() + bias[1].float()]).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert_raises(lambda: sim.npu_grouped_matmul([xb.float()], [wb.float()], **bf), NpuTypeError, "x[0]")
    make_simulator("Ascend910B3").npu_grouped_matmul([xb.float()], [wb.float()], **bf)  # A2/A3 list FLOAT32
    assert_raises(lambda: sim.npu_grouped_matmul([xb], [wb], **{**bf, "split_item": 0}), NpuValueError,
                  "split_item")
    assert_raises(lambda: sim.npu_grouped_matmul([xb, xb], [wb[0], wb[1]], group_type=-1, split_item=2),
                  NpuValueError, "split_item")
    # torch_npu doc, group_type: "`group_list`输入类型为`List[int]`时仅支持传入`None`。"
    assert_raises(lambda: sim.npu_grouped_matmul([xb], list(wb.unbind(0)), group_list=[2, 6], group_type=0,
                                                 split_item=3), NpuTypeError, "group_list")
    sim.npu_grouped_matmul([xb], list(wb.unbind(0)), group_list=[2, 6], split_item=0)


def test_grouped_matmul_non_quantized_contract(sim):
    """aclnnGroupedMatmulV4, 非量化 ("不同groupType约束", Ascend 950): x not transposed in the M-split forms ("x不支持
    转置"); one 3-D weight contiguous or transposed, a list of weights all one or the other ("是否转置需保持统一") with
    (n,) biases; a list of weights' group_list covering every row of x ("最后一个值与x中tensor的第一维相等"; one 3-D
    weight takes fewer, "不大于"). A2/A3 only: "x和weight中每一组tensor的最后一维大小都应小于65536". Each product is
    the cube's (float32 sums of exact products, rounded once), checked on dyadic values whose sums are exact, at a
    size that takes the bfloat16 GEMM too."""
    gmm = sim.npu_grouped_matmul
    gen = torch.Generator().manual_seed(7)
    dyadic = lambda *shape: (torch.randint(-64, 64, shape, generator=gen) / 8).bfloat16()  # noqa: E731
    m, k, n = 6, 8, 4
    xb, wb = dyadic(m, k), dyadic(2, k, n)
    ms = dict(split_item=3, group_type=0)
    assert_raises(lambda: gmm([xb.t().contiguous().t()], [wb], group_list=torch.tensor([2, 6]), **ms), NpuValueError,
                  "x[0]")
    (out,) = gmm([xb], [wb.transpose(1, 2).contiguous().transpose(1, 2)], group_list=torch.tensor([2, 5]), **ms)
    want = torch.cat([xb[:2].double() @ wb[0].double(), xb[2:5].double() @ wb[1].double()]).bfloat16()
    assert torch.equal(out[:5], want) and not out[5:].any()  # the rows past group_list: none computed
    assert_raises(lambda: gmm([xb], [wb[0], wb[1]], group_list=torch.tensor([2, 5]), **ms), NpuValueError, "cover")
    assert_raises(lambda: gmm([xb], [wb[0], wb[1].t().contiguous().t()], group_list=torch.tensor([2, 6]), **ms),
                  NpuValueError, "transposed")
    assert_raises(lambda: gmm([xb], [wb[0], wb[1]], bias=[torch.zeros(n), torch.zeros(n + 1)],
                              group_list=torch.tensor([2, 6]), **ms), NpuValueError, "bias[1]")
    wide_x, wide_w = dyadic(2, 65536), dyadic(1, 65536, 2)
    gmm([wide_x], [wide_w], group_list=torch.tensor([2]), **ms)  # no such limit on the 950
    assert_raises(lambda: make_simulator("Ascend910B3").npu_grouped_matmul(
        [wide_x], [wide_w], group_list=torch.tensor([2]), **ms), NpuValueError, "65536")
    big_x, big_w = dyadic(256, 128), dyadic(2, 128, 128)  # 256 * 128 * 128 multiply-adds per group: the bf16 GEMM
    (out,) = gmm([torch.cat([big_x, big_x])], [big_w], group_list=torch.tensor([256, 512]), **ms)
    want = torch.cat([big_x.double() @ big_w[0].double(), big_x.double() @ big_w[1].double()]).bfloat16()
    assert torch.equal(out, want)
    dy = dyadic(256, 32)
    (wgrad,) = gmm([big_x.t()], [dy], group_list=torch.tensor([100, 256]), split_item=3, group_type=2)
    want = torch.stack([big_x[:100].double().t() @ dy[:100].double(), big_x[100:].double().t() @ dy[100:].double()])
    assert torch.equal(wgrad, want.bfloat16())


def test_mc2_contract_before_communication(sim):
    """aclnnAllGatherMatmulV2 / aclnnMatmulReduceScatterV2 (Ascend 950), the torch_npu docs and bindings: "k轴取值
    范围为[256, 65535)"; "x1矩阵只支持不转置场景"; commMode "当前版本仅支持输入“ccu”"; the base kernels' bindings pass
    groupSize 0, which E8M0 scales cannot take ("...FLOAT8_E8M0时，[groupSizeM, groupSizeN, groupSizeK]取值组合仅支持
    [1, 1, 32]"); MX x1Scale "(m, CeilDiv(k, 64), 2)" of dtype FLOAT8_E8M0; reduce-scatter "mx量化场景下，x2/x2Scale
    仅支持转置输入" and the all-gather's mx case "x2转置 ... x2Scale转置"; quantScale "仅支持nullptr", blockSize 0,
    amaxOut "仅支持nullptr或空tensor"; the bindings' world sizes: [2, 4, 8, 16, 32] (base), [2, 4, 8, 16, 32, 64]
    (quant). Refused before any communication."""
    ag, rs = sim.npu_all_gather_base_mm, sim.npu_mm_reduce_scatter_base
    agq, rsq = sim.npu_all_gather_quant_mm, sim.npu_quant_mm_reduce_scatter
    ccu = dict(comm_mode="ccu")
    a = torch.randn(4, 128, dtype=torch.bfloat16)
    assert_raises(lambda: ag(a, torch.randn(128, 8, dtype=torch.bfloat16), "h", 2, **ccu), NpuValueError, "k")
    big = torch.randn(4, 65535, dtype=torch.bfloat16)
    assert_raises(lambda: rs(big, torch.randn(65535, 2, dtype=torch.bfloat16), "h", 2, **ccu), NpuValueError, "k")
    x = torch.randn(256, 4, dtype=torch.bfloat16).t()
    assert_raises(lambda: ag(x, torch.randn(256, 8, dtype=torch.bfloat16), "h", 2, **ccu), NpuValueError, "self")
    m, k, n = 4, 256, 8
    q1, s1 = sim.npu_dynamic_mx_quant(torch.randn(m, k, dtype=torch.bfloat16), dst_type=sim.float8_e4m3fn)
    q2, s2 = sim.npu_dynamic_mx_quant(torch.randn(n, k, dtype=torch.bfloat16), dst_type=sim.float8_e4m3fn)
    x2, s2t = q2.t(), s2.transpose(0, 1)  # (k, n) and (k/64, n, 2) as transposed views
    mx = dict(group_sizes=[1, 1, 32], y_dtype=torch.float32, x1_scale_dtype=sim.float8_e8m0fnu,
              x2_scale_dtype=sim.float8_e8m0fnu)
    # the base kernels: MX scales refused (groupSize 0); a missing comm_mode refused on the 950
    assert_raises(lambda: ag(q1, x2, "h", 2, x1_scale=s1, x2_scale=s2t, output_dtype=torch.float32, **ccu),
                  NpuValueError, "groupSize")
    hp, w = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16)
    assert_raises(lambda: ag(hp, w, "h", 2), NpuValueError, "comm_mode")
    # the quant kernels
    assert_raises(lambda: agq(q1, x2, "h", 2, x1_scale=s1[:, :1], x2_scale=s2t, **mx), NpuValueError, "x1_scale")
    for kernel in (agq, rsq):
        assert_raises(lambda kernel=kernel: kernel(q1, x2.contiguous(), "h", 2, x1_scale=s1, x2_scale=s2t.contiguous(),
                                                   **mx), NpuValueError, "x2")
    assert_raises(lambda: agq(q1, x2, "h", 2, x1_scale=s1.float(), x2_scale=s2t, **mx), NpuTypeError, "x1_scale")
    no_dtype = {**mx, "x1_scale_dtype": None}  # uint8 bytes read as UINT8 without it
    assert_raises(lambda: agq(q1, x2, "h", 2, x1_scale=s1, x2_scale=s2t, **no_dtype), NpuTypeError, "x1_scale")
    assert_raises(lambda: agq(q1, x2, "h", 2, x1_scale=s1, x2_scale=s2t, **{**mx, "group_sizes": None}),
                  NpuValueError, "group_sizes")
    assert_raises(lambda: agq(q1, x2, "h", 2, x1_scale=s1, x2_scale=s2t, **{**mx, "y_dtype": None}),
                  NpuTypeError, "y_dtype")
    for bad in (dict(amax_output=True), dict(quant_scale=torch.ones(1)), dict(block_size=32)):
        assert_raises(lambda bad=bad: rsq(q1, x2, "h", 2, x1_scale=s1, x2_scale=s2t, **mx, **bad),
                      NpuValueError, next(iter(bad)))
    assert sim.total_launches() == 2  # only the two quantizations ran
    # world sizes: 64 only on the quant kernels (then the unknown communicator is refused); 3 on none
    assert_raises(lambda: agq(q1, x2, "unknown", 64, x1_scale=s1, x2_scale=s2t, **mx), NpuValueError, "hcom")


def _mc2_worker(rank, world):
    from mindspeed_te.testing.npu_sim import make_simulator

    sim = make_simulator()
    group = torch.distributed.new_group(list(range(world)))
    hcom = sim.hcom_of(group)
    g = torch.Generator().manual_seed(5)
    full = torch.randn(4 * world, 256, generator=g).bfloat16()
    w = torch.randn(256, 8, generator=g).bfloat16()
    mine = full.chunk(world)[rank]
    y, gathered = sim.npu_all_gather_base_mm(mine, w, hcom, world, comm_mode="ccu")
    rs = sim.npu_mm_reduce_scatter_base(full, w, hcom, world, comm_mode="ccu")
    # MX with x2 and x2_scale as transposed views (the form the 950 documents give)
    wt = torch.randn(8, 256, generator=g).bfloat16()
    q1, s1 = sim.npu_dynamic_mx_quant(full, dst_type=sim.float8_e4m3fn)
    q2, s2 = sim.npu_dynamic_mx_quant(wt, dst_type=sim.float8_e4m3fn)
    e8m0 = sim.float8_e8m0fnu
    mx = dict(group_sizes=[1, 1, 32], y_dtype=torch.float32, x1_scale_dtype=e8m0, x2_scale_dtype=e8m0)
    rs_mx, _ = sim.npu_quant_mm_reduce_scatter(q1, q2.t(), hcom, world, x1_scale=s1, x2_scale=s2.transpose(0, 1),
                                               **mx)
    mine_q, mine_s = q1.chunk(world)[rank], s1.chunk(world)[rank]
    ag_mx, gathered_mx, _ = sim.npu_all_gather_quant_mm(mine_q, q2.t(), hcom, world, x1_scale=mine_s,
                                                        x2_scale=s2.transpose(0, 1), **mx)
    bad = []
    for call in (lambda: sim.npu_all_gather_base_mm(mine, w, hcom, 3, comm_mode="ccu"),
                 lambda: sim.npu_all_gather_base_mm(mine, w, hcom, 64, comm_mode="ccu")):
        try:
            call()
        except ValueError as err:
            bad.append(str(err))
    return (y.float(), gathered.float(), rs.float(), rs_mx, ag_mx, gathered_mx.view(torch.uint8), q1, s1, q2, s2,
            bad)


@pytest.mark.slow
def test_mc2_legal_calls():
    """Legal calls (k = 256; bf16 with comm_mode "ccu"; MX through the quant kernels, x2 transposed) pass on 2
    real ranks and give all_gather(x) @ w and reduce_scatter(x @ w); world_size must be one the binding takes (3
    and, for the base kernels, 64 are not) and match the group."""
    results = run_distributed(_mc2_worker, 2)
    full = results[0][1]
    for rank, (y, gathered, rs, rs_mx, ag_mx, gathered_mx, q1, s1, q2, s2, bad) in enumerate(results):
        torch.testing.assert_close(gathered, full)
        assert y.shape == (8, 8) and rs.shape == (4, 8) and rs_mx.shape == (4, 8)
        e1 = np.repeat(2.0 ** (s1.numpy().reshape(8, -1)[:, :8].astype(np.float64) - 127), 32, 1)
        e2 = np.repeat(2.0 ** (s2.numpy().reshape(8, -1)[:, :8].astype(np.float64) - 127), 32, 1)
        a = np_decode(raw(q1), "E4M3").astype(np.float64) * e1
        b = np_decode(raw(q2), "E4M3").astype(np.float64) * e2
        both = 2 * (a @ b.T)  # both ranks hold the same full operands: the reduction doubles the product
        close(rs_mx, both[rank * 4:(rank + 1) * 4], rtol=1e-5)
        close(ag_mx, a @ b.T, rtol=1e-5)  # the gathered rows of every rank: the full product
        assert torch.equal(gathered_mx, q1.view(torch.uint8))
        assert len(bad) == 2 and all("world_size" in message for message in bad)


def test_fusion_attention_contract(sim):
    """torch_npu-npu_fusion_attention.md: keep_prob "取值范围为(0, 1]"; "输入`key`和`value`的shape必须一致"; "B：
    batchsize必须相等"; "Nq取值范围1~256"; "D ... 取值范围1~768"; S and T from 1 to 1M; atten_mask "BNSS格式、B1SS
    格式、11SS格式、SS格式"."""
    fa = sim.npu_fusion_attention
    s, b, h, d = 5, 2, 2, 4
    q, k, v = (torch.randn(s, b, h * d) for _ in range(3))
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
    for shape in ((s, s), (1, 1, s, s), (b, 1, s, s), (b, h, s, s)):
        out = fa(q, k, v, h, "SBH", atten_mask=mask.expand(shape), scale=0.5)[0]
        qh, kh, vh = (t.reshape(s, b, h, d).permute(1, 2, 0, 3).double().numpy() for t in (q, k, v))
        logits = qh @ kh.transpose(0, 1, 3, 2) * 0.5
        logits = np.where(mask.numpy(), -np.inf, logits)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        ref = (p / p.sum(-1, keepdims=True)) @ vh
        np.testing.assert_allclose(out.double().numpy(), ref.transpose(2, 0, 1, 3).reshape(s, b, h * d), rtol=1e-5,
                                   atol=1e-6)
    assert_raises(lambda: fa(q, k, v, h, "SBH", atten_mask=mask[None]), NpuValueError, "atten_mask")
    for keep in (0.0, 1.5):
        assert_raises(lambda keep=keep: fa(q, k, v, h, "SBH", keep_prob=keep), NpuValueError, "keep_prob")
    assert_raises(lambda: fa(q, k, v[:, :, :4], h, "SBH"), NpuValueError, "value")
    assert_raises(lambda: fa(q, k[:, :1], v[:, :1], h, "SBH"), NpuValueError, "batch")
    wide = torch.randn(1, 1, 257)
    assert_raises(lambda: fa(wide, wide, wide, 257, "SBH"), NpuValueError, "head_num")
    deep = torch.randn(1, 1, 769)
    assert_raises(lambda: fa(deep, deep, deep, 1, "SBH"), NpuValueError, "head dim")
    # "S：sequence length，取值范围1~1M"; varlen: "要求T（B*S）取值范围1~1M"
    assert_raises(lambda: fa(q[:0], k, v, h, "SBH"), NpuValueError, "sequence length")
    assert_raises(lambda: fa(q, k[:0], v[:0], h, "SBH"), NpuValueError, "sequence length")
    flat = torch.randn(0, h, d)
    assert_raises(lambda: fa(flat, flat, flat, h, "TND", actual_seq_qlen=[0], actual_seq_kvlen=[0]), NpuValueError,
                  "T (0)")
    # softmax_layout "当前仅在input_layout=“TND”时进行配置，仅支持传入“TND”"; sink "shape为[head_num]，数据类型仅支持
    # float32"
    assert_raises(lambda: fa(q, k, v, h, "SBH", softmax_layout="TND"), NpuValueError, "softmax_layout")
    assert_raises(lambda: fa(q, k, v, h, "SBH", softmax_layout="BNSD"), NpuValueError, "softmax_layout")
    assert_raises(lambda: fa(q, k, v, h, "SBH", sink=torch.zeros(h + 1)), NpuValueError, "sink")
    assert_raises(lambda: fa(q, k, v, h, "SBH", sink=torch.zeros(h, dtype=torch.bfloat16)), NpuTypeError, "sink")


def test_rms_norm_gamma_dtypes_and_specials(sim):
    """aclnnRmsNorm (Ascend 950): x BFLOAT16 with gamma FLOAT32 or BFLOAT16; "当输入是Inf时，输出为Inf。当输入是NaN时，
    输出为NaN。" """
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    gamma = torch.rand(16) + 0.5
    y, rstd = sim.npu_rms_norm(x, gamma)
    xf = f32(x).astype(np.float64)
    ref_rstd = 1 / np.sqrt((xf**2).mean(-1, keepdims=True) + 1e-6)
    torch.testing.assert_close(y, torch.from_numpy(xf * ref_rstd * f32(gamma)).to(torch.bfloat16), rtol=1e-2,
                               atol=1e-2)
    x[0, 3], x[1, 5] = float("inf"), float("nan")
    y, _ = sim.npu_rms_norm(x, gamma)
    assert y[0, 3] == float("inf") and torch.isnan(y[1, 5])
    assert_raises(lambda: sim.npu_rms_norm(x.half(), gamma.bfloat16()), NpuTypeError, "gamma")


def test_cube_matmul_sums_exact_products_in_float32():
    """FP8 values times powers of two (bfloat16 values: oneDNN's bf16 kernel may run) and values no bfloat16
    holds (the float32 kernel, bit for bit) both give float32 sums of exact products."""
    from mindspeed_te.testing.npu_sim.cube import cube_matmul

    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 256, (2, 128, 320), dtype=torch.uint8, generator=g)  # 2^22.3 multiply-adds
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    a, b = (codecs.decode(c, torch.float8_e4m3fn) * 2.0**-20 for c in codes)
    got = cube_matmul(a, b.t())
    exact = a.double() @ b.double().t()
    assert ((got.double() - exact).abs() <= 320 * 2.0**-24 * (a.double().abs() @ b.double().abs().t())).all()
    wide = a * 1.1  # values no bfloat16 holds
    assert torch.equal(cube_matmul(wide, b.t()), torch.matmul(wide, b.t()))


def test_cube_matmul_rounded_is_the_float32_sum_rounded_once():
    """A bfloat16 output of bfloat16 values (oneDNN's bf16 kernel rounding its own sum) and of other values
    (the float32 sum, cast) both are a float32 sum of the exact products rounded once: cube_matmul's, except
    where the exact sum lies within float32 summation error of a bfloat16 tie, which a sum in another order
    may round the other way (oneDNN's bf16 kernel blocks k its own way on CPUs with bf16 dot products)."""
    from mindspeed_te.testing.npu_sim.cube import cube_matmul, cube_matmul_rounded

    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (2, 128, 320), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0
    a, b = (codecs.decode(c, torch.float8_e4m3fn) * 2.0**-20 for c in codes)
    for x in (a, a * 1.1):
        exact = x.double() @ b.t().double()
        summation_error = 320 * 2.0**-24 * (x.double().abs() @ b.t().double().abs())
        for dtype in (torch.bfloat16, torch.float32):
            got, once = cube_matmul_rounded(x, b.t(), dtype), cube_matmul(x, b.t()).to(dtype)
            assert got.dtype == dtype
            other = got != once
            tie = (got.double() + once.double()) / 2
            assert ((exact - tie).abs() <= summation_error)[other].all()
            assert other.sum() <= 8  # a rare case: 3 of 16384 on an AVX-512 BF16 machine


def test_empty_operands(sim):
    """aclnnQuantMatmulV5: x1, x2, x1Scale, x2Scale "不支持空Tensor", except on the Ascend 950 "当输入参数x1为m=0的
    空tensor或x2为n=0的空tensor时，输出为空tensor"; aclnnDynamicBlockQuantV2: x "不支持空Tensor". The MX quantize
    documents say nothing of empty input: 0 rows give empty codes and scales."""
    q1, s1 = sim.npu_dynamic_mx_quant(torch.zeros(0, 128, dtype=torch.bfloat16), dst_type=sim.float8_e4m3fn)
    assert q1.shape == (0, 128) and s1.shape == (0, 2, 2)
    q2, s2 = sim.npu_dynamic_mx_quant(torch.randn(64, 128, dtype=torch.bfloat16), dst_type=sim.float8_e4m3fn)
    mx = dict(scale_dtype=sim.float8_e8m0fnu, pertoken_scale_dtype=sim.float8_e8m0fnu, group_sizes=[1, 1, 32])
    y = sim.npu_quant_matmul(q1, q2.t(), s2.transpose(0, 1), pertoken_scale=s1, output_dtype=torch.bfloat16, **mx)
    assert y.shape == (0, 64) and y.dtype == torch.bfloat16
    x1, s1k = torch.zeros(64, 0, dtype=torch.float8_e4m3fn), torch.zeros(64, 0, 2, dtype=torch.uint8)
    x2, s2k = torch.zeros(64, 0, dtype=torch.float8_e4m3fn), torch.zeros(64, 0, 2, dtype=torch.uint8)
    assert_raises(lambda: sim.npu_quant_matmul(x1, x2.t(), s2k.transpose(0, 1), pertoken_scale=s1k,
                                               output_dtype=torch.bfloat16, **mx), NpuValueError, "only in m or n")
    assert_raises(lambda: sim.npu_dynamic_block_quant(torch.zeros(0, 128), dst_type=sim.float8_e4m3fn),
                  NpuValueError, "empty")


def test_fusion_attention_rows_without_keys(sim):
    """inner_precise: "当前0、1为保留配置值，2为开启无效行计算，其功能是避免在计算过程中存在整行mask进而导致精度有
    损失": a query whose keys are all masked gets zeros with 2 and, as the simulator's stand-in for the unspecified
    loss, NaN otherwise; values outside 0-2 are refused."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 1, 32, generator=g) for _ in range(3))
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[2] = True  # query 2 sees no key
    plain = sim.npu_fusion_attention(q, k, v, 2, "SBH", atten_mask=mask, scale=0.25)[0]
    fixed = sim.npu_fusion_attention(q, k, v, 2, "SBH", atten_mask=mask, scale=0.25, inner_precise=2)[0]
    assert torch.isnan(plain[2]).all() and not torch.isnan(plain[[0, 1, 3]]).any()
    assert not fixed[2].any() and torch.equal(fixed[[0, 1, 3]], plain[[0, 1, 3]])
    assert_raises(lambda: sim.npu_fusion_attention(q, k, v, 2, "SBH", atten_mask=mask, inner_precise=3),
                  NpuValueError, "inner_precise")


def _attention_oracle(q, k, v, heads, scale, masked):
    """Float64 softmax(Q Kᵀ · scale) V of SBH tensors, `masked` [s_q, s_k] True where a key is not seen; rows
    without keys give zeros."""
    s_q, b, hidden = q.shape
    d = hidden // heads
    qh, kh, vh = (t.detach().reshape(t.shape[0], b, heads, d).permute(1, 2, 0, 3).double().numpy() for t in (q, k, v))
    logits = np.where(masked, -np.inf, qh @ kh.transpose(0, 1, 3, 2) * scale)
    top = logits.max(-1, keepdims=True)
    p = np.exp(logits - np.where(np.isinf(top), 0.0, top))
    out = (p / np.maximum(p.sum(-1, keepdims=True), 1e-300)) @ vh
    return out.transpose(2, 0, 1, 3).reshape(s_q, b, hidden)


@pytest.mark.parametrize("mode, s_q, s_k, pre, nxt", [(2, 6, 9, 0, 0), (2, 9, 6, 0, 0), (3, 6, 9, 0, 0),
                                                      (3, 9, 6, 0, 0), (4, 8, 8, 2, 0), (4, 6, 9, 3, 1),
                                                      (4, 8, 8, 2147483647, 2)])
def test_fusion_attention_causal_and_band_modes(sim, mode, s_q, s_k, pre, nxt):
    """torch_npu-npu_fusion_attention.md: sparse_mode 2 "leftUpCausal ... 以左上顶点划分的下三角", 3
    "rightDownCausal ... 以右下顶点划分的下三角", 4 "band场景，即计算pre_tockens和next_tockens之间的部分，参数起点为
    右下角", each with the compressed 2048x2048 mask; with Sq > Skv mode 3 turns on the invalid-row computation
    itself. The masks below are built from those words, per query q and key k."""
    g = torch.Generator().manual_seed(mode)
    q = torch.randn(s_q, 2, 16, generator=g)
    k, v = torch.randn(s_k, 2, 16, generator=g), torch.randn(s_k, 2, 16, generator=g)
    qi, ki = np.arange(s_q)[:, None], np.arange(s_k)[None, :]
    diagonal = ki - qi - (s_k - s_q)  # 0 on the diagonal through the bottom-right corner
    masked = {2: ki > qi, 3: diagonal > 0, 4: (diagonal < -pre) | (diagonal > nxt)}[mode]
    compressed = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    out = sim.npu_fusion_attention(q, k, v, 2, "SBH", atten_mask=compressed, scale=0.5, sparse_mode=mode,
                                   pre_tockens=pre, next_tockens=nxt, inner_precise=2 if mode == 4 else 0)[0]
    np.testing.assert_allclose(out.double().numpy(), _attention_oracle(q, k, v, 2, 0.5, masked), rtol=1e-5, atol=1e-6)


def test_fusion_attention_sparse_mode_contract(sim):
    """"sparse_mode为1、2、3、4、5、6、7、8时，应传入对应正确的atten_mask，否则将导致计算结果错误": any matrix but the
    compressed one is refused; "pre_tockens和next_tockens之间需要有交集"; modes the simulator does not model say so."""
    q = torch.randn(4, 1, 8)
    compressed = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    assert_raises(lambda: sim.npu_fusion_attention(q, q, q, 1, "SBH", atten_mask=compressed[:4, :4], sparse_mode=2),
                  NpuValueError, "atten_mask")
    assert_raises(lambda: sim.npu_fusion_attention(q, q, q, 1, "SBH", atten_mask=compressed.t().contiguous(),
                                                   sparse_mode=3), NpuValueError, "compressed")
    assert_raises(lambda: sim.npu_fusion_attention(q, q, q, 1, "SBH", atten_mask=compressed, sparse_mode=4,
                                                   pre_tockens=-2, next_tockens=1), NpuValueError, "overlap")
    for mode in (1, 5, 6):
        with pytest.raises(NpuSimNotImplemented):
            sim.npu_fusion_attention(q, q, q, 1, "SBH", atten_mask=compressed, sparse_mode=mode)
    # "当atten_mask输入为None时，sparse_mode、pre_tockens、next_tockens参数不生效，固定为全计算。"
    full = sim.npu_fusion_attention(q, q, q, 1, "SBH", sparse_mode=2, scale=0.3)[0]
    np.testing.assert_allclose(full.double().numpy(), _attention_oracle(q, q, q, 1, 0.3, np.zeros((4, 4), bool)),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", [0, 3])
def test_fusion_attention_backward_is_one_grad_kernel_call(sim, mode):
    """op-plugin's derivatives.yaml: "query, key, value, pse, sink: npu_fusion_attention_grad(...)" -- one kernel,
    whose gradients equal float64 autograd of the masked softmax."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(6, 2, 32, generator=g, requires_grad=True) for _ in range(3))
    masked = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
    mask = masked if mode == 0 else torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    out = sim.npu_fusion_attention(q, k, v, 4, "SBH", atten_mask=mask, scale=0.25, sparse_mode=mode)[0]
    dy = torch.randn(out.shape, generator=g)
    sim.reset_counts()
    out.backward(dy)
    assert sim.launch_counts == {"npu_fusion_attention_grad": 1}
    q64, k64, v64 = (t.detach().double().reshape(6, 2, 4, 8).permute(1, 2, 0, 3).requires_grad_() for t in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, attn_mask=~masked, scale=0.25)
    grads = torch.autograd.grad(want.permute(2, 0, 1, 3).reshape(6, 2, 32), (q64, k64, v64), dy.double())
    for got, ref in zip((q.grad, k.grad, v.grad), grads):
        torch.testing.assert_close(got.double(), ref.permute(2, 0, 1, 3).reshape(6, 2, 32), rtol=1e-5, atol=1e-6)
    assert_raises(lambda: sim.npu_fusion_attention_grad(q, k, v, dy[:3], 4, "SBH"), NpuValueError, "dy")


def _packed_masked(q_lens, k_lens, causal_from):
    """[T_q, T_kv] True where a key is not seen: another sequence's, or past the causal diagonal of the sequence's
    top-left ("tl") or bottom-right ("br") corner."""
    masked = np.ones((sum(q_lens), sum(k_lens)), bool)
    q0 = k0 = 0
    for lq, lk in zip(q_lens, k_lens):
        qi, ki = np.arange(lq)[:, None], np.arange(lk)[None, :]
        block = np.zeros((lq, lk), bool)
        if causal_from == "tl":
            block = ki > qi
        elif causal_from == "br":
            block = ki - qi > lk - lq
        masked[q0:q0 + lq, k0:k0 + lk] = block
        q0, k0 = q0 + lq, k0 + lk
    return masked


@pytest.mark.parametrize("mode, q_lens, k_lens", [(None, [3, 5, 2], [3, 5, 2]), (2, [3, 5, 2], [3, 5, 2]),
                                                  (2, [4, 2], [2, 5]), (3, [2, 4], [3, 4])])
def test_fusion_attention_varlen(sim, mode, q_lens, k_lens):
    """input_layout "TND" "即为varlen场景": each batch's queries see only its own keys, given by the cumulative
    "actual_seq_qlen"/"actual_seq_kvlen" (host lists); no mask is full attention inside a batch, sparse_mode 2 and 3
    causal from the batch's top-left and bottom-right corner (the modes the varlen split modes 8 and 7 start from);
    GQA heads; the backward is one npu_fusion_attention_grad."""
    g = torch.Generator().manual_seed(len(q_lens) + (mode or 0))
    q = torch.randn(sum(q_lens), 4, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(sum(k_lens), 2, 8, generator=g, requires_grad=True) for _ in range(2))
    kwargs = dict(actual_seq_qlen=np.cumsum(q_lens).tolist(), actual_seq_kvlen=np.cumsum(k_lens).tolist())
    if mode is not None:
        kwargs.update(atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1), sparse_mode=mode)
    out = sim.npu_fusion_attention(q, k, v, 4, "TND", scale=0.3, **kwargs)[0]
    masked = _packed_masked(q_lens, k_lens, {None: None, 2: "tl", 3: "br"}[mode])
    k4, v4 = (t.detach().repeat_interleave(2, 1).reshape(t.shape[0], 1, 32) for t in (k, v))
    want = _attention_oracle(q.detach().reshape(-1, 1, 32), k4, v4, 4, 0.3, masked)
    np.testing.assert_allclose(out.detach().double().numpy(), want.reshape(out.shape), rtol=1e-5, atol=1e-6)
    sim.reset_counts()
    out.sum().backward()
    assert sim.launch_counts == {"npu_fusion_attention_grad": 1} and q.grad.shape == q.shape


def test_fusion_attention_varlen_contract(sim):
    """actual_seq_qlen "varlen场景时需要传入此参数", cumulative ("累加和长度"), "尾部传入对应个数个0" for batches
    left out; "B：batchsize必须相等"; "varlen场景下 ... atten_mask中不能存在某一行全1的场景"."""
    q = torch.randn(6, 2, 8)
    fa = sim.npu_fusion_attention
    compressed = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    out = fa(q, q, q, 2, "TND", actual_seq_qlen=[2, 6, 0], actual_seq_kvlen=[2, 6, 0])[0]  # a trailing batch left out
    assert out.shape == (6, 2, 8)
    assert_raises(lambda: fa(q, q, q, 2, "TND"), NpuValueError, "actual_seq_qlen")
    assert_raises(lambda: fa(q, q, q, 2, "TND", actual_seq_qlen=[4, 2, 6], actual_seq_kvlen=[4, 2, 6]),
                  NpuValueError, "non-decreasing")
    assert_raises(lambda: fa(q, q, q, 2, "TND", actual_seq_qlen=[2, 6], actual_seq_kvlen=[6]), NpuValueError,
                  "batches")
    assert_raises(lambda: fa(q, q[:2], q[:2], 2, "TND", actual_seq_qlen=[2, 6], actual_seq_kvlen=[2, 2]),
                  NpuValueError, "without keys")
    assert_raises(lambda: fa(q, q[:4], q[:4], 2, "TND", actual_seq_qlen=[2, 6], actual_seq_kvlen=[2, 4],
                             atten_mask=compressed, sparse_mode=3), NpuValueError, "without keys")
    assert_raises(lambda: fa(q, q, q, 3, "TND", actual_seq_qlen=[6], actual_seq_kvlen=[6]), NpuValueError, "head_num")
    assert_raises(lambda: fa(q.reshape(6, 1, 16), q.reshape(6, 1, 16), q.reshape(6, 1, 16), 2, "SBH",
                             actual_seq_qlen=[6], actual_seq_kvlen=[6]), NpuValueError, "TND")
    with pytest.raises(NpuSimNotImplemented):
        fa(q, q, q, 2, "TND", actual_seq_qlen=[2, 4], actual_seq_kvlen=[2, 4])  # tokens past the last batch
    with pytest.raises(NpuSimNotImplemented):
        fa(q, q, q, 2, "TND", actual_seq_qlen=[6], actual_seq_kvlen=[6], atten_mask=compressed[:6, :6])


def test_fusion_attention_dropout_mask_is_the_grad_kernels_too(sim):
    """keep_prob < 1 ("代表Dropout中1的比例"): the kept attention probabilities are divided by keep_prob, the others
    are zero; the kernel returns the seed, offset and mask size it used, and its grad kernel drops the same ones.
    With one value per key (V = I) the output is the dropped probability matrix itself, so nothing here depends
    on how the simulator draws its mask: P_drop from the output, dV = P_dropᵀ dY from the backward."""
    g = torch.Generator().manual_seed(9)
    q, k = torch.randn(64, 1, 64, generator=g), torch.randn(64, 1, 64, generator=g)
    v = torch.eye(64).reshape(64, 1, 64).requires_grad_()
    plain = sim.npu_fusion_attention(q, k, v, 1, "SBH", scale=0.125)[0].detach()[:, 0]
    torch.manual_seed(0)
    out, *_, seed, offset, numels = sim.npu_fusion_attention(q, k, v, 1, "SBH", scale=0.125, keep_prob=0.6)
    dropped = out.detach()[:, 0]
    kept = dropped != 0
    torch.testing.assert_close(dropped[kept], plain[kept] / 0.6)
    assert numels == 64 * 64 and abs(kept.float().mean().item() - 0.6) < 0.04
    torch.manual_seed(0)  # the same generator state: the same mask
    assert torch.equal(sim.npu_fusion_attention(q, k, v, 1, "SBH", scale=0.125, keep_prob=0.6)[0].detach()[:, 0],
                       dropped)
    dy = torch.randn(64, 1, 64, generator=g)
    out.backward(dy)
    torch.testing.assert_close(v.grad[:, 0], dropped.t() @ dy[:, 0], rtol=1e-5, atol=1e-6)
    assert_raises(lambda: sim.npu_fusion_attention_grad(q, k, v.detach(), dy, 1, "SBH", scale_value=0.125,
                                                        keep_prob=0.6, seed=seed, offset=offset, numels=7),
                  NpuValueError, "numels")


@pytest.mark.parametrize("mode", [0, 2])
def test_fusion_attention_sink_joins_each_softmax(sim, mode):
    """sink "每个注意力头的偏置": the document's reference appends one sink logit per head, applies softmax, then
    drops that column before multiplying by V; its gradient is the grad kernel's fifth output (float32 [head_num]),
    checked, with dq/dk/dv, against float64 autograd of that reference."""
    g = torch.Generator().manual_seed(4)
    s_, b, h, d = 6, 2, 4, 8
    q, k, v = (torch.randn(s_, b, h * d, generator=g, requires_grad=True) for _ in range(3))
    sink = torch.tensor([-0.5, 0.0, 0.7, 2.0], requires_grad=True)
    masked = torch.triu(torch.ones(s_, s_, dtype=torch.bool), 1)
    mask = masked if mode == 0 else torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    out = sim.npu_fusion_attention(q, k, v, h, "SBH", atten_mask=mask, scale=0.3, sparse_mode=mode, sink=sink)[0]
    dy = torch.randn(out.shape, generator=g)
    sim.reset_counts()
    out.backward(dy)
    assert sim.launch_counts == {"npu_fusion_attention_grad": 1} and sink.grad.dtype == torch.float32
    q64, k64, v64 = (t.detach().double().reshape(s_, b, h, d).permute(1, 2, 0, 3).requires_grad_() for t in (q, k, v))
    s64 = sink.detach().double().requires_grad_()
    scores = (q64 @ k64.transpose(2, 3) * 0.3).masked_fill(masked, float("-inf"))
    probs = torch.softmax(torch.cat([scores, s64.view(1, h, 1, 1).expand(b, h, s_, 1)], dim=-1), dim=-1)[..., :-1]
    ref = (probs @ v64).permute(2, 0, 1, 3).reshape(s_, b, h * d)
    torch.testing.assert_close(out.detach().double(), ref.detach(), rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(ref, (q64, k64, v64, s64), dy.double())
    for got, want in zip((q.grad, k.grad, v.grad), grads[:3]):
        torch.testing.assert_close(got.double(), want.permute(2, 0, 1, 3).reshape(s_, b, h * d), rtol=1e-5,
                                   atol=1e-6)
    torch.testing.assert_close(sink.grad.double(), grads[3], rtol=1e-5, atol=1e-6)


def test_quant_matmul_last_dims_at_most_65535(sim):
    """torch_npu npu_quant_matmul: "其他情况, x1与x2最后一维的shape大小不能超过65535" (x1's k; x2's n, as passed)."""
    k_ok, _ = random_codes((2, 65535), "E4M3", 40)
    k_big, _ = random_codes((2, 65536), "E4M3", 41)
    args = dict(pertoken_scale=torch.ones(1), output_dtype=torch.float32)
    assert sim.npu_quant_matmul(k_ok, k_ok.t(), torch.ones(1), **args).shape == (2, 2)
    assert_raises(lambda: sim.npu_quant_matmul(k_big, k_big.t(), torch.ones(1), **args), NpuValueError, "65535")
    n_big, _ = random_codes((65536, 2), "E4M3", 42)
    assert_raises(lambda: sim.npu_quant_matmul(k_big[:, :2], n_big.t(), torch.ones(1), **args), NpuValueError,
                  "65535")


def test_quant_matmul_without_pertoken_scale_truncates_the_scale(sim):
    """Without pertoken_scale torch_npu turns a float32 scale into the static form (npu_trans_quant_param), whose
    aclnnTransQuantParamV2 keeps "高19位": the scale's 13 low mantissa bits are dropped."""
    x, vx = random_codes((4, 32), "E4M3", 43)
    w, vw = random_codes((32, 3), "E4M3", 44)
    scale = torch.tensor([1.0 + 2.0 ** -20 + 2.0 ** -9])  # bit 3 and bit 14 of the mantissa set
    out = sim.npu_quant_matmul(x, w, scale, output_dtype=torch.float32)
    np.testing.assert_array_equal(out.numpy(), (vx @ vw * (1.0 + 2.0 ** -9)).astype(np.float32))
    exact = sim.npu_quant_matmul(x, w, scale, pertoken_scale=torch.ones(1), output_dtype=torch.float32)
    np.testing.assert_array_equal(exact.numpy(), (vx @ vw * f32(scale)[0]).astype(np.float32))


def test_quantize_and_dynamic_quant_refuse_what_torch_npu_refuses(sim):
    """npu_quantize's dtype map holds the native float8 dtypes and HiF8, not torch_npu's numbers 291/292; with a
    group_index, npu_dynamic_quant takes at most as many experts as x has rows ("专家数不超过x剔除最后一维的各个维度
    乘积")."""
    x = torch.randn(4, 8)
    for number in (291, 292):
        assert_raises(lambda n=number: sim.npu_quantize(x, torch.ones(1), None, n, -1, True), NpuTypeError, "dtype")
    assert sim.npu_quantize(x, torch.ones(1), None, torch.float8_e4m3fn, -1, True).dtype == torch.float8_e4m3fn
    xb = torch.randn(2, 4, dtype=torch.bfloat16)
    smooth = torch.ones(3, 4, dtype=torch.bfloat16)
    assert_raises(lambda: sim.npu_dynamic_quant(xb, smooth_scales=smooth, dst_type=torch.float8_e4m3fn,
                                                group_index=torch.tensor([0, 2, 2], dtype=torch.int32)),
                  NpuValueError, "experts")
    sim.npu_dynamic_quant(xb, smooth_scales=smooth[:2], dst_type=torch.float8_e4m3fn,
                          group_index=torch.tensor([1, 2], dtype=torch.int32))


# npu_quant_max (a simulator of its own: the backend does not call it) ---------------------------------------------
@pytest.fixture
def qmax_sim():
    from mindspeed_te.testing.npu_sim import make_simulator_with_quant_max

    return make_simulator_with_quant_max()


def test_quant_max_only_on_its_own_simulator(qmax_sim):
    """torch_npu releases before op-plugin 26.1.0 have no npu_quant_max (hasattr is False): the default simulator
    models them, and the self-check asks an installed torch_npu only for the default simulator's kernels."""
    assert not hasattr(make_simulator(), "npu_quant_max")
    assert hasattr(qmax_sim, "npu_quant_max") and qmax_sim.npu.get_device_name() == "Ascend950PR"
    params = inspect.signature(qmax_sim.npu_quant_max).parameters
    assert list(params) == ["x", "scale", "round_mode", "dst_dtype", "group_list"]
    assert params["dst_dtype"].default == 291 and params["round_mode"].default == "rint"  # "int dst_dtype=291"
    assert params["round_mode"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2", "HIF8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quant_max_multiplies_by_the_scale_and_returns_the_inputs_amax(qmax_sim, fmt, dtype):
    """"y = cast(x * scale, dst_dtype), amax = max(|x|)": the float32 product, a saturating cast (kernel source:
    SatMode::SAT); amax of x itself (before the scale), shape [1], in x's dtype."""
    gen = np.random.default_rng(5)
    x = torch.from_numpy(gen.standard_normal((3, 7, 40)).astype(np.float32) * 50).to(dtype)
    x[0, 0, 0] = 1e4  # saturates
    s = torch.tensor([0.37], dtype=torch.float32)
    y, amax = qmax_sim.npu_quant_max(x, s, round_mode="round" if fmt == "HIF8" else "rint",
                                     dst_dtype=npu_dtype(qmax_sim, fmt))
    np.testing.assert_array_equal(raw(y), np_cast(f32(x) * f32(s)[0], fmt))
    assert y.dtype == (torch.uint8 if fmt == "HIF8" else TORCH_FP8[fmt]) and y.shape == x.shape
    assert amax.dtype == dtype and tuple(amax.shape) == (1,) and amax.item() == np.abs(f32(x)).max()
    assert qmax_sim.launch_counts == {"npu_quant_max": 1}


def test_quant_max_is_not_the_divide_rule_of_npu_quantize(qmax_sim):
    """Why delayed scaling keeps npu_quantize: it divides by d = 1/scale (bfloat16-rounded for bfloat16 inputs),
    npu_quant_max multiplies. x / d = 1.3671875 / 1.75 = 0.78125 is an E4M3 tie (0.75 | 0.8125), which nearest-even
    takes down; x * (1 / d), with 1 / 1.75 rounded to float32, lies just above it and goes up. A power-of-2 d gives
    the same codes both ways (x / 2^k and x * 2^-k are one exact scaling)."""
    x = torch.tensor([1.3671875, 2.734375, 5.46875, -3.171875], dtype=torch.bfloat16)
    d = torch.tensor([1.75], dtype=torch.bfloat16)
    divided = qmax_sim.npu_quantize(x, d, None, torch.float8_e4m3fn, -1, True)
    multiplied, _ = qmax_sim.npu_quant_max(x, d.float().reciprocal(), dst_dtype=torch.float8_e4m3fn)
    assert (raw(divided) != raw(multiplied)).all()
    np.testing.assert_array_equal(raw(divided), np_cast(f32(x) / np.float32(1.75), "E4M3"))
    for fmt in ("E4M3", "HIF8"):
        p2 = torch.tensor([0.125], dtype=torch.bfloat16)
        y, _ = qmax_sim.npu_quant_max(x * 37, p2.float().reciprocal(), round_mode="round" if fmt == "HIF8" else "rint",
                                      dst_dtype=npu_dtype(qmax_sim, fmt))
        np.testing.assert_array_equal(raw(y), raw(qmax_sim.npu_quantize(x * 37, p2, None, npu_dtype(qmax_sim, fmt),
                                                                         -1, True)))


def test_quant_max_nonfinite_input(qmax_sim):
    """Inf saturates to the format's max and makes amax Inf; NaN stays a NaN code, and the NaN amax is the
    simulator's assumption (the documents are silent on NaN)."""
    x = torch.tensor([1.0, float("inf"), -2.0])
    y, amax = qmax_sim.npu_quant_max(x, torch.ones(1), dst_dtype=torch.float8_e4m3fn)
    assert y.float().tolist() == [1.0, 448.0, -2.0] and amax.item() == math.inf
    y, amax = qmax_sim.npu_quant_max(torch.tensor([1.0, math.nan]), torch.ones(1), round_mode="round",
                                     dst_dtype=qmax_sim.hifloat8)
    assert raw(y)[1] == 0x80 and math.isnan(amax.item())


def test_quant_max_contract(qmax_sim):
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    s = torch.ones(1)
    q = qmax_sim.npu_quant_max
    e4m3 = torch.float8_e4m3fn
    # aclnnQuantMax: "Ascend 950PR&950DT系列产品：支持", "Atlas A2系列产品：不支持"
    from mindspeed_te.testing.npu_sim import make_simulator_with_quant_max

    assert_raises(lambda: make_simulator_with_quant_max("Ascend910B3").npu_quant_max(x, s, dst_dtype=e4m3),
                  NpuSocError, "Ascend910B3")
    make_simulator_with_quant_max("Ascend950DT").npu_quant_max(x, s, dst_dtype=e4m3)
    assert_raises(lambda: q(x.int(), s, dst_dtype=e4m3), NpuTypeError, "x")  # "float32、bfloat16和float16"
    assert_raises(lambda: q(x.reshape([1] * 7 + [32]).unsqueeze(0), s, dst_dtype=e4m3), NpuValueError, "x")  # 1-8
    assert_raises(lambda: q(x, s.bfloat16(), dst_dtype=e4m3), NpuTypeError, "scale")  # "数据类型支持float32"
    assert_raises(lambda: q(x, torch.ones(2), dst_dtype=e4m3), NpuValueError, "scale")  # "shape固定为[1]"
    assert_raises(lambda: q(x, torch.ones(()), dst_dtype=e4m3), NpuValueError, "scale")
    assert_raises(lambda: q(x, s, dst_dtype=torch.int8), NpuTypeError, "dst_dtype")  # "{34, 35, 36}"
    assert_raises(lambda: q(x, s, dst_dtype=None), NpuTypeError, "dst_dtype")
    assert_raises(lambda: q(x, s, round_mode="round", dst_dtype=e4m3), NpuValueError, "round_mode")
    assert_raises(lambda: q(x, s, dst_dtype=qmax_sim.hifloat8), NpuValueError, "round_mode")  # "rint": not HiF8's
    assert q(x, s)[0].dtype == torch.float8_e5m2  # the default 291
    assert q(x, s, dst_dtype=292)[0].dtype == e4m3  # torch_npu's number, as the binding takes it
    for call in (lambda: q(x, s, round_mode="hybrid", dst_dtype=qmax_sim.hifloat8),
                 lambda: q(x, s, dst_dtype=e4m3, group_list=torch.tensor([2, 4])),
                 lambda: q(x[:0], s, dst_dtype=e4m3)):
        with pytest.raises(NpuSimNotImplemented):
            call()
    assert qmax_sim.launch_counts["npu_quant_max"] == 2  # the rejected calls launched nothing


# Fused norm / SwiGLU + MX quantize (a simulator of their own: op-plugin 26.0.0 / 26.1.0 and later) ---------------
@pytest.fixture
def fused_sim():
    from mindspeed_te.testing.npu_sim import make_simulator_with_fused_quant

    return make_simulator_with_fused_quant()


def test_fused_quant_kernels_only_on_their_own_simulator(fused_sim):
    """The library calls them only where `hasattr(torch_npu, name)`; the default simulator (and so the self-check)
    lacks them. Keywords, defaults and kinds are op-plugin's schemas: "npu_rms_norm_dynamic_mx_quant(Tensor x,
    Tensor gamma, *, Tensor? beta=None, float epsilon=1e-06, int scale_alg=0, str round_mode="rint", int
    dst_type=296)", "npu_swiglu_mx_quant_with_dual_axis(Tensor x, *, Tensor? group_index=None, bool
    activate_left=True, str round_mode="rint", int scale_alg=1, int dst_type=24, float dst_type_max=0)"."""
    for name in ("npu_rms_norm_dynamic_mx_quant", "npu_swiglu_mx_quant_with_dual_axis"):
        assert not hasattr(make_simulator(), name) and hasattr(fused_sim, name)
    params = inspect.signature(fused_sim.npu_rms_norm_dynamic_mx_quant).parameters
    assert list(params) == ["x", "gamma", "beta", "epsilon", "scale_alg", "round_mode", "dst_type"]
    assert [params[k].default for k in list(params)[2:]] == [None, 1e-6, 0, "rint", 296]
    assert params["beta"].kind is inspect.Parameter.KEYWORD_ONLY
    params = inspect.signature(fused_sim.npu_swiglu_mx_quant_with_dual_axis).parameters
    assert list(params) == ["x", "group_index", "activate_left", "round_mode", "scale_alg", "dst_type", "dst_type_max"]
    assert [params[k].default for k in list(params)[1:]] == [None, True, "rint", 1, 24, 0.0]


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
@pytest.mark.parametrize("alg", [0, 1])
@pytest.mark.parametrize("dtype,gamma_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                               (torch.bfloat16, torch.float32)])
def test_rms_norm_dynamic_mx_quant_is_npu_rms_norm_then_mx_quant(fused_sim, fmt, alg, dtype, gamma_dtype):
    """"y = RmsNorm(x) ... 在尾轴上按k = 32个数分组": the norm as npu_rms_norm computes it (its rstd too), rounded to
    x's dtype (the kernel casts it into the buffer its MX quantize reads), then MX along the last dim by
    npu_dynamic_mx_quant's rules (the oracle: mx_reference on that rounded output). mxscale: x.shape[:-1] +
    (ceil(n / 64), 2); rstd: x.shape[:-1] + (1,) when x requires grad, else empty."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 40, 96, generator=gen) * 5).to(dtype).requires_grad_()
    gamma = (torch.randn(96, generator=gen) * 2).to(gamma_dtype)
    y, scale, rstd = fused_sim.npu_rms_norm_dynamic_mx_quant(x, gamma, epsilon=1e-5, scale_alg=alg,
                                                             dst_type=npu_dtype(fused_sim, fmt))
    normed, want_rstd = fused_sim.npu_rms_norm(x.detach(), gamma, 1e-5)
    codes, scales = mx_reference(f32(normed).reshape(-1, 96), fmt, alg)
    assert y.dtype == TORCH_FP8[fmt] and y.shape == x.shape
    np.testing.assert_array_equal(raw(y).reshape(-1, 96), codes)
    assert scale.dtype == torch.uint8 and tuple(scale.shape) == (2, 40, 2, 2)
    np.testing.assert_array_equal(scale.numpy().reshape(80, 2, 2), pair_blocks(scales))
    assert torch.equal(rstd, want_rstd) and tuple(rstd.shape) == (2, 40, 1)
    assert fused_sim.npu_rms_norm_dynamic_mx_quant(x.detach(), gamma, dst_type=torch.float8_e4m3fn)[2].numel() == 0
    assert fused_sim.launch_counts["npu_rms_norm_dynamic_mx_quant"] == 2


def test_rms_norm_dynamic_mx_quant_quantizes_the_rounded_norm(fused_sim):
    """The kernel stores the float32 norm in x's dtype (CAST_RINT) and quantizes that: its codes are those of the
    bfloat16 output, which differ at some elements from those of the float32 norm (a rounding twice: the bfloat16
    value can land on an E4M3 tie the float32 one lay beyond). beta is added in float32 before that rounding."""
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(64, 256, generator=gen) * 3).bfloat16()
    gamma = torch.randn(256, generator=gen).bfloat16()
    beta = torch.randn(256, generator=gen).bfloat16()
    y, _, _ = fused_sim.npu_rms_norm_dynamic_mx_quant(x, gamma, beta=beta, scale_alg=1, dst_type=torch.float8_e4m3fn)
    xf = f32(x).astype(np.float32)
    rstd = f32(torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6))
    y_hp = xf * rstd * f32(gamma) + f32(beta)
    rounded, _ = mx_reference(f32(torch.from_numpy(y_hp).bfloat16()), "E4M3", 1)
    unrounded, _ = mx_reference(y_hp, "E4M3", 1)
    np.testing.assert_array_equal(raw(y), rounded)
    assert (raw(y) != unrounded).any()


def test_rms_norm_dynamic_mx_quant_nonfinite_rows(fused_sim):
    """"当输入是Inf时：1、输出yOut为0；2、输出mxscaleOut为255，偶数pad填充值为0；3、输出rstdOut为0。当输入是NaN时：
    ... rstdOut为NaN。", per row; other rows as usual."""
    x = torch.randn(3, 96).bfloat16().requires_grad_()
    with torch.no_grad():
        x[0, 5], x[2, 40] = math.inf, math.nan
    y, scale, rstd = fused_sim.npu_rms_norm_dynamic_mx_quant(x, torch.ones(96, dtype=torch.bfloat16),
                                                             dst_type=torch.float8_e4m3fn)
    assert (raw(y)[[0, 2]] == 0).all() and (raw(y)[1] != 0).any()
    assert scale[0].flatten().tolist() == [255, 255, 255, 0] == scale[2].flatten().tolist()
    assert (scale[1] != 255).all()
    assert rstd[0].item() == 0 and math.isnan(rstd[2].item()) and math.isfinite(rstd[1].item())


def test_rms_norm_dynamic_mx_quant_contract(fused_sim):
    from mindspeed_te.testing.npu_sim import make_simulator_with_fused_quant

    x = torch.randn(4, 64, dtype=torch.bfloat16)
    g = torch.ones(64, dtype=torch.bfloat16)
    q = fused_sim.npu_rms_norm_dynamic_mx_quant
    e4m3 = torch.float8_e4m3fn
    # "Ascend 950PR/Ascend 950DT：支持", "Atlas A2 训练系列产品/Atlas A2 推理系列产品：不支持"
    assert_raises(lambda: make_simulator_with_fused_quant("Ascend910B3").npu_rms_norm_dynamic_mx_quant(
        x, g, dst_type=e4m3), NpuSocError, "Ascend910B3")
    make_simulator_with_fused_quant("Ascend950DT").npu_rms_norm_dynamic_mx_quant(x, g, dst_type=e4m3)
    assert_raises(lambda: q(x.float(), g.float(), dst_type=e4m3), NpuTypeError, "x")  # "FLOAT16、BFLOAT16"
    assert_raises(lambda: q(x.reshape([1] * 7 + [4, 64]), g, dst_type=e4m3), NpuValueError, "x")  # "1-7"
    assert_raises(lambda: q(x, g.half(), dst_type=e4m3), NpuTypeError, "gamma")  # x's dtype or FLOAT32
    assert_raises(lambda: q(x, g.reshape(1, 64), dst_type=e4m3), NpuValueError, "gamma")  # "shape只能为一维"
    assert_raises(lambda: q(x, g[:32], dst_type=e4m3), NpuValueError, "gamma")
    assert_raises(lambda: q(x, g, beta=g.float(), dst_type=e4m3), NpuTypeError, "beta")  # "与gamma保持一致"
    assert_raises(lambda: q(x, g, dst_type=torch.int8), NpuTypeError, "dst_type")  # {35, 36, 40, 41}
    assert_raises(lambda: q(x, g, dst_type=e4m3, round_mode="round"), NpuValueError, "round_mode")
    assert_raises(lambda: q(x, g, dst_type=e4m3, scale_alg=2), NpuValueError, "scale_alg")
    with pytest.raises(NpuSimNotImplemented):
        q(x, g)  # the default FP4 output
    assert fused_sim.launch_counts["npu_rms_norm_dynamic_mx_quant"] == 0


@pytest.mark.parametrize("chip", ["Ascend950PR", "Ascend950DT"])
@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
@pytest.mark.parametrize("alg", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swiglu_mx_quant_with_dual_axis_is_swiglu_then_dual_axis_mx_quant(chip, fmt, alg, dtype):
    """"swigluOut_i = Swish(A_i) * B_i" in float32 (A the left half with activate_left), rounded to x's dtype, then
    MX along -1 and -2: the oracle is mx_reference on rows and on columns of that output. Shapes: y1, y2 [M, N],
    mxscale1 [M, ceil(N/64), 2], mxscale2 [ceil(M/64), N, 2] ("mxscale2Out输出需要对每两行数据进行交织处理").
    On the 950PR too ("Ascend 950PR/Ascend 950DT：支持"), as npu_dynamic_mx_quant_with_dual_axis."""
    from mindspeed_te.testing.npu_sim import make_simulator_with_fused_quant

    sim = make_simulator_with_fused_quant(chip)
    x = (torch.randn(96, 2 * 80, generator=torch.Generator().manual_seed(5)) * 4).to(dtype)
    y1, s1, y2, s2 = sim.npu_swiglu_mx_quant_with_dual_axis(x, scale_alg=alg, dst_type=npu_dtype(sim, fmt))
    a, b = x.float()[:, :80], x.float()[:, 80:]
    act = f32((torch.nn.functional.silu(a) * b).to(dtype))
    codes, scales = mx_reference(act, fmt, alg)
    np.testing.assert_array_equal(raw(y1), codes)
    assert tuple(s1.shape) == (96, 2, 2) and s1.dtype == torch.uint8
    np.testing.assert_array_equal(s1.numpy(), pair_blocks(scales))
    codes, scales = mx_reference(act.T.copy(), fmt, alg)
    np.testing.assert_array_equal(raw(y2), codes.T)
    assert tuple(s2.shape) == (2, 80, 2)
    np.testing.assert_array_equal(s2.numpy(), pair_blocks(scales).transpose(1, 0, 2))
    right = sim.npu_swiglu_mx_quant_with_dual_axis(torch.cat([x[:, 80:], x[:, :80]], -1), activate_left=False,
                                                   scale_alg=alg, dst_type=npu_dtype(sim, fmt))
    assert all(torch.equal(p.view(torch.uint8), q.view(torch.uint8)) for p, q in zip(right, (y1, s1, y2, s2)))


def test_swiglu_mx_quant_with_dual_axis_contract(fused_sim):
    from mindspeed_te.testing.npu_sim import make_simulator_with_fused_quant

    x = torch.randn(64, 128, dtype=torch.bfloat16)
    sq = fused_sim.npu_swiglu_mx_quant_with_dual_axis
    assert_raises(lambda: make_simulator_with_fused_quant("Ascend910_9391").npu_swiglu_mx_quant_with_dual_axis(x),
                  NpuSocError, "Ascend910_9391")
    assert sq(x)[0].dtype == torch.float8_e4m3fn  # the default dst_type 24
    assert_raises(lambda: sq(x.float()), NpuTypeError, "x")  # "FLOAT16、BFLOAT16"
    assert_raises(lambda: sq(x.reshape(2, 32, 128)), NpuValueError, "x")  # 维度 "2"
    assert_raises(lambda: sq(x[:, :127]), NpuValueError, "x")  # "最后一维必须为偶数"
    assert_raises(lambda: sq(x[:0]), NpuValueError, "x")  # "不支持空Tensor"
    assert_raises(lambda: sq(x, dst_type_max=448.0), NpuValueError, "dst_type_max")  # "取值仅支持0"
    assert_raises(lambda: sq(x, round_mode="floor"), NpuValueError, "round_mode")
    assert_raises(lambda: sq(x, scale_alg=2), NpuValueError, "scale_alg")
    assert_raises(lambda: sq(x, dst_type=fused_sim.hifloat8), NpuTypeError, "dst_type")
    for call in (lambda: sq(x, group_index=torch.tensor([32, 64])), lambda: sq(x, dst_type=296)):
        with pytest.raises(NpuSimNotImplemented):
            call()
    assert fused_sim.launch_counts["npu_swiglu_mx_quant_with_dual_axis"] == 1


# npu_grouped_dynamic_mx_quant, npu_add_quant_matmul_, npu_add_quant_gmm_ (a simulator of their own: op-plugin
# 26.0.0 and later), and the K-split MX grouped GEMM they feed -----------------------------------------------------
@pytest.fixture
def wgrad_sim():
    from mindspeed_te.testing.npu_sim import make_simulator_with_fused_wgrad

    return make_simulator_with_fused_wgrad()


def grouped_pairs_reference(x, sizes, fmt, alg):
    """NumPy: each group of rows of x MX-quantized along its rows on its own (`mx_reference` of its transpose),
    its pairs placed at row (K_0 + .. + K_{i-1}) // 64 + i of a (K // 64 + g, n, 2) array; (codes, pairs, the
    rows that hold a group's pairs)."""
    m, n = x.shape
    codes = np.zeros((m, n), np.uint8)
    pairs = np.zeros((m // 64 + len(sizes), n, 2), np.int64)
    used, start = [], 0
    for i, size in enumerate(sizes):
        if size:
            c, sc = mx_reference(x[start:start + size].T.copy(), fmt, alg)
            codes[start:start + size] = c.T
            first = start // 64 + i
            pairs[first:first + -(-size // 64)] = pair_blocks(sc).transpose(1, 0, 2)
            used += range(first, first + -(-size // 64))
        start += size
    return codes, pairs, used


def test_fused_wgrad_kernels_only_on_their_own_simulator(wgrad_sim):
    """torch_npu releases before op-plugin 26.0.0 have none of them (hasattr is False): the default simulator
    lacks them, as the self-check's list of kernels the plugin needs must."""
    names = ("npu_grouped_dynamic_mx_quant", "npu_add_quant_matmul_", "npu_add_quant_gmm_")
    assert not any(hasattr(make_simulator(), name) for name in names)
    assert all(hasattr(wgrad_sim, name) for name in names) and wgrad_sim.npu.get_device_name() == "Ascend950PR"
    params = inspect.signature(wgrad_sim.npu_add_quant_matmul_).parameters
    assert [p for p in params if params[p].kind is inspect.Parameter.KEYWORD_ONLY] == [
        "x1_scale", "group_sizes", "x1_dtype", "x2_dtype", "x1_scale_dtype", "x2_scale_dtype"]


@pytest.mark.parametrize("fmt, alg", [("E4M3", 0), ("E4M3", 1), ("E5M2", 1)])
def test_grouped_dynamic_mx_quant_quantizes_each_group_on_its_own(wgrad_sim, fmt, alg):
    """Each group's rows MX-quantized along the rows in 32-row blocks from its first row, against NumPy; the scale
    pairs of group i at row (m_0 + .. + m_{i-1}) // 64 + i (odd block counts paired with a 0 byte), the rows between
    groups left unwritten (0xFF here); an empty group has none."""
    sizes = [32, 96, 0, 64, 160]  # odd and even numbers of 32-blocks, an empty group
    x = torch.randn(sum(sizes), 96, generator=torch.Generator().manual_seed(5)).bfloat16() * 40
    y, mxscale = wgrad_sim.npu_grouped_dynamic_mx_quant(
        x, torch.tensor(np.cumsum(sizes), dtype=torch.int32), dst_type=npu_dtype(wgrad_sim, fmt), scale_alg=alg)
    codes, pairs, used = grouped_pairs_reference(x.float().numpy(), sizes, fmt, alg)
    assert y.dtype == TORCH_FP8[fmt] and tuple(mxscale.shape) == (352 // 64 + 5, 96, 2)
    np.testing.assert_array_equal(raw(y), codes)
    np.testing.assert_array_equal(mxscale.numpy()[used], pairs[used])
    assert (mxscale.numpy()[[r for r in range(mxscale.shape[0]) if r not in used]] == 0xFF).all()
    assert wgrad_sim.launch_counts == {"npu_grouped_dynamic_mx_quant": 1}


def test_grouped_dynamic_mx_quant_contract(wgrad_sim):
    from mindspeed_te.testing.npu_sim import make_simulator_with_fused_wgrad

    x = torch.randn(128, 64, dtype=torch.bfloat16)
    ends = torch.tensor([64, 128], dtype=torch.int32)
    q = wgrad_sim.npu_grouped_dynamic_mx_quant
    assert q(x, ends)[0].dtype == torch.float8_e5m2  # the schema's default dst_type 23
    assert_raises(lambda: make_simulator_with_fused_wgrad("Ascend910B1").npu_grouped_dynamic_mx_quant(x, ends),
                  NpuSocError, "Ascend910B1")
    assert_raises(lambda: q(x.float(), ends), NpuTypeError, "x")  # "FLOAT16、BFLOAT16"
    assert_raises(lambda: q(x.reshape(2, 64, 64), ends), NpuValueError, "x")  # "shape仅支持2维"
    assert_raises(lambda: q(x, ends.long()), NpuTypeError, "group_index")  # "INT32"
    assert_raises(lambda: q(x, torch.tensor([64, 100], dtype=torch.int32)), NpuValueError, "group_index")
    assert_raises(lambda: q(x, torch.tensor([64, 32, 128], dtype=torch.int32)), NpuValueError, "group_index")
    assert_raises(lambda: q(x, ends, blocksize=64), NpuValueError, "blocksize")  # "仅支持32"
    assert_raises(lambda: q(x, ends, round_mode="floor"), NpuValueError, "round_mode")
    assert_raises(lambda: q(x, ends, scale_alg=2), NpuValueError, "scale_alg")  # FP8: 0 or 1
    assert_raises(lambda: q(x, ends, dst_type=wgrad_sim.hifloat8), NpuTypeError, "dst_type")
    with pytest.raises(NpuSimNotImplemented):
        q(x, ends, dst_type=296)


def _k_split_operands(sim, sizes, m=48, n=80, seed=7):
    """Per-group MX operands of a K-split GEMM over the tokens: dY (K, m) and X (K, n) quantized by
    npu_grouped_dynamic_mx_quant, with each group's own npu_dynamic_mx_quant(axis=0) forms beside."""
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(sum(sizes), m, generator=g).bfloat16() * 3
    x = torch.randn(sum(sizes), n, generator=g).bfloat16()
    ends = torch.tensor(np.cumsum(sizes), dtype=torch.int32)
    a, sa = sim.npu_grouped_dynamic_mx_quant(dy, ends, dst_type=sim.float8_e5m2, scale_alg=1)
    b, sb = sim.npu_grouped_dynamic_mx_quant(x, ends, dst_type=sim.float8_e4m3fn, scale_alg=1)
    own, start = [], 0
    for size in sizes:
        own.append([sim.npu_dynamic_mx_quant(t[start:start + size], axis=0, dst_type=d, scale_alg=1)
                    for t, d in ((dy, sim.float8_e5m2), (x, sim.float8_e4m3fn))] if size else None)
        start += size
    return (a, sa, b, sb), own


def _own_product(sim, forms, out_dtype):
    (qa, pa), (qb, pb) = forms
    return sim.npu_quant_matmul(qa.t(), qb, pb, pertoken_scale=pa.permute(1, 0, 2), output_dtype=out_dtype,
                                scale_dtype=sim.float8_e8m0fnu, pertoken_scale_dtype=sim.float8_e8m0fnu,
                                group_sizes=[1, 1, 32])


@pytest.mark.parametrize("sizes", [[32, 96, 64], [64, 0, 160, 32], [96]])
def test_grouped_matmul_mx_split_k(wgrad_sim, sizes):
    """aclnnGroupedMatmulV4's K-split MX mode (groupType 2, E8M0 scales ((K / 64) + g, M, 2) and ((K / 64) + g,
    N, 2), group i's at row (K_0 + .. + K_{i-1}) // 64 + i): each group's product equals the MX npu_quant_matmul
    of that group's own forms, bit for bit (float32 and bfloat16 out); an empty group gives zeros. The rows
    between groups are never read (their 0xFF bytes would make NaN)."""
    (a, sa, b, sb), own = _k_split_operands(wgrad_sim, sizes)
    kw = dict(group_list=torch.tensor(np.cumsum(sizes)), split_item=3, group_type=2,
              scale_dtype=wgrad_sim.float8_e8m0fnu, per_token_scale_dtype=wgrad_sim.float8_e8m0fnu)
    for out_dtype in (torch.float32, torch.bfloat16):
        (y,) = wgrad_sim.npu_grouped_matmul([a.t()], [b], scale=[sb], per_token_scale=[sa], output_dtype=out_dtype,
                                            **kw)
        assert y.shape == (len(sizes), 48, 80) and y.dtype == out_dtype
        for i, forms in enumerate(own):
            want = torch.zeros(48, 80, dtype=out_dtype) if forms is None else _own_product(wgrad_sim, forms, out_dtype)
            assert torch.equal(y[i], want)
    # what the mode refuses: x not the transposed view, scales of other shapes or not contiguous
    gmm = wgrad_sim.npu_grouped_matmul
    args = dict(kw, scale=[sb], per_token_scale=[sa], output_dtype=torch.float32)
    assert_raises(lambda: gmm([a.t().contiguous()], [b], **args), NpuValueError, "x[0]")
    assert_raises(lambda: gmm([a.t()], [b], **dict(args, scale=[sb[1:]])), NpuValueError, "scale[0]")
    assert_raises(lambda: gmm([a.t()], [b], **dict(args, per_token_scale=[sa[:, :-1]])), NpuValueError,
                  "per_token_scale[0]")
    swapped = sa.transpose(0, 1).contiguous().transpose(0, 1)
    assert_raises(lambda: gmm([a.t()], [b], **dict(args, per_token_scale=[swapped])), NpuValueError, "contiguous")


def test_add_quant_matmul_adds_the_mx_product_in_one_rounding(wgrad_sim):
    """npu_add_quant_matmul_ (aclnnQuantBatchMatmulInplaceAdd, mx量化): y + the MX GEMM's float32 sum, rounded once
    -- exactly y.add_(npu_quant_matmul(..., output_dtype=float32)) -- written into y itself; x1_scale as the
    (ceil(K/64), M, 2) pairs or their transposed view (the document's example)."""
    (_, _, _, _), own = _k_split_operands(wgrad_sim, [160])
    (qa, pa), (qb, pb) = own[0]
    y0 = torch.randn(48, 80, generator=torch.Generator().manual_seed(3)) * 100
    want = y0 + _own_product(wgrad_sim, own[0], torch.float32)
    e8 = dict(group_sizes=[1, 1, 32], x1_scale_dtype=wgrad_sim.float8_e8m0fnu, x2_scale_dtype=wgrad_sim.float8_e8m0fnu)
    for x1_scale in (pa, pa.permute(1, 0, 2)):
        y = y0.clone()
        assert wgrad_sim.npu_add_quant_matmul_(y, qa.t(), qb, pb, x1_scale=x1_scale, **e8) is y
        assert torch.equal(y, want)
    add = wgrad_sim.npu_add_quant_matmul_
    y = y0.clone()
    assert_raises(lambda: add(y.bfloat16(), qa.t(), qb, pb, x1_scale=pa, **e8), NpuTypeError, "self")  # float32
    assert_raises(lambda: add(y[:-1], qa.t(), qb, pb, x1_scale=pa, **e8), NpuValueError, "self")  # (M, N)
    # "当前仅支持transposeX1=true且transposeX2=false"
    assert_raises(lambda: add(y, qa.t().contiguous(), qb, pb, x1_scale=pa, **e8), NpuValueError, "x1")
    assert_raises(lambda: add(y, qa.t(), qb.t().contiguous().t(), pb, x1_scale=pa, **e8), NpuValueError, "x2")
    assert_raises(lambda: add(y, qa.t(), qb, pb, x1_scale=pa, **dict(e8, group_sizes=None)), NpuValueError,
                  "group_sizes")
    assert_raises(lambda: add(y, qa.t(), qb, pb, x1_scale=pa, **dict(e8, x2_scale_dtype=None)), NpuTypeError,
                  "x2_scale_dtype")
    assert_raises(lambda: add(y, qa.t(), qb, pb, **e8), NpuValueError, "x1_scale")
    assert_raises(lambda: add(y, qa.t(), qb, pb[1:], x1_scale=pa, **e8), NpuValueError, "scale")
    assert_raises(lambda: add(y, qa.t()[:, :0], qb[:0], pb[:0], x1_scale=pa[:0], **e8), NpuValueError, "K")
    h1, _ = random_codes((160, 48), "HIF8", 8)
    h2, _ = random_codes((160, 80), "HIF8", 9)
    with pytest.raises(NpuSimNotImplemented):  # the HiF8 T-T mode, which the library does not call
        add(y, h1.t(), h2, torch.ones(1), x1_scale=torch.ones(1), group_sizes=[0, 0, 0], x1_dtype=wgrad_sim.hifloat8,
            x2_dtype=wgrad_sim.hifloat8)
    assert torch.equal(y, y0)  # refused calls leave y as it was
    assert wgrad_sim.launch_counts["npu_add_quant_matmul_"] == 2


def test_add_quant_gmm_adds_each_groups_product(wgrad_sim):
    """npu_add_quant_gmm_ (aclnnQuantGroupedMatmulInplaceAdd, mx量化): y[i] + group i's K-split MX product, its
    float32 sum rounded once, in place; the group_list may stop short of K (the rest updates nothing)."""
    sizes = [32, 96, 0, 64]
    (a, sa, b, sb), own = _k_split_operands(wgrad_sim, sizes)
    y0 = torch.randn(4, 48, 80, generator=torch.Generator().manual_seed(4))
    e8 = dict(x1_scale_dtype=wgrad_sim.float8_e8m0fnu, x2_scale_dtype=wgrad_sim.float8_e8m0fnu)
    y = y0.clone()
    group_list = torch.tensor(np.cumsum(sizes))
    assert wgrad_sim.npu_add_quant_gmm_(y, a.t(), b, sb, group_list, x1_scale=sa, **e8) is y
    for i, forms in enumerate(own):
        assert torch.equal(y[i], y0[i] if forms is None else y0[i] + _own_product(wgrad_sim, forms, torch.float32))
    gmm_add = wgrad_sim.npu_add_quant_gmm_
    assert_raises(lambda: gmm_add(y, a.t(), b, sb, group_list, x1_scale=sa, group_sizes=[1, 1, 32], **e8),
                  NpuValueError, "group_sizes")  # the binding: "group_sizes is not supported currently."
    assert_raises(lambda: gmm_add(y[:3], a.t(), b, sb, group_list, x1_scale=sa, **e8), NpuValueError, "self")
    assert_raises(lambda: gmm_add(y.bfloat16(), a.t(), b, sb, group_list, x1_scale=sa, **e8), NpuTypeError, "self")
    assert_raises(lambda: gmm_add(y, a.t(), b, sb, group_list.int(), x1_scale=sa, **e8), NpuTypeError, "group_list")
    assert_raises(lambda: gmm_add(y, a.t(), b, sb, group_list, x1_scale=sa, group_list_type=2, **e8),
                  NpuValueError, "group_list_type")
    assert_raises(lambda: gmm_add(y, a.t(), b, sb, group_list, **e8), NpuValueError, "x1_scale")


def test_grouped_matmul_add_adds_each_groups_product(wgrad_sim):
    """npu_grouped_matmul_add_: y_i + x_iᵀ @ weight_i per group of the token dim, in float64 exactly (bf16 values,
    few tokens: every float32 sum is exact here), in place. 26.0.0's binding on the 950 calls
    aclnnGroupedMatmulAddV2 (y (g, m, n), group_list cumulative or sizes); on Atlas A2/A3 the first kernel
    (y (g * m, n)); 2.14's binding calls the first kernel everywhere, which the 950 refuses."""
    sizes = [3, 0, 5, 8]
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-8, 9, (16, 6), generator=g).bfloat16()  # (K, m): tokens-major, as the binding takes it
    w = torch.randint(-8, 9, (16, 7), generator=g).bfloat16()
    y0 = torch.randint(-64, 65, (4, 6, 7), generator=g).float()
    ends = np.cumsum(sizes)
    want = torch.stack([y0[i].double() + x[e - k:e].double().t() @ w[e - k:e].double()
                        for i, (e, k) in enumerate(zip(ends, sizes))])
    for list_type, group_list in ((0, torch.tensor(ends)), (1, torch.tensor(sizes))):
        y = y0.clone()
        assert wgrad_sim.npu_grouped_matmul_add_(y, x, w, group_list, group_list_type=list_type) is y
        assert torch.equal(y.double(), want)
    a2 = make_release_simulator("Ascend910B3", "26.1")
    y = y0.clone().view(24, 7)
    a2.npu_grouped_matmul_add_(y, x, w, torch.tensor(ends))
    assert torch.equal(y.view(4, 6, 7).double(), want)
    assert_raises(lambda: a2.npu_grouped_matmul_add_(y0.clone(), x, w, torch.tensor(ends)), NpuValueError, "self")
    assert_raises(lambda: a2.npu_grouped_matmul_add_(y, x, w, torch.tensor(sizes), group_list_type=1),
                  NpuValueError, "group_list_type")  # the first kernel: "仅支持0（cumsum模式）"
    assert_raises(lambda: make_simulator().npu_grouped_matmul_add_(y0.clone(), x, w, torch.tensor(ends)),
                  NpuSocError, "Atlas A2/A3")
    add, group_list, y = wgrad_sim.npu_grouped_matmul_add_, torch.tensor(ends), y0.clone()
    assert_raises(lambda: add(y.view(24, 7), x, w, group_list), NpuValueError, "self")
    assert_raises(lambda: add(y.double(), x, w, group_list), NpuTypeError, "self")
    assert_raises(lambda: add(y, x.float(), w.float(), group_list), NpuTypeError, "x")
    assert_raises(lambda: add(y, x, w.half(), group_list), NpuTypeError, "weight")
    assert_raises(lambda: add(y, x, w, group_list, transpose_x=False), NpuValueError, "transpose_x")
    assert_raises(lambda: add(y, x, w, group_list, transpose_weight=True), NpuValueError, "transpose_weight")
    assert_raises(lambda: add(y, x, w, group_list, group_type=0), NpuValueError, "group_type")
    assert_raises(lambda: add(y, x, w, group_list.int()), NpuTypeError, "group_list")
    assert_raises(lambda: add(y, x, w, torch.tensor([3, 3, 8, 12])), NpuValueError, "group_list")
    assert_raises(lambda: add(y, x[:12], w, group_list), NpuValueError, "first dim")
    assert torch.equal(y, y0)  # refused calls leave y as it was
