"""Per-module quantization state for one direction (forward or backward), built from a recipe.

A module that runs `num_gemms` GEMMs asks for a forward state with 3 * num_gemms quantizers (input,
weight, output of each GEMM) and a backward state with 2 * num_gemms (grad_output, grad_input). By default
the slots go GEMM by GEMM (input, weight, output of GEMM 0, then of GEMM 1, ...); a module that orders them
otherwise passes each slot's role (`roles`). `make_quantizers()` returns the quantizers in slot order.
"""
from __future__ import annotations

from typing import Any, Callable, Literal, Optional, Sequence

import torch

from mindspeed_te.nonfinite import PendingPairs, take_flags
from mindspeed_te.quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8WarmupQuantizer,
    MXFP4Quantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
)
from mindspeed_te.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    HIF8DelayedScaling,
    MXFP4BlockScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QParams,
    Recipe,
)
from mindspeed_te.scaling import FLT_MAX, batched_delayed_update, delayed_scaling_update

__all__ = [
    "RecipeState",
    "DelayedScalingRecipeState",
    "HIF8DelayedScalingRecipeState",
    "Float8CurrentScalingRecipeState",
    "Float8BlockScalingRecipeState",
    "MXFP8BlockScalingRecipeState",
    "NVFP4BlockScalingRecipeState",
    "MXFP4BlockScalingRecipeState",
    "FORWARD_ROLES",
    "BACKWARD_ROLES",
]

FORWARD_ROLES = ("input", "weight", "output")
BACKWARD_ROLES = ("grad_output", "grad_input")


def _roles(forward: bool, num_quantizers: int, roles: Optional[Sequence[str]] = None) -> list[str]:
    """Each slot's role: `roles` checked, or GEMM by GEMM."""
    base = FORWARD_ROLES if forward else BACKWARD_ROLES
    if roles is None:
        return [base[i % len(base)] for i in range(num_quantizers)]
    roles = list(roles)
    if len(roles) != num_quantizers or any(role not in base for role in roles):
        raise ValueError(f"roles must be {num_quantizers} entries (num_quantizers) out of {base}, got {roles!r}")
    return roles


Mode = Literal["forward", "backward"]


class SlotViews:
    """The one-element views t[i : i + 1] of a per-slot tensor (for a 2-D amax history: of its row 0), made
    once: a view costs microseconds of host time, every module call hands one per slot to its quantizers,
    and the states only ever write these tensors in place."""

    def __init__(self) -> None:
        self._views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def __call__(self, t: torch.Tensor) -> list[torch.Tensor]:
        entry = self._views.get(id(t))
        if entry is None or entry[0] is not t:
            row = t if t.dim() == 1 else t[0]
            entry = self._views[id(t)] = (t, [row[i : i + 1] for i in range(row.shape[0])])
        return entry[1]


