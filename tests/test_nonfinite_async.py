"""Issue 30: the non-finite check at each step's end reads nothing on the host; its report is harvested at the
next outermost region entry once its copy is done (never waiting there), else at the step boundary, so it
arrives at most one step late and still names the module and tensor; a CPU run, which has no events, reports
at the boundary."""
import contextlib
import math
import warnings
from collections.abc import Iterator

import pytest
import torch

from mindspeed_te import DelayedScaling, Float8CurrentScaling, FP8GlobalStateManager, fp8_autocast
from mindspeed_te.modules import Linear
from mindspeed_te.nonfinite import HostCopy
from mindspeed_te.state import nonfinite_report

RECIPES = {"delayed": DelayedScaling, "tensorwise": Float8CurrentScaling}


def _reports():
    return FP8GlobalStateManager.quantization_state.nonfinite_reports


class _Model:
    """Two named layers in one region per step; `step(bad=True)` puts a NaN into b's input."""

    def __init__(self, recipe: str) -> None:
        self.recipe = RECIPES[recipe]()
        self.a, self.b = Linear(32, 32, name="a"), Linear(32, 32, name="b")
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, bad: bool = False) -> torch.Tensor:
        x = torch.randn(16, 32, generator=self.gen).requires_grad_()
        with fp8_autocast(fp8_recipe=self.recipe):
            h = self.a(x)
            if bad:
                h = h.index_put((torch.tensor([2]), torch.tensor([3])), torch.tensor(math.nan))
            return self.b(h)

    def step(self, bad: bool = False) -> None:
        self.forward(bad).sum().backward()


