"""Megatron integration: the patch registry and what it patches. `mindspeed_te.megatron_adaptor` applies it.

    registry = build_registry()   # every patch that applies to the Megatron importable here
    registry.apply()              # ... and registry.revert() to undo
"""
from __future__ import annotations

import contextlib
import importlib.util
from typing import Iterator

from mindspeed_te.patches.registry import (
    SUPPORTED_MEGATRON_CORE,
    PatchError,
    PatchRegistry,
    installed_megatron_core,
    megatron_versions,
    supported_release,
)

__all__ = ["PatchError", "PatchRegistry", "build_registry"]


def build_registry() -> PatchRegistry:
    """The TE module patches for megatron.core, the argument hooks when megatron.training (the Megatron-LM
    repository, not on PyPI) is importable, apex's gradient-accumulation kernels where apex is missing, and the CPU
    device adaptor when there is no accelerator."""
    if importlib.util.find_spec("megatron.core") is None:
        raise ImportError("mindspeed_te's Megatron patches need megatron-core 0.12 to 0.19: pip install "
                          "megatron-core==0.16.1 (or put a Megatron-LM checkout on sys.path)")
    _check_megatron_release()
    registry = PatchRegistry()
    with _building("megatron.core.extensions.transformer_engine"):
        from mindspeed_te.patches.megatron_te import register_megatron_te

        register_megatron_te(registry)
    with _building("megatron.core.optimizer.distrib_optimizer"):
        from mindspeed_te.patches.optimizer import register_optimizer

        register_optimizer(registry)
    from mindspeed_te.patches.library_compat import register_library_compat

    register_library_compat(registry)
    from mindspeed_te.patches.grad_accum import register_grad_accum

    register_grad_accum(registry)
    with _building("torch.cuda"):
        from mindspeed_te.patches.device_cpu import accelerator_present, register_device_cpu

        if not accelerator_present():
            register_device_cpu(registry)
    if importlib.util.find_spec("megatron.training") is not None:
        with _building("megatron.training.arguments"):
            from mindspeed_te.patches.arguments import register_arguments

            register_arguments(registry)
        with _building("megatron.training.training.train_step"):
            from mindspeed_te.patches.training import register_training

            register_training(registry)
    return registry


@contextlib.contextmanager
def _building(targets: str) -> Iterator[None]:
    """Turn an import or attribute error while the patches of `targets` are being built (a Megatron module or
    name they need is missing) into a PatchError with the target and the megatron-core versions."""
    try:
        yield
    except PatchError:
        raise
    except (ImportError, AttributeError) as error:
        missing = getattr(error, "name", None)
        raise PatchError(f"cannot build the patches of {targets!r}: {error}"
                         f"{f' (missing {missing!r})' if missing else ''} ({megatron_versions()})") from error


def _check_megatron_release() -> None:
    """Refuse a megatron-core outside the supported release lines, naming them (a release line the patches were
    never run against fails in ways that name no cause)."""
    installed = installed_megatron_core()
    if not supported_release(installed):
        raise PatchError(f"mindspeed_te does not support megatron-core {installed}; supported releases: "
                         f"{', '.join(line + '.x' for line in SUPPORTED_MEGATRON_CORE)}")