class RecipeState:
    """State and quantizer factory for one module, one direction. Build it with `RecipeState.create`."""

    def __init__(self, recipe: Recipe, mode: Mode, num_quantizers: int = 1,
                 device: Optional[torch.device] = None, roles: Optional[Sequence[str]] = None) -> None:
        if mode not in ("forward", "backward"):
            raise ValueError(f"mode must be 'forward' or 'backward', got {mode!r}")
        if not isinstance(num_quantizers, int) or num_quantizers < 1:
            raise ValueError(f"num_quantizers must be an integer >= 1, got {num_quantizers!r}")
        self.recipe = recipe
        self.mode = mode
        self.forward = mode == "forward"
        self.num_quantizers = num_quantizers
        self.roles = _roles(self.forward, num_quantizers, roles)
        self.fp8_dtype = recipe.fp8_dtype(self.forward)
        # Per slot: non-finite once a tensor holding NaN/Inf was quantized there since the last check (set by
        # quantizers.record_nonfinite, or for delayed scaling by the per-step update; read and cleared by
        # FP8GlobalStateManager.check_nonfinite). `nonfinite_pending`: the state manager's list of the step's
        # flag updates, given to this state's quantizers (set by FP8GlobalStateManager.watch_nonfinite).
        self.nonfinite = take_flags(num_quantizers, device)
        self.nonfinite_pending: Optional[PendingPairs] = None
        self.slots = SlotViews()

    @staticmethod
    def create(
        recipe: Recipe,
        *,
        mode: Optional[Mode] = None,
        num_quantizers: int = 1,
        device: Optional[torch.device] = None,
        forward: Optional[bool] = None,
        roles: Optional[Sequence[str]] = None,
    ) -> RecipeState:
        """The state class that matches the recipe, TransformerEngine's factory: `mode` is "forward" (3
        quantizers per GEMM: input, weight, output) or "backward" (grad_output, grad_input). `forward=True/
        False` is accepted in place of `mode`. `roles`: each slot's role when not GEMM by GEMM."""
        if (mode is None) == (forward is None):
            raise ValueError("RecipeState.create takes exactly one of mode='forward'|'backward' and forward=bool")
        if mode is None:
            mode = "forward" if forward else "backward"
        for recipe_type, state_type in _STATE_TYPES.items():
            if isinstance(recipe, recipe_type):
                return state_type(recipe, mode=mode, num_quantizers=num_quantizers, device=device, roles=roles)
        raise TypeError(f"unsupported recipe type {type(recipe).__name__}")

    def __getstate__(self) -> dict[str, Any]:
        """A copy or pickle holds its own flags (not a view into the buffer every state's flags share) and none
        of the step's pending notes (other layers' tensors); its views are made again."""
        return {**self.__dict__, "nonfinite": self.nonfinite.clone(), "nonfinite_pending": None,
                "slots": SlotViews()}

    def frozen_copy(self) -> RecipeState:
        """A copy whose quantizers use today's scales and record amaxes nowhere that matters (for the
        recompute of an activation-checkpointed region). Stateless recipes need no copy."""
        return self

    def make_quantizers(self) -> list[Quantizer]:
        """One quantizer per slot, in the slot order above."""
        raise NotImplementedError

    def _watched(self, quantizers: list[Quantizer]) -> list[Quantizer]:
        """Give each quantizer its slot of the non-finite flags, and where to note their updates."""
        for quantizer, flag in zip(quantizers, self.slots(self.nonfinite)):
            quantizer.nonfinite = flag
            quantizer.nonfinite_pending = self.nonfinite_pending
        return quantizers


def _qparams(recipe: Recipe, role: str) -> QParams:
    return {"input": recipe.fp8_quant_fwd_inp, "output": recipe.fp8_quant_fwd_inp,
            "weight": recipe.fp8_quant_fwd_weight}.get(role, recipe.fp8_quant_bwd_grad)


class Float8CurrentScalingRecipeState(RecipeState):
    """Current ("tensorwise") scaling keeps no state: one quantizer per slot with the role's QParams."""

    def __init__(self, recipe: Float8CurrentScaling, *, mode: Mode, num_quantizers: int = 1,
                 device: Optional[torch.device] = None, roles: Optional[Sequence[str]] = None) -> None:
        super().__init__(recipe, mode, num_quantizers, device, roles)

    def make_quantizers(self) -> list[Quantizer]:
        target = self.recipe.target_max(self.forward)
        return self._watched([Float8CurrentScalingQuantizer(self.fp8_dtype, target, amax_epsilon=q.amax_epsilon,
                                                            power_2_scale=q.power_2_scale)
                              for q in (_qparams(self.recipe, role) for role in self.roles)])


