"""`--fp8-numerics-report DIR`: wrap Megatron's train_step so every `--fp8-numerics-interval`-th iteration
records the per-layer FP8 numerics (mindspeed_te.debug) and rewrites the report files. Without the flag the
wrapper only checks it."""
from __future__ import annotations

import functools
from typing import Callable, Optional

from mindspeed_te.debug import NumericsReport

_REPORT: Optional[NumericsReport] = None


def wrap_train_step(train_step: Callable) -> Callable:
    @functools.wraps(train_step)
    def wrapped(forward_step_func, data_iterator, model, *args, **kwargs):
        from megatron.training import get_args

        megatron_args = get_args()
        directory = getattr(megatron_args, "fp8_numerics_report", None)
        if not directory:
            return train_step(forward_step_func, data_iterator, model, *args, **kwargs)
        global _REPORT
        if _REPORT is None:
            _REPORT = NumericsReport(directory, megatron_args.fp8_numerics_interval)
            for chunk in (model if isinstance(model, list) else [model]):
                _REPORT.watch(chunk)
        iteration = megatron_args.curr_iteration + 1
        _REPORT.begin_step(iteration)
        try:
            return train_step(forward_step_func, data_iterator, model, *args, **kwargs)
        finally:
            _REPORT.stop()
            if iteration % _REPORT.interval == 0 and _rank() == 0:
                _REPORT.write()

    return wrapped


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
