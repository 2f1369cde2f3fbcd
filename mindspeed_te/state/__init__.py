"""The one global FP8 state: autocast regions, model-init mode, activation-checkpoint phases, and the
once-per-step amax reduction.

The manager is one class of classmethods, TransformerEngine's `FP8GlobalStateManager`, composed in
manager.py from a mixin per concern: availability.py (what the device runs, the default recipe), regions.py
(autocast entry and exit, the region state), reduction.py (registration and the amax reduction),
nonfinite_report.py (the per-step NaN/Inf report), checkpoint_phases.py (activation recompute, the
skip-weight-update flag) and operand_observer.py; global_state.py holds the storage they share and
autocast.py the public context managers. This package re-exports the public names.
"""
from mindspeed_te.state.autocast import (
    autocast,
    fp8_autocast,
    fp8_model_init,
    preserve_high_precision_init_val,
    quantized_model_init,
)
from mindspeed_te.state.availability import get_default_recipe
from mindspeed_te.state.global_state import CheckpointPhase as CheckpointPhase  # the checkpointing module's
from mindspeed_te.state.global_state import FP8GlobalState
from mindspeed_te.state.global_state import OperandObserver as OperandObserver  # the debug report's
from mindspeed_te.state.manager import (
    FP8GlobalStateManager,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
)

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
