"""Per-module quantization state for one direction (forward or backward), built from a recipe.

A module that runs `num_gemms` GEMMs asks for a forward state with 3 * num_gemms quantizers (input,
weight, output of each GEMM) and a backward state with 2 * num_gemms (grad_output, grad_input), the
ordering TransformerEngine uses. `make_quantizers()` returns the quantizers in that order.
"""
from __future__ import annotations

from typing import Optional

import torch

from mindspeed_te.quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
    Quantizer,
)
from mindspeed_te.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    QParams,
    Recipe,
)
from mindspeed_te.scaling import delayed_scaling_update

__all__ = ["RecipeState", "DelayedScalingRecipeState", "FORWARD_ROLES", "BACKWARD_ROLES"]

FORWARD_ROLES = ("input", "weight", "output")
BACKWARD_ROLES = ("grad_output", "grad_input")


def _roles(forward: bool, num_quantizers: int) -> list[str]:
    base = FORWARD_ROLES if forward else BACKWARD_ROLES
    return [base[i % len(base)] for i in range(num_quantizers)]


class RecipeState:
    """State and quantizer factory for one module, one direction."""

    def __init__(self, recipe: Recipe, forward: bool, num_quantizers: int) -> None:
        if num_quantizers < 1:
            raise ValueError(f"num_quantizers must be >= 1, got {num_quantizers}")
        self.recipe = recipe
        self.forward = forward
        self.num_quantizers = num_quantizers
        self.roles = _roles(forward, num_quantizers)
        self.fp8_dtype = recipe.fp8_dtype(forward)

    @staticmethod
    def create(
        recipe: Recipe, *, forward: bool, num_quantizers: int, device: Optional[torch.device] = None
    ) -> "RecipeState":
        """The state class that matches the recipe."""
        if isinstance(recipe, DelayedScaling):
            return DelayedScalingRecipeState(recipe, forward, num_quantizers, device=device)
        if isinstance(recipe, (Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling)):
            return RecipeState(recipe, forward, num_quantizers)
        raise TypeError(f"unsupported recipe type {type(recipe).__name__}")

    def _qparams(self, role: str) -> QParams:
        recipe = self.recipe
        return {
            "input": recipe.fp8_quant_fwd_inp,
            "output": recipe.fp8_quant_fwd_inp,
            "weight": recipe.fp8_quant_fwd_weight,
        }.get(role, recipe.fp8_quant_bwd_grad)

    def _block_dim(self, role: str) -> int:
        recipe = self.recipe
        return {"input": recipe.x_block_scaling_dim, "output": recipe.x_block_scaling_dim,
                "weight": recipe.w_block_scaling_dim}.get(role, recipe.grad_block_scaling_dim)

    def frozen_copy(self) -> "RecipeState":
        """A copy whose quantizers use today's scales and record amaxes nowhere that matters (for the
        recompute of an activation-checkpointed region). Stateless recipes need no copy."""
        return self

    def make_quantizers(self) -> list[Quantizer]:
        recipe = self.recipe
        target = recipe.target_max(self.forward)
        quantizers: list[Quantizer] = []
        for role in self.roles:
            if isinstance(recipe, Float8CurrentScaling):
                q = self._qparams(role)
                quantizers.append(Float8CurrentScalingQuantizer(
                    self.fp8_dtype, target, amax_epsilon=q.amax_epsilon, power_2_scale=q.power_2_scale))
            elif isinstance(recipe, Float8BlockScaling):
                q = self._qparams(role)
                quantizers.append(Float8BlockQuantizer(
                    self.fp8_dtype, target, block_scaling_dim=self._block_dim(role),
                    amax_epsilon=q.amax_epsilon, power_2_scale=q.power_2_scale))
            else:
                quantizers.append(MXFP8Quantizer(self.fp8_dtype, rounding=recipe.scale_rounding))
        return quantizers


class DelayedScalingRecipeState(RecipeState):
    """amax_history [L, n] and scale [n] for the module's n tensors. Quantizers hold views into them, so
    updates are done in place."""

    def __init__(self, recipe: DelayedScaling, forward: bool, num_quantizers: int,
                 device: Optional[torch.device] = None) -> None:
        super().__init__(recipe, forward, num_quantizers)
        self.fp8_max = recipe.target_max(forward)
        self.amax_history = torch.zeros(recipe.amax_history_len, num_quantizers, dtype=torch.float32, device=device)
        self.scale = torch.ones(num_quantizers, dtype=torch.float32, device=device)

    def make_quantizers(self) -> list[Quantizer]:
        return [
            Float8Quantizer(self.scale[i : i + 1], self.amax_history[0, i : i + 1], self.fp8_dtype)
            for i in range(self.num_quantizers)
        ]

    def frozen_copy(self) -> "DelayedScalingRecipeState":
        copy = DelayedScalingRecipeState(self.recipe, self.forward, self.num_quantizers, device=self.scale.device)
        copy.scale.copy_(self.scale)
        return copy

    def update(self) -> None:
        """Roll the history and recompute scales from the amaxes now in slot 0 (after any reduction)."""
        recipe: DelayedScaling = self.recipe
        history, scale = delayed_scaling_update(
            self.amax_history, self.scale, self.fp8_max, recipe.margin, recipe.amax_compute_algo,
            recipe.scaling_factor_compute_algo, recipe,
        )
        self.amax_history.copy_(history)
        self.scale.copy_(scale)
