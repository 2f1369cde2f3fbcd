"""The hook that sees every quantized GEMM operand.

The numerics report of mindspeed_te.debug registers an observer here, so the linear autograd functions
call one optional callback instead of knowing about the report; with none set a GEMM pays one check.
"""
from __future__ import annotations

from typing import ClassVar, Optional

from mindspeed_te.state.global_state import FP8GlobalState, OperandObserver


class OperandObserverMixin:
    """The manager's operand observer, set and queried."""

    quantization_state: ClassVar[FP8GlobalState]  # the composed manager's (state/manager.py)

    @classmethod
    def set_operand_observer(cls, observer: Optional[OperandObserver]) -> None:
        """Have the linear autograd functions call `observer` with each quantized operand (None: stop)."""
        if observer is not None and not callable(observer):
            raise TypeError(f"observer must be callable or None, got {type(observer).__name__}")
        cls.quantization_state.operand_observer = observer

    @classmethod
    def get_operand_observer(cls) -> Optional[OperandObserver]:
        return cls.quantization_state.operand_observer
