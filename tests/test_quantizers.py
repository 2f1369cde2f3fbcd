"""Quantizers against the numpy/ml_dtypes/en_dtypes oracles: data bits, scale_inv, exact dequantize."""
from copy import deepcopy

import numpy as np
import pytest
import torch

from mindspeed_te import (
    DelayedScaling,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Format,
    FP8Dtype,
    MXFP8Quantizer,
    RecipeState,
)
from mindspeed_te.formats import cast_from_fp8
from mindspeed_te.recipe_state import update_delayed_states
from tests.oracles import current_scale_inv, mx_reference, np_cast, np_decode, tiles_reference

ALL = [FP8Dtype.E4M3, FP8Dtype.E5M2, FP8Dtype.HIF8]


def _codes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def _sample(shape, seed=0, spread=4.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * spread)


@pytest.mark.parametrize("fp8_dtype", ALL)
@pytest.mark.parametrize("target", [None, 15.0])
def test_current_scaling_matches_oracle(fp8_dtype, target):
    target = target or fp8_dtype.max
    x = _sample((37, 100))
    q = Float8CurrentScalingQuantizer(fp8_dtype, target)(x)
    xn = x.numpy()
    scale_inv = current_scale_inv(float(np.abs(xn).max()), target)
    np.testing.assert_array_equal(_codes(q.data), np_cast(xn / scale_inv, fp8_dtype.name))
    assert q.scale_inv.item() == scale_inv
    expected = np_decode(_codes(q.data), fp8_dtype.name) * scale_inv
    np.testing.assert_array_equal(q.dequantize().numpy(), expected)
    assert q.data.shape == x.shape and q.columnwise_data.shape == (100, 37)


def test_current_scaling_error_bound_e4m3():
    x = _sample((64, 64), seed=3, spread=1.0)
    deq = Float8CurrentScalingQuantizer(FP8Dtype.E4M3, 448.0)(x).dequantize()
    # E4M3 has 3 mantissa bits: relative error <= 2^-4 for normal values; absolute floor at the subnormals.
    amax = x.abs().max()
    assert ((deq - x).abs() <= x.abs() * 2**-4 + amax / 448 * 2**-9).all()


def test_power_2_and_epsilon_options():
    x = torch.full((4, 4), 3.0)
    q = Float8CurrentScalingQuantizer(FP8Dtype.E4M3, 448.0, power_2_scale=True)(x)
    assert q.scale_inv.item() == 1 / 128
    q = Float8CurrentScalingQuantizer(FP8Dtype.E4M3, 448.0, amax_epsilon=1.0)(torch.full((2,), 1e-3))
    assert q.scale_inv.item() == np.float32(1) / np.float32(448)  # amax raised to epsilon = 1


@pytest.mark.parametrize("fp8_dtype", ALL)
def test_delayed_quantizer_uses_state_scale_and_records_amax(fp8_dtype):
    fmt = {FP8Dtype.E4M3: Format.E4M3, FP8Dtype.E5M2: Format.HYBRID, FP8Dtype.HIF8: Format.HIF8}[fp8_dtype]
    forward = fp8_dtype is not FP8Dtype.E5M2
    state = RecipeState.create(DelayedScaling(fp8_format=fmt, amax_history_len=4), forward=forward,
                               num_quantizers=3)
    quantizers = state.make_quantizers()
    state.scale[1] = 3.5
    x = _sample((8, 16), seed=5)
    q = quantizers[1](x)
    # Delayed scaling divides by scale_inv = 1/scale, as npu_quantize(div_mode=True) does.
    np.testing.assert_array_equal(_codes(q.data), np_cast(x.numpy() / (np.float32(1) / np.float32(3.5)),
                                                          fp8_dtype.name))
    assert state.amax_history[0].tolist() == [0.0, x.abs().max().item(), 0.0]
    quantizers[1](x * 0.5)  # max-accumulates
    assert state.amax_history[0, 1].item() == x.abs().max().item()
    state.update()
    target = state.recipe.target_max(forward)
    assert state.scale[1].item() == np.float32(target) / np.float32(x.abs().max().item())
    assert state.amax_history[:, 1].tolist()[-1] == x.abs().max().item()


