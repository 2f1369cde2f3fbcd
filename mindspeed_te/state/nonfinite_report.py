"""The per-step report of NaN/Inf that entered quantized GEMMs.

Quantizers of watched recipe states flag non-finite inputs in shared buffers (mindspeed_te.nonfinite); this
mixin folds the noted flag updates once per step for all layers, reads all flags with one host sync at the
end of each step, warns naming the modules and tensors, counts them and tells the listeners (e.g. the
numerics report). A pass without gradients runs no amax update, so its amaxes are folded into the flags here.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Callable, ClassVar

import torch

from mindspeed_te.nonfinite import clear_flags, fold_nonfinite_pairs
from mindspeed_te.recipe_state import HIF8DelayedScalingRecipeState, RecipeState
from mindspeed_te.state.global_state import FP8GlobalState


class NonfiniteReportMixin:
    """The manager's watch list of recipe states, the per-step check and fold, and the counts."""

    quantization_state: ClassVar[FP8GlobalState]  # the composed manager's (state/manager.py)
    _nonfinite_listeners: ClassVar[list[Callable[[list[str]], None]]]

    @classmethod
    def watch_nonfinite(cls, module_name: str, state: RecipeState) -> None:
        """Have `check_nonfinite` report NaN/Inf that `state`'s quantizers see, naming `module_name`. Watching a
        watched state again renames it (e.g. once Megatron's model is built and its layers have paths). Its
        quantizers made from now on note their flag updates for the per-step fold (`fold_nonfinite`)."""
        qstate = cls.quantization_state
        state.nonfinite_pending = qstate.nonfinite_pending
        qstate.nonfinite_watch = [(name, ref) for name, ref in qstate.nonfinite_watch if ref() is not state]
        qstate.nonfinite_watch.append((module_name, weakref.ref(state)))

    @classmethod
    def add_nonfinite_listener(cls, listener: Callable[[list[str]], None]) -> None:
        """Call `listener(found)` after every check that found NaN/Inf ("<module> <tensor>" each), e.g. the
        numerics report's counters. Listeners outlive `reset()`: they are tools, not training state."""
        if listener not in cls._nonfinite_listeners:
            cls._nonfinite_listeners.append(listener)

    @classmethod
    def check_nonfinite(cls) -> list[str]:
        """Report the tensors that held NaN/Inf when quantized since the last check ("<module> <tensor>"),
        warn once per check naming them, count them, tell the listeners, and clear the flags. One host read of
        all flags, at the end of each step: after the last backward amax reduction the step's regions owe, at
        the exit of a region run without gradients, else (backward never ran) at the next outermost entry.
        `nonfinite_check` off turns these automatic checks off (the step end then only folds)."""
        cls.fold_nonfinite()
        qstate = cls.quantization_state
        qstate.nonfinite_unchecked = False
        watched = [(name, ref()) for name, ref in qstate.nonfinite_watch]
        watched = [(name, state) for name, state in watched if state is not None]
        qstate.nonfinite_watch = [(name, weakref.ref(state)) for name, state in watched]
        if not watched:
            return []
        flags = [state.nonfinite for _, state in watched]
        bad = torch.cat(flags).isfinite().logical_not_().tolist()
        clear_flags(flags)
        found, offset = [], 0
        for name, state in watched:
            per_gemm = 3 if state.forward else 2
            for i, role in enumerate(state.roles):
                if bad[offset + i]:  # the GEMM: how many slots of this role come before (any slot layout)
                    gemm = f"[{state.roles[:i].count(role)}]" if state.num_quantizers > per_gemm else ""
                    found.append(f"{name} {role}{gemm}")
            offset += state.num_quantizers
        if found:
            qstate.nonfinite_steps += 1
            qstate.nonfinite_counts.update(found)
            warnings.warn(f"mindspeed_te: NaN/Inf entered quantized GEMMs at {', '.join(found)}: their outputs are "
                          "non-finite, as in high precision; scales and amax histories were left unchanged "
                          f"({qstate.nonfinite_steps} such checks so far)", RuntimeWarning, stacklevel=2)
            for listener in cls._nonfinite_listeners:
                listener(found)
        return found

    @classmethod
    def fold_nonfinite(cls) -> None:
        """Fold the flag updates noted since the last fold into the flags, all layers' at once
        (`nonfinite.fold_nonfinite_pairs`: a fixed handful of ops). Runs before the flags are read and at the
        end of every step, so the list never outlives a step."""
        cls.quantization_state.nonfinite_pending.fold()

    @classmethod
    def _end_step_nonfinite(cls) -> None:
        """The step is over: check the flags (which folds first), or with the check off, or nothing left to
        check, still fold, so that the flags stay current for a later `check_nonfinite` and the pending
        pairs never pile up."""
        qstate = cls.quantization_state
        if qstate.nonfinite_unchecked and qstate.nonfinite_check:
            cls.check_nonfinite()
        else:
            cls.fold_nonfinite()

    @classmethod
    def get_nonfinite_counts(cls) -> dict[str, int]:
        """How many checks found NaN/Inf per "<module> <tensor>", and under "steps" in how many checks."""
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
