"""The report of NaN/Inf that entered quantized GEMMs, read where the host waits anyway.

Quantizers of watched recipe states flag non-finite inputs in shared buffers (mindspeed_te.nonfinite); this
mixin folds the noted flag updates once per step for all layers and checks the flags at the end of each step
(after the last backward amax reduction the step's regions owe, at the exit of a region run without gradients,
else at the next outermost entry). The check does not read them: it copies them to host memory without waiting
(`nonfinite.HostCopy`: a concatenation, a non-blocking copy into pinned memory, an event; then one indexed fill
per flag buffer clears them) and keeps the report pending. Megatron runs a step per micro-batch, so a host read
there would stop the host from queuing work ahead of the device. Pending reports are harvested (warned naming
the modules and tensors, counted, told to the listeners, e.g. the numerics report) at the next outermost
region entry when their copy is done (never waiting; on the CPU, which has no events, never there), and without
fail at Megatron's step boundary (patches/training.py: after train_step, whose optimizer step has synchronised
the host already) or in `harvest_nonfinite`/`check_nonfinite`: at most one training step late. A pass without
gradients runs no amax update, so its amaxes are folded into the flags here.
"""
from __future__ import annotations

import math
import warnings
import weakref
from typing import Callable, ClassVar

import torch

from mindspeed_te.nonfinite import HostCopy, clear_flags, fold_nonfinite_pairs
from mindspeed_te.recipe_state import HIF8DelayedScalingRecipeState, RecipeState
from mindspeed_te.state.global_state import FP8GlobalState, PendingReport

# Pending reports kept at most: past them a check reads the oldest at once (waiting for its copy if the device
# is that far behind; on the CPU reading it costs nothing), so that a loop with no step boundary (no Megatron,
# no harvest_nonfinite) still reports and holds a bounded number of host buffers.
MAX_PENDING_REPORTS = 32


def _labels(name: str, state: RecipeState) -> list[str]:
    """Each slot's "<module> <tensor>": its role, and the GEMM where the state has several (how many slots of
    that role come before, whatever the slot layout)."""
    many = state.num_quantizers > (3 if state.forward else 2)
    return [f"{name} {role}{f'[{state.roles[:i].count(role)}]' if many else ''}"
            for i, role in enumerate(state.roles)]


