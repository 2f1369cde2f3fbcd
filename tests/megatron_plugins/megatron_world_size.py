"""A pytest plugin for Megatron-LM's unit tests run on fewer ranks than some of them ask for (loaded by
tests/test_megatron_unit_tests.py as `-p megatron_world_size`; this folder is on the run's PYTHONPATH and holds
nothing else, so no module of ours shadows one of Megatron's `tests` package).

It tells a test that needs more ranks from a failing one by what the test asked for, not by the words of an
error. Megatron's harness (Utils.initialize_model_parallel) sets every model-parallel layout up through
megatron.core.parallel_state.initialize_model_parallel; when that call fails and the layout it was given
(TP x PP x CP, and ETP x EP x PP for the experts) does not divide the world size, the failure is raised again as
`NeedsMoreRanks` (a RuntimeError, as Megatron's own), and the test's junit report carries the world size the
layout needs as the property `needs_world_size`. Any other failure carries none.
"""
from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable, Iterator

import pytest

PROPERTY = "needs_world_size"


class NeedsMoreRanks(RuntimeError):
    """initialize_model_parallel refused a layout that does not fit the world size."""

    def __init__(self, message: str, world_size: int) -> None:
        super().__init__(message)
        self.world_size = world_size


def required_world_size(initialize: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """The smallest world size the layout of initialize(*args, **kwargs) fits: a multiple of TP x PP x CP and of
    ETP x EP x PP (ETP defaults to TP), the divisions initialize_model_parallel makes of the world."""
    bound = inspect.signature(initialize).bind(*args, **kwargs)
    bound.apply_defaults()
    size = bound.arguments
    tp = size.get("tensor_model_parallel_size") or 1
    pp = size.get("pipeline_model_parallel_size") or 1
    cp = size.get("context_parallel_size") or 1
    ep = size.get("expert_model_parallel_size") or 1
    etp = size.get("expert_tensor_parallel_size") or tp
    return math.lcm(tp * pp * cp, etp * ep * pp)


def checked(initialize: Callable[..., Any]) -> Callable[..., Any]:
    """initialize_model_parallel whose failure on a layout larger than the world is a NeedsMoreRanks."""

    @functools.wraps(initialize)
    def initialize_model_parallel(*args: Any, **kwargs: Any) -> Any:
        try:
            return initialize(*args, **kwargs)
        except Exception as err:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise
            try:
                needed = required_world_size(initialize, *args, **kwargs)
            except TypeError:  # arguments this release does not take: Megatron's own error stands
                raise err from None
            if dist.get_world_size() % needed == 0:
                raise
            raise NeedsMoreRanks(str(err), needed) from err

    return initialize_model_parallel


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    import megatron.core.parallel_state as parallel_state

    parallel_state.initialize_model_parallel = checked(parallel_state.initialize_model_parallel)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    yield
    if call.excinfo is not None and call.excinfo.errisinstance(NeedsMoreRanks):
        # on the item: junit writes the properties of the test's last (teardown) report
        item.user_properties.append((PROPERTY, call.excinfo.value.world_size))
