"""Megatron's `train_step`, wrapped once: the FP8 modules named by their path in the model (so non-finite
warnings name the layer), the step boundary of the non-finite report, `--fp8-step-recovery`, and the numerics
report (`patches/numerics.py`).

The non-finite checks of a step's micro-batches copy their flags to the host without waiting
(state/nonfinite_report.py); they are harvested (warned, counted) when each train_step attempt returns. By then
train_step has synchronised the host with the device (after `optimizer.step()` it reads
`logical_and_across_model_parallel_group(update_successful)` with `.item()`, on every rank and every path),
so the harvest waits for nothing, and the reports reach the numerics report's counters of their own step.

Step recovery uses Megatron's own skip path: when `mindspeed_te.recovery.StepRecovery.failed` (called after
`forward_backward_func`, on the reduced losses and the gradient buffers, one MAX all-reduce over all ranks)
says the step failed, the optimizer's `prepare_grads` reports found_inf, so `optimizer.step()` updates
nothing and `train_step` returns skipped_iter=1 with no learning-rate step, as for an fp16 overflow. The
batch is then retried once from a replaying data iterator, after the amax histories of the recipes the step
used are reset.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import torch

from mindspeed_te.debug import count
from mindspeed_te.modules.base import FP8ModuleBase
from mindspeed_te.patches.numerics import wrap_train_step as wrap_numerics
from mindspeed_te.patches.registry import resolve
from mindspeed_te.recovery import ReplayIterator, StepRecovery
from mindspeed_te.state import FP8GlobalStateManager

TARGET = "megatron.training.training.train_step"
_RECOVERY: Optional[StepRecovery] = None


def name_fp8_modules(model: Any) -> None:
    """Give every FP8 module without a name its path in the model ("decoder.layers.0.mlp.linear_fc1"; the
    DDP / Float16Module wrappers' "module." prefixes dropped), and rename its watched states."""
    for chunk in model if isinstance(model, list) else [model]:
        for path, module in chunk.named_modules():
            if isinstance(module, FP8ModuleBase) and not getattr(module, "name", None):
                while path.startswith("module."):
                    path = path.removeprefix("module.")
                module.name = path
                for state in module.fp8_states or ():
                    FP8GlobalStateManager.watch_nonfinite(path, state)


def _gradients(model: Any) -> list[torch.Tensor]:
    """The gradients Megatron's DDP keeps in its contiguous buffers (one tensor per buffer), else per
    parameter."""
    grads = []
    for chunk in model if isinstance(model, list) else [model]:
        # DDP's buffer lists (an instance attribute shadowing nn.Module.buffers, the method)
        buffers = [buffer for name in ("buffers", "expert_parallel_buffers")
                   if isinstance(getattr(chunk, name, None), list) for buffer in getattr(chunk, name)]
        if buffers:
            grads += [buffer.grad_data for buffer in buffers]
        else:
            grads += [getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
                      for p in chunk.parameters()]
    return [g for g in grads if g is not None]


def _losses(losses_reduced: Any) -> list[torch.Tensor]:
    return [value for entry in losses_reduced or () if isinstance(entry, dict)
            for value in entry.values() if isinstance(value, torch.Tensor)]


class _Replay:
    """Replaying versions of train_step's data iterator(s). Megatron's RerunDataIterator keeps its type (the
    rerun state machine checks it): its inner iterator is wrapped for the step instead."""

    def __init__(self, data_iterator: Any) -> None:
        self.replays: list[ReplayIterator] = []
        self._inner: list[tuple[Any, Any]] = []  # (RerunDataIterator, its own iterable)
        items = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        wrapped = [self._wrap(it) for it in items]
        self.data_iterator = wrapped if isinstance(data_iterator, list) else wrapped[0]

    def _wrap(self, iterator: Any) -> Any:
        if iterator is None:
            return None
        if hasattr(iterator, "iterable") and hasattr(iterator, "saved_microbatches"):  # RerunDataIterator
            replay = ReplayIterator(iterator.iterable)
            self._inner.append((iterator, iterator.iterable))
            iterator.iterable = replay
            self.replays.append(replay)
            return iterator
        replay = ReplayIterator(iterator)
        self.replays.append(replay)
        return replay

    def restore(self) -> None:
        for iterator, iterable in self._inner:
            iterator.iterable = iterable


def _recovering_step(train_step: Callable, bound: inspect.BoundArguments) -> Any:
    global _RECOVERY
    if _RECOVERY is None:
        _RECOVERY = StepRecovery()
    recovery = _RECOVERY
    arguments = bound.arguments
    replay = _Replay(arguments["data_iterator"])
    arguments["data_iterator"] = replay.data_iterator
    forward_backward_func, model = arguments["forward_backward_func"], arguments["model"]

    def checked_forward_backward(*args: Any, **kwargs: Any) -> Any:
        losses = forward_backward_func(*args, **kwargs)
        recovery.failed(None, _losses(losses) + _gradients(model))
        return losses

    arguments["forward_backward_func"] = checked_forward_backward
    optimizer = arguments["optimizer"]
    prepare_grads = optimizer.prepare_grads

    def prepare_grads_or_skip() -> bool:
        return bool(prepare_grads()) or recovery.last_failed

    optimizer.prepare_grads = prepare_grads_or_skip
    retried, skipped = recovery.retried, recovery.skipped
    try:
        return recovery.run(lambda: train_step(*bound.args, **bound.kwargs), replay.replays)
    finally:
        del optimizer.prepare_grads  # the instance attribute: the class's method shows through again
        replay.restore()
        if recovery.retried > retried:
            count("fp8_step_recovery_retries", recovery.retried - retried)
        if recovery.skipped > skipped:
            count("fp8_step_recovery_skipped_batches", recovery.skipped - skipped)


def harvest_at_step_end(train_step: Callable) -> Callable:
    """train_step, then the non-finite reports of its micro-batches harvested (each attempt's, under step
    recovery: a failed attempt's fault is warned before its retry)."""

    @functools.wraps(train_step)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = train_step(*args, **kwargs)
        FP8GlobalStateManager.harvest_nonfinite()
        return result

    return wrapped


def wrap_recovery(train_step: Callable) -> Callable:
    """train_step with the FP8 modules named (first call) and, with --fp8-step-recovery, step recovery."""
    signature = inspect.signature(train_step)
    named: set[int] = set()

    @functools.wraps(train_step)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        bound = signature.bind(*args, **kwargs)
        if id(bound.arguments["model"]) not in named:
            name_fp8_modules(bound.arguments["model"])
            named.add(id(bound.arguments["model"]))
        if not getattr(get_args(), "fp8_step_recovery", False):
            return train_step(*args, **kwargs)
        return _recovering_step(train_step, bound)

    return wrapped


def register_training(registry) -> None:
    """Hook megatron.training.training.train_step (numerics report around step recovery, around the
    non-finite harvest at each attempt's end)."""
    registry.register(TARGET, wrap_numerics(wrap_recovery(harvest_at_step_end(resolve(TARGET)))))
