"""LayerNorm and RMSNorm against float64 closed forms: values, gradients, zero-centered gamma, float32 math for
bf16 tensors, and the parameter attributes Megatron reads."""
from contextlib import nullcontext

import pytest
import torch

from mindspeed_te.modules.norm import LayerNorm, RMSNorm

EPS = 1e-5
NORMS = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}


def _reference(kind: str, x, weight, bias, zero_centered: bool):
    """Closed form in float64: (x - mean) / sqrt(var + eps) or x / sqrt(mean(x²) + eps), times gamma, plus bias."""
    x = x.double()
    gamma = weight.double() + 1 if zero_centered else weight.double()
    if kind == "LayerNorm":
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + EPS) * gamma + bias.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * gamma


def _make(kind: str, hidden: int, zero_centered: bool, dtype=torch.float32, seed: int = 0):
    """A norm with random (non-identity) parameters and an input of shape [seq, batch, hidden]."""
    g = torch.Generator().manual_seed(seed)
    norm = NORMS[kind](hidden, eps=EPS, zero_centered_gamma=zero_centered, params_dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=g) * 0.3 + (0.0 if zero_centered else 1.0))
        if kind == "LayerNorm":
            norm.bias.copy_(torch.randn(hidden, generator=g) * 0.1)
    x = torch.randn(8, 3, hidden, generator=g) * 2 + 0.5
    return norm, x.to(dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("kind", NORMS)
def test_float32_matches_closed_form_values_and_gradients(kind, zero_centered):
    norm, x = _make(kind, 96, zero_centered)
    x.requires_grad_()
    y = norm(x)
    dy = torch.randn_like(y)
    y.backward(dy)

    x64 = x.detach().double().requires_grad_()
    w64 = norm.weight.detach().double().requires_grad_()
    b64 = norm.bias.detach().double().requires_grad_() if kind == "LayerNorm" else None
    ref = _reference(kind, x64, w64, b64, zero_centered)
    ref.backward(dy.double())

    assert y.dtype == torch.float32
    assert _rel(y, ref) < 1e-6
    assert _rel(x.grad, x64.grad) < 1e-5
    assert _rel(norm.weight.grad, w64.grad) < 1e-5
    if kind == "LayerNorm":
        assert _rel(norm.bias.grad, b64.grad) < 1e-5


@pytest.mark.parametrize("kind", NORMS)
def test_bf16_is_computed_in_float32(kind):
    """bf16 in, bf16 out, every element the float64 closed form rounded to bf16 (relative error at most bf16's
    unit roundoff 2^-8, plus 1e-6 for float32 arithmetic). bf16 arithmetic inside misses this by far on an
    input whose mean is large against its spread."""
    norm, x = _make(kind, 256, zero_centered=False, dtype=torch.bfloat16)
    x = (x.float() * 0.25 + 4).to(torch.bfloat16).requires_grad_()
    y = norm(x)
    assert y.dtype == torch.bfloat16
    ref = _reference(kind, x.detach(), norm.weight.detach(), getattr(norm, "bias", None), False).detach()
    assert ((y.double() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-6).all()

    y.backward(torch.ones_like(y))
    assert x.grad.dtype == torch.bfloat16 and norm.weight.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("kind", NORMS)
def test_zero_centered_gamma_adds_one_in_float32(kind):
    """Stored weight starts at 0 (the identity transform), and 1 + weight keeps a deviation that bf16 cannot
    hold next to 1 (2^-10), so the norm must add the 1 in float32."""
    norm = NORMS[kind](64, zero_centered_gamma=True, params_dtype=torch.bfloat16)
    assert torch.equal(norm.weight, torch.zeros(64, dtype=torch.bfloat16))
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        norm.weight.fill_(2.0**-10)
    bias = getattr(norm, "bias", None)
    ref = _reference(kind, x, norm.weight, bias, zero_centered=True)
    assert _rel(norm(x), ref) < 1e-6


@pytest.mark.parametrize("kind", NORMS)
def test_parameters_initialisation_and_sequence_parallel_attribute(kind):
    for sp in (False, True):
        norm = NORMS[kind](32, sequence_parallel=sp, params_dtype=torch.bfloat16)
        names = [name for name, _ in norm.named_parameters()]
        assert names == (["weight", "bias"] if kind == "LayerNorm" else ["weight"])
        for param in norm.parameters():
            assert param.sequence_parallel is sp
            assert param.dtype == torch.bfloat16
        assert torch.equal(norm.weight, torch.ones(32, dtype=torch.bfloat16))
        if kind == "LayerNorm":
            assert torch.equal(norm.bias, torch.zeros(32, dtype=torch.bfloat16))


@pytest.mark.parametrize("kind", NORMS)
def test_multi_dim_normalized_shape(kind):
    """A tuple normalized_shape normalizes over that many trailing dims."""
    norm = NORMS[kind]((4, 8), eps=EPS)
    x = torch.randn(5, 4, 8, generator=torch.Generator().manual_seed(2))
    flat = NORMS[kind](32, eps=EPS)
    torch.testing.assert_close(norm(x), flat(x.reshape(5, 32)).reshape(5, 4, 8))


def test_npu_layer_norm_takes_bf16_input_as_it_is():
    """On the NPU path (simulated) a bf16 LayerNorm is torch_npu's one LayerNorm kernel on x and the parameters
    as they are (a zero-centered gamma in float32): its backward keeps x in bf16 and float32 statistics, no
    float32 copy of the activation (nor does the reference, which runs its float32 norm again in backward), and
    every output and gradient equals the reference backend's bit for bit."""
    from mindspeed_te.bench.launches import npu_simulated

    for zero_centered in (False, True):
        results, kept = [], []
        for simulated in (False, True):
            norm, x = _make("LayerNorm", 256, zero_centered, dtype=torch.bfloat16)
            x = (x.float() * 0.25 + 4).to(torch.bfloat16).requires_grad_()
            dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
            saved: list[torch.Tensor] = []
            with npu_simulated() if simulated else nullcontext():
                with torch.autograd.graph.saved_tensors_hooks(lambda t, kept=saved: kept.append(t) or t, lambda t: t):
                    y = norm(x)
                y.backward(dy)
            results.append((y, x.grad, norm.weight.grad, norm.bias.grad))
            kept.append({(t.dtype, t.numel()) for t in saved})
        for ours, reference in zip(results[1], results[0]):
            assert torch.equal(ours, reference)
        activation = x.numel()
        assert (torch.float32, activation) not in kept[0] and (torch.bfloat16, activation) in kept[0]
        assert (torch.float32, activation) not in kept[1] and (torch.bfloat16, activation) in kept[1]
        assert (torch.float32, activation // 256) in kept[1]  # mean and rstd