class Float8BlockScalingRecipeState(RecipeState):
    """Blockwise scaling keeps no state; weights use `w_block_scaling_dim`, activations
    `x_block_scaling_dim`, gradients `grad_block_scaling_dim`."""

    def __init__(self, recipe: Float8BlockScaling, *, mode: Mode, num_quantizers: int = 1,
                 device: Optional[torch.device] = None, roles: Optional[Sequence[str]] = None) -> None:
        super().__init__(recipe, mode, num_quantizers, device, roles)

    def _block_dim(self, role: str) -> int:
        recipe = self.recipe
        return {"input": recipe.x_block_scaling_dim, "output": recipe.x_block_scaling_dim,
                "weight": recipe.w_block_scaling_dim}.get(role, recipe.grad_block_scaling_dim)

    def make_quantizers(self) -> list[Quantizer]:
        target = self.recipe.target_max(self.forward)
        quantizers: list[Quantizer] = []
        for role in self.roles:
            q = _qparams(self.recipe, role)
            quantizers.append(Float8BlockQuantizer(
                self.fp8_dtype, target, block_scaling_dim=self._block_dim(role),
                amax_epsilon=q.amax_epsilon, power_2_scale=q.power_2_scale))
        return self._watched(quantizers)


class MXFP8BlockScalingRecipeState(RecipeState):
    """MXFP8 keeps no state: one MXFP8 quantizer per slot."""

    def __init__(self, recipe: MXFP8BlockScaling, *, mode: Mode, num_quantizers: int = 1,
                 device: Optional[torch.device] = None, roles: Optional[Sequence[str]] = None) -> None:
        super().__init__(recipe, mode, num_quantizers, device, roles)

    def make_quantizers(self) -> list[Quantizer]:
        return self._watched([MXFP8Quantizer(self.fp8_dtype, rounding=self.recipe.scale_rounding)
                              for _ in range(self.num_quantizers)])


def _fp4_qparams(recipe: Recipe, role: str) -> QParams:
    """TE's dispatch of an FP4 recipe's QParams: gradients `fp4_quant_bwd_grad`, weights `fp4_quant_fwd_weight`,
    inputs and outputs `fp4_quant_fwd_inp`."""
    if role in BACKWARD_ROLES:
        return recipe.fp4_quant_bwd_grad
    return recipe.fp4_quant_fwd_weight if role == "weight" else recipe.fp4_quant_fwd_inp


class NVFP4BlockScalingRecipeState(RecipeState):
    """NVFP4 keeps no state: one NVFP4Quantizer per slot with its role's QParams (TE's
    NVFP4BlockScalingRecipeState): a random Hadamard transform of the columnwise form, stochastic rounding,
    16x16 tiles as they say."""

    def __init__(self, recipe: NVFP4BlockScaling, *, mode: Mode, num_quantizers: int = 1,
                 device: Optional[torch.device] = None, roles: Optional[Sequence[str]] = None) -> None:
        super().__init__(recipe, mode, num_quantizers, device, roles)

    def make_quantizers(self) -> list[Quantizer]:
        quantizers: list[Quantizer] = []
        for role in self.roles:
            q = _fp4_qparams(self.recipe, role)
            quantizers.append(NVFP4Quantizer(with_rht=q.random_hadamard_transform,
                                             with_2d_quantization=q.fp4_2d_quantization,
                                             stochastic_rounding=q.stochastic_rounding))
        return self._watched(quantizers)


class MXFP4BlockScalingRecipeState(RecipeState):
    """MXFP4 keeps no state: per slot an MXFP4Quantizer with its role's QParams, or, with `fp8_activations`,
    an MXFP8Quantizer (the recipe's forward or backward FP8 element, the same scale rule) for every role but
    the weights."""

    def __init__(self, recipe: MXFP4BlockScaling, *, mode: Mode, num_quantizers: int = 1,
                 device: Optional[torch.device] = None, roles: Optional[Sequence[str]] = None) -> None:
        super().__init__(recipe, mode, num_quantizers, device, roles)

    def make_quantizers(self) -> list[Quantizer]:
        recipe: MXFP4BlockScaling = self.recipe
        quantizers: list[Quantizer] = []
        for role in self.roles:
            if recipe.fp8_activations and role != "weight":
                quantizers.append(MXFP8Quantizer(recipe.fp8_dtype(self.forward), rounding=recipe.scale_rounding))
                continue
            q = _fp4_qparams(recipe, role)
            quantizers.append(MXFP4Quantizer(rounding=recipe.scale_rounding, with_rht=q.random_hadamard_transform,
                                             stochastic_rounding=q.stochastic_rounding))
        return self._watched(quantizers)


