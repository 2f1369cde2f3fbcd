"""mindspeed_te: TransformerEngine-compatible FP8/HiF8 training for Megatron-LM on Ascend NPUs.

Importing this package has no side effects; `import mindspeed_te.megatron_adaptor` patches Megatron.
"""
from mindspeed_te.checkpointing import checkpoint
from mindspeed_te.formats import FP4Dtype, FP8Dtype
from mindspeed_te.modules import (
    DotProductAttention,
    GroupedLinear,
    LayerNorm,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    RMSNorm,
    convert_linears,
    set_extra_state_format,
)
from mindspeed_te.ops.cpu_offload import get_cpu_offload_context, mark_not_offload
from mindspeed_te.optimizers import FusedAdam
from mindspeed_te.quantized_tensor import (
    Float8BlockwiseQTensor,
    Float8Tensor,
    MXFP4Tensor,
    MXFP8Tensor,
    NVFP4Tensor,
    QuantizedTensor,
)
from mindspeed_te.quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    MXFP4Quantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
)
from mindspeed_te.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    HIF8DelayedScaling,
    MMParams,
    MXFP4BlockScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QParams,
    Recipe,
)
from mindspeed_te.recipe_state import (
    DelayedScalingRecipeState,
    Float8BlockScalingRecipeState,
    Float8CurrentScalingRecipeState,
    HIF8DelayedScalingRecipeState,
    MXFP4BlockScalingRecipeState,
    MXFP8BlockScalingRecipeState,
    NVFP4BlockScalingRecipeState,
    RecipeState,
)
from mindspeed_te.state import (
    FP8GlobalStateManager,
    autocast,
    fp8_autocast,
    fp8_model_init,
    get_default_recipe,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    quantized_model_init,
)
from mindspeed_te.tensor import (
    Float8BlockwiseQTensorStorage,
    Float8TensorStorage,
    MXFP4TensorStorage,
    MXFP8TensorStorage,
    NVFP4TensorStorage,
    QuantizedTensorStorage,
)

__version__ = "0.1.0"

__all__ = [
    "Format", "FP8Dtype", "FP4Dtype",
    "Recipe", "DelayedScaling", "HIF8DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling",
    "NVFP4BlockScaling", "MXFP4BlockScaling",
    "QParams", "MMParams",
    "Quantizer", "Float8Quantizer", "Float8CurrentScalingQuantizer", "Float8BlockQuantizer", "MXFP8Quantizer",
    "NVFP4Quantizer", "MXFP4Quantizer",
    "get_default_recipe",
    "RecipeState", "DelayedScalingRecipeState", "Float8CurrentScalingRecipeState", "Float8BlockScalingRecipeState",
    "MXFP8BlockScalingRecipeState", "HIF8DelayedScalingRecipeState", "NVFP4BlockScalingRecipeState",
    "MXFP4BlockScalingRecipeState",
    "QuantizedTensorStorage", "Float8TensorStorage", "Float8BlockwiseQTensorStorage", "MXFP8TensorStorage",
    "NVFP4TensorStorage", "MXFP4TensorStorage",
    "QuantizedTensor", "Float8Tensor", "Float8BlockwiseQTensor", "MXFP8Tensor", "NVFP4Tensor", "MXFP4Tensor",
    "FP8GlobalStateManager", "fp8_autocast", "autocast", "fp8_model_init", "quantized_model_init",
    "is_fp8_available", "is_mxfp8_available", "is_fp8_block_scaling_available",
    "checkpoint", "Fp8Padding", "Fp8Unpadding", "get_cpu_offload_context", "mark_not_offload", "FusedAdam",
    "Linear", "LayerNormLinear", "LayerNormMLP", "LayerNorm", "RMSNorm", "GroupedLinear", "DotProductAttention",
    "convert_linears", "set_extra_state_format",
]


_LAZY = ("Fp8Padding", "Fp8Unpadding")


def __getattr__(name: str):
    """`Fp8Padding` / `Fp8Unpadding` live with the Megatron-facing modules, whose package imports
    megatron.core: resolved on first use so that `import mindspeed_te` stays free of Megatron."""
    if name in _LAZY:
        from mindspeed_te.megatron import misc

        return getattr(misc, name)
    raise AttributeError(f"module 'mindspeed_te' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
