"""LayerNormMLP against a plain-torch MLP written from TransformerEngine's documented formulas: forward and
backward in high precision, FP8 within the format's precision, quantized weights under fp8_model_init, tensor
and sequence parallelism on gloo against one process, and delayed wgrad."""
import math

import pytest
import torch
import torch.nn.functional as F

import mindspeed_te
from mindspeed_te import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    FP8GlobalStateManager,
    LayerNormMLP,
    MXFP8BlockScaling,
    QuantizedTensor,
    fp8_autocast,
    fp8_model_init,
)
from tests.dist_utils import run_distributed

HIDDEN, FFN = 64, 96


def _sigmoid(x):
    return 1 / (1 + torch.exp(-x))


def _gelu_tanh(x):  # TE's GELU, the tanh approximation: x/2 (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * x * (1 + 0.044715 * x * x)))


def _clamped_swiglu(a, b, limit=7.0, alpha=1.702, offset=1.0):  # TE: gate clamped above, linear to [-l, l] + 1
    a = torch.minimum(a, torch.tensor(limit, dtype=a.dtype))
    return a * _sigmoid(alpha * a) * (torch.clamp(b, -limit, limit) + offset)


UNARY = {"gelu": _gelu_tanh, "qgelu": lambda x: x * _sigmoid(1.702 * x), "relu": lambda x: torch.where(x > 0, x, 0),
         "srelu": lambda x: torch.where(x > 0, x * x, 0), "silu": lambda x: x * _sigmoid(x)}
GATES = {"geglu": "gelu", "qgeglu": "qgelu", "reglu": "relu", "sreglu": "srelu", "swiglu": "silu"}


def reference_activation(name, h):
    if name in UNARY:
        return UNARY[name](h)
    a, b = h[..., : h.shape[-1] // 2], h[..., h.shape[-1] // 2:]  # TE gates the first half
    if name == "glu":
        return _sigmoid(a) * b
    if name == "clamped_swiglu":
        return _clamped_swiglu(a, b)
    return UNARY[GATES[name]](a) * b


def reference_mlp(x, p, activation, normalization, eps=1e-5, zero_centered_gamma=False):
    gamma = p["layer_norm_weight"] + (1 if zero_centered_gamma else 0)
    if normalization == "LayerNorm":
        mean = x.mean(-1, keepdim=True)
        ln = (x - mean) / torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True) + eps) * gamma + p["layer_norm_bias"]
    else:
        ln = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * gamma
    h = ln @ p["fc1_weight"].t() + p.get("fc1_bias", 0)
    return reference_activation(activation, h) @ p["fc2_weight"].t() + p.get("fc2_bias", 0), ln


def _randomize(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            scale = 0.1 if "weight" in name and "layer_norm" not in name else 0.3
            param.copy_(torch.randn(param.shape, generator=g, dtype=torch.float64).to(param.dtype) * scale
                        + (1.0 if name == "layer_norm_weight" else 0.0))


def _grads(module, x):
    return {"x": x.grad, **{n: p.grad for n, p in module.named_parameters()}}


ACTIVATIONS = ["gelu", "geglu", "glu", "qgelu", "qgeglu", "relu", "reglu", "srelu", "sreglu", "silu", "swiglu",
               "clamped_swiglu"]


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_high_precision_matches_the_reference(activation, normalization):
    """float64 forward and backward equal the plain-torch MLP to rounding, for every TE activation."""
    mlp = LayerNormMLP(HIDDEN, FFN, normalization=normalization, activation=activation, params_dtype=torch.float64)
    _randomize(mlp)
    x = (torch.randn(5, 3, HIDDEN, dtype=torch.float64) * 3).requires_grad_()
    dy = torch.randn(5, 3, HIDDEN, dtype=torch.float64)
    mlp(x).backward(dy)
    got = _grads(mlp, x)
    params = {n: p.detach().clone().requires_grad_() for n, p in mlp.named_parameters()}
    x_ref = x.detach().clone().requires_grad_()
    out_ref, _ = reference_mlp(x_ref, params, activation, normalization)
    out_ref.backward(dy)
    torch.testing.assert_close(mlp(x).detach(), out_ref.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got["x"], x_ref.grad, rtol=1e-9, atol=1e-9)
    for name, param in params.items():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-9, atol=1e-9, msg=name)