class ScaleInv:
    """1 / scale of a delayed-scaling state, prepared by the per-step update so a quantize launches no
    reciprocal, in the two forms the quantizers divide by: float32 (`value`, for float32 and other inputs)
    and rounded to bfloat16 (`value_bf16`, for bfloat16 inputs: the NPU quantize kernel takes its scale in
    the input's dtype) with its exact float32 value (`value_bf16_f32`, the scale_inv stored with the codes).
    `forms`: those three tensors when they already exist (views into `DelayedScalingBuffers`). Anything else
    that writes the scale in place (a checkpoint load, a reset) bumps the scale's version counter, and the
    next `get` recomputes them once (three ops, no host sync)."""

    def __init__(self, scale: torch.Tensor,
                 forms: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None) -> None:
        self.scale = scale
        if forms is None:
            value = scale.reciprocal()
            value_bf16 = value.to(torch.bfloat16)
            forms = (value, value_bf16, value_bf16.float())
        self.value, self.value_bf16, self.value_bf16_f32 = forms
        self.synced = scale._version
        self.slots = SlotViews()

    def get(self) -> torch.Tensor:
        """The float32 1 / scale."""
        return self.divisors(torch.float32)[0]

    def divisors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(the divisor for inputs of `dtype`, its exact float32 value): the bfloat16-rounded pair for
        bfloat16 inputs, the float32 reciprocal twice otherwise."""
        if self.synced != self.scale._version:
            self.refresh()
        if dtype == torch.bfloat16:
            return self.value_bf16, self.value_bf16_f32
        return self.value, self.value

    def refresh(self) -> None:
        """Recompute the three forms from the scale (three ops)."""
        torch.reciprocal(self.scale, out=self.value)
        self.value_bf16.copy_(self.value)
        self.value_bf16_f32.copy_(self.value_bf16)
        self.synced = self.scale._version

    def slot(self, i: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`divisors` of slot i, as one-element views."""
        div, exact = self.divisors(dtype)
        return self.slots(div)[i], self.slots(exact)[i]


class HistoryWatch:
    """What the library knows of an amax history tensor's writes: its version counter after the last write
    the library made and noted (`version`), and an epoch that moves on whenever the counter shows a write it
    did not note (a user writing through fp8_meta, a TE-style quantizer over the state's tensors, an in-place
    reduction), so that no slot of that history counts as fresh until the next update."""

    def __init__(self, history: torch.Tensor) -> None:
        self.version, self.epoch = history._version, 0

    def check(self, history: torch.Tensor) -> int:
        """The epoch, moved on first if `history` was written since the last noted write."""
        if history._version != self.version:
            self.version, self.epoch = history._version, self.epoch + 1
        return self.epoch


