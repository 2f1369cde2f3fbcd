"""Autocast regions: entering and leaving them, and the region state modules query inside.

An autocast region sets the active recipe, reduction group and calibration/graph flags, and restores them
on exit; the outermost region also opens and closes a step: its entry settles what the previous step left
(stale backward registrations, the non-finite check, the reports of earlier checks that reached the host),
its exit runs the forward amax reduction. This is the manager's state machine; the reduction and the
non-finite report it triggers are their own mixins, reached through `cls` so that all of them work on the one
`quantization_state` of the composed class.
"""
from __future__ import annotations

from typing import ClassVar, Optional

import torch
import torch.distributed as dist

from mindspeed_te.distributed import check_same_on_all_ranks
from mindspeed_te.nonfinite import zero_nonfinite
from mindspeed_te.recipe import Recipe
from mindspeed_te.state.availability import get_default_recipe
from mindspeed_te.state.global_state import FP8GlobalState


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


class RegionsMixin:
    """The manager's autocast-region queries, state save/restore, and region entry and exit."""

    quantization_state: ClassVar[FP8GlobalState]  # the composed manager's (state/manager.py)

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
            cls._check_available(recipe)
        qstate = cls.quantization_state
        if enabled and fp8_group not in qstate.recipe_agreed_groups and dist.is_available() \
                and dist.is_initialized():
            # Once per group, at its first FP8 step: ranks running different recipes fail here, all of them
            # with both recipes named, instead of deadlocking or mismatching in the amax reduction.
            check_same_on_all_ranks("the FP8 recipe", recipe.portable_key(), fp8_group)
            qstate.recipe_agreed_groups.add(fp8_group)
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
            cls._harvest_ready_nonfinite()  # the reports whose copy to the host is done; never waits
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
            cls.drop_failed_region_recompute_stash()
        elif torch.is_grad_enabled() or calibrating:
            cls.reduce_and_update_fp8_tensors(forward=True)
        if not failed and not torch.is_grad_enabled():
            slots = [] if calibrating else cls._flag_nonfinite_amaxes(qstate.registered_in_region)
            # no backward follows: this region is the whole step
            if cls._end_step_nonfinite() and slots:
                # their NaN/Inf are in the check's flags now: the next training update must neither count these
                # amaxes again nor see them (a few ops, whatever they hold: the check's answer is not read here)
                zero_nonfinite(slots)
        qstate.registered_in_region = []

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
