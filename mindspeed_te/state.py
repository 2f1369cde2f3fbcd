"""The one global FP8 state: autocast regions, model-init mode, activation-checkpoint phases, and the
once-per-step amax reduction.

Delayed scaling keeps per-tensor amax histories. Every module that quantizes inside an autocast region
registers its `DelayedScalingRecipeState` here under the key (recipe, reduction group). Once per step and
direction, all amaxes registered under one key are concatenated, MAX-reduced across ranks with a single
all-reduce, written back and turned into new scales: forward states when the outermost autocast region
exits, backward states when the backward of the first FP8 module (the last backward to run) finishes.

All mutable state lives in one `FP8GlobalState` instance (TransformerEngine's shape), so `reset()` is one
assignment and nothing can be forgotten.
"""
from __future__ import annotations

import functools
import warnings
import weakref
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Literal, Optional, Union

import torch
import torch.distributed as dist

from mindspeed_te.distributed import check_same_on_all_ranks
from mindspeed_te.kernels import get_backend, reset_backend
from mindspeed_te.nonfinite import PendingPairs, clear_flags, fold_nonfinite_pairs
from mindspeed_te.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    Recipe,
)
from mindspeed_te.recipe_state import (
    DelayedScalingRecipeState,
    HIF8DelayedScalingRecipeState,
    RecipeState,
    update_delayed_states,
)
from mindspeed_te.tensor import QuantizedTensorStorage

__all__ = [
    "FP8GlobalState",
    "FP8GlobalStateManager",
    "fp8_autocast",
    "autocast",
    "fp8_model_init",
    "quantized_model_init",
    "preserve_high_precision_init_val",
    "is_fp8_available",
    "is_mxfp8_available",
    "is_fp8_block_scaling_available",
    "get_default_recipe",
]

CheckpointPhase = Literal["forward", "recompute"]
# observer(weight, tensor name: "input" | "weight" | "grad_output", high-precision operand, its quantized form)
OperandObserver = Callable[[torch.Tensor, str, torch.Tensor, QuantizedTensorStorage], None]
# (autocast key, forward) -> {id(state): state}, in registration order
_Registry = dict[tuple[str, bool], dict[int, DelayedScalingRecipeState]]


def _check_recipe(recipe: Optional[Recipe], arg: str) -> Recipe:
    if recipe is None:
        return get_default_recipe()
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"{arg} must be a mindspeed_te recipe (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, "
            f"MXFP8BlockScaling) or None, got {type(recipe).__name__}"
        )
    # Recipes are mutable dataclasses: a field changed after construction is caught here, before any state
    # is built from it, not in the middle of a step.
    recipe.validate()
    return recipe


def _check_group(group: object, arg: str) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{arg} must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")


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


def _fp8_support() -> tuple[bool, str]:
    """FP8 needs torch's float8 dtypes; the reference backend then runs it on any device, the NPU backend
    needs a chip with FP8 matmuls: the backend says, through its contract."""
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "float8_e5m2"):
        return False, f"torch {torch.__version__} has no float8 dtypes (need torch >= 2.1)"
    return get_backend().available()


def _mxfp8_support() -> tuple[bool, str]:
    if not hasattr(torch, "float8_e8m0fnu"):
        return False, f"torch {torch.__version__} has no float8_e8m0fnu dtype for MX scales (need torch >= 2.7)"
    return _fp8_support()


def get_default_recipe() -> Recipe:
    """The recipe used when none is given, by TransformerEngine's rule: MXFP8BlockScaling on a device with
    MXFP8 GEMMs, Float8CurrentScaling on CUDA devices of compute capability 12.x (FP8 GEMMs, but MXFP8 not for
    every layout), DelayedScaling everywhere else. Here the device is the current accelerator and its kernel
    backend: an NPU whose kernels run FP8 (the Ascend 950 series, which has MX matmuls) gets MXFP8; the CPU,
    where every format is emulated and none has native GEMMs, keeps DelayedScaling, as do NPUs without FP8."""
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    device_type = accelerator.type if accelerator is not None else "cpu"
    if device_type == "cuda":
        capability = torch.cuda.get_device_capability()
        if capability >= (12, 0):
            return Float8CurrentScaling()
        return MXFP8BlockScaling() if capability >= (10, 0) else DelayedScaling()
    from mindspeed_te.kernels import get_backend

    backend = get_backend(device_type)
    if backend.capabilities.native_mx_gemm and backend.available()[0]:
        return MXFP8BlockScaling()
    return DelayedScaling()


