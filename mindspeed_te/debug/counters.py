"""Named event counters that appear in the numerics report (e.g. steps skipped for non-finite gradients).
Anyone may call `count("nonfinite_steps")`; counting is a dict update whether or not a report is on."""
from __future__ import annotations

from collections import Counter

from mindspeed_te.state import FP8GlobalStateManager

__all__ = ["count", "counters", "reset_counters"]

_COUNTS: Counter[str] = Counter()


def count(name: str, n: int = 1) -> None:
    """Add `n` to the counter `name`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"count: name must be a non-empty string, got {name!r}")
    _COUNTS[name] += n


def counters() -> dict[str, int]:
    return dict(_COUNTS)


def reset_counters() -> None:
    _COUNTS.clear()


def _count_nonfinite(found: list[str]) -> None:
    """The state manager's non-finite check: one "nonfinite_steps" per check that found any, and one
    "nonfinite <module> <tensor>" per tensor."""
    count("nonfinite_steps")
    for where in found:
        count(f"nonfinite {where}")


FP8GlobalStateManager.add_nonfinite_listener(_count_nonfinite)
