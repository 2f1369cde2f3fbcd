"""Step recovery (`--fp8-step-recovery`): a step whose loss or gradients are non-finite on any rank is skipped
on every rank, the amax histories of the recipes it ran are reset, and its batch is retried once; a second
failure skips the batch for good.

The pieces are independent of Megatron: `ReplayIterator` re-feeds an attempt's batches, `StepRecovery.failed`
is the one collective that makes every rank take the same decision (call it before the optimizer update, and
skip the update when it says so), and `StepRecovery.run` retries an attempt that failed.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from mindspeed_te.state import FP8GlobalStateManager

__all__ = ["ReplayIterator", "StepRecovery", "all_finite"]

R = TypeVar("R")


class ReplayIterator:
    """Wraps a data iterator so that an attempt can be replayed: `rewind()` makes the next items the ones
    drawn since the last `commit()`, in order."""

    def __init__(self, iterator: Iterator) -> None:
        self.iterator = iterator
        self._drawn: list[Any] = []
        self._replay: list[Any] = []

    def __iter__(self) -> ReplayIterator:
        return self

    def __next__(self) -> Any:
        item = self._replay.pop(0) if self._replay else next(self.iterator)
        self._drawn.append(item)
        return item

    def rewind(self) -> None:
        self._replay, self._drawn = self._drawn + self._replay, []

    def commit(self) -> None:
        self._drawn = []


def all_finite(tensors: Iterable[Optional[torch.Tensor]]) -> torch.Tensor:
    """A 0-d bool tensor: every element of every tensor is finite (no host read; None entries are skipped)."""
    present = [t for t in tensors if t is not None and t.numel()]
    if not present:
        return torch.tensor(True)
    # the extremes of each tensor (one pass, no copy): NaN and +-Inf show in them, and one cat checks them all
    return torch.cat([torch.stack(torch.aminmax(t.detach().reshape(-1))).float() for t in present]).isfinite().all()


class StepRecovery:
    """Skip-and-retry of non-finite steps, agreed across the ranks of `group` (default: all ranks).
    `retried` and `skipped` count retries and batches given up."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, retries: int = 1) -> None:
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an integer >= 0, got {retries!r}")
        self.group = group
        self.retries = retries
        self.retried = 0
        self.skipped = 0
        self._failed: Optional[bool] = None  # the decision of the running attempt

    def failed(self, loss: Optional[torch.Tensor] = None,
               grads: Iterable[Optional[torch.Tensor]] = ()) -> bool:
        """Whether this attempt failed on any rank: this rank's loss or gradients hold NaN/Inf. One MAX
        all-reduce of a flag, so every rank gets the same answer; call it once per attempt on every rank,
        before the optimizer update, and skip the update when it is True. Its read waits for the device, so
        the attempt's pending non-finite reports are harvested here at no cost: a fault is warned, naming
        the layer, before the retry."""
        bad = (~all_finite([loss, *grads])).float().reshape(1)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        self._failed = bool(bad.item())
        FP8GlobalStateManager.harvest_nonfinite()
        return self._failed

    def run(self, attempt: Callable[[], R], iterators: Sequence[ReplayIterator] = ()) -> R:
        """Run `attempt()` (one training step that calls `failed()` before its update). If it failed: reset the
        amax histories of the recipe keys it used, rewind `iterators` and run it again, up to `retries`
        times; returns the last attempt's result."""
        FP8GlobalStateManager.take_used_autocast_keys()
        tries = 0
        while True:
            self._failed = None
            result = attempt()
            keys = FP8GlobalStateManager.take_used_autocast_keys()
            if not self._failed:
                break
            FP8GlobalStateManager.reset_amax_histories(keys)
            if tries == self.retries:
                self.skipped += 1
                break
            tries += 1
            self.retried += 1
            for iterator in iterators:
                iterator.rewind()
        for iterator in iterators:
            iterator.commit()
        return result

    @property
    def last_failed(self) -> bool:
        """Whether the last attempt failed (after `run`: the batch was skipped)."""
        return bool(self._failed)