class FP8GlobalStateManager:
    """Process-global FP8 state, as in TransformerEngine: modules query it, autocast regions set it.
    The state itself is the `quantization_state` instance."""

    quantization_state: FP8GlobalState = FP8GlobalState()
    _nonfinite_listeners: list[Callable[[list[str]], None]] = []

    @classmethod
    def reset(cls) -> None:
        """Back to the state at import (for tests and for starting a new run in one process); the kernel
        backend is chosen from the environment again at its next use. Watched states stop noting their flag
        updates in the old state's list (no one would fold it): a module that outlives the reset folds its
        own at each quantize until it is watched again."""
        for _, ref in cls.quantization_state.nonfinite_watch:
            state = ref()
            if state is not None:
                state.nonfinite_pending = None
        cls.quantization_state = FP8GlobalState()
        reset_backend()

    # Availability ------------------------------------------------------------------------------------
    @classmethod
    def is_fp8_available(cls) -> tuple[bool, str]:
        """(available, reason) for delayed and current per-tensor scaling."""
        return _fp8_support()

    @classmethod
    def is_mxfp8_available(cls) -> tuple[bool, str]:
        """(available, reason) for MXFP8BlockScaling."""
        return _mxfp8_support()

    @classmethod
    def is_fp8_block_scaling_available(cls) -> tuple[bool, str]:
        """(available, reason) for Float8BlockScaling."""
        return _fp8_support()

    # Queries -----------------------------------------------------------------------------------------
    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.quantization_state.fp8_enabled

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return cls.quantization_state.fp8_calibration

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        return cls.quantization_state.fp8_graph_capturing

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        """The active recipe, or the default recipe outside an autocast region."""
        recipe = cls.quantization_state.fp8_recipe
        return recipe if recipe is not None else get_default_recipe()

    @classmethod
    def get_fp8_group(cls) -> Optional[dist.ProcessGroup]:
        return cls.quantization_state.fp8_distributed_group

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return cls.quantization_state.fp8_parameters

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        return cls.quantization_state.high_precision_init_val

    @classmethod
    def get_fp8_model_init_recipe(cls) -> Optional[Recipe]:
        return cls.quantization_state.fp8_model_init_recipe

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        """True for the first FP8 module to run in the outermost autocast region (and clears the flag): that
        module's backward runs last and performs the backward amax reduction."""
        qstate = cls.quantization_state
        first, qstate.is_first_fp8_module = qstate.is_first_fp8_module, False
        return first

    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, skip: bool) -> None:
        """Set the one-element flag Megatron's CUDA-graph code uses to tell modules whether to re-quantize
        their weights this micro-batch (1.0 = skip)."""
        qstate = cls.quantization_state
        if qstate.skip_fp8_weight_update_tensor is None:
            qstate.skip_fp8_weight_update_tensor = torch.empty(1, dtype=torch.float32)
        qstate.skip_fp8_weight_update_tensor.fill_(float(bool(skip)))

    @classmethod
    def get_skip_fp8_weight_update_tensor(cls) -> Optional[torch.Tensor]:
        return cls.quantization_state.skip_fp8_weight_update_tensor

    # Activation checkpointing ------------------------------------------------------------------------
    @classmethod
    def get_checkpoint_phase(cls) -> Optional[CheckpointPhase]:
        """"forward" in the first pass of a checkpointed region, "recompute" in its recompute, else None."""
        return cls.quantization_state.checkpoint_phase

    @classmethod
    @contextmanager
    def checkpoint_phase(cls, phase: CheckpointPhase,
                         stash: Union[list[RecipeState], dict[int, deque]]) -> Iterator[None]:
        """Run a pass of an activation-checkpointed region. In "forward" each FP8 module appends a frozen
        copy of its forward state to `stash`; in "recompute" each takes its copy back, in the same order, so
        the recompute quantizes with the first pass's scales and records amaxes nowhere that matters. A
        recompute consumes its own copy of the list (it may stop early, or run more than once). A dict stash
        (`activation_recompute_forward`) keeps each module's states in a queue of its own, consumed oldest first."""
        if phase not in ("forward", "recompute"):
            raise ValueError(f"checkpoint phase must be 'forward' or 'recompute', got {phase!r}")
        qstate = cls.quantization_state
        saved = qstate.checkpoint_phase, qstate.checkpoint_stash
        qstate.checkpoint_phase = phase
        qstate.checkpoint_stash = stash if phase == "forward" or isinstance(stash, dict) else list(stash)
        try:
            yield
        finally:
            qstate.checkpoint_phase, qstate.checkpoint_stash = saved

    @classmethod
    @contextmanager
    def activation_recompute_forward(cls, activation_recompute: bool = False,
                                     recompute_phase: bool = False) -> Iterator[None]:
        """TransformerEngine's context for a checkpointed pass that keeps no stash of its own (Megatron's
        output-discarding checkpoint, e.g. --recompute-modules moe_act): the first pass (recompute_phase False,
        inside an FP8 region) keeps each FP8 module's forward state, the recompute gives each module back its
        own, oldest first."""
        if not (activation_recompute and (recompute_phase or cls.is_fp8_enabled())):
            yield
            return
        phase: CheckpointPhase = "recompute" if recompute_phase else "forward"
        with cls.checkpoint_phase(phase, cls.quantization_state.recompute_queues):
            yield

    @classmethod
    def stash_forward_state_for_recompute(cls, state: RecipeState) -> None:
        """First pass of a checkpointed region: keep a frozen copy of `state` for the recompute."""
        stash = cls.quantization_state.checkpoint_stash
        if isinstance(stash, dict):
            stash.setdefault(id(state), deque()).append(state.frozen_copy())
        else:
            stash.append(state.frozen_copy())

    @classmethod
    def pop_forward_state_for_recompute(cls, state: RecipeState) -> RecipeState:
        """Recompute of a checkpointed region: the frozen first-pass copy of the forward state `state` (the next
        in call order, or this module's oldest under `activation_recompute_forward`)."""
        stash = cls.quantization_state.checkpoint_stash
        queue = stash.get(id(state)) if isinstance(stash, dict) else stash
        if not queue:
            raise RuntimeError("activation recompute ran more FP8 modules than the first pass of the checkpointed "
                               "region; the region must run the same modules both times")
        return queue.popleft() if isinstance(queue, deque) else queue.pop(0)

    # Observing quantized operands ------------------------------------------------------------------------
    @classmethod
    def set_operand_observer(cls, observer: Optional[OperandObserver]) -> None:
        """Have the linear autograd functions call `observer` with each quantized operand (None: stop)."""
        if observer is not None and not callable(observer):
            raise TypeError(f"observer must be callable or None, got {type(observer).__name__}")
        cls.quantization_state.operand_observer = observer

    @classmethod
    def get_operand_observer(cls) -> Optional[OperandObserver]:
        return cls.quantization_state.operand_observer

    # Non-finite inputs -----------------------------------------------------------------------------------
    @classmethod
    def watch_nonfinite(cls, module_name: str, state: RecipeState) -> None:
        """Have `check_nonfinite` report NaN/Inf that `state`'s quantizers see, naming `module_name`. Watching a
        watched state again renames it (e.g. once Megatron's model is built and its layers have paths). Its
        quantizers made from now on note their flag updates for the per-step fold (`fold_nonfinite`)."""
        qstate = cls.quantization_state
        state.nonfinite_pending = qstate.nonfinite_pending
        qstate.nonfinite_watch = [(name, ref) for name, ref in qstate.nonfinite_watch if ref() is not state]
        qstate.nonfinite_watch.append((module_name, weakref.ref(state)))

    @classmethod
    def add_nonfinite_listener(cls, listener: Callable[[list[str]], None]) -> None:
        """Call `listener(found)` after every check that found NaN/Inf ("<module> <tensor>" each), e.g. the
        numerics report's counters. Listeners outlive `reset()`: they are tools, not training state."""
        if listener not in cls._nonfinite_listeners:
            cls._nonfinite_listeners.append(listener)

    @classmethod
    def check_nonfinite(cls) -> list[str]:
        """Report the tensors that held NaN/Inf when quantized since the last check ("<module> <tensor>"),
        warn once per check naming them, count them, tell the listeners, and clear the flags. One host read of
        all flags, at the end of each step: after the last backward amax reduction the step's regions owe, at
        the exit of a region run without gradients, else (backward never ran) at the next outermost entry.
        `nonfinite_check` off turns these automatic checks off (the step end then only folds)."""
        cls.fold_nonfinite()
        qstate = cls.quantization_state
        qstate.nonfinite_unchecked = False
        watched = [(name, ref()) for name, ref in qstate.nonfinite_watch]
        watched = [(name, state) for name, state in watched if state is not None]
        qstate.nonfinite_watch = [(name, weakref.ref(state)) for name, state in watched]
        if not watched:
            return []
        flags = [state.nonfinite for _, state in watched]
        bad = torch.cat(flags).isfinite().logical_not_().tolist()
        clear_flags(flags)
        found, offset = [], 0
        for name, state in watched:
            per_gemm = 3 if state.forward else 2
            for i, role in enumerate(state.roles):
                if bad[offset + i]:  # the GEMM: how many slots of this role come before (any slot layout)
                    gemm = f"[{state.roles[:i].count(role)}]" if state.num_quantizers > per_gemm else ""
                    found.append(f"{name} {role}{gemm}")
            offset += state.num_quantizers
        if found:
            qstate.nonfinite_steps += 1
            qstate.nonfinite_counts.update(found)
            warnings.warn(f"mindspeed_te: NaN/Inf entered quantized GEMMs at {', '.join(found)}: their outputs are "
                          "non-finite, as in high precision; scales and amax histories were left unchanged "
                          f"({qstate.nonfinite_steps} such checks so far)", RuntimeWarning, stacklevel=2)
            for listener in cls._nonfinite_listeners:
                listener(found)
        return found

    @classmethod
    def fold_nonfinite(cls) -> None:
        """Fold the flag updates noted since the last fold into the flags, all layers' at once
        (`nonfinite.fold_nonfinite_pairs`: a fixed handful of ops). Runs before the flags are read and at the
        end of every step, so the list never outlives a step."""
        cls.quantization_state.nonfinite_pending.fold()

    @classmethod
    def _end_step_nonfinite(cls) -> None:
        """The step is over: check the flags (which folds first), or with the check off, or nothing left to
        check, still fold, so that the flags stay current for a later `check_nonfinite` and the pending
        pairs never pile up."""
        qstate = cls.quantization_state
        if qstate.nonfinite_unchecked and qstate.nonfinite_check:
            cls.check_nonfinite()
        else:
            cls.fold_nonfinite()

    @classmethod
    def get_nonfinite_counts(cls) -> dict[str, int]:
        """How many checks found NaN/Inf per "<module> <tensor>", and under "steps" in how many checks."""
        qstate = cls.quantization_state
        return {"steps": qstate.nonfinite_steps, **qstate.nonfinite_counts}

    # Registration and reduction ----------------------------------------------------------------------
    @staticmethod
    def get_unique_autocast_key(recipe: Optional[Recipe] = None, group: Optional[dist.ProcessGroup] = None) -> str:
        """The key that identifies an autocast region for amax reduction: the recipe's configuration and the
        reduction group's identity."""
        recipe_key = recipe.key() if recipe is not None else None
        return f"recipe={recipe_key},group={id(group) if group is not None else None}"

    @classmethod
    def get_autocast_key(cls, recipe: Recipe, group: Optional[dist.ProcessGroup]) -> str:
        return cls.get_unique_autocast_key(recipe, group)

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, state: RecipeState,
                                         group: Optional[dist.ProcessGroup] = None) -> None:
        """Register a delayed-scaling state for this step's reduction under its (recipe, group) key.
        Registering the same state again in a step is a no-op; other recipes have nothing to reduce."""
        if not isinstance(state, DelayedScalingRecipeState):
            return
        qstate = cls.quantization_state
        key = cls.get_unique_autocast_key(state.recipe, group)
        qstate.autocast_arguments.setdefault(key, (state.recipe, group))
        qstate.delayed_states.setdefault(key, weakref.WeakSet()).add(state)
        qstate.used_keys.add(key)
        entry = (key, state.forward)
        states = qstate.registered.setdefault(entry, {})
        if not state.forward:
            qstate.backward_owner[id(state)] = qstate.region_seq
        if id(state) not in states:
            states[id(state)] = state
            if qstate.autocast_depth > 0:
                qstate.registered_in_region.append((entry, id(state)))

    @classmethod
    def expect_backward_reduction(cls, ctx: object) -> None:
        """Called by the first FP8 module's autograd function with its context: the running region's backward
        registrations are reduced by that context's backward. If the context dies first (the backward raised,
        or the graph was dropped), the registrations are stale and the next step drops them."""
        qstate = cls.quantization_state
        qstate.backward_reducers[qstate.region_seq] = weakref.ref(ctx)

    @classmethod
    def _drop_stale_backward_registrations(cls) -> None:
        """Drop the backward registrations of regions whose backward can no longer run, with the amaxes their
        failed backward left in slot 0 (HiF8 delayed states keep slot 0: it holds the whole update interval)."""
        qstate = cls.quantization_state
        dead = {seq for seq, ref in qstate.backward_reducers.items() if ref() is None}
        if not dead:
            return
        for seq in dead:
            del qstate.backward_reducers[seq]
        slots = []
        for entry in [entry for entry in qstate.registered if not entry[1]]:
            states = qstate.registered[entry]
            for state_id in [i for i in states if qstate.backward_owner.get(i) in dead]:
                state = states.pop(state_id)
                del qstate.backward_owner[state_id]
                if not isinstance(state, HIF8DelayedScalingRecipeState):
                    slots.append(state.amax_history[0])
            if not states:
                del qstate.registered[entry]
        if slots:
            torch._foreach_zero_(slots)

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        """For every key: one MAX all-reduce of all registered amaxes, then every scale update. The
        registrations are taken first, so a failure here cannot leave them behind for later steps."""
        qstate = cls.quantization_state
        if not forward:
            cls._drop_stale_backward_registrations()
        for (key, fwd) in [entry for entry in qstate.registered if entry[1] == forward]:
            states = qstate.registered.pop((key, fwd))
            if not fwd:
                for state_id in states:
                    qstate.backward_owner.pop(state_id, None)
            if not states:
                continue
            recipe, group = qstate.autocast_arguments[key]
            reduce = recipe.reduce_amax and dist.is_available() and dist.is_initialized() \
                and dist.get_world_size(group) > 1
            update_delayed_states(list(states.values()),
                                  functools.partial(_all_reduce_amaxes, group=group) if reduce else None)

    @classmethod
    def reduce_backward_amaxes(cls, ctx: object) -> None:
        """The backward of a region's first FP8 module (`ctx`, see `expect_backward_reduction`): reduce the
        backward amaxes. When no other region's backward is still to come, the step is over: report the
        non-finite inputs it quantized."""
        qstate = cls.quantization_state
        qstate.backward_reducers = {seq: ref for seq, ref in qstate.backward_reducers.items() if ref() is not ctx}
        cls.reduce_and_update_fp8_tensors(forward=False)
        if not qstate.backward_reducers:
            cls._end_step_nonfinite()

    @classmethod
    def take_used_autocast_keys(cls) -> set[str]:
        """The autocast keys delayed-scaling states were registered under since the last call."""
        qstate = cls.quantization_state
        keys, qstate.used_keys = qstate.used_keys, set()
        return keys

    @classmethod
    def reset_amax_histories(cls, keys: Optional[Iterable[str]] = None) -> None:
        """Forget the amax history and scales of every delayed-scaling state under `keys` (default: all keys),
        as after a failed step: the next step starts them as new (HiF8 delayed: with its warm-up)."""
        qstate = cls.quantization_state
        for key in qstate.delayed_states if keys is None else keys:
            for state in list(qstate.delayed_states.get(key, ())):
                state.reset_amax_history()

    # Autocast ----------------------------------------------------------------------------------------
    @classmethod
    def get_autocast_state(cls) -> tuple:
        """The autocast fields, to restore when a region exits."""
        q = cls.quantization_state
        return (q.fp8_enabled, q.fp8_calibration, q.fp8_recipe, q.fp8_distributed_group,
                q.is_first_fp8_module, q.fp8_graph_capturing)

    @classmethod
    def set_autocast_state(cls, state: tuple) -> None:
        q = cls.quantization_state
        (q.fp8_enabled, q.fp8_calibration, q.fp8_recipe, q.fp8_distributed_group,
         q.is_first_fp8_module, q.fp8_graph_capturing) = state

    # TransformerEngine <= 2.8 names.
    get_fp8_autocast_state = get_autocast_state
    set_fp8_autocast_state = set_autocast_state

    @classmethod
    def autocast_enter(cls, enabled: bool = False, calibrating: bool = False, fp8_recipe: Optional[Recipe] = None,
                       fp8_group: Optional[dist.ProcessGroup] = None, _graph: bool = False) -> None:
        """Enter an autocast region: check the arguments and the device, then set the state."""
        recipe = _check_recipe(fp8_recipe, "fp8_recipe")
        _check_group(fp8_group, "fp8_group")
        if enabled:
            _check_available(recipe)
        qstate = cls.quantization_state
        if enabled and id(fp8_group) not in qstate.recipe_agreed_groups and dist.is_available() \
                and dist.is_initialized():
            # Once per group, at its first FP8 step: ranks running different recipes fail here, all of them
            # with both recipes named, instead of deadlocking or mismatching in the amax reduction.
            check_same_on_all_ranks("the FP8 recipe", recipe.portable_key(), fp8_group)
            qstate.recipe_agreed_groups.add(id(fp8_group))
        qstate.autocast_arguments[cls.get_unique_autocast_key(recipe, fp8_group)] = (recipe, fp8_group)
        qstate.fp8_enabled = bool(enabled)
        qstate.fp8_calibration = bool(calibrating)
        qstate.fp8_recipe = recipe
        qstate.fp8_distributed_group = fp8_group
        qstate.fp8_graph_capturing = bool(_graph)
        if qstate.autocast_depth == 0:
            cls._drop_stale_backward_registrations()
            if not qstate.backward_reducers:  # no backward to come that would end the step before
                cls._end_step_nonfinite()
            qstate.nonfinite_unchecked = True
            qstate.region_seq += 1
            # Set even when this outer region is disabled: an enabled region nested inside still has a
            # first module, whose backward reduces the backward amaxes.
            qstate.is_first_fp8_module = True
            qstate.registered_in_region = []
        qstate.autocast_depth += 1

    @classmethod
    def autocast_exit(cls, enabled: bool, _graph: bool, calibrating: bool = False, failed: bool = False) -> None:
        """Leave an autocast region. The outermost exit reduces and updates the forward amaxes registered
        inside it (whether or not that outer region itself is enabled), unless gradients are off and it is
        not calibrating (an evaluation pass keeps the training scales, as in TransformerEngine; its amaxes
        are folded into the next training step) or the region failed."""
        qstate = cls.quantization_state
        qstate.autocast_depth -= 1
        if qstate.autocast_depth > 0 or _graph:
            return
        if failed:
            # An exception left the region: other ranks may never reach the collective, so nothing is
            # reduced, and everything this region registered (forward and backward) is dropped: its
            # backward never runs. The partial amaxes stay in slot 0 and are folded into the next step.
            for entry, state_id in qstate.registered_in_region:
                states = qstate.registered.get(entry, {})
                states.pop(state_id, None)
                if not entry[1]:
                    qstate.backward_owner.pop(state_id, None)
                if not states:
                    qstate.registered.pop(entry, None)
            qstate.backward_reducers.pop(qstate.region_seq, None)
        elif torch.is_grad_enabled() or calibrating:
            cls.reduce_and_update_fp8_tensors(forward=True)
        if not failed and not torch.is_grad_enabled():
            slots = [] if calibrating else cls._flag_nonfinite_amaxes(qstate.registered_in_region)
            faults = qstate.nonfinite_steps
            cls._end_step_nonfinite()  # no backward follows: this region is the whole step
            if slots and qstate.nonfinite_steps > faults:
                # reported now: the next training update must neither count these amaxes again nor see them
                for slot in slots:
                    slot.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        qstate.registered_in_region = []

    @classmethod
    def _flag_nonfinite_amaxes(cls, region: list[tuple[tuple[str, bool], int]]) -> list[torch.Tensor]:
        """A pass without gradients runs no update, which is where delayed scaling folds NaN/Inf amaxes into
        the states' flags: fold this region's here, in one op. Returns the amax slots it read."""
        qstate = cls.quantization_state
        states = [qstate.registered.get(entry, {}).get(state_id) for entry, state_id in region]
        states = [s for s in states if s is not None and not isinstance(s, HIF8DelayedScalingRecipeState)]
        slots = [state.amax_history[0] for state in states]
        if states:
            fold_nonfinite_pairs([(flag, amax, False) for state, slot in zip(states, slots)
                                  for flag, amax in zip(state.nonfinite.split(1), slot.split(1))])
        return slots

    # TransformerEngine <= 2.8 names.
    @classmethod
    def fp8_autocast_enter(cls, enabled: bool = False, calibrating: bool = False,
                           fp8_recipe: Optional[Recipe] = None, fp8_group: Optional[dist.ProcessGroup] = None,
                           _graph: bool = False) -> None:
        cls.autocast_enter(enabled, calibrating, fp8_recipe, fp8_group, _graph)

    @classmethod
    def fp8_autocast_exit(cls, enabled: bool, _graph: bool) -> None:
        cls.autocast_exit(enabled, _graph)

    @classmethod
    def autocast_region_exit_state(cls, saved: tuple) -> None:
        """Restore the autocast fields saved at a region's entry, except that a first-module flag consumed
        inside a nested region stays consumed: in outer{inner{A}; B} only A is the first module, so the
        backward amaxes are reduced after A's backward, which runs last."""
        first_unused = cls.quantization_state.is_first_fp8_module
        cls.set_autocast_state(saved)
        cls.quantization_state.is_first_fp8_module &= first_unused


