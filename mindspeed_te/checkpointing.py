"""Activation checkpointing of regions that contain FP8 modules (TransformerEngine's `checkpoint`).

The recompute must quantize exactly as the first pass did: the same scales, autocast state and RNG streams,
and no second recording of amaxes. The state manager's checkpoint phases carry each module's forward state
from the first pass to the recompute; this module drives them around torch's non-reentrant checkpoint.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils.checkpoint

from mindspeed_te.recipe_state import RecipeState
from mindspeed_te.state import CheckpointPhase, FP8GlobalStateManager

__all__ = ["checkpoint"]


@contextlib.contextmanager
def _phase(phase: CheckpointPhase, stash: list[RecipeState], autocast_state: Optional[tuple] = None,
           tracker_states: Optional[dict] = None, get_rng_state_tracker: Optional[Callable] = None) -> Iterator[None]:
    """Enter a checkpoint phase. The first pass fills `stash` with each FP8 module's forward state; a
    recompute (which may stop early, and may run more than once) consumes a fresh copy of it, and also
    restores the first pass's autocast state and RNG tracker streams so the activations come out equal."""
    saved_autocast = FP8GlobalStateManager.get_autocast_state()
    tracker = get_rng_state_tracker() if get_rng_state_tracker is not None else None
    saved_tracker = tracker.get_states() if tracker is not None and tracker_states is not None else None
    if autocast_state is not None:
        FP8GlobalStateManager.set_autocast_state(autocast_state)
    if saved_tracker is not None:
        tracker.set_states(tracker_states)
    try:
        with FP8GlobalStateManager.checkpoint_phase(phase, stash):
            yield
    finally:
        FP8GlobalStateManager.set_autocast_state(saved_autocast)
        if saved_tracker is not None:
            tracker.set_states(saved_tracker)


def checkpoint(function: Callable, *args: Any, distribute_saved_activations: bool = False,
               get_rng_state_tracker: Optional[Callable] = None, tp_group: Optional[Any] = None,
               use_reentrant: bool = True, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` with its activations recomputed in backward.

    Args:
        function: the region to checkpoint
        distribute_saved_activations: accepted for compatibility; changes nothing
        get_rng_state_tracker: returns the RNG states tracker whose streams the recompute replays
        tp_group: accepted for compatibility; changes nothing
        use_reentrant: accepted for compatibility; the recompute is always non-reentrant
    """
    autocast_state = FP8GlobalStateManager.get_autocast_state()
    tracker = get_rng_state_tracker() if get_rng_state_tracker is not None else None
    tracker_states = tracker.get_states() if tracker is not None and tracker.is_initialized() else None

    stash: list[RecipeState] = []

    def contexts():
        return (_phase("forward", stash),
                _phase("recompute", stash, autocast_state, tracker_states, get_rng_state_tracker))

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=contexts,
                                             preserve_rng_state=True, **kwargs)
