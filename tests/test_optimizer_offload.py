"""Megatron's HybridDeviceOptimizer (--optimizer-cpu-offload) on the CPU device, as patches/optimizer_offload.py
serves it: the offloaded fraction of the parameters gets host copies and torch's AdamW, the rest stays with the
device optimizer, and a step gives what one AdamW over all parameters gives."""
from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")


@pytest.fixture
def patched():
    from mindspeed_te.patches.device_cpu import register_device_cpu
    from mindspeed_te.patches.optimizer_offload import register_optimizer_offload
    from mindspeed_te.patches.registry import PatchRegistry

    registry = PatchRegistry()
    register_device_cpu(registry)  # Megatron's torch.cuda streams, as a CPU run of Megatron has them
    register_optimizer_offload(registry)
    registry.apply()
    yield
    registry.revert()


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n, 8, generator=gen).bfloat16()) for n in (4, 4, 8, 16)]


def _hybrid(params, fraction: float):
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    from mindspeed_te.optimizers import FusedAdam

    return HybridDeviceOptimizer(params, offload_fraction=fraction, cpu_optimizer_cls=torch.optim.AdamW,
                                 gpu_optimizer_cls=FusedAdam, param_update_in_fp32=True, lr=1e-2,
                                 weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, bias_correction=True)


@pytest.mark.parametrize("fraction, host", [(0.0, 0), (0.25, 2), (0.5, 3), (1.0, 4)])
def test_offloaded_fraction_goes_to_host_adamw(patched, fraction, host):
    """Parameters move whole, in order, while the elements moved are below the fraction (sizes 32, 32, 64, 128)."""
    params = _params()
    optimizer = _hybrid(params, fraction)
    host_params = [p for o in optimizer.cpu_optimizers for g in o.param_groups for p in g["params"]]
    assert len(host_params) == host
    assert all(isinstance(o, torch.optim.AdamW) for o in optimizer.cpu_optimizers)
    assert (optimizer.gpu_optimizer is None) == (host == len(params))


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_a_step_is_adamw_over_float32_copies(patched, fraction):
    """The reference: torch's AdamW on float32 copies of the weights, rounded to bf16 after the step."""
    params = _params()
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    gen = torch.Generator().manual_seed(1)
    reference = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    optimizer = _hybrid(params, fraction)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen).bfloat16() for p in params]
        for p, m, g in zip(params, masters, grads):
            p.grad, m.grad = g, g.float()
        optimizer.step()
        reference.step()
        for p, m in zip(params, masters):
            torch.testing.assert_close(p.float(), m.detach().bfloat16().float(), rtol=0, atol=2e-3)