def _check_available(recipe: Recipe) -> None:
    """Refuse an enabled region the device cannot run, with the reason."""
    if isinstance(recipe, MXFP8BlockScaling):
        available, reason = FP8GlobalStateManager.is_mxfp8_available()
    elif isinstance(recipe, Float8BlockScaling):
        available, reason = FP8GlobalStateManager.is_fp8_block_scaling_available()
    else:
        available, reason = FP8GlobalStateManager.is_fp8_available()
    if not available:
        raise RuntimeError(f"FP8 is not available: {reason} (recipe {type(recipe).__name__})")


def _all_reduce_amaxes(amaxes: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """One MAX all-reduce of a key's contiguous slot-0 amaxes, in place. NaN becomes +Inf first: gloo/NCCL MAX
    is not NaN-consistent across ranks, while Inf is, and the update then ignores the non-finite amax
    everywhere."""
    torch.nan_to_num(amaxes, nan=float("inf"), out=amaxes)
    dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)


def is_fp8_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """Whether delayed and current per-tensor scaling can run; with `return_reason`, (available, reason)."""
    result = FP8GlobalStateManager.is_fp8_available()
    return result if return_reason else result[0]


def is_mxfp8_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """Whether MXFP8BlockScaling can run; with `return_reason`, (available, reason)."""
    result = FP8GlobalStateManager.is_mxfp8_available()
    return result if return_reason else result[0]


def is_fp8_block_scaling_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """Whether Float8BlockScaling can run; with `return_reason`, (available, reason)."""
    result = FP8GlobalStateManager.is_fp8_block_scaling_available()
    return result if return_reason else result[0]


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
