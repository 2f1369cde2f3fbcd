"""What every FP8 module shares: recipe states that follow the active recipe, registration for the
once-per-step amax reduction, and the module's FP8 metadata in `_extra_state`."""
from __future__ import annotations

from typing import Optional

import torch

from mindspeed_te.quantizers import Quantizer
from mindspeed_te.recipe_state import DelayedScalingRecipeState, RecipeState
from mindspeed_te.state import FP8GlobalStateManager


class FP8ModuleBase(torch.nn.Module):
    """Base of the TE-style modules. A module running `num_gemms` GEMMs owns one forward state
    (3 quantizers per GEMM: input, weight, output) and one backward state (grad_output, grad_input)."""

    def __init__(self, num_gemms: int = 1) -> None:
        super().__init__()
        self.num_gemms = num_gemms
        self.fp8_states: Optional[tuple[RecipeState, RecipeState]] = None
        self._fp8_recipe_key: Optional[str] = None

    def _states_for_current_recipe(self, device: torch.device) -> tuple[RecipeState, RecipeState]:
        recipe = FP8GlobalStateManager.get_fp8_recipe()
        if self.fp8_states is None or self._fp8_recipe_key != recipe.key():
            self.fp8_states = (
                RecipeState.create(recipe, forward=True, num_quantizers=3 * self.num_gemms, device=device),
                RecipeState.create(recipe, forward=False, num_quantizers=2 * self.num_gemms, device=device),
            )
            self._fp8_recipe_key = recipe.key()
        return self.fp8_states

    def prepare_forward(self, device: torch.device) -> Optional[tuple[list[Quantizer], list[Quantizer], bool]]:
        """Quantizers for this call, or None outside FP8/calibration. Returns (forward quantizers, backward
        quantizers, whether this module is the step's first FP8 module)."""
        if not (FP8GlobalStateManager.is_fp8_enabled() or FP8GlobalStateManager.is_fp8_calibration()):
            return None
        fwd, bwd = self._states_for_current_recipe(device)
        group = FP8GlobalStateManager.get_fp8_group()
        FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(fwd, group)
        FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(bwd, group)
        first = FP8GlobalStateManager.is_first_fp8_module()
        return fwd.make_quantizers(), bwd.make_quantizers(), first

    @staticmethod
    def calibrate(quantizers: list[Quantizer], *tensors: torch.Tensor) -> None:
        """Calibration (autocast enabled=False, calibrating=True): record delayed-scaling amaxes of the
        high-precision tensors so scales are ready when FP8 is turned on."""
        for quantizer, tensor in zip(quantizers, tensors):
            if hasattr(quantizer, "amax"):
                quantizer.quantize(tensor.detach())

    def has_delayed_state(self) -> bool:
        return self.fp8_states is not None and isinstance(self.fp8_states[0], DelayedScalingRecipeState)
