"""The storage every part of the state manager shares: the `FP8GlobalState` dataclass and the types of
its fields.

All mutable FP8 state of the process lives in one `FP8GlobalState` instance, held by the composed
`FP8GlobalStateManager` (state/manager.py) as its `quantization_state` class attribute, so `reset()` is one
assignment and nothing can be forgotten. The manager's concerns (regions, reduction, the non-finite report,
checkpoint phases) are written as separate mixins; this module is what they have in common, kept apart so
that each of them imports the storage and none imports another.
"""
from __future__ import annotations

import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional, Union

import torch
import torch.distributed as dist

from mindspeed_te.nonfinite import PendingPairs
from mindspeed_te.recipe import Recipe
from mindspeed_te.recipe_state import DelayedScalingRecipeState, RecipeState
from mindspeed_te.tensor import QuantizedTensorStorage

CheckpointPhase = Literal["forward", "recompute"]
# observer(weight, tensor name: "input" | "weight" | "grad_output", high-precision operand, its quantized form)
OperandObserver = Callable[[torch.Tensor, str, torch.Tensor, QuantizedTensorStorage], None]
# (autocast key, forward) -> {id(state): state}, in registration order
_Registry = dict[tuple[str, bool], dict[int, DelayedScalingRecipeState]]


@dataclass
class FP8GlobalState:
    """Everything the state manager tracks. Field names follow TransformerEngine's `FP8GlobalState`."""

    fp8_enabled: bool = False
    fp8_calibration: bool = False
    fp8_recipe: Optional[Recipe] = None
    fp8_distributed_group: Optional[dist.ProcessGroup] = None
    fp8_graph_capturing: bool = False
    is_first_fp8_module: bool = False
    autocast_depth: int = 0
    # fp8_model_init / quantized_model_init
    fp8_parameters: bool = False
    fp8_model_init_recipe: Optional[Recipe] = None
    high_precision_init_val: bool = False
    # autocast key -> (recipe, group), for every region entered since the last reset
    autocast_arguments: dict[str, tuple[Recipe, Optional[dist.ProcessGroup]]] = field(default_factory=dict)
    # delayed-scaling states waiting for this step's reduction
    registered: _Registry = field(default_factory=dict)
    # registrations made inside the running outermost region (dropped again if the region fails)
    registered_in_region: list[tuple[tuple[str, bool], int]] = field(default_factory=list)
    # Backward registrations and who reduces them: the outermost region (by sequence number) that last
    # registered each backward state, and per region the autograd context of its first FP8 module (weakly:
    # it dies with the graph). A region whose context died before its backward reduction ran had its
    # backward fail or never run; its registrations are stale and are dropped.
    region_seq: int = 0
    backward_owner: dict[int, int] = field(default_factory=dict)
    backward_reducers: dict[int, weakref.ref] = field(default_factory=dict)
    # every delayed-scaling state registered under each autocast key, and the keys registered since the last
    # `take_used_autocast_keys()` (step recovery resets the histories of the keys a failed step used)
    delayed_states: dict[str, weakref.WeakSet] = field(default_factory=dict)
    used_keys: set[str] = field(default_factory=set)
    # Activation checkpointing: the phase of the running checkpointed region and its stash of each FP8
    # module's forward state from the first pass, in call order, for the recompute; or, under TE's
    # `activation_recompute_forward`, `recompute_queues`: each module's stashed states, oldest first.
    checkpoint_phase: Optional[CheckpointPhase] = None
    checkpoint_stash: Union[list[RecipeState], dict[int, deque]] = field(default_factory=list)
    recompute_queues: dict[int, deque] = field(default_factory=dict)
    skip_fp8_weight_update_tensor: Optional[torch.Tensor] = None
    # Non-finite inputs: the recipe states whose flags are checked (module name, weak reference), whether
    # the check runs at the end of every step (see check_nonfinite), and what it found so far.
    nonfinite_watch: list[tuple[str, weakref.ref]] = field(default_factory=list)
    nonfinite_check: bool = True
    nonfinite_unchecked: bool = False  # an outermost region ran since the last check
    nonfinite_steps: int = 0
    nonfinite_counts: Counter = field(default_factory=Counter)
    # The flag updates the watched states' quantizers noted since the last fold (quantizers.
    # record_nonfinite_many), folded once per step for all layers (fold_nonfinite), or sooner in large steps.
    nonfinite_pending: PendingPairs = field(default_factory=PendingPairs)
    # reduction groups (by id) whose ranks were checked to run the same recipe
    recipe_agreed_groups: set[int] = field(default_factory=set)
    # Sees every quantized GEMM operand when set (the numerics report of mindspeed_te.debug registers here,
    # so the autograd functions need not know it); None costs the GEMM one check.
    operand_observer: Optional[OperandObserver] = None
