"""The simulator's errors: what the real kernel refuses, and what the simulator does not model."""
from __future__ import annotations

__all__ = ["NpuContractError", "NpuTypeError", "NpuValueError", "NpuSocError", "NpuSimNotImplemented"]


class NpuContractError(RuntimeError):
    """A call the real kernel rejects. A RuntimeError, like the errors torch_npu raises."""


class NpuTypeError(NpuContractError, TypeError):
    """Wrong dtype or argument type."""


class NpuValueError(NpuContractError, ValueError):
    """Wrong shape, layout or option value."""


class NpuSocError(NpuContractError):
    """The simulated chip cannot run this (FP8/HiF8/MX need the Ascend 950 series)."""


class NpuSimNotImplemented(NotImplementedError):
    """A call the real kernel may accept but that this simulator does not model."""

