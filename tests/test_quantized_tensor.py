"""Quantized parameters (fp8_model_init): TransformerEngine's documented example, the tensor contract
(ops see real values, in-place updates requantize, aliasing, clone, save/load, broadcast), the forward using
the stored codes, and training with a plain torch optimizer."""
import io

import numpy as np
import pytest
import torch

import mindspeed_te
from mindspeed_te import (
    DelayedScaling,
    Float8BlockwiseQTensor,
    Float8CurrentScaling,
    Float8Tensor,
    Format,
    GroupedLinear,
    LayerNormLinear,
    Linear,
    MXFP8Tensor,
    QuantizedTensor,
    fp8_autocast,
    fp8_model_init,
    quantized_model_init,
)
from tests.dist_utils import run_distributed
from tests.oracles import current_scale_inv, np_cast
from tests.recipes import recipe

TENSOR_CLASSES = {  # the quantized parameter class each case makes
    "delayed/hybrid": Float8Tensor, "delayed/hif8": Float8Tensor, "tensorwise/e4m3": Float8Tensor,
    "tensorwise/hif8": Float8Tensor, "blockwise/e4m3": Float8BlockwiseQTensor, "mxfp8/e4m3": MXFP8Tensor,
}
RECIPES = [(recipe(name), cls) for name, cls in TENSOR_CLASSES.items()]
IDS = list(TENSOR_CLASSES)


def test_te_documented_example_runs_verbatim():
    transformer_engine = type("te", (), {"pytorch": mindspeed_te})  # the example's module path
    with fp8_model_init(enabled=True):
        model = transformer_engine.pytorch.Linear(768, 768)
    assert isinstance(model.weight, QuantizedTensor)
    assert not hasattr(model.weight, "get_high_precision_init_val")  # only when asked to preserve it
    torch.manual_seed(7)
    with fp8_model_init(enabled=True, preserve_high_precision_init_val=True):
        model = transformer_engine.pytorch.Linear(768, 768)
    master_weight = model.weight.get_high_precision_init_val()
    model.weight.clear_high_precision_init_val()
    # The exact initial value: the same seed gives the same high-precision initialization outside the context.
    torch.manual_seed(7)
    reference = Linear(768, 768)
    assert master_weight.device.type == "cpu" and torch.equal(master_weight, reference.weight.detach())
    assert model.weight.get_high_precision_init_val() is None
    assert torch.allclose(model.weight.dequantize(), master_weight, rtol=0.07, atol=1e-4)


@pytest.mark.parametrize("recipe,cls", RECIPES, ids=IDS)
def test_modules_create_quantized_weights(recipe, cls):
    with quantized_model_init(recipe=recipe):
        modules = [Linear(64, 32), LayerNormLinear(64, 32), GroupedLinear(2, 64, 32)]
    weights = [modules[0].weight, modules[1].weight, *modules[2].weights]
    for w in weights:
        assert type(w) is cls and isinstance(w, torch.nn.Parameter) and w.requires_grad
        assert w.shape == (32, 64) and w.dtype == torch.float32
        assert w._data.dtype == torch.uint8 and w._data.shape == (32, 64)  # 1 byte per element
        assert w._scale_inv.dtype in (torch.float32, torch.uint8)
    assert all(not isinstance(b, QuantizedTensor) for m in modules for b in m.parameters() if b.dim() == 1)


@pytest.mark.parametrize("fmt", ["E4M3", "HIF8"])
def test_current_scaling_codes_match_oracle(fmt):
    with fp8_model_init(recipe=Float8CurrentScaling(fp8_format=Format[fmt]), preserve_high_precision_init_val=True):
        layer = Linear(48, 16)
    w = layer.weight
    init = w.get_high_precision_init_val().numpy()
    target = 448.0 if fmt == "E4M3" else Float8CurrentScaling(fp8_format=Format.HIF8).target_max(True)
    scale_inv = current_scale_inv(np.abs(init).max(), target)
    assert w._scale_inv.item() == scale_inv
    np.testing.assert_array_equal(w._data.numpy(), np_cast(init / scale_inv, fmt))


