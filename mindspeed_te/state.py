"""The one global FP8 state: autocast regions, model-init mode, and the once-per-step amax reduction.

Delayed scaling keeps per-tensor amax histories. Every module that quantizes inside an autocast region
registers its `DelayedScalingRecipeState` here under the key (recipe, reduction group). Once per step and
direction, all amaxes registered under one key are concatenated, MAX-reduced across ranks with a single
all-reduce, written back and turned into new scales: forward states when the outermost autocast region
exits, backward states when the backward of the first FP8 module (the last backward to run) finishes.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from mindspeed_te.recipe import DelayedScaling, Recipe
from mindspeed_te.recipe_state import DelayedScalingRecipeState

__all__ = [
    "FP8GlobalStateManager",
    "fp8_autocast",
    "autocast",
    "fp8_model_init",
    "quantized_model_init",
    "preserve_high_precision_init_val",
]

_Key = tuple[str, int]


def _check_recipe(recipe: Optional[Recipe], arg: str) -> Recipe:
    if recipe is None:
        return DelayedScaling()
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"{arg} must be a mindspeed_te recipe (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, "
            f"MXFP8BlockScaling) or None, got {type(recipe).__name__}"
        )
    return recipe


def _check_group(group: object, arg: str) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{arg} must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")


class FP8GlobalStateManager:
    """Class-level state, as in TransformerEngine: modules query it, autocast regions set it."""

    FP8_ENABLED: bool = False
    FP8_CALIBRATION: bool = False
    FP8_RECIPE: Optional[Recipe] = None
    FP8_DISTRIBUTED_GROUP: Optional[dist.ProcessGroup] = None
    FP8_GRAPH_CAPTURING: bool = False
    IS_FIRST_FP8_MODULE: bool = False
    FP8_AUTOCAST_DEPTH: int = 0
    FP8_PARAMETERS: bool = False
    FP8_MODEL_INIT_RECIPE: Optional[Recipe] = None
    HIGH_PRECISION_INIT_VAL: bool = False
    # Activation checkpointing: None, "forward" (first pass of a checkpointed region) or "recompute".
    CHECKPOINT_PHASE: Optional[str] = None
    # The running checkpointed region's stash: each FP8 module's forward state from the first pass, in call
    # order, for the recompute (set by te_checkpoint).
    _checkpoint_stash: list = []
    # (key, forward) -> {id(state): state}, in registration order; key -> (recipe, group).
    _registered: dict[tuple[_Key, bool], dict[int, DelayedScalingRecipeState]] = {}
    _key_info: dict[_Key, tuple[Recipe, Optional[dist.ProcessGroup]]] = {}

    @classmethod
    def reset(cls) -> None:
        """Back to the state at import (for tests and for starting a new run in one process)."""
        cls.FP8_ENABLED = False
        cls.FP8_CALIBRATION = False
        cls.FP8_RECIPE = None
        cls.FP8_DISTRIBUTED_GROUP = None
        cls.FP8_GRAPH_CAPTURING = False
        cls.IS_FIRST_FP8_MODULE = False
        cls.FP8_AUTOCAST_DEPTH = 0
        cls.FP8_PARAMETERS = False
        cls.FP8_MODEL_INIT_RECIPE = None
        cls.HIGH_PRECISION_INIT_VAL = False
        cls.CHECKPOINT_PHASE = None
        cls._checkpoint_stash = []
        cls._registered = {}
        cls._key_info = {}

    # Queries -----------------------------------------------------------------------------------------
    @classmethod
    def is_fp8_available(cls) -> tuple[bool, str]:
        """FP8 needs torch's float8 dtypes; the reference backend then runs it on any device."""
        if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "float8_e5m2"):
            return False, f"torch {torch.__version__} has no float8 dtypes (need torch >= 2.1)"
        from mindspeed_te.kernels import requested_backend

        if requested_backend() == "npu":
            from mindspeed_te.kernels.npu import get_npu_backend

            return get_npu_backend().available()
        return True, ""

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.FP8_ENABLED

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return cls.FP8_CALIBRATION

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        """The active recipe, or TransformerEngine's default outside an autocast region."""
        return cls.FP8_RECIPE if cls.FP8_RECIPE is not None else DelayedScaling()

    @classmethod
    def get_fp8_group(cls) -> Optional[dist.ProcessGroup]:
        return cls.FP8_DISTRIBUTED_GROUP

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return cls.FP8_PARAMETERS

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        return cls.HIGH_PRECISION_INIT_VAL

    @classmethod
    def get_fp8_model_init_recipe(cls) -> Optional[Recipe]:
        return cls.FP8_MODEL_INIT_RECIPE

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        """True for the first FP8 module to run in the outermost autocast region (and clears the flag): that
        module's backward runs last and performs the backward amax reduction."""
        first = cls.IS_FIRST_FP8_MODULE
        cls.IS_FIRST_FP8_MODULE = False
        return first

    # Registration and reduction ----------------------------------------------------------------------
    @staticmethod
    def get_autocast_key(recipe: Recipe, group: Optional[dist.ProcessGroup]) -> _Key:
        return recipe.key(), id(group)

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, state: DelayedScalingRecipeState,
                                         group: Optional[dist.ProcessGroup] = None) -> None:
        """Register a delayed-scaling state for this step's reduction under its (recipe, group) key.
        Registering the same state again in a step is a no-op."""
        if not isinstance(state, DelayedScalingRecipeState):
            return
        key = cls.get_autocast_key(state.recipe, group)
        cls._key_info[key] = (state.recipe, group)
        cls._registered.setdefault((key, state.forward), {}).setdefault(id(state), state)

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        """For every key: one MAX all-reduce of all registered amaxes, then every scale update."""
        for (key, fwd), states in list(cls._registered.items()):
            if fwd != forward or not states:
                continue
            recipe, group = cls._key_info[key]
            state_list = list(states.values())
            if recipe.reduce_amax and dist.is_available() and dist.is_initialized() \
                    and dist.get_world_size(group) > 1:
                _all_reduce_amaxes(state_list, group)
            for state in state_list:
                state.update()
            del cls._registered[(key, fwd)]

    # Autocast ----------------------------------------------------------------------------------------
    @classmethod
    def get_autocast_state(cls) -> tuple:
        return (cls.FP8_ENABLED, cls.FP8_CALIBRATION, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP,
                cls.IS_FIRST_FP8_MODULE, cls.FP8_GRAPH_CAPTURING)

    @classmethod
    def set_autocast_state(cls, state: tuple) -> None:
        (cls.FP8_ENABLED, cls.FP8_CALIBRATION, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP,
         cls.IS_FIRST_FP8_MODULE, cls.FP8_GRAPH_CAPTURING) = state

    @classmethod
    def fp8_autocast_enter(cls, enabled: bool, calibrating: bool, fp8_recipe: Optional[Recipe],
                           fp8_group: Optional[dist.ProcessGroup], _graph: bool) -> None:
        recipe = _check_recipe(fp8_recipe, "fp8_recipe")
        _check_group(fp8_group, "fp8_group")
        if enabled:
            available, reason = cls.is_fp8_available()
            if not available:
                raise RuntimeError(f"FP8 is not available: {reason}")
        cls.FP8_ENABLED = bool(enabled)
        cls.FP8_CALIBRATION = bool(calibrating)
        cls.FP8_RECIPE = recipe
        cls.FP8_DISTRIBUTED_GROUP = fp8_group
        cls.FP8_GRAPH_CAPTURING = bool(_graph)
        if cls.FP8_AUTOCAST_DEPTH == 0:
            cls.IS_FIRST_FP8_MODULE = bool(enabled)
        cls.FP8_AUTOCAST_DEPTH += 1

    @classmethod
    def fp8_autocast_exit(cls, enabled: bool, calibrating: bool, _graph: bool, failed: bool) -> None:
        cls.FP8_AUTOCAST_DEPTH -= 1
        if cls.FP8_AUTOCAST_DEPTH > 0 or _graph:
            return
        if failed:
            # An exception left the region: other ranks may never reach the collective, so do not reduce;
            # the partial amaxes stay in slot 0 and are folded into the next step.
            for entry in [k for k in cls._registered if k[1]]:
                del cls._registered[entry]
        elif enabled or calibrating:
            cls.reduce_and_update_fp8_tensors(forward=True)


