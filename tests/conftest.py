"""Shared test setup. Every test starts and ends with fresh global state, so a test that fails half-way
cannot leak an open autocast, recorded amaxes or a cached backend into the tests after it."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from mindspeed_te import FP8GlobalStateManager


def reset_global_state() -> None:
    """The state manager back to its import state; that also drops the kernel backend chosen from the
    environment (and the NPU backend built from it), which tests change."""
    FP8GlobalStateManager.reset()


@pytest.fixture(autouse=True)
def _fresh_global_state() -> Iterator[None]:
    reset_global_state()
    yield
    reset_global_state()


@pytest.fixture
def use_backend(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """use_backend(name) selects a kernel backend for the rest of the test; "npu" runs torch_npu's kernels
    on the CPU through the simulator."""

    def select(name: str) -> None:
        monkeypatch.setenv("MINDSPEED_TE_BACKEND", name)
        if name == "npu":
            monkeypatch.setenv("MINDSPEED_TE_NPU_SIMULATOR", "1")
        reset_global_state()

    return select