class DelayedScalingBuffers:
    """One contiguous copy of the tensors of the delayed-scaling states that update together (one (recipe,
    group) key): amax histories [L, N], scales, the 1/scale forms of `ScaleInv`, the non-finite flags and
    what the scales divide (fp8_max, or HiF8's per-slot targets). Each state's tensors are views into it
    (`DelayedScalingRecipeState.bind`), so the per-step update is a fixed handful of ops on whole buffers,
    whatever the number of states, with nothing gathered or written back per state (a multi-tensor op over
    per-state tensors is one NPU launch per 16 to 48 tensors, or one per tensor off its fast route)."""

    def __init__(self, states: Sequence[DelayedScalingRecipeState]) -> None:
        self.count, self.columns = len(states), sum(s.num_quantizers for s in states)
        self.history = torch.cat([s.amax_history for s in states], dim=1)
        self.scale = torch.cat([s.scale for s in states])
        self.scale_inv = ScaleInv(self.scale)  # every column's; the states' are views of its forms
        self.nonfinite = torch.cat([s.nonfinite for s in states])
        self.watch = HistoryWatch(self.history)
        first = states[0]
        self.fp8_max = (torch.cat([s.targets for s in states]) if isinstance(first, HIF8DelayedScalingRecipeState)
                        else torch.tensor(first.fp8_max, dtype=torch.float32, device=self.scale.device))
        offset = 0
        for state in states:
            state.bind(self, offset)
            offset += state.num_quantizers

    @classmethod
    def of(cls, states: Sequence[DelayedScalingRecipeState]) -> DelayedScalingBuffers:
        """The buffers that hold all of `states`, made (their current values copied in) when none do: on a
        key's first update, and when a state joins. Columns of states that did not run this step have a zero
        newest amax, which the update leaves as it is (window and scale kept)."""
        buffers = states[0].buffers
        if buffers is None or any(s.buffers is not buffers for s in states):
            buffers = cls(states)
        return buffers

    def update(self, recipe: DelayedScaling, columns: Optional[torch.Tensor] = None) -> None:
        """`batched_delayed_update` of every column (or of the True `columns`; the others keep their history,
        slot 0 cleared of NaN/Inf, and scale) written in place, then the 1/scale forms of the new scales."""
        history, scale = batched_delayed_update(self.history, self.scale, self.fp8_max, recipe.margin,
                                                recipe.amax_compute_algo)
        if columns is not None:
            history = torch.where(columns, history, self.history)  # slot 0 was cleared in place
            scale = torch.where(columns, scale, self.scale)
        torch._foreach_copy_([self.history, self.scale], [history, scale])
        self.scale_inv.refresh()


def update_delayed_states(states: list[DelayedScalingRecipeState],
                          reduce_amax: Optional[Callable[[torch.Tensor], None]] = None) -> None:
    """The per-step update of all delayed-scaling states of one (recipe, group) key, on their
    `DelayedScalingBuffers`: non-finite amaxes (NaN/Inf data quantized since the last update) folded into
    the flags, `reduce_amax` (an in-place all-reduce of the contiguous slot-0 amaxes) called once, and a
    fixed handful of ops for every state together (TransformerEngine's fused multi-tensor update),
    HIF8DelayedScaling included. One key is one recipe: states with a callable algorithm update themselves."""
    buffers = DelayedScalingBuffers.of(states)
    newest = buffers.history[0]
    buffers.nonfinite.add_(newest, alpha=0.0)  # flag + 0 * amax: NaN where the amax is NaN or Inf (sticky)
    if reduce_amax is not None:
        reduce_amax(newest)
    if not states[0].batchable():
        for state in states:
            state.update()
        return
    columns, updating = None, [True] * len(states)
    if isinstance(states[0], HIF8DelayedScalingRecipeState):
        # Every state counts the step; those at an update step are updated, the others keep accumulating
        # slot 0, cleared of NaN/Inf (flagged above) so that it recovers at once.
        for state in states:
            state.steps += 1
        updating = [state.recipe.updates_at(state.steps) for state in states]
        if not any(updating):
            torch.nan_to_num(newest, nan=0.0, posinf=0.0, out=newest)
            return
        if not all(updating) or len(states) < buffers.count:  # a column mask, by each state's columns
            mask = [False] * buffers.columns
            for state in (s for s, u in zip(states, updating) if u):
                mask[state.offset : state.offset + state.num_quantizers] = [True] * state.num_quantizers
            columns = torch.tensor(mask, device=newest.device)
    buffers.update(states[0].recipe, columns)
    for state, updated in zip(states, updating):
        state.scale_inv.synced = state.scale._version
        # The update cleared slot 0; the others' columns keep accumulating (and took the reduction's amaxes).
        state.set_fresh(updated)