def test_parameters_shapes_and_return_conventions():
    mlp = LayerNormMLP(HIDDEN, FFN, activation="swiglu", return_bias=True, return_layernorm_output=True,
                       zero_centered_gamma=True)
    assert [n for n, _ in mlp.named_parameters()] == ["layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias",
                                                      "fc2_weight", "fc2_bias"]
    assert mlp.fc1_weight.shape == (2 * FFN, HIDDEN) and mlp.fc2_weight.shape == (HIDDEN, FFN)  # gated: FC1 doubled
    assert torch.equal(mlp.layer_norm_weight, torch.zeros(HIDDEN))  # zero-centered gamma starts at 0
    x = torch.randn(4, HIDDEN)
    out, bias, ln_out = mlp(x)
    params = {n: p.detach() for n, p in mlp.named_parameters()}
    expected, expected_ln = reference_mlp(x, {**params, "fc2_bias": 0}, "swiglu", "LayerNorm", zero_centered_gamma=True)
    assert bias is mlp.fc2_bias
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)  # bias returned, not added
    torch.testing.assert_close(ln_out, expected_ln, rtol=1e-5, atol=1e-5)
    rms = LayerNormMLP(HIDDEN, FFN, normalization="RMSNorm", bias=False, activation="relu")
    assert [n for n, _ in rms.named_parameters()] == ["layer_norm_weight", "fc1_weight", "fc2_weight"]
    assert rms.layer_norm_bias is None and rms(x).shape == (4, HIDDEN)
    assert "_extra_state" in rms.state_dict()
    assert mlp.will_execute_quantized(True) and not mlp.will_execute_quantized(False)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="activation must be one of"):
        LayerNormMLP(HIDDEN, FFN, activation="tanh")
    with pytest.raises(ValueError, match="normalization"):
        LayerNormMLP(HIDDEN, FFN, normalization="BatchNorm")
    with pytest.raises(ValueError, match="activation_params"):
        LayerNormMLP(HIDDEN, FFN, activation="gelu", activation_params={"limit": 3.0})
    with pytest.raises(ValueError, match="ffn_hidden_size"):
        LayerNormMLP(HIDDEN, 95, tp_size=2)


FP8_RECIPES = {
    "delayed/e4m3": lambda: DelayedScaling(fp8_format=Format.E4M3, amax_history_len=1, amax_compute_algo="most_recent"),
    "tensorwise/hif8": lambda: Float8CurrentScaling(fp8_format=Format.HIF8),
    "blockwise/e4m3": lambda: Float8BlockScaling(fp8_format=Format.E4M3),
    "mxfp8/e4m3": lambda: MXFP8BlockScaling(fp8_format=Format.E4M3),
}


def _relative_error(got, want):
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("recipe", list(FP8_RECIPES))
def test_fp8_matches_the_reference_within_format_precision(recipe):
    """Under fp8_autocast both GEMMs run quantized: the output and every gradient stay within a few units of
    the 8-bit formats' relative precision (E4M3 2^-4, HiF8 2^-4 near the target) of the float64 reference,
    and are not the high-precision result (the GEMMs really were quantized)."""
    torch.manual_seed(0)
    mlp = LayerNormMLP(128, 256, activation="swiglu")
    _randomize(mlp)
    x = torch.randn(64, 128, requires_grad=True)
    dy = torch.randn(64, 128)
    with fp8_autocast(fp8_recipe=FP8_RECIPES[recipe]()):
        out = mlp(x)
    out.backward(dy)
    got = _grads(mlp, x)
    params = {n: p.detach().double().requires_grad_() for n, p in mlp.named_parameters()}
    x_ref = x.detach().double().requires_grad_()
    out_ref, _ = reference_mlp(x_ref, params, "swiglu", "LayerNorm")
    out_ref.backward(dy.double())
    assert 1e-4 < _relative_error(out.detach().double(), out_ref.detach()) < 0.08
    assert _relative_error(got["x"].double(), x_ref.grad) < 0.12
    for name in ("fc1_weight", "fc2_weight", "layer_norm_weight"):
        assert _relative_error(got[name].double(), params[name].grad) < 0.12, name
    fwd, bwd = mlp.fp8_states
    assert fwd.num_quantizers == 6 and bwd.num_quantizers == 4  # TE's layout for two GEMMs


