"""TransformerEngine's `FP8GlobalStateManager`, composed from one mixin per concern, and its function forms.

The manager is a class of classmethods (TE's public name and API). Its concerns are written apart:
availability, autocast regions, amax reduction, the non-finite report, checkpoint phases and the operand
observer; this module joins them into the one class and holds the shared storage as its class attributes.
Every mixin reads and writes that storage through `cls`, which is this class, so `reset()` replacing
`quantization_state` here resets it for all of them. TE's module-level `is_*_available` functions, which
query the composed class, live here too.
"""
from __future__ import annotations

from typing import Callable

from mindspeed_te.kernels import reset_backend
from mindspeed_te.state.availability import AvailabilityMixin
from mindspeed_te.state.checkpoint_phases import CheckpointPhasesMixin
from mindspeed_te.state.global_state import FP8GlobalState
from mindspeed_te.state.nonfinite_report import NonfiniteReportMixin
from mindspeed_te.state.operand_observer import OperandObserverMixin
from mindspeed_te.state.reduction import ReductionMixin
from mindspeed_te.state.regions import RegionsMixin


class FP8GlobalStateManager(AvailabilityMixin, RegionsMixin, ReductionMixin, NonfiniteReportMixin,
                            CheckpointPhasesMixin, OperandObserverMixin):
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