def test_quantizers_of_every_call_alias_their_states_tensors():
    """Each module call makes new quantizers over one-element views its state makes once: views taken before
    an update see it, and a deep-copied state's quantizers write into the copy only."""
    state = RecipeState.create(DelayedScaling(fp8_format=Format.E4M3, amax_history_len=2), forward=True,
                               num_quantizers=3)
    early = state.make_quantizers()
    state.amax_history[0, 2] = 7.0
    update_delayed_states([state])  # batched: new scales and 1/scale written in place
    late = state.make_quantizers()
    assert late[2] is not early[2]
    x = _sample((4, 8), seed=3)
    for quantizer in (early[2], late[2]):  # both divide by 1/scale of the update: 7 / 448
        np.testing.assert_array_equal(_codes(quantizer(x).data),
                                      np_cast(x.numpy() / (np.float32(1) / (np.float32(448) / np.float32(7))),
                                              "E4M3"))
    assert state.amax_history[0].tolist() == [0.0, 0.0, x.abs().max().item()]
    copy = deepcopy(state)
    copy.make_quantizers()[0](x * 2)
    early[1](x * 3)
    assert copy.amax_history[0].tolist() == [(x * 2).abs().max().item(), 0.0, x.abs().max().item()]
    assert state.amax_history[0].tolist() == [0.0, (x * 3).abs().max().item(), x.abs().max().item()]


@pytest.mark.parametrize("fp8_dtype", ALL)
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("shape", [(130, 300), (5, 128), (2, 3, 200)])
def test_blockwise_matches_oracle(fp8_dtype, block_dim, shape):
    x = _sample(shape, seed=7)
    q = Float8BlockQuantizer(fp8_dtype, fp8_dtype.max, block_scaling_dim=block_dim)(x)
    x2 = x.reshape(-1, shape[-1]).numpy()
    rows = 1 if block_dim == 1 else 128
    codes, scale_inv = tiles_reference(x2, rows, 128, fp8_dtype.name, fp8_dtype.max, pow2=True)
    np.testing.assert_array_equal(_codes(q.rowwise_data).reshape(x2.shape), codes)
    np.testing.assert_array_equal(q.rowwise_scale_inv.numpy(), scale_inv)
    # Columnwise: 1x128 re-quantized from the high-precision transpose; 128x128 is the exact transpose.
    ccodes, cscale = tiles_reference(np.ascontiguousarray(x2.T), rows, 128, fp8_dtype.name, fp8_dtype.max, True)
    cdata, cscale_inv = q.columnwise_pair()
    np.testing.assert_array_equal(_codes(cdata), ccodes)
    np.testing.assert_array_equal(cscale_inv.numpy(), cscale)
    # Dequantize is exact: decode(data) * the tile's scale_inv.
    tile_scales = np.repeat(np.repeat(scale_inv, rows, 0)[: x2.shape[0]], 128, 1)[:, : x2.shape[1]]
    expected = np_decode(codes, fp8_dtype.name) * tile_scales
    np.testing.assert_array_equal(q.dequantize().reshape(x2.shape).numpy(), expected)
    assert q.dequantize(columnwise=True).shape == x.shape


def test_blockwise_non_power_2_scales():
    x = _sample((4, 256), seed=2)
    q = Float8BlockQuantizer(FP8Dtype.E4M3, 448.0, power_2_scale=False)(x)
    _, scale_inv = tiles_reference(x.numpy(), 1, 128, "E4M3", 448.0, pow2=False)
    np.testing.assert_array_equal(q.rowwise_scale_inv.numpy(), scale_inv)


@pytest.mark.parametrize("fp8_dtype", [FP8Dtype.E4M3, FP8Dtype.E5M2])
@pytest.mark.parametrize("rounding", ["ceil", "floor"])
def test_mxfp8_matches_oracle(fp8_dtype, rounding):
    x = _sample((64, 96), seed=11, spread=3.0)
    x[0, :32] = 0.0  # an all-zero block
    x[1, :32] = 448.0 * 2.0**-3  # a block whose amax is exactly fmt_max * 2^k
    q = MXFP8Quantizer(fp8_dtype, rounding=rounding)(x)
    codes, exps = mx_reference(x.numpy(), fp8_dtype.name, rounding)
    np.testing.assert_array_equal(_codes(q.rowwise_data), codes)
    np.testing.assert_array_equal(q.rowwise_scale_inv.numpy(), exps)
    ccodes, cexps = mx_reference(np.ascontiguousarray(x.numpy().T), fp8_dtype.name, rounding)
    np.testing.assert_array_equal(_codes(q.columnwise_data), ccodes)
    np.testing.assert_array_equal(q.columnwise_scale_inv.numpy(), cexps)
    expected = np_decode(codes, fp8_dtype.name) * np.repeat(np.ldexp(1.0, exps.astype(int) - 127), 32, 1)
    np.testing.assert_array_equal(q.dequantize().numpy(), expected.astype(np.float32))
    if rounding == "ceil":  # TE's rule never saturates: every scaled element is within the format's range
        scaled = x.double().numpy() / np.repeat(np.ldexp(1.0, exps.astype(int) - 127), 32, 1)
        assert (np.abs(scaled) <= fp8_dtype.max).all()


