"""What older megatron-core releases need of the newer libraries installed beside them, while the patches are
applied (each only where the library lacks it):
- NumPy 2 removed `numpy.product`, which distributed checkpointing calls up to 0.15 (validation, mapping,
  exchange_utils, on a save): it is `numpy.prod` again.
- torch 2.7 added a required `serialization_format` to the checkpoint writer's `_write_item`, which 0.12's
  asynchronous filesystem writer calls without it (0.13 on pass torch's TORCH_SAVE where it is taken): 0.12's
  binding gets that default.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import numpy

from mindspeed_te.patches.registry import has_module, resolve

ASYNC_WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"


def _torch_save_format(write_item: Callable) -> Callable:
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    @functools.wraps(write_item)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("serialization_format", SerializationFormat.TORCH_SAVE)
        return write_item(*args, **kwargs)
    return wrapped


def register_library_compat(registry) -> None:
    """`numpy.product` where NumPy has none (2.0 on); the writer's serialization format for 0.12."""
    if not hasattr(numpy, "product"):
        registry.register("numpy.product", numpy.prod, create=True)
    if has_module(ASYNC_WRITER):
        write_item = resolve(f"{ASYNC_WRITER}._write_item")
        takes_format = "serialization_format" in inspect.signature(write_item).parameters
        if takes_format and "serialization_format" not in inspect.getsource(resolve(ASYNC_WRITER)):  # 0.12
            registry.register(f"{ASYNC_WRITER}._write_item", _torch_save_format(write_item))