@pytest.mark.parametrize("recipe,cls", RECIPES, ids=IDS)
def test_forward_uses_stored_weight(recipe, cls, monkeypatch):
    torch.manual_seed(0)
    with fp8_model_init(recipe=recipe):
        layer = Linear(64, 32, bias=False)
    quantize = type(layer.weight._quantizer).quantize
    calls = []

    def spy(q, t):
        calls.append((q, quantize(q, t)))
        return calls[-1][1]

    monkeypatch.setattr(type(layer.weight._quantizer), "quantize", spy)
    x = torch.randn(32, 64, requires_grad=True)
    with fp8_autocast(fp8_recipe=recipe):
        out = layer(x)
    assert len(calls) == 1 and calls[0][0] is not layer.weight._quantizer  # the input only, not the weight
    # Oracle: the same GEMM on the input's and the stored weight's real values.
    qx = calls[0][1]  # (backward keeps only its columnwise copy, which has the same values)
    expected = qx.dequantize(columnwise=not qx.has_data()) @ layer.weight.dequantize().t()
    torch.testing.assert_close(out.detach(), expected, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert layer.weight.grad.shape == (32, 64) and not isinstance(layer.weight.grad, QuantizedTensor)
    outside = layer(x.detach())  # outside autocast: the dequantized weight in high precision
    torch.testing.assert_close(outside, x.detach() @ layer.weight.dequantize().t())


def test_tensor_contract():
    with fp8_model_init(recipe=Float8CurrentScaling()):
        w = Linear(32, 8).weight
    values = w.dequantize()
    assert torch.equal(w * 2, values * 2) and type(w * 2) is torch.Tensor
    alias = w.detach()
    assert type(alias) is Float8Tensor and alias._storage is w._storage
    assert w.view(8, 32)._storage is w._storage
    twin = w.clone()
    with torch.no_grad():
        w.add_(1.0)
    assert torch.equal(twin.dequantize(), values)  # clone is independent
    expected = Float8Tensor.from_storage(w._quantizer.quantize(values + 1.0), w._quantizer)
    assert torch.equal(w._data, expected._data) and torch.equal(alias.dequantize(), w.dequantize())
    with pytest.raises(ValueError, match="source shape"):
        w.quantize_(torch.zeros(3))


@pytest.mark.parametrize("recipe,cls", RECIPES, ids=IDS)
def test_state_dict_save_load_is_exact(recipe, cls):
    torch.manual_seed(1)
    with fp8_model_init(recipe=recipe):
        src, dst = Linear(64, 32), Linear(64, 32)
    buffer = io.BytesIO()
    torch.save(src.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded["weight"]) is cls
    dst.load_state_dict(loaded)
    assert torch.equal(dst.weight._data, src.weight._data) and torch.equal(dst.weight._scale_inv, src.weight._scale_inv)
    assert dst.weight._storage is not src.weight._storage


def test_plain_optimizer_trains_fp8_weights():
    """Adam steps on FP8 weights (requantized in place each step) fit a linear map: the loss falls by more
    than 10x, to the level FP8 weights without fp32 master copies can reach."""
    torch.manual_seed(0)
    target = torch.randn(32, 64) * 0.1
    data = torch.randn(256, 64)
    with fp8_model_init(recipe=Float8CurrentScaling()):
        layer = Linear(64, 32, bias=False)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
            loss = torch.nn.functional.mse_loss(layer(data), data @ target.t())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert isinstance(layer.weight, Float8Tensor) and layer.weight._data.dtype == torch.uint8
    assert losses[-1] < losses[0] / 10


def _broadcast(rank, world_size):
    torch.manual_seed(rank)
    with fp8_model_init(recipe=DelayedScaling()):
        w = Linear(64, 32).weight
    torch.distributed.broadcast(w.data, src=0)
    return w._data.clone(), w._scale_inv.clone()


def test_broadcast_moves_codes_and_scales():
    (data0, s0), (data1, s1) = run_distributed(_broadcast, 2)
    assert torch.equal(data0, data1) and torch.equal(s0, s1)


def test_loading_high_precision_values_restores_the_saved_codes():
    """A distributed checkpoint hands an FP8 weight back as high-precision values. Loading them into a module
    built under fp8_model_init with delayed scaling gives back the saved codes exactly: the module's FP8
    metadata (the weight's scale) is applied before the weight, as in TransformerEngine."""
    recipe = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=2)
    torch.manual_seed(0)
    with fp8_model_init(recipe=recipe):
        source = Linear(64, 32)
    optimizer = torch.optim.SGD(source.parameters(), lr=0.3)
    for _ in range(3):  # the weight's delayed scale moves away from its initial one
        with fp8_autocast(fp8_recipe=recipe):
            source(torch.randn(16, 64)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    state = source.state_dict()
    state["weight"] = state["weight"].dequantize()  # what torch_dist gives back: values, not codes
    torch.manual_seed(1)
    with fp8_model_init(recipe=recipe):
        target = Linear(64, 32)
    assert not torch.equal(target.fp8_states[0].scale, source.fp8_states[0].scale)
    target.load_state_dict(state)
    assert torch.equal(target.weight._data, source.weight._data)
    assert torch.equal(target.weight.dequantize(), source.weight.dequantize())