class DelayedScalingRecipeState(RecipeState):
    """amax_history [L, n] and scale [n] for the module's n tensors. Quantizers hold views into them, so
    updates are done in place."""

    def __init__(self, recipe: DelayedScaling, *, mode: Mode, num_quantizers: int = 1,
                 device: Optional[torch.device] = None, roles: Optional[Sequence[str]] = None) -> None:
        super().__init__(recipe, mode, num_quantizers, device, roles)
        self.fp8_max = recipe.target_max(self.forward)
        self.amax_history = torch.zeros(recipe.amax_history_len, num_quantizers, dtype=torch.float32, device=device)
        self.scale = torch.ones(num_quantizers, dtype=torch.float32, device=device)
        self.scale_inv = ScaleInv(self.scale)
        self.buffers: Optional[DelayedScalingBuffers] = None
        self.offset = 0  # of this state's columns in `buffers`
        self.own_watch = HistoryWatch(self.amax_history)
        self.set_fresh(True)

    def __getstate__(self) -> dict[str, Any]:
        """A copy or pickle holds this state's own columns, contiguous, not the buffers it shares with the
        other states of its key (it joins a key's buffers again at its first update)."""
        copy = super().__getstate__()
        copy.update(amax_history=self.amax_history.clone(), scale=self.scale.clone(), buffers=None, offset=0,
                    scale_inv=None)
        return copy

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.scale_inv = ScaleInv(self.scale)
        self.own_watch = HistoryWatch(self.amax_history)
        self.set_fresh(False)  # a copy's slot 0 holds what it held (states pickled before this flag included)

    def bind(self, buffers: DelayedScalingBuffers, offset: int) -> None:
        """Take this state's columns offset.. of `buffers` as its tensors (their values are this state's)."""
        cols = slice(offset, offset + self.num_quantizers)
        self.buffers, self.offset = buffers, offset
        self.slots = SlotViews()  # the views of the tensors this state no longer holds go with them
        self.amax_history = buffers.history[:, cols]
        self.scale = buffers.scale[cols]
        self.nonfinite = buffers.nonfinite[cols]
        forms = buffers.scale_inv
        self.scale_inv = ScaleInv(self.scale, (forms.value[cols], forms.value_bf16[cols], forms.value_bf16_f32[cols]))

    def _watch(self) -> HistoryWatch:
        return self.buffers.watch if self.buffers is not None else self.own_watch

    def set_fresh(self, fresh: bool) -> None:
        """After an update or reset (True: slot 0 is clear) or anything else that leaves slot 0 as it is."""
        watch = self._watch()
        self.fresh, self.fresh_epoch = [fresh] * self.num_quantizers, watch.check(self.amax_history)
        watch.version = self.amax_history._version

    def fresh_amax_slot(self, i: int) -> Optional[torch.Tensor]:
        """Slot 0 of column i when it is zero and unwritten since its last update or reset, so a quantize may
        write its amax there instead of max-accumulating (one launch fewer on an NPU; the caller then calls
        `amax_written`); None otherwise. Either way the slot counts as written from now on, as after any
        other use of it (`Float8Quantizer.amax`). A write to the history the library did not note (its
        version counter tells) makes no slot of it fresh until the next update."""
        fresh = self.fresh[i] and self.fresh_epoch == self._watch().check(self.amax_history)
        self.fresh[i] = False
        return self.slots(self.amax_history)[i] if fresh else None

    def amax_written(self) -> None:
        """Note that the library has just written amaxes into the history (not a write from outside)."""
        self._watch().version = self.amax_history._version

    def make_quantizers(self) -> list[Quantizer]:
        # No per-quantizer non-finite flags: NaN/Inf data leaves a non-finite amax in slot 0, which the
        # per-step update folds into `nonfinite` (update_delayed_states), so a quantize spends no op on it.
        return [Float8Quantizer(None, None, self.fp8_dtype, state=(self, i)) for i in range(self.num_quantizers)]

    def frozen_copy(self) -> DelayedScalingRecipeState:
        copy = DelayedScalingRecipeState(self.recipe, mode=self.mode, num_quantizers=self.num_quantizers,
                                         device=self.scale.device, roles=self.roles)
        copy.scale.copy_(self.scale)
        return copy

    def batchable(self) -> bool:
        """Whether `update_delayed_states` may update this state in its batched form (built-in algorithms)."""
        recipe: DelayedScaling = self.recipe
        return recipe.scaling_factor_compute_algo is None and recipe.amax_compute_algo in ("max", "most_recent")

    def update(self) -> None:
        """Roll the history and recompute scales from the amaxes now in slot 0 (after any reduction)."""
        recipe: DelayedScaling = self.recipe
        history, scale = delayed_scaling_update(
            self.amax_history, self.scale, self.fp8_max, recipe.margin, recipe.amax_compute_algo,
            recipe.scaling_factor_compute_algo, recipe,
        )
        self.amax_history.copy_(history)
        self.scale.copy_(scale)

    def reset_amax_history(self) -> None:
        """Forget the history and scales, back to a new state's (after a failed step)."""
        self.amax_history.zero_()
        self.scale.fill_(1.0)
        self.set_fresh(True)