@pytest.mark.parametrize("rows", [1, 30, 70])
def test_mxfp8_columnwise_blocks_along_any_rows(rows):
    """Rows not divisible by 32 (an expert's tokens, unpadded): the columnwise form's last block is short, its scale
    from its own rows; the rowwise form is row-local. TE would refuse the shape."""
    x = _sample((rows, 64), seed=5, spread=3.0)
    q = MXFP8Quantizer(FP8Dtype.E4M3)(x)
    codes, exps = mx_reference(x.numpy(), "E4M3", "ceil")
    np.testing.assert_array_equal(_codes(q.rowwise_data), codes)
    np.testing.assert_array_equal(q.rowwise_scale_inv.numpy(), exps)
    ccodes, cexps = mx_reference(np.ascontiguousarray(x.numpy().T), "E4M3", "ceil")
    assert cexps.shape == (64, -(-rows // 32))
    np.testing.assert_array_equal(_codes(q.columnwise_data), ccodes)
    np.testing.assert_array_equal(q.columnwise_scale_inv.numpy(), cexps)
    expected = np_decode(ccodes, "E4M3") * np.repeat(np.ldexp(1.0, cexps.astype(int) - 127), 32, 1)[:, :rows]
    np.testing.assert_array_equal(q.dequantize(columnwise=True).numpy().T, expected.astype(np.float32))


def test_mxfp8_rejects_a_last_dim_not_divisible_by_32():
    with pytest.raises(ValueError, match="last dim .* divisible by 32"):
        MXFP8Quantizer(FP8Dtype.E4M3)(torch.ones(64, 30))
    with pytest.raises(ValueError, match="E4M3 or E5M2"):
        MXFP8Quantizer(FP8Dtype.HIF8)


def test_usage_controls_and_dropping_copies():
    x = _sample((128, 128))
    q = Float8BlockQuantizer(FP8Dtype.E4M3, 448.0, rowwise=False, columnwise=True)(x)
    assert q.rowwise_data is None and q.columnwise_data is not None
    w = Float8BlockQuantizer(FP8Dtype.E4M3, 448.0, block_scaling_dim=2)(x)
    assert w.columnwise_data is None and w.columnwise_pair()[0].data_ptr() == w.rowwise_data.data_ptr()
    with pytest.raises(RuntimeError, match="no rowwise data"):
        q.dequantize()
    q = MXFP8Quantizer(FP8Dtype.E4M3)(x)
    full = q.nbytes()
    q.update_usage(rowwise=False)
    assert q.nbytes() == full // 2 and q.rowwise_data is None


def test_nan_and_inf_inputs_dequantize_to_nan_only_where_they_were():
    """Issue 12: a tile holding NaN/Inf is not given scale 1 silently: its decode scale is NaN, so it
    dequantizes to NaN; the other tiles are quantized exactly as if the bad values were absent."""
    x = _sample((2, 256))
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    q = Float8BlockQuantizer(FP8Dtype.E4M3, 448.0)(x)
    assert torch.isnan(q.rowwise_scale_inv[:, 0]).all() and torch.isfinite(q.rowwise_scale_inv[:, 1]).all()
    clean = Float8BlockQuantizer(FP8Dtype.E4M3, 448.0)(x[:, 128:])
    assert torch.equal(q.rowwise_scale_inv[:, 1], clean.rowwise_scale_inv[:, 0])
    values = q.dequantize()
    assert torch.isnan(values[:, :128]).all() and torch.equal(values[:, 128:], clean.dequantize())
    cq = Float8CurrentScalingQuantizer(FP8Dtype.HIF8, 15.0)(x)
    assert torch.isnan(cq.scale_inv).all() and torch.isnan(cq.dequantize()).all()


def test_bad_input_is_rejected():
    q = Float8CurrentScalingQuantizer(FP8Dtype.E4M3, 448.0)
    with pytest.raises(TypeError, match="floating-point"):
        q(torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="0-d"):
        q(torch.tensor(1.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_dequantize_to_their_dtype(dtype):
    x = _sample((16, 128)).to(dtype)
    q = Float8CurrentScalingQuantizer(FP8Dtype.HIF8, 15.0)(x)
    assert q.dequantize().dtype == dtype
    scale_inv = current_scale_inv(float(x.float().abs().max()), 15.0)
    np.testing.assert_array_equal(_codes(q.data), np_cast(x.float().numpy() / scale_inv, "HIF8"))
    np.testing.assert_array_equal(cast_from_fp8(q.data, FP8Dtype.HIF8).numpy(),
                                  np_decode(_codes(q.data), "HIF8"))