def test_delayed_scaling_records_each_gemm_operand_in_tes_slots():
    """Forward slots per GEMM are (input, weight, output): the amaxes recorded are those of the norm output
    (FC1 input), FC1's weight, the activation (FC2 input) and FC2's weight."""
    mlp = LayerNormMLP(HIDDEN, FFN, activation="gelu")
    _randomize(mlp)
    x = torch.randn(16, HIDDEN)
    recipe = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=2)
    with fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe):
        mlp(x)
    fwd, _ = mlp.fp8_states
    params = {n: p.detach() for n, p in mlp.named_parameters()}
    _, ln = reference_mlp(x, params, "gelu", "LayerNorm")
    act = _gelu_tanh(ln @ params["fc1_weight"].t() + params["fc1_bias"])
    newest = fwd.amax_history[-1]  # the calibrating region's exit rolled the recorded amaxes in
    expected = [ln.abs().max(), params["fc1_weight"].abs().max(), act.abs().max(), params["fc2_weight"].abs().max()]
    torch.testing.assert_close(newest[[0, 1, 3, 4]], torch.stack(expected), rtol=1e-5, atol=0)


@pytest.mark.parametrize("recipe", list(FP8_RECIPES))
def test_fp8_model_init_keeps_quantized_weights_that_train(recipe):
    make = FP8_RECIPES[recipe]
    with fp8_model_init(recipe=make()):
        assert isinstance(FP8GlobalStateManager.get_fp8_recipe(), type(make()))
        mlp = LayerNormMLP(128, 256, activation="gelu")
    for w in (mlp.fc1_weight, mlp.fc2_weight):
        assert isinstance(w, QuantizedTensor) and w._data.dtype == torch.uint8 and w._data.numel() == w.numel()
    assert not isinstance(mlp.fc1_bias, QuantizedTensor) and not isinstance(mlp.layer_norm_weight, QuantizedTensor)
    x = torch.randn(64, 128)
    params = {n: (p.dequantize() if isinstance(p, QuantizedTensor) else p).detach() for n, p in mlp.named_parameters()}
    want, _ = reference_mlp(x, params, "gelu", "LayerNorm")
    with fp8_autocast(fp8_recipe=make()):
        out = mlp(x)
    assert _relative_error(out.detach(), want) < 0.08
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.01)
    before = mlp.fc2_weight.dequantize().clone()
    out.square().sum().backward()
    optimizer.step()
    assert isinstance(mlp.fc2_weight, QuantizedTensor) and not torch.equal(mlp.fc2_weight.dequantize(), before)


def test_delay_wgrad_compute_gives_identical_gradients():
    torch.manual_seed(3)
    plain = LayerNormMLP(HIDDEN, FFN, activation="swiglu")
    delayed = LayerNormMLP(HIDDEN, FFN, activation="swiglu", delay_wgrad_compute=True)
    delayed.load_state_dict(plain.state_dict())
    x = torch.randn(8, HIDDEN)
    recipe = Float8CurrentScaling(fp8_format=Format.E4M3)
    for module in (plain, delayed):
        with fp8_autocast(fp8_recipe=recipe):
            out = module(x)
        out.sum().backward()
    assert delayed.fc1_weight.grad is None and delayed.fc2_weight.grad is None  # left for backward_dw
    assert torch.equal(delayed.layer_norm_weight.grad, plain.layer_norm_weight.grad)
    delayed.backward_dw()
    for name, param in plain.named_parameters():
        assert torch.equal(dict(delayed.named_parameters())[name].grad, param.grad), name
    assert all(getattr(delayed, n).skip_backward_post_hook for n in ("fc1_weight", "fc1_bias", "fc2_weight"))


