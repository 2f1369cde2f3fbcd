"""Activation checkpointing's view of the FP8 state, and Megatron's skip-weight-update flag.

A checkpointed region runs its modules twice, and the recompute must quantize with the first pass's scales
and record no amaxes. The phase of the running pass and the stash of each FP8 module's frozen forward
state are kept here (driven by mindspeed_te.checkpointing, or TE's `activation_recompute_forward` for
Megatron's output-discarding checkpoint), together with the flag Megatron's CUDA-graph code sets to tell
modules whether to re-quantize their weights in a micro-batch: both say how a module's repeated forward uses
state saved from an earlier one.
"""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import ClassVar, Iterator, Optional, Union

import torch

from mindspeed_te.recipe_state import RecipeState
from mindspeed_te.state.global_state import CheckpointPhase, FP8GlobalState, WeakIdentityMap


class CheckpointPhasesMixin:
    """The manager's checkpoint phases, recompute stash and skip-weight-update tensor."""

    quantization_state: ClassVar[FP8GlobalState]  # the composed manager's (state/manager.py)

    # Activation checkpointing ------------------------------------------------------------------------
    @classmethod
    def get_checkpoint_phase(cls) -> Optional[CheckpointPhase]:
        """"forward" in the first pass of a checkpointed region, "recompute" in its recompute, else None."""
        return cls.quantization_state.checkpoint_phase

    @classmethod
    @contextmanager
    def checkpoint_phase(cls, phase: CheckpointPhase,
                         stash: Union[list[RecipeState], WeakIdentityMap[RecipeState, deque]]) -> Iterator[None]:
        """Run a pass of an activation-checkpointed region. In "forward" each FP8 module appends a frozen
        copy of its forward state to `stash`; in "recompute" each takes its copy back, in the same order, so
        the recompute quantizes with the first pass's scales and records amaxes nowhere that matters. A
        recompute consumes its own copy of the list (it may stop early, or run more than once). A map stash
        (`activation_recompute_forward`) keeps each module's states in a queue of its own, consumed oldest first."""
        if phase not in ("forward", "recompute"):
            raise ValueError(f"checkpoint phase must be 'forward' or 'recompute', got {phase!r}")
        qstate = cls.quantization_state
        saved = qstate.checkpoint_phase, qstate.checkpoint_stash
        qstate.checkpoint_phase = phase
        qstate.checkpoint_stash = stash if phase == "forward" or isinstance(stash, WeakIdentityMap) else list(stash)
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
        """First pass of a checkpointed region: keep a frozen copy of `state` for the recompute. Under
        `activation_recompute_forward` it is queued under `state` itself, held weakly (a module that is gone
        leaves no stash, and a new state at its address is not given it), and tagged with the outermost region
        that made it, which drops it if it fails (`drop_failed_region_recompute_stash`)."""
        qstate = cls.quantization_state
        stash = qstate.checkpoint_stash
        frozen = state.frozen_copy()
        if isinstance(stash, WeakIdentityMap):
            # None for a state that is its own frozen copy (stateless recipes): the queue must not keep it alive
            stash.setdefault(state, deque()).append((qstate.region_seq, None if frozen is state else frozen))
        else:
            stash.append(frozen)

    @classmethod
    def pop_forward_state_for_recompute(cls, state: RecipeState) -> RecipeState:
        """Recompute of a checkpointed region: the frozen first-pass copy of the forward state `state` (the next
        in call order, or this module's oldest under `activation_recompute_forward`)."""
        stash = cls.quantization_state.checkpoint_stash
        queue = stash.get(state) if isinstance(stash, WeakIdentityMap) else stash
        if not queue:
            raise RuntimeError("activation recompute ran more FP8 modules than the first pass of the checkpointed "
                               "region; the region must run the same modules both times")
        if isinstance(queue, deque):
            frozen = queue.popleft()[1]
            return state if frozen is None else frozen
        return queue.pop(0)

    @classmethod
    def drop_failed_region_recompute_stash(cls) -> None:
        """An exception left the running outermost autocast region: its backward, and with it the recompute of
        what it stashed under `activation_recompute_forward`, never runs, so those copies go now; left queued,
        a later recompute of the same module would take their stale scales first. Other regions' copies (micro-
        batches whose backward is still to come) stay."""
        qstate = cls.quantization_state
        for state, queue in qstate.recompute_queues.items():
            kept = [entry for entry in queue if entry[0] != qstate.region_seq]
            if not kept:
                qstate.recompute_queues.pop(state)
            elif len(kept) != len(queue):
                queue.clear()
                queue.extend(kept)

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