class NonfiniteReportMixin:
    """The manager's watch list of recipe states, the per-step check and fold, the pending reports, the counts."""

    quantization_state: ClassVar[FP8GlobalState]  # the composed manager's (state/manager.py)
    _nonfinite_listeners: ClassVar[list[Callable[[list[str]], None]]]

    @classmethod
    def watch_nonfinite(cls, module_name: str, state: RecipeState) -> None:
        """Have the checks report NaN/Inf that `state`'s quantizers see, naming `module_name`. Watching a
        watched state again renames it (e.g. once Megatron's model is built and its layers have paths). Its
        quantizers made from now on note their flag updates for the per-step fold (`fold_nonfinite`)."""
        qstate = cls.quantization_state
        state.nonfinite_pending = qstate.nonfinite_pending
        qstate.nonfinite_watch = [(name, ref) for name, ref in qstate.nonfinite_watch if ref() is not state]
        qstate.nonfinite_watch.append((module_name, weakref.ref(state)))
        qstate.nonfinite_labels = None

    @classmethod
    def add_nonfinite_listener(cls, listener: Callable[[list[str]], None]) -> None:
        """Call `listener(found)` after every check that found NaN/Inf ("<module> <tensor>" each), when it is
        harvested, e.g. the numerics report's counters. Listeners outlive `reset()`: they are tools, not
        training state."""
        if listener not in cls._nonfinite_listeners:
            cls._nonfinite_listeners.append(listener)

    @classmethod
    def check_nonfinite(cls) -> list[str]:
        """Check now and wait for the answer: the tensors that held NaN/Inf when quantized since the last check
        ("<module> <tensor>"), after the reports still pending (all of them warned, counted and told to the
        listeners, one warning per check that found any). The flags are cleared. TransformerEngine's
        synchronous form; the automatic checks at each step's end do not wait (see the module docstring), and
        `nonfinite_check` off turns them off (the step end then only folds)."""
        cls._start_nonfinite_check()
        return cls._harvest_nonfinite(wait=True)

    @classmethod
    def harvest_nonfinite(cls) -> list[str]:
        """The step boundary: report every pending check, waiting for its copy where it is not done (after
        Megatron's train_step the host has synchronised already, so nothing is waited for). Steps that ended
        unchecked (no backward ended them, and none is owed any more) are checked first. Returns what the
        reports found."""
        qstate = cls.quantization_state
        owed = any(ref() is not None for ref in qstate.backward_reducers.values())
        if qstate.nonfinite_unchecked and qstate.nonfinite_check and not owed:
            cls._start_nonfinite_check()
        return cls._harvest_nonfinite(wait=True)

    @classmethod
    def _harvest_ready_nonfinite(cls) -> None:
        """At an outermost region entry: report the pending checks whose copy is done, never waiting (on the
        CPU, without events, none: they wait for the step boundary)."""
        if cls.quantization_state.nonfinite_reports:
            cls._harvest_nonfinite(wait=False)

    @classmethod
    def _harvest_nonfinite(cls, wait: bool) -> list[str]:
        """Report the pending checks in order, all (waiting where needed) or, without `wait`, those done."""
        reports = cls.quantization_state.nonfinite_reports
        found = []
        while reports and (wait or reports[0].flags.ready()):
            found += cls._report_nonfinite(reports.popleft())
        return found

    @classmethod
    def _start_nonfinite_check(cls) -> None:
        """Fold, copy the watched flags to the host without waiting, clear them, and keep the report pending.
        Launches: the fold's, then one concatenation, one copy and one indexed fill per flag buffer (delayed
        scaling: the forward and backward buffers of each key), whatever the number of layers (before, the
        check took 4 more ops and waited for the device with one read)."""
        cls.fold_nonfinite()
        qstate = cls.quantization_state
        qstate.nonfinite_unchecked = False
        watched = [(name, ref()) for name, ref in qstate.nonfinite_watch]
        watched = [(name, state) for name, state in watched if state is not None]
        if len(watched) != len(qstate.nonfinite_watch):
            qstate.nonfinite_watch = [(name, weakref.ref(state)) for name, state in watched]
            qstate.nonfinite_labels = None
        if not watched:
            return
        if qstate.nonfinite_labels is None:
            qstate.nonfinite_labels = [label for name, state in watched for label in _labels(name, state)]
        flags = [state.nonfinite for _, state in watched]
        qstate.nonfinite_reports.append(PendingReport(HostCopy(flags), qstate.nonfinite_labels))
        clear_flags(flags)
        while len(qstate.nonfinite_reports) > MAX_PENDING_REPORTS:
            cls._report_nonfinite(qstate.nonfinite_reports.popleft())

    @classmethod
    def _report_nonfinite(cls, report: PendingReport) -> list[str]:
        """Read one check's flags (waiting for their copy if it is not done) and, where any is non-finite,
        warn naming the modules and tensors, count them and tell the listeners."""
        found = [label for label, value in zip(report.labels, report.flags.values()) if not math.isfinite(value)]
        if found:
            qstate = cls.quantization_state
            qstate.nonfinite_steps += 1
            qstate.nonfinite_counts.update(found)
            warnings.warn(f"mindspeed_te: NaN/Inf entered quantized GEMMs at {', '.join(found)}: their outputs are "
                          "non-finite, as in high precision; scales and amax histories were left unchanged "
                          f"({qstate.nonfinite_steps} such checks so far)", RuntimeWarning, stacklevel=3)
            for listener in cls._nonfinite_listeners:
                listener(found)
        return found

    @classmethod
    def fold_nonfinite(cls) -> None:
        """Fold the flag updates noted since the last fold into the flags, all layers' at once
        (`nonfinite.fold_nonfinite_pairs`: a fixed handful of ops). Runs before the flags are copied and at the
        end of every step, so the list never outlives a step."""
        cls.quantization_state.nonfinite_pending.fold()

    @classmethod
    def _end_step_nonfinite(cls) -> bool:
        """The step is over: start its check (which folds first), or with the check off, or nothing left to
        check, still fold, so that the flags stay current for a later `check_nonfinite` and the pending
        pairs never pile up. Returns whether a check was started."""
        qstate = cls.quantization_state
        if qstate.nonfinite_unchecked and qstate.nonfinite_check:
            cls._start_nonfinite_check()
            return True
        cls.fold_nonfinite()
        return False

    @classmethod
    def get_nonfinite_counts(cls) -> dict[str, int]:
        """How many checks found NaN/Inf per "<module> <tensor>", and under "steps" in how many checks
        (the checks harvested so far)."""
        qstate = cls.quantization_state
        return {"steps": qstate.nonfinite_steps, **qstate.nonfinite_counts}

    @classmethod
    def _flag_nonfinite_amaxes(cls, region: list[tuple[tuple[str, bool], int]]) -> list[torch.Tensor]:
        """A pass without gradients runs no update, which is where delayed scaling folds NaN/Inf amaxes into
        the states' flags: fold this region's here, in one op. Returns the amax slots it read."""
        qstate = cls.quantization_state
        states = [qstate.registered.get(entry, {}).get(state_id) for entry, state_id in region]
        states = [s for s in states if s is not None and not isinstance(s, HIF8DelayedScalingRecipeState)]
        slots = [state.amax_history[0] for state in states]
        if states:
            fold_nonfinite_pairs([(flag, amax, False) for state, slot in zip(states, slots)
                                  for flag, amax in zip(state.nonfinite.split(1), slot.split(1))])
        return slots
