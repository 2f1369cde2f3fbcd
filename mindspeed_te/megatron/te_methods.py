"""Methods megatron-core calls on its TE* modules beyond forward, with megatron-core 0.16.1's behaviour:

- `finish_init(quantization_config)`: GPTModel / MambaModel call it on every module after construction with
  the layer's entry of `config.quant_recipe` (Megatron's per-module quantization override, or None). The
  override is parsed by Megatron's own `TEQuantizationParams`; forward then runs inside the autocast region
  it asks for (a recipe, or high precision), and `will_execute_quantized` answers accordingly (Megatron's
  FP8 inference padding asks it).
- `backward_dw()`: the delayed weight-gradient GEMMs, run only when `config.delay_wgrad_compute` is set.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Optional

from mindspeed_te.megatron.fp4 import FP4_RECIPES
from mindspeed_te.recipe import Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling, Recipe
from mindspeed_te.state import FP8GlobalStateManager, fp8_autocast

__all__ = ["MegatronTEMethods"]

_RECIPES = {"tensorwise": Float8CurrentScaling, "blockwise": Float8BlockScaling, "mxfp8": MXFP8BlockScaling}


def _active_recipe(params, training: bool):
    """The TEQuantizationRecipe that applies now: the evaluation one when not training and one is given."""
    if params is None:
        return None
    if not training and params.evaluation_recipe is not None:
        return params.evaluation_recipe
    return params.training_recipe


def _overrides(qrecipe, context_quantized: bool) -> bool:
    """Whether the override replaces the surrounding autocast state (it says so per enabled / disabled)."""
    return qrecipe.override_quantized_autocast if context_quantized else qrecipe.override_nonquantized_autocast


def _override_recipe(qrecipe) -> Recipe:
    """Our recipe for an override's fp8_quantization_recipe / fp8_format, or its fp4_quantization_recipe
    (delayed scaling is refused by Megatron's parser already; custom recipe factories have no counterpart
    here)."""
    if qrecipe.fp4_quantization_recipe is not None:
        fp4 = getattr(qrecipe.fp4_quantization_recipe, "value", qrecipe.fp4_quantization_recipe)
        if fp4 not in FP4_RECIPES:
            raise ValueError(f"quant_recipe: fp4_quantization_recipe {fp4!r} is not supported; allowed: "
                             f"{', '.join(FP4_RECIPES)}")
        return FP4_RECIPES[fp4]()
    name = getattr(qrecipe.fp8_quantization_recipe, "value", qrecipe.fp8_quantization_recipe)
    if name not in _RECIPES:
        raise ValueError(f"quant_recipe: fp8_quantization_recipe {name!r} is not supported; allowed: "
                         f"{', '.join(_RECIPES)}")
    return _RECIPES[name](fp8_format=Format.from_name(qrecipe.fp8_format))


def _amax_group(tp_only_amax_red: bool):
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_amax_reduction_group(with_context_parallel=True, tp_only_amax_red=tp_only_amax_red)


class MegatronTEMethods:
    """Mixed into the Megatron-facing modules, in front of the generic module class."""

    te_quant_params = None  # Megatron's TEQuantizationParams, set by finish_init

    def finish_init(self, quantization_config: Optional[object]) -> None:
        """Take this module's quantization override (Megatron's QuantizationConfig, or None for none)."""
        if quantization_config is None:
            self.te_quant_params = None
            return
        try:
            from megatron.core.extensions.transformer_engine import TEQuantizationParams
        except ImportError:  # 0.12 to 0.15
            raise ValueError("quant_recipe: per-module quantization of TE modules needs megatron-core 0.16 or later "
                             "(this release's quant_recipe configures NVIDIA Kitchen modules only)") from None
        self.te_quant_params = TEQuantizationParams.parse_from_config(quantization_config)

    def will_execute_quantized(self, is_context_quantized: bool) -> bool:
        """Whether the GEMMs run quantized in a context that is (or is not) quantized, the override applied."""
        qrecipe = _active_recipe(self.te_quant_params, self.training)
        if qrecipe is not None and _overrides(qrecipe, is_context_quantized):
            is_context_quantized = qrecipe.fp8_quantization_recipe is not None \
                or qrecipe.fp4_quantization_recipe is not None
        return super().will_execute_quantized(is_context_quantized)

    def quantization_override_context(self) -> AbstractContextManager:
        """The autocast region the override asks for around this forward (nothing without an override)."""
        qrecipe = _active_recipe(self.te_quant_params, self.training)
        if qrecipe is None or not _overrides(qrecipe, FP8GlobalStateManager.is_fp8_enabled()):
            return nullcontext()
        if qrecipe.fp8_quantization_recipe is None and qrecipe.fp4_quantization_recipe is None:
            return fp8_autocast(enabled=False)
        return fp8_autocast(enabled=True, fp8_recipe=_override_recipe(qrecipe),
                            fp8_group=_amax_group(qrecipe.tp_only_amax_red))

    def backward_dw(self) -> None:
        """Delayed weight gradients, only when Megatron's config asks for them (`delay_wgrad_compute`)."""
        if getattr(self.config, "delay_wgrad_compute", False):
            super().backward_dw()