class HIF8DelayedScalingRecipeState(DelayedScalingRecipeState):
    """HIF8DelayedScaling: per-slot targets from the per-tensor margins, current scaling while the warm-up
    fills the history, then delayed scales updated every `scale_update_interval` steps."""

    def __init__(self, recipe: HIF8DelayedScaling, *, mode: Mode, num_quantizers: int = 1,
                 device: Optional[torch.device] = None, roles: Optional[Sequence[str]] = None) -> None:
        super().__init__(recipe, mode=mode, num_quantizers=num_quantizers, device=device, roles=roles)
        self.targets = torch.tensor([recipe.role_target(role) for role in self.roles], device=device)
        self.steps = 0  # updates seen, i.e. completed steps

    def warming_up(self) -> bool:
        return self.steps < self.recipe.amax_collect_interval

    def make_quantizers(self) -> list[Quantizer]:
        if not self.warming_up():
            return super().make_quantizers()
        return [Float8WarmupQuantizer((self, i), self.fp8_dtype, self.recipe.role_target(role))
                for i, role in enumerate(self.roles)]

    def frozen_copy(self) -> HIF8DelayedScalingRecipeState:
        copy = HIF8DelayedScalingRecipeState(self.recipe, mode=self.mode, num_quantizers=self.num_quantizers,
                                             device=self.scale.device, roles=self.roles)
        copy.scale.copy_(self.scale)
        copy.steps = self.steps
        return copy

    def update(self) -> None:
        """At an update step: roll the history and set scale = target / amax per slot (targets are powers of
        two, so dividing and multiplying by them is exact). Otherwise slot 0 keeps accumulating. The batched
        form (`update_delayed_states`) gives the same scales as one division target / amax."""
        self.steps += 1
        if not self.recipe.updates_at(self.steps):
            return
        history, unit_scale = delayed_scaling_update(self.amax_history, self.scale / self.targets, 1.0, 0.0,
                                                     self.recipe.amax_compute_algo)
        self.amax_history.copy_(history)
        self.scale.copy_((unit_scale * self.targets).clamp_(max=FLT_MAX))

    def reset_amax_history(self) -> None:
        """Forget the history and scales and start the warm-up again (after a failed step)."""
        super().reset_amax_history()
        self.steps = 0


_STATE_TYPES: dict[type, type[RecipeState]] = {
    HIF8DelayedScaling: HIF8DelayedScalingRecipeState,
    DelayedScaling: DelayedScalingRecipeState,
    Float8CurrentScaling: Float8CurrentScalingRecipeState,
    Float8BlockScaling: Float8BlockScalingRecipeState,
    MXFP8BlockScaling: MXFP8BlockScalingRecipeState,
    NVFP4BlockScaling: NVFP4BlockScalingRecipeState,
    MXFP4BlockScaling: MXFP4BlockScalingRecipeState,
}
