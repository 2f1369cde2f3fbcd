"""Delayed scaling's once-per-step amax reduction.

Every module that quantizes inside an autocast region registers its `DelayedScalingRecipeState` here under
the key (recipe, reduction group). Once per step and direction, all amaxes registered under one key are
concatenated, MAX-reduced across ranks with a single all-reduce, written back and turned into new scales:
forward states when the outermost autocast region exits, backward states when the backward of the first FP8
module (the last backward to run) finishes. Registrations of a region whose backward can no longer run are
dropped, and step recovery resets the amax histories of the keys a failed step used.
"""
from __future__ import annotations

import functools
import weakref
from typing import ClassVar, Iterable, Optional

import torch
import torch.distributed as dist

from mindspeed_te.recipe import Recipe
from mindspeed_te.recipe_state import (
    DelayedScalingRecipeState,
    HIF8DelayedScalingRecipeState,
    RecipeState,
    update_delayed_states,
)
from mindspeed_te.state.global_state import FP8GlobalState


class ReductionMixin:
    """The manager's registration of delayed-scaling states and their amax reduction and update."""

    quantization_state: ClassVar[FP8GlobalState]  # the composed manager's (state/manager.py)

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
        backward amaxes. When no other region's backward is still to come, the step is over: check the
        non-finite inputs it quantized (the flags start on their way to the host; read later, never here)."""
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


def _all_reduce_amaxes(amaxes: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """One MAX all-reduce of a key's contiguous slot-0 amaxes, in place. NaN becomes +Inf first: gloo/NCCL MAX
    is not NaN-consistent across ranks, while Inf is, and the update then ignores the non-finite amax
    everywhere."""
    torch.nan_to_num(amaxes, nan=float("inf"), out=amaxes)
    dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