def _all_reduce_amaxes(states: list[DelayedScalingRecipeState], group: Optional[dist.ProcessGroup]) -> None:
    """One MAX all-reduce over the concatenated slot-0 amaxes. NaN becomes +Inf first: gloo/NCCL MAX is not
    NaN-consistent across ranks, while Inf is, and the update then ignores the non-finite amax everywhere."""
    buffer = torch.cat([state.amax_history[0] for state in states])
    buffer = torch.nan_to_num(buffer, nan=float("inf"))
    dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=group)
    offset = 0
    for state in states:
        n = state.num_quantizers
        state.amax_history[0].copy_(buffer[offset : offset + n])
        offset += n


@contextmanager
def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: Optional[Recipe] = None,
    fp8_group: Optional[dist.ProcessGroup] = None,
    _graph: bool = False,
) -> Iterator[None]:
    """Run the enclosed modules' GEMMs in FP8 with `fp8_recipe` (default DelayedScaling()).

    `calibrating=True` with `enabled=False` computes in high precision but records amaxes, so delayed
    scales are ready when FP8 is switched on. `fp8_group` is the group amaxes are reduced over.
    """
    saved = FP8GlobalStateManager.get_autocast_state()
    FP8GlobalStateManager.fp8_autocast_enter(enabled, calibrating, fp8_recipe, fp8_group, _graph)
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        FP8GlobalStateManager.set_autocast_state(saved)
        FP8GlobalStateManager.fp8_autocast_exit(enabled, calibrating, _graph, failed)


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
    on the CPU, reachable through `param.get_high_precision_init_val()` (e.g. to seed fp32 master weights)."""
    checked = _check_recipe(recipe, "recipe")
    saved = (FP8GlobalStateManager.FP8_PARAMETERS, FP8GlobalStateManager.FP8_MODEL_INIT_RECIPE,
             FP8GlobalStateManager.HIGH_PRECISION_INIT_VAL)
    FP8GlobalStateManager.FP8_PARAMETERS = bool(enabled)
    FP8GlobalStateManager.FP8_MODEL_INIT_RECIPE = checked
    FP8GlobalStateManager.HIGH_PRECISION_INIT_VAL = bool(preserve_high_precision_init_val)
    try:
        yield
    finally:
        (FP8GlobalStateManager.FP8_PARAMETERS, FP8GlobalStateManager.FP8_MODEL_INIT_RECIPE,
         FP8GlobalStateManager.HIGH_PRECISION_INIT_VAL) = saved


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
