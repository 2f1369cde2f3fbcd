"""Megatron's gradient-accumulation fusion without apex. Megatron turns it on by default
(--gradient-accumulation-fusion) and then needs apex's CUDA extension `fused_weight_gradient_mlp_cuda`, which an NPU
never has and a GPU may lack: its own linears (the output layer) then refuse to build. Where the extension is
missing, a stand-in adds the weight gradient into `main_grad` with torch ops, on any device."""
from __future__ import annotations

import types

import torch

from mindspeed_te.patches.registry import PatchRegistry, resolve

__all__ = ["fused_weight_gradient_mlp_cuda", "register_grad_accum"]


def _wgrad_gemm_accum(inp: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad += grad_outputᵀ · input, computed in fp32 and rounded once into main_grad's dtype: what
    apex's fused_weight_gradient_mlp_cuda kernels do (a GEMM with beta=1 into the gradient buffer)."""
    grad_output = grad_output.reshape(-1, grad_output.shape[-1])
    inp = inp.reshape(-1, inp.shape[-1])
    if main_grad.dtype == torch.float32:
        main_grad.addmm_(grad_output.t().float(), inp.float())
    else:
        main_grad.copy_(torch.addmm(main_grad.float(), grad_output.t().float(), inp.float()))


# wgrad_gemm_accum_fp32 for fp32 main grads, wgrad_gemm_accum_fp16 for fp16/bf16 ones.
fused_weight_gradient_mlp_cuda = types.ModuleType("fused_weight_gradient_mlp_cuda", _wgrad_gemm_accum.__doc__)
fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 = _wgrad_gemm_accum
fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16 = _wgrad_gemm_accum


def register_grad_accum(registry: PatchRegistry) -> None:
    """The stand-in, where megatron.core's linears found no apex extension."""
    layers = "megatron.core.tensor_parallel.layers"
    if getattr(resolve(layers), "_grad_accum_fusion_available", False):
        return
    registry.register(f"{layers}.fused_weight_gradient_mlp_cuda", fused_weight_gradient_mlp_cuda, create=True)
    registry.register(f"{layers}._grad_accum_fusion_available", True)