def _tp_worker(rank, world, full, sequence_parallel, recipe):
    """One rank of a TP=world LayerNormMLP (set_parallel_mode) holding its shard of `full`'s weights."""
    group = torch.distributed.new_group(list(range(world)))
    mlp = LayerNormMLP(HIDDEN, FFN, activation="swiglu", set_parallel_mode=True, tp_group=group,
                       sequence_parallel=sequence_parallel)
    with torch.no_grad():
        a, b = full["fc1_weight"].chunk(2)  # TE's local FC1 is [act half; gate half] of this rank's columns
        mlp.fc1_weight.copy_(torch.cat([a.chunk(world)[rank], b.chunk(world)[rank]]))
        ab, bb = full["fc1_bias"].chunk(2)
        mlp.fc1_bias.copy_(torch.cat([ab.chunk(world)[rank], bb.chunk(world)[rank]]))
        mlp.fc2_weight.copy_(full["fc2_weight"].chunk(world, dim=1)[rank])
        for name in ("layer_norm_weight", "layer_norm_bias", "fc2_bias"):
            getattr(mlp, name).copy_(full[name])
    x, dy = full["x"], full["dy"]
    if sequence_parallel:
        x, dy = x.chunk(world)[rank], dy.chunk(world)[rank]
    x = x.clone().requires_grad_()
    with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe, fp8_group=group):
        out = mlp(x)
    out.backward(dy)
    return {"out": out.detach(), "dx": x.grad, "fc2_weight": mlp.fc2_weight.grad, "ln": mlp.layer_norm_weight.grad,
            "fc2_bias": mlp.fc2_bias.grad}


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("fp8", [False, True], ids=["high-precision", "delayed"])
def test_tensor_and_sequence_parallel_match_one_process(sequence_parallel, fp8):
    """TP=2 over gloo against the full layer on one process: the same output, input gradient and (summed
    over the ranks, as Megatron does for sequence-parallel norm parameters) the same weight gradients.
    Delayed scaling reduces amaxes over the group, so FP8 matches too (to fp32 summation order)."""
    torch.manual_seed(11)
    one = LayerNormMLP(HIDDEN, FFN, activation="swiglu")
    _randomize(one)
    full = {n: p.detach().clone() for n, p in one.named_parameters()}
    full["x"] = torch.randn(8, 2, HIDDEN)
    full["dy"] = torch.randn(8, 2, HIDDEN)
    recipe = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=1) if fp8 else None
    x = full["x"].clone().requires_grad_()
    FP8GlobalStateManager.reset()
    with fp8_autocast(enabled=fp8, fp8_recipe=recipe):
        out = one(x)
    out.backward(full["dy"])
    ranks = run_distributed(_tp_worker, 2, full, sequence_parallel, recipe)
    cat = (lambda key: torch.cat([r[key] for r in ranks])) if sequence_parallel else (lambda key: ranks[0][key])
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cat("out"), out.detach(), **tol)
    torch.testing.assert_close(cat("dx"), x.grad, **tol)
    torch.testing.assert_close(torch.cat([r["fc2_weight"] for r in ranks], dim=1), one.fc2_weight.grad, **tol)
    ln_grad = sum(r["ln"] for r in ranks) if sequence_parallel else ranks[0]["ln"]
    torch.testing.assert_close(ln_grad, one.layer_norm_weight.grad, **tol)
    bias_grad = sum(r["fc2_bias"] for r in ranks) if sequence_parallel else ranks[0]["fc2_bias"]
    torch.testing.assert_close(bias_grad, one.fc2_bias.grad, **tol)


def test_exported_at_top_level():
    assert mindspeed_te.LayerNormMLP is LayerNormMLP and "LayerNormMLP" in mindspeed_te.__all__
    assert math.isclose(_gelu_tanh(torch.tensor(1.0)).item(), F.gelu(torch.tensor(1.0), approximate="tanh").item(),
                        rel_tol=1e-6)