@contextlib.contextmanager
def _nothing_reported() -> Iterator[None]:
    """Nothing may be reported inside: a RuntimeWarning fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_done_copy_is_reported_at_the_next_entry_naming_the_module(recipe, monkeypatch):
    """On a device, the copy's event says it is done: the next step's first region entry reports it."""
    monkeypatch.setattr(HostCopy, "ready", lambda self: True)
    model = _Model(recipe)
    with _nothing_reported():
        model.step()
        model.step(bad=True)  # its entry read the first step's (clean) report
        assert len(_reports()) == 1  # the faulty step's: checked at its end, read nowhere yet
    with pytest.warns(RuntimeWarning, match=r"GEMMs at b input:") as caught:
        autocast = fp8_autocast(fp8_recipe=model.recipe)
        autocast.__enter__()  # the next step's entry: one step late at most
    autocast.__exit__(None, None, None)
    assert len(caught) == 1 and not _reports()
    assert FP8GlobalStateManager.get_nonfinite_counts() == {"steps": 1, "b input": 1}


def test_a_copy_not_done_is_never_waited_for_at_an_entry_but_at_the_step_boundary(monkeypatch):
    """The device is behind: entries leave the report (and never read it: that would wait); the step
    boundary reads it, naming the module, at the end of the next step."""
    monkeypatch.setattr(HostCopy, "ready", lambda self: False)
    reads = []
    values = HostCopy.values
    monkeypatch.setattr(HostCopy, "values", lambda self: reads.append(self) or values(self))
    model = _Model("tensorwise")
    with _nothing_reported():
        model.step(bad=True)
        model.step()
        assert reads == [] and len(_reports()) == 2
    with pytest.warns(RuntimeWarning, match=r"GEMMs at b input:"):
        assert FP8GlobalStateManager.harvest_nonfinite() == ["b input"]
    assert len(reads) == 2 and not _reports()


def test_a_cpu_run_reports_at_the_boundary_and_keeps_a_bounded_number_pending(monkeypatch):
    """The CPU has no events: no entry reads a report; the boundary does. Past MAX_PENDING_REPORTS a check
    reads the oldest, so a loop that never reaches a boundary still reports, late, and holds few buffers."""
    model = _Model("delayed")
    with _nothing_reported():
        for bad in (False, True, False):
            model.step(bad)
        assert len(_reports()) == 3
    with pytest.warns(RuntimeWarning, match=r"GEMMs at b input:"):
        assert FP8GlobalStateManager.harvest_nonfinite() == ["b input"]

    monkeypatch.setattr(nonfinite_report, "MAX_PENDING_REPORTS", 2)
    with _nothing_reported():
        model.step(bad=True)
        model.step()
    with pytest.warns(RuntimeWarning, match=r"GEMMs at b input:"):
        model.step()  # its check makes 3 pending: the oldest, the faulty step's, is read
    assert len(_reports()) == 2
    assert FP8GlobalStateManager.harvest_nonfinite() == []
    assert FP8GlobalStateManager.get_nonfinite_counts() == {"steps": 2, "b input": 2}


def test_check_nonfinite_is_the_synchronous_answer():
    """TransformerEngine's check_nonfinite waits: it reports what is pending and what is flagged now, e.g.
    a forward whose backward has not run (no check was started)."""
    model = _Model("tensorwise")
    model.step(bad=True)  # pending
    model.forward(bad=True)  # flagged, unchecked
    with pytest.warns(RuntimeWarning) as caught:
        assert FP8GlobalStateManager.check_nonfinite() == ["b input", "b input"]
    assert len(caught) == 2 and not _reports()
    assert FP8GlobalStateManager.check_nonfinite() == []


def test_with_the_check_off_nothing_is_copied_or_reported():
    FP8GlobalStateManager.quantization_state.nonfinite_check = False
    model = _Model("delayed")
    with _nothing_reported():
        model.step(bad=True)
        assert not _reports()
        assert FP8GlobalStateManager.harvest_nonfinite() == []
    with pytest.warns(RuntimeWarning, match="b input"):  # the flags kept it for an explicit check
        assert FP8GlobalStateManager.check_nonfinite() == ["b input"]


def test_listeners_hear_of_a_check_when_it_is_harvested():
    heard = []
    FP8GlobalStateManager.add_nonfinite_listener(heard.append)
    try:
        model = _Model("tensorwise")
        model.step(bad=True)
        assert heard == []
        with pytest.warns(RuntimeWarning):
            FP8GlobalStateManager.harvest_nonfinite()
        assert heard == [["b input"]]
    finally:
        FP8GlobalStateManager._nonfinite_listeners.remove(heard.append)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the event path)")


@cuda
def test_on_a_device_the_copy_is_pinned_and_waits_for_nothing_until_read():
    """The copy into pinned memory is queued behind the device's work: making it and clearing the flags wait
    for nothing (no host sync), `ready()` says not done while the device is busy, `values()` waits."""
    from mindspeed_te.diagnostics import HostSyncCounter
    from mindspeed_te.nonfinite import clear_flags, take_flags

    flags = take_flags(6, "cuda")
    # once: the index tensor of the flags' layout (a copy from the host, which waits) and the first use of the
    # kernels (CUDA loads them lazily, waiting for the device)
    HostCopy([flags[:3], flags[3:]]).values()
    clear_flags([flags])
    busy = torch.randn(4096, 4096, device="cuda") / 64
    flags[4:5].fill_(math.nan)
    torch.cuda.synchronize()
    for _ in range(30):  # tens of milliseconds of queued work
        busy = busy @ busy
    with HostSyncCounter(trap=True):
        copy = HostCopy([flags[:3], flags[3:]])
        clear_flags([flags])
        done_at_once = copy.ready()
    assert copy.host.is_pinned() and copy.event is not None
    assert not done_at_once
    assert [math.isfinite(v) for v in copy.values()] == [True] * 4 + [False, True]
    assert copy.ready() and not flags.isnan().any()


@cuda
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_on_a_device_a_step_reads_nothing_and_the_next_entry_reports(recipe):
    """A faulty step of two CUDA layers makes no host sync with the check on; once the host has synchronised
    (as Megatron's train_step does), the next region entry reports it, naming the layer."""
    from mindspeed_te.diagnostics import HostSyncCounter

    a, b = (Linear(64, 64, name=name, bias=False, params_dtype=torch.bfloat16, device="cuda") for name in "ab")
    for step in range(3):
        x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with HostSyncCounter(trap=True), fp8_autocast(fp8_recipe=RECIPES[recipe]()):
            h = a(x)
            if step == 1:
                nan = torch.tensor(math.nan, device="cuda", dtype=h.dtype)
                h = h.index_put((torch.tensor([2], device="cuda"),), nan)
            y = b(h)
        with HostSyncCounter(trap=True):
            y.sum().backward()
        torch.cuda.synchronize()
        if step == 1:  # its copy is done: the next entry reads it (host memory: no sync, in the trap or not)
            autocast = fp8_autocast(fp8_recipe=RECIPES[recipe]())
            with pytest.warns(RuntimeWarning, match=r"GEMMs at b input:"), HostSyncCounter(trap=True):
                autocast.__enter__()
            autocast.__exit__(None, None, None)
    assert FP8GlobalStateManager.harvest_nonfinite() == []
    assert FP8GlobalStateManager.get_nonfinite_counts() == {"steps": 1, "b input": 1}
