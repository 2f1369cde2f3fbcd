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
from typing import Callable, Generic, Iterator, Literal, NamedTuple, Optional, TypeVar, Union

import torch
import torch.distributed as dist

from mindspeed_te.nonfinite import HostCopy, PendingPairs
from mindspeed_te.recipe import Recipe
from mindspeed_te.recipe_state import DelayedScalingRecipeState, RecipeState
from mindspeed_te.tensor import QuantizedTensorStorage

CheckpointPhase = Literal["forward", "recompute"]
# observer(weight, tensor name: "input" | "weight" | "grad_output", high-precision operand, its quantized form)
OperandObserver = Callable[[torch.Tensor, str, torch.Tensor, QuantizedTensorStorage], None]
# (autocast key, forward) -> {id(state): state}, in registration order
_Registry = dict[tuple[str, bool], dict[int, DelayedScalingRecipeState]]
K = TypeVar("K")
V = TypeVar("V")


class WeakIdentityMap(Generic[K, V]):
    """Values by the identity of their key object, each kept only while the key lives. A dict keyed by id(key)
    outlives the key, and a new object that reuses a dead one's id would be taken for it (given its stash, or
    its group's recipe check); a weakref.WeakKeyDictionary compares keys by ==, and two equal recipe states are
    still two modules' states. Keys must be weakly referenceable, or None (kept for good)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Optional[weakref.ref], V]] = {}

    def _lookup(self, key: K) -> Optional[tuple[Optional[weakref.ref], V]]:
        entry = self._entries.get(id(key))
        if entry is None or (key is not None and (entry[0] is None or entry[0]() is not key)):
            return None
        return entry

    def __contains__(self, key: K) -> bool:
        return self._lookup(key) is not None

    def get(self, key: K, default: Optional[V] = None) -> Optional[V]:
        entry = self._lookup(key)
        return default if entry is None else entry[1]

    def __setitem__(self, key: K, value: V) -> None:
        if key is None:
            self._entries[id(None)] = (None, value)
            return
        owner = weakref.ref(self)

        def forget(ref: weakref.ref, key_id: int = id(key)) -> None:  # the key died: its entry goes
            live = owner()
            entry = None if live is None else live._entries.get(key_id)
            if entry is not None and entry[0] is ref:
                del live._entries[key_id]

        self._entries[id(key)] = (weakref.ref(key, forget), value)

    def setdefault(self, key: K, default: V) -> V:
        entry = self._lookup(key)
        if entry is not None:
            return entry[1]
        self[key] = default
        return default

    def add(self, key: K) -> None:
        """Set-like use: remember `key`."""
        self[key] = None  # type: ignore[assignment]

    def pop(self, key: K, default: Optional[V] = None) -> Optional[V]:
        if self._lookup(key) is None:
            return default
        return self._entries.pop(id(key))[1]

    def items(self) -> list[tuple[K, V]]:
        """The live keys and their values (a list: removing entries while going through it is safe)."""
        out = []
        for ref, value in list(self._entries.values()):
            key = None if ref is None else ref()
            if ref is None or key is not None:
                out.append((key, value))
        return out

    def values(self) -> list[V]:
        return [value for _, value in self.items()]

    def __iter__(self) -> Iterator[K]:
        return iter([key for key, _ in self.items()])

    def __len__(self) -> int:
        return len(self.items())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WeakIdentityMap) and [(id(k), v) for k, v in self.items()] == \
            [(id(k), v) for k, v in other.items()]


class PendingReport(NamedTuple):
    """A non-finite check on its way to the host: the watched flags' values (`HostCopy`: host buffer and event)
    and, in the same slot order, the "<module> <tensor>" each flag stands for."""

    flags: HostCopy
    labels: list[str]


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
    # `activation_recompute_forward`, `recompute_queues`: each module's stashed states, oldest first, as
    # (region_seq of the region that stashed it, the frozen state or None for the state itself), kept only while
    # the module's state lives, and dropped with a region that fails (its recompute never runs).
    checkpoint_phase: Optional[CheckpointPhase] = None
    checkpoint_stash: Union[list[RecipeState], WeakIdentityMap[RecipeState, deque]] = field(default_factory=list)
    recompute_queues: WeakIdentityMap[RecipeState, deque] = field(default_factory=WeakIdentityMap)
    skip_fp8_weight_update_tensor: Optional[torch.Tensor] = None
    # Non-finite inputs: the recipe states whose flags are checked (module name, weak reference), whether
    # the check runs at the end of every step (see check_nonfinite), and what it found so far. A check copies
    # the flags to the host without waiting (`reports`, oldest first); they are read where the host waits
    # anyway (harvest_nonfinite), so no host read sits inside a step. `labels`: the watched slots' names, in
    # flag order, made again when the watch list changes.
    nonfinite_watch: list[tuple[str, weakref.ref]] = field(default_factory=list)
    nonfinite_check: bool = True
    nonfinite_unchecked: bool = False  # an outermost region ran since the last check
    nonfinite_reports: deque[PendingReport] = field(default_factory=deque)
    nonfinite_labels: Optional[list[str]] = None
    nonfinite_steps: int = 0
    nonfinite_counts: Counter = field(default_factory=Counter)
    # The flag updates the watched states' quantizers noted since the last fold (quantizers.
    # record_nonfinite_many), folded once per step for all layers (fold_nonfinite), or sooner in large steps.
    nonfinite_pending: PendingPairs = field(default_factory=PendingPairs)
    # reduction groups whose ranks were checked to run the same recipe (weakly: a destroyed group goes, and a
    # new group is checked even when it reuses the dead one's id)
    recipe_agreed_groups: WeakIdentityMap[Optional[dist.ProcessGroup], None] = field(default_factory=WeakIdentityMap)
    # Sees every quantized GEMM operand when set (the numerics report of mindspeed_te.debug registers here,
    # so the autograd functions need not know it); None costs the GEMM one check.
    operand_observer: Optional[OperandObserver] = None
