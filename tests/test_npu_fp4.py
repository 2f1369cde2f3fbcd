"""FP4 on the NPU path: the simulator's MX kernels with FP4 operands against ml_dtypes and closed forms, the MXFP4
recipe on those kernels against the reference backend bit for bit, the launch counts, and NVFP4's refusal."""
import ml_dtypes
import numpy as np
import pytest
import torch

from mindspeed_te import FP8GlobalStateManager, fp8_autocast
from mindspeed_te.bench.launches import linear_launches, npu_simulated
from mindspeed_te.kernels.npu import NpuBackend
from mindspeed_te.modules import Linear
from mindspeed_te.quantizers import MXFP4Quantizer
from mindspeed_te.recipe import MXFP4BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling
from mindspeed_te.testing.npu_sim import (
    NpuContractError,
    NpuSimNotImplemented,
    NpuTypeError,
    NpuValueError,
    make_simulator,
)
from tests.test_npu_backend import _step

CHIPS = ("Ascend950PR", "Ascend950DT")


def _e2m1(values: np.ndarray) -> np.ndarray:
    """ml_dtypes' E2M1 codes (round to nearest even, saturating) of float32 values."""
    return values.astype(np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF


def _oracle_mx_fp4(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(E2M1 codes, E8M0 bytes) of 32-blocks along the last dim by the OCP rule: 2^(floor(log2 amax) - 2)."""
    v = x.float().numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(v).max(axis=-1)
    exponent = np.floor(np.log2(amax)).astype(np.int64) - 2
    codes = _e2m1(v / np.exp2(exponent)[..., None].astype(np.float32))
    return codes.reshape(x.shape), (exponent + 127).astype(np.uint8)


def _unpack(packed: torch.Tensor) -> np.ndarray:
    b = packed.numpy()
    return np.stack((b & 0xF, b >> 4), axis=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])


def test_simulator_fp4_codec_is_ml_dtypes():
    from mindspeed_te.testing.npu_sim.fp4 import e2m1_values, fp4_decode_packed, fp4_encode_packed

    codes = np.arange(16, dtype=np.uint8)
    assert np.array_equal(e2m1_values().numpy(), codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64))
    x = torch.linspace(-8, 8, 4097, dtype=torch.float64).float()  # every midpoint and beyond the max
    packed = fp4_encode_packed(x.reshape(1, -1)[:, :4096])
    assert np.array_equal(_unpack(packed)[0], _e2m1(x[:4096].numpy()))
    assert torch.equal(fp4_decode_packed(packed)[0], torch.from_numpy(
        _e2m1(x[:4096].numpy()).view(ml_dtypes.float4_e2m1fn).astype(np.float32)))
    assert fp4_encode_packed(torch.tensor([[1.0, -6.0]])).item() == 0x2 | (0xF << 4)  # element 0 in the low nibble


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dynamic_mx_quant_fp4_is_the_ocp_rule(dtype):
    sim = make_simulator()
    x = (torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 5).to(dtype)
    y, scale = sim.npu_dynamic_mx_quant(x, axis=-1, dst_type=sim.float4_e2m1fn_x2, scale_alg=0)
    codes, e8m0 = _oracle_mx_fp4(x)
    assert y.dtype == torch.uint8 and y.shape == (64, 48)
    assert np.array_equal(_unpack(y), codes)
    assert scale.shape == (64, 2, 2) and np.array_equal(scale.reshape(64, 4)[:, :3].numpy(), e8m0)
    assert (scale.reshape(64, 4)[:, 3] == 0).all()  # "并对其进行偶数pad，pad填充值为0"
    # along the rows: blocks of 32 rows, the bytes still packed along the last dim, scale rows interleaved in pairs
    y2, scale2 = sim.npu_dynamic_mx_quant(x, axis=-2, dst_type=sim.float4_e2m1fn_x2, scale_alg=0)
    codes_t, e8m0_t = _oracle_mx_fp4(x.t().contiguous())
    assert np.array_equal(_unpack(y2), codes_t.T)
    assert scale2.shape == (1, 96, 2) and np.array_equal(scale2[0].numpy(), e8m0_t)


def test_dual_axis_fp4_is_both_single_axis_calls():
    sim = make_simulator("Ascend950DT")
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    kw = dict(dst_type=sim.float4_e2m1fn_x2, scale_alg=0)
    got = sim.npu_dynamic_mx_quant_with_dual_axis(x, **kw)
    want = (*sim.npu_dynamic_mx_quant(x, axis=-1, **kw), *sim.npu_dynamic_mx_quant(x, axis=-2, **kw))
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("kwargs, error", [
    (dict(scale_alg=1), NpuValueError),  # "当dstType为FLOAT4_E2M1时仅支持取值为0和2"
    (dict(scale_alg=2), NpuSimNotImplemented),
    (dict(round_mode="floor"), NpuSimNotImplemented),
    (dict(round_mode="ceil"), NpuValueError),
    (dict(dst_type_max=5.0), NpuValueError),  # "支持取值0.0和6.0-12.0"
])
def test_dynamic_mx_quant_fp4_contract(kwargs, error):
    sim = make_simulator()
    with pytest.raises(error):
        sim.npu_dynamic_mx_quant(torch.ones(32, 64), dst_type=sim.float4_e2m1fn_x2, **kwargs)
    with pytest.raises(NpuValueError, match="even last dim"):  # "x的最后一维必须是偶数"
        sim.npu_dynamic_mx_quant(torch.ones(32, 33), axis=0, dst_type=sim.float4_e2m1fn_x2)
    assert sum(sim.launch_counts.values()) == 0


def _fp4_operand(sim, rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """(packed codes (rows, k / 2), scale pairs (rows, k / 64, 2), the exact float64 values) of a random MXFP4
    operand made by the simulator's quantize."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 3
    y, s = sim.npu_dynamic_mx_quant(x, axis=-1, dst_type=sim.float4_e2m1fn_x2, scale_alg=0)
    values = _unpack(y).astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    scales = np.exp2(s.reshape(rows, -1).numpy().astype(np.float64) - 127)
    return y, s, values * np.repeat(scales, 32, axis=1)


def test_quant_matmul_fp4_x_fp4_is_the_block_scaled_product():
    sim = make_simulator()
    m, k, n = 48, 128, 40
    x1, s1, a = _fp4_operand(sim, m, k, 0)
    w, sw, b = _fp4_operand(sim, n, k, 1)
    fp4, e8m0 = sim.float4_e2m1fn_x2, sim.float8_e8m0fnu
    out = sim.npu_quant_matmul(x1, w.t(), sw.transpose(0, 1), pertoken_scale=s1, output_dtype=torch.float32,
                               x1_dtype=fp4, x2_dtype=fp4, scale_dtype=e8m0, pertoken_scale_dtype=e8m0,
                               group_sizes=[1, 1, 32])
    assert out.shape == (m, n)
    np.testing.assert_allclose(out.numpy(), a @ b.T, rtol=1e-6, atol=1e-6)
    # the transposed x1 of a kernel-made columnwise form: (k, m) packed along m
    xt, st = sim.npu_dynamic_mx_quant(torch.from_numpy(a.T.copy()).float(), axis=-2, dst_type=fp4, scale_alg=0)
    out_t = sim.npu_quant_matmul(xt.t(), w.t(), sw.transpose(0, 1), pertoken_scale=st.permute(1, 0, 2),
                                 output_dtype=torch.float32, x1_dtype=fp4, x2_dtype=fp4, scale_dtype=e8m0,
                                 pertoken_scale_dtype=e8m0, group_sizes=[1, 1, 32])
    np.testing.assert_allclose(out_t.numpy(), a @ b.T, rtol=1e-6, atol=1e-6)  # a's values are FP4 values already


def test_quant_matmul_e4m3_x_fp4_contract():
    sim = make_simulator()
    m, k, n = 32, 128, 64
    w, sw, b = _fp4_operand(sim, n, k, 2)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    x1, s1 = sim.npu_dynamic_mx_quant(x, axis=-1, dst_type=torch.float8_e4m3fn, scale_alg=0)
    fp4, e8m0 = sim.float4_e2m1fn_x2, sim.float8_e8m0fnu
    kw = dict(pertoken_scale=s1, x2_dtype=fp4, scale_dtype=e8m0, pertoken_scale_dtype=e8m0, group_sizes=[1, 1, 32])
    bias = torch.randn(1, n).bfloat16()
    out = sim.npu_quant_matmul(x1, w.t(), sw.transpose(0, 1), output_dtype=torch.bfloat16, bias=bias, **kw)
    a = x1.float().numpy().astype(np.float64) * np.repeat(np.exp2(s1.reshape(m, -1).numpy() - 127.0), 32, axis=1)
    np.testing.assert_allclose(out.float().numpy(), a @ b.T + bias.float().numpy(), rtol=2 ** -7, atol=1e-3)
    # "MX伪量化 ... out BFLOAT16/FLOAT16", bias of the output's dtype, x2 transposed, k a multiple of 64
    with pytest.raises(NpuContractError):
        sim.npu_quant_matmul(x1, w.t(), sw.transpose(0, 1), output_dtype=torch.float32, **kw)
    with pytest.raises(NpuContractError):
        sim.npu_quant_matmul(x1, w.t(), sw.transpose(0, 1), output_dtype=torch.bfloat16, bias=bias.float(), **kw)
    with pytest.raises(NpuContractError):
        sim.npu_quant_matmul(x1, w.t().contiguous(), sw, output_dtype=torch.bfloat16, **kw)
    x5, s5 = sim.npu_dynamic_mx_quant(x, axis=-1, dst_type=torch.float8_e5m2, scale_alg=0)
    with pytest.raises(NpuTypeError):  # no FLOAT8_E5M2 x FLOAT4_E2M1 row
        sim.npu_quant_matmul(x5, w.t(), sw.transpose(0, 1), output_dtype=torch.bfloat16, **{**kw, "pertoken_scale": s5})
    with pytest.raises(NpuTypeError):  # FP4 operands only in the MX mode
        sim.npu_quant_matmul(w, w.t(), torch.ones(1), output_dtype=torch.float32, x1_dtype=fp4, x2_dtype=fp4)


MXFP4_RECIPES = {
    "default": MXFP4BlockScaling(),
    "hadamard": MXFP4BlockScaling(random_hadamard_transform=True),
    "stochastic rounding": MXFP4BlockScaling(stochastic_rounding=True),
    "fp8 activations": MXFP4BlockScaling(fp8_activations=True),
    "ceil": MXFP4BlockScaling(scale_rounding="ceil"),
}


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(MXFP4_RECIPES))
def test_mxfp4_npu_path_matches_reference_bit_for_bit(name, dtype, chip, monkeypatch, use_backend):
    recipe = MXFP4_RECIPES[name]
    sim = make_simulator(chip)
    torch.manual_seed(5)  # stochastic rounding's bits: the same draws on both backends
    got = _step(use_backend, "npu", monkeypatch, recipe, sim, dtype=dtype)
    torch.manual_seed(5)
    want = _step(use_backend, "reference", monkeypatch, recipe, dtype=dtype)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    if name != "fp8 activations" or dtype == torch.bfloat16:  # E4M3 x FP4 gives bf16/fp16 only: fp32 falls back
        assert sim.launch_counts["npu_quant_matmul"] >= 2
    if name != "ceil":  # "ceil" scales are no kernel's rule: the quantizer's torch ops
        assert sim.launch_counts["npu_dynamic_mx_quant"] + sim.launch_counts[
            "npu_dynamic_mx_quant_with_dual_axis"] >= 2


@pytest.mark.parametrize("with_rht", [False, True])
def test_mxfp4_kernel_quantize_is_the_quantizers_bits(with_rht):
    backend = NpuBackend(make_simulator())
    x = torch.randn(96, 64, generator=torch.Generator().manual_seed(7)).bfloat16() * 4
    q = MXFP4Quantizer(with_rht=with_rht)
    got, want = backend.quantize(q, x), q.quantize(x)
    for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.columnwise_rht_sign_mask == want.columnwise_rht_sign_mask
    assert torch.equal(got.dequantize(columnwise=True), want.dequantize(columnwise=True))


@pytest.mark.parametrize("chip", ["1", "Ascend950DT"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_linear_launches_no_more_than_mxfp8(chip, dtype):
    with npu_simulated(chip) as npu:
        fp4 = linear_launches(MXFP4BlockScaling(), dtype, npu)
        fp8 = linear_launches(MXFP8BlockScaling(), dtype, npu)
    for got, bound in zip(fp4, fp8):
        assert got.total <= bound.total, (str(got), str(bound))


def test_nvfp4_is_refused_on_the_npu_with_the_alternatives():
    with npu_simulated():
        available, reason = FP8GlobalStateManager.is_nvfp4_available()
        assert not available and "MXFP4BlockScaling" in reason
        layer = Linear(64, 64)
        with pytest.raises(RuntimeError, match="NVFP4 is not available.*MINDSPEED_TE_BACKEND=reference"):
            with fp8_autocast(fp8_recipe=NVFP4BlockScaling()):
                layer(torch.randn(32, 64))
        with fp8_autocast(fp8_recipe=MXFP4BlockScaling()):  # MXFP4 runs
            layer(torch.randn(32, 64))
    assert FP8GlobalStateManager.is_nvfp4_available() == (True, "")  # the CPU reference emulates it
