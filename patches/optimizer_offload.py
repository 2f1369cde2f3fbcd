"""Megatron's `--optimizer-cpu-offload` (its HybridDeviceOptimizer) on the device that trains, whatever it is.

Megatron picks the parameters whose update moves to the host by `param.is_cuda` and pins their host copies.
On an NPU (torch_npu's transfer_to_npu leaves `is_cuda` False) and on the CPU device adaptor, no parameter
counts as a device one: nothing is offloaded, every parameter lands in the host optimizers, and the first step
fails looking up host copies that were never made (a KeyError). With TE, the device part runs on TE's
FusedAdam; without it on torch's AdamW, the same class as the host part, so the optimizer then moves every
state to the host after each step.

Patched here (only without TE and Apex, as patches/optimizer.py):
- `HybridDeviceOptimizer._get_sub_optimizer_param_groups`: a parameter is a device one when it lives on the
  training device (the current accelerator, or the CPU when there is none); the first `offload_fraction` of
  them, by elements, get host copies (pinned where there is an accelerator) updated by the host optimizers, the
  others stay with the device optimizer, each with a float32 copy when `param_update_in_fp32`;
- `HybridDeviceOptimizer.__init__`: host buffers are not pinned without an accelerator (torch cannot pin then);
- `_get_megatron_optimizer_based_on_param_groups`: with `--optimizer-cpu-offload` the device optimizer is
  mindspeed_te's FusedAdam, where Megatron takes TE's.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from mindspeed_te.optimizers import FusedAdam
from mindspeed_te.patches.precision_optimizer import OPTIMIZER, module_values, wrap_patch
from mindspeed_te.patches.registry import PatchRegistry, has_module, resolve

HYBRID = f"{OPTIMIZER}.cpu_offloading.hybrid_optimizer.HybridDeviceOptimizer"


def _training_device() -> torch.device:
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return torch.device(accelerator.type if accelerator is not None else "cpu")


def _sub_optimizer_param_groups(self: Any, offload_fraction: float) -> tuple:
    """(host groups, device groups, param -> host copy, host copy -> param, param -> float32 copy), the first
    `offload_fraction` of the device parameters' elements going to the host."""
    device = _training_device()
    on_device = [p for group in self.param_groups for p in group["params"] if p.device.type == device.type]
    budget = offload_fraction * sum(p.numel() for p in on_device)
    moved, to_host, from_host, to_fp32 = 0, {}, {}, {}
    host_groups, device_groups = [], []
    for group in self.param_groups:
        host_group, device_group = {**group, "params": []}, {**group, "params": []}
        for param in group["params"]:
            inner, offloaded = param, moved < budget and param.device.type == device.type
            if offloaded:
                inner = param.detach().to("cpu", copy=True)
                inner = inner.pin_memory() if device.type != "cpu" else inner
                moved += param.numel()
            if self.param_update_in_fp32 and inner.dtype != torch.float32:
                inner = inner.detach().clone().float()
                to_fp32[param] = inner
            if offloaded:
                to_host[param], from_host[inner] = inner, param
            (host_group if offloaded or param.device.type != device.type else device_group)["params"].append(inner)
        host_groups += [host_group] if host_group["params"] else []
        device_groups += [device_group] if device_group["params"] else []
    return host_groups, device_groups, to_host, from_host, to_fp32


def _unpinned_without_accelerator(init: Callable) -> Callable:
    @functools.wraps(init)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        if _training_device().type == "cpu":
            kwargs.update(pin_cpu_grads=False, pin_cpu_params=False)
        init(self, *args, **kwargs)
    return wrapped


def _fused_adam_on_device(build: Callable) -> Callable:
    @functools.wraps(build)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        config = kwargs["config"] if "config" in kwargs else args[0]
        if not getattr(config, "optimizer_cpu_offload", False) or config.optimizer != "adam":
            return build(*args, **kwargs)
        with module_values(OPTIMIZER, Adam=FusedAdam):
            return build(*args, **kwargs)
    return wrapped


def register_optimizer_offload(registry: PatchRegistry) -> None:
    """Register the patches above where megatron-core has the hybrid optimizer."""
    if not has_module(HYBRID.rpartition(".")[0]) or resolve(f"{OPTIMIZER}.distrib_optimizer.HAVE_APEX_OR_TE"):
        return
    registry.register(f"{HYBRID}._get_sub_optimizer_param_groups", _sub_optimizer_param_groups)
    registry.register(f"{HYBRID}.__init__", _unpinned_without_accelerator(resolve(f"{HYBRID}.__init__")))
    wrap_patch(registry, f"{OPTIMIZER}._get_megatron_optimizer_based_on_param_groups", _fused_adam_on_device)
