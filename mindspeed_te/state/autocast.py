"""TransformerEngine's public context managers over the state manager.

`fp8_autocast`/`autocast` open an autocast region (the manager's entry and exit, made exception-safe) and
`fp8_model_init`/`quantized_model_init` a model-init region, whose modules keep their weights only in
quantized form; `preserve_high_precision_init_val` gives such a parameter its high-precision initial value.
These are the functions user code calls; the manager's classmethods are what modules call.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from mindspeed_te.recipe import Recipe
from mindspeed_te.state.manager import FP8GlobalStateManager
from mindspeed_te.state.regions import _check_recipe


@contextmanager
def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: Optional[Recipe] = None,
    fp8_group: Optional[dist.ProcessGroup] = None,
    _graph: bool = False,
) -> Iterator[None]:
    """Run the enclosed modules' GEMMs in FP8 with `fp8_recipe` (default `get_default_recipe()`).

    `calibrating=True` with `enabled=False` computes in high precision but records amaxes, so delayed
    scales are ready when FP8 is switched on. `fp8_group` is the group amaxes are reduced over.
    """
    saved = FP8GlobalStateManager.get_autocast_state()
    FP8GlobalStateManager.autocast_enter(enabled, calibrating, fp8_recipe, fp8_group, _graph)
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        FP8GlobalStateManager.autocast_region_exit_state(saved)
        FP8GlobalStateManager.autocast_exit(enabled, _graph, calibrating=calibrating, failed=failed)


@contextmanager
def autocast(
    enabled: bool = True,
    calibrating: bool = False,
    recipe: Optional[Recipe] = None,
    amax_reduction_group: Optional[dist.ProcessGroup] = None,
    _graph: bool = False,
) -> Iterator[None]:
    """TransformerEngine 2.x name of `fp8_autocast`."""
    with fp8_autocast(enabled, calibrating, recipe, amax_reduction_group, _graph):
        yield


@contextmanager
def fp8_model_init(
    enabled: bool = True, recipe: Optional[Recipe] = None, preserve_high_precision_init_val: bool = False
) -> Iterator[None]:
    """Modules created inside keep their weights only in quantized form (as Megatron's --fp8-param-gather
    wants). With `preserve_high_precision_init_val`, each parameter keeps its initial high-precision value
    on the CPU, reachable through `param.get_high_precision_init_val()` (e.g. to seed fp32 master weights).
    As in TransformerEngine, the region's recipe (default `get_default_recipe()`) is also the active one:
    `FP8GlobalStateManager.get_fp8_recipe()` returns it inside, until an autocast region says otherwise."""
    checked = _check_recipe(recipe, "recipe")
    qstate = FP8GlobalStateManager.quantization_state
    saved = (qstate.fp8_parameters, qstate.fp8_model_init_recipe, qstate.high_precision_init_val,
             qstate.fp8_recipe)
    qstate.fp8_parameters = bool(enabled)
    qstate.fp8_model_init_recipe = checked
    qstate.high_precision_init_val = bool(preserve_high_precision_init_val)
    qstate.fp8_recipe = checked
    try:
        yield
    finally:
        (qstate.fp8_parameters, qstate.fp8_model_init_recipe, qstate.high_precision_init_val,
         qstate.fp8_recipe) = saved


@contextmanager
def quantized_model_init(
    enabled: bool = True, recipe: Optional[Recipe] = None, preserve_high_precision_init_val: bool = False
) -> Iterator[None]:
    """TransformerEngine 2.x name of `fp8_model_init`."""
    with fp8_model_init(enabled, recipe, preserve_high_precision_init_val):
        yield


def preserve_high_precision_init_val(param: torch.Tensor, value: torch.Tensor) -> None:
    """Attach a CPU copy of `value` to `param` with `get_high_precision_init_val()` and
    `clear_high_precision_init_val()` methods, as TransformerEngine's FP8 parameters have."""
    param._high_precision_init_val = value.detach().to("cpu", copy=True)

    def get() -> Optional[torch.Tensor]:
        return getattr(param, "_high_precision_init_val", None)

    def clear() -> None:
        param._high_precision_init_val = None

    param.get_high_precision_init_val = get
    param.clear_high_precision_init_val = clear
