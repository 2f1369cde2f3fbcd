"""Megatron's gradient-accumulation fusion (its default) without apex: a stand-in for apex's extension, on any
device (an NPU never has apex; Megatron's output layer refused to build on a GPU without it)."""
import pytest
import torch

pytest.importorskip("megatron.core")

from mindspeed_te.patches import build_registry  # noqa: E402

LAYERS = "megatron.core.tensor_parallel.layers"


def test_gradient_accumulation_fusion_accumulates_the_weight_gradient_into_main_grad():
    """apex's wgrad_gemm_accum_fp32 / _fp16: main_grad += dYᵀ·X, one fp32 GEMM rounded once into main_grad."""
    from mindspeed_te.patches.grad_accum import fused_weight_gradient_mlp_cuda as fused

    torch.manual_seed(0)
    x, dy = torch.randn(2, 8, 16, dtype=torch.bfloat16), torch.randn(2, 8, 4, dtype=torch.bfloat16)
    exact = dy.double().reshape(-1, 4).t() @ x.double().reshape(-1, 16)
    start = torch.randn(4, 16)
    main_grad = start.clone()
    fused.wgrad_gemm_accum_fp32(x, dy, main_grad)
    assert torch.allclose(main_grad.double(), start.double() + exact, rtol=0, atol=1e-5)
    half = start.to(torch.bfloat16)
    fused.wgrad_gemm_accum_fp16(x, dy, half)
    assert torch.equal(half, (start.to(torch.bfloat16).double() + exact).to(torch.bfloat16))


@pytest.mark.parametrize("accelerator", [False, True])
def test_the_stand_in_is_registered_wherever_apex_is_missing(accelerator, monkeypatch):
    import megatron.core.tensor_parallel.layers as layers

    import mindspeed_te.patches.device_cpu as device_cpu

    monkeypatch.setattr(device_cpu, "accelerator_present", lambda: accelerator)
    assert not layers._grad_accum_fusion_available  # no apex here
    registry = build_registry()
    registry.apply()
    try:
        assert layers._grad_accum_fusion_available
        assert layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 is not None
    finally:
        registry.revert()
    assert not layers._grad_accum_fusion_available and not hasattr(layers, "fused_weight_gradient_mlp_cuda")


def test_apex_is_left_alone(monkeypatch):
    import megatron.core.tensor_parallel.layers as layers

    apex = object()
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", apex, raising=False)
    registry = build_registry()
    registry.apply()
    try:
        assert layers.fused_weight_gradient_mlp_cuda is apex
    finally:
        registry.revert()
