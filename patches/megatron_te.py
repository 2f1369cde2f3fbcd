"""Which Megatron symbols get which replacement, so that `--transformer-impl transformer_engine` builds
mindspeed_te modules without TransformerEngine installed.

Megatron decides "TE is here" per module, by `import transformer_engine` in a try block that also imports
the TE* classes and sets `HAVE_TE`. Without TE those blocks fail part-way: the extension module defines its
TE* classes on a MagicMock base, and its importers end up with missing names and `HAVE_TE = False`. So this
table (1) replaces the TE* classes and helpers in `megatron.core.extensions.transformer_engine` (the registry
rebinds every module that already imported them), (2) supplies the names and flags that the failed blocks
of the GPT path's modules never set, and (3) routes `fp8_utils.get_fp8_recipe` / `get_fp8_context` to our
state manager. Flags are raised only in modules whose TE branches use nothing but these names. (4) The alltoall
token dispatcher marks what it knows on the host for TE's fused MoE functions (`moe_fused.mark_*`).
"""
from __future__ import annotations

import functools
import importlib
import types
from typing import Any, Callable

from packaging.version import Version

from mindspeed_te.megatron import (
    Fp8Padding,
    Fp8Unpadding,
    SplitAlongDim,
    TEColumnParallelGroupedLinear,
    TEColumnParallelLinear,
    TECudaRNGStatesTracker,
    TEDelayedScaling,
    TEDotProductAttention,
    TEFusedMLP,
    TEGroupedLinear,
    TELayerNormColumnParallelLinear,
    TELinear,
    TENorm,
    TERowParallelGroupedLinear,
    TERowParallelLinear,
    fp4,
    fp8_params,
    fused_apply_rotary_pos_emb,
    fused_apply_rotary_pos_emb_thd,
    get_cpu_offload_context,
    moe_fused,
    set_save_original_input,
    te_checkpoint,
    te_parallel_cross_entropy,
)
from mindspeed_te.megatron.fp8 import get_fp8_context, get_fp8_recipe
from mindspeed_te.megatron.mla_rope import fused_apply_mla_rope_for_kv, fused_apply_mla_rope_for_q
from mindspeed_te.patches.registry import PatchRegistry, has_module, resolve
from mindspeed_te.quantized_tensor import FP4Tensor
from mindspeed_te.state import FP8GlobalStateManager, fp8_autocast

# The TransformerEngine release whose API the modules mirror, as Megatron's version checks see it.
TE_API_VERSION = "2.8.0"

EXTENSION = "megatron.core.extensions.transformer_engine"
SPEC_PROVIDER = f"{EXTENSION}_spec_provider"

TE_CLASSES = {
    "TENorm": TENorm,
    "TELinear": TELinear,
    "TEColumnParallelLinear": TEColumnParallelLinear,
    "TERowParallelLinear": TERowParallelLinear,
    "TELayerNormColumnParallelLinear": TELayerNormColumnParallelLinear,
    "TEDotProductAttention": TEDotProductAttention,
    "TEGroupedLinear": TEGroupedLinear,
    "TEColumnParallelGroupedLinear": TEColumnParallelGroupedLinear,
    "TERowParallelGroupedLinear": TERowParallelGroupedLinear,
    "TEDelayedScaling": TEDelayedScaling,
    "TECudaRNGStatesTracker": TECudaRNGStatesTracker,
    "Fp8Padding": Fp8Padding,
    "Fp8Unpadding": Fp8Unpadding,
    "te_checkpoint": te_checkpoint,
    "get_cpu_offload_context": get_cpu_offload_context,
}

# Classes the extension sets to None without TE (so their importers are not rebound by identity).
TE_OPTIONAL_CLASSES = {"TEFusedMLP": TEFusedMLP}

# Functions the extension defines only when TE imports (absent otherwise, so they are added).
TE_FUNCTIONS = {
    "fused_apply_rotary_pos_emb": fused_apply_rotary_pos_emb,
    "fused_apply_rotary_pos_emb_thd": fused_apply_rotary_pos_emb_thd,
    "te_parallel_cross_entropy": te_parallel_cross_entropy,
    "SplitAlongDim": SplitAlongDim,
    "set_save_original_input": set_save_original_input,
    **{name: getattr(moe_fused, name) for name in moe_fused.__all__},  # --moe-permute-fusion, --moe-router-fusion
}

# module -> names its failed TE import block should have bound (taken from the extension after patching),
# and whether its HAVE_TE may be raised.
# Names that are None in the extension (not classes) are not rebound by identity, so their importers are
# listed too. The table is checked against Megatron's source by tests/test_patches_megatron.py.
IMPORTERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "megatron.core.extensions.transformer_engine_spec_provider": (
        ("TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear"), False),
    "megatron.core.fp8_utils": (("Fp8Padding", "Fp8Unpadding"), False),
    "megatron.core.models.bert.bert_layer_specs": (
        ("TEDotProductAttention", "TELayerNormColumnParallelLinear", "TERowParallelLinear"), True),
    "megatron.core.models.T5.t5_spec": (("TEColumnParallelLinear", "TEDotProductAttention",
                                         "TELayerNormColumnParallelLinear", "TENorm", "TERowParallelLinear"), True),
    # --apply-rope-fusion (Megatron's default with RoPE) calls these; without TE they are None there.
    "megatron.core.models.common.embeddings.rope_utils": (
        ("fused_apply_rotary_pos_emb", "fused_apply_rotary_pos_emb_thd"), False),
    # --cross-entropy-loss-fusion --cross-entropy-fusion-impl te
    "megatron.core.models.common.language_module.language_module": (("te_parallel_cross_entropy",), False),
    "megatron.core.models.gpt.gpt_layer_specs": (("TENorm", "TESpecProvider", "TEFusedMLP", "TEColumnParallelLinear",
                                                  "TEDotProductAttention", "TELayerNormColumnParallelLinear",
                                                  "TERowParallelLinear"), True),
    # MoE specs: the TE classes (0.12) or the spec provider (0.13 to 0.15) behind a TE check
    "megatron.core.models.gpt.moe_module_specs": (
        ("TESpecProvider", "TEColumnParallelLinear", "TERowParallelLinear", "TEColumnParallelGroupedLinear",
         "TERowParallelGroupedLinear"), True),
    # MLA's projections: its import block succeeds up to 0.16; from 0.17 on it reads the extension's HAVE_TE.
    "megatron.core.transformer.multi_latent_attention": (("TEColumnParallelLinear", "TELayerNormColumnParallelLinear",
                                                          "TELinear", "set_save_original_input"), True),
    # MTP's spec provider (0.17 on, behind the extension's HAVE_TE), the layer recompute's te_checkpoint (0.18 on)
    "megatron.core.transformer.multi_token_prediction": (("TESpecProvider",), False),
    "megatron.core.recompute": (("te_checkpoint",), False),
    # The fused QKV split, and the output projection keeping its high-precision input under FP8 (HAVE_TE).
    "megatron.core.transformer.attention": (("SplitAlongDim", "TELinear", "set_save_original_input"), True),
    # LayerNormImpl: the final layer norm of every block, TENorm when TE is present
    "megatron.core.transformer.transformer_block": (
        ("TENorm", "LayerNormImpl", "get_cpu_offload_context", "te_checkpoint"), False),
    "megatron.core.transformer.moe.experts": (("Fp8Padding", "Fp8Unpadding"), True),
    "megatron.core.transformer.moe.moe_layer": (("TELinear", "te_checkpoint"), False),
    # TE's fused MoE permutation, router and router GEMM (mindspeed_te/megatron/moe_fused.py); its HAVE_TE only
    # guards them.
    "megatron.core.transformer.moe.moe_utils": ((
        "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute", "fused_permute_with_probs",
        "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function",
        "fused_unpermute", "te_general_gemm"), True),
}

# Megatron's own fused MLA RoPE (triton kernels that need a GPU), called with --apply-rope-fusion: replaced in
# the modules that import them, where the release has them (0.13 on).
MLA_ROPE = {"fused_apply_mla_rope_for_q": fused_apply_mla_rope_for_q,
            "fused_apply_mla_rope_for_kv": fused_apply_mla_rope_for_kv}
MLA_ROPE_IMPORTERS = ("megatron.core.transformer.multi_latent_attention",
                      "megatron.core.transformer.experimental_attention_variant.absorbed_mla")


# megatron.core.fp8_utils functions whose no-TE versions would refuse or ignore our quantized parameters.
FP8_PARAM_HOOKS = ("is_float8tensor", "is_mxfp8tensor", "modify_underlying_storage", "quantize_param_shard",
                   "prepare_model_for_fp8_inference", "_fp8_inference_wrapped_modules", "_wrap_te_linear_for_padding")
FP4_UTILS = "megatron.core.fp4_utils"
ALLTOALL_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher"
# megatron.core.fp4_utils functions replaced by mindspeed_te.megatron.fp4's (get_fp4_align_size: 0.16 on,
# quantize_nvfp4_param_shard: 0.17 on)
FP4_FUNCTIONS = ("get_fp4_recipe", "get_fp4_context", "get_fp4_align_size", "is_nvfp4tensor", "dequantize_fp4_tensor",
                 "quantize_nvfp4_param_shard")
# The linears Megatron's FP8 inference padding wraps (empty without TE).
TE_LINEAR_TYPES = (TELinear, TEColumnParallelLinear, TERowParallelLinear, TELayerNormColumnParallelLinear)


def _stand_in_extension(replacements: dict) -> types.ModuleType:
    """A module to stand in for Megatron's TE extension where the release's own cannot import without TE
    (megatron-core 0.12 imports transformer_engine at its top): our TE* classes and functions under the names
    Megatron imports, so that the modules imported after the patches bind them with `HAVE_TE = True`."""
    module = types.ModuleType(EXTENSION, "mindspeed_te's stand-in for Megatron's TransformerEngine extension")
    vars(module).update(replacements)
    return module


def register_megatron_te(registry: PatchRegistry) -> None:
    """Add the TE replacement patches to `registry` (applied later, together with the others). A module or name
    the installed release does not have is left out (megatron-core 0.12 has no spec provider module; each
    release imports its own subset of the fused MoE functions)."""
    replacements = dict(TE_CLASSES, **TE_OPTIONAL_CLASSES, **TE_FUNCTIONS)
    try:
        importlib.import_module(EXTENSION)
    except ModuleNotFoundError as error:
        if not (error.name or "").startswith("transformer_engine"):
            raise
        registry.register_module(EXTENSION, _stand_in_extension(replacements))
    else:
        for name, replacement in TE_CLASSES.items():
            registry.register(f"{EXTENSION}.{name}", replacement)
        for name, replacement in {**TE_OPTIONAL_CLASSES, **TE_FUNCTIONS}.items():
            registry.register(f"{EXTENSION}.{name}", replacement, create=True)
    replacements["LayerNormImpl"] = TENorm
    if has_module(SPEC_PROVIDER):
        replacements["TESpecProvider"] = resolve(f"{SPEC_PROVIDER}.TESpecProvider")
    for module, (names, raise_flag) in IMPORTERS.items():
        if not has_module(module):
            continue
        for name in names:
            if name in replacements:  # (TESpecProvider is absent where the release has no provider: 0.12)
                registry.register(f"{module}.{name}", replacements[name], create=True)
        if raise_flag:
            registry.register(f"{module}.HAVE_TE", True, create=True)
    for module in MLA_ROPE_IMPORTERS:
        if has_module(module):
            for name, replacement in MLA_ROPE.items():
                if hasattr(importlib.import_module(module), name):
                    registry.register(f"{module}.{name}", replacement)
    # Megatron's output-discarding checkpoint (CheckpointWithoutOutput: --recompute-modules moe_act, ...) reads
    # these three from TransformerEngine under its own import guard.
    for name, value in (("FP8GlobalStateManager", FP8GlobalStateManager), ("fp8_autocast", fp8_autocast),
                        ("activation_recompute_forward", FP8GlobalStateManager.activation_recompute_forward)):
        registry.register(f"megatron.core.tensor_parallel.random.{name}", value, create=True)
    registry.register("megatron.core.fp8_utils.get_fp8_recipe", get_fp8_recipe, create=True)  # 0.14 on
    registry.register("megatron.core.fp8_utils.get_fp8_context", get_fp8_context)
    for name in FP8_PARAM_HOOKS:  # --fp8-param-gather and FP8 inference on our quantized parameters
        registry.register(f"megatron.core.fp8_utils.{name}", getattr(fp8_params, name), create=True)
    registry.register("megatron.core.fp8_utils.TE_LINEAR_TYPES", TE_LINEAR_TYPES, create=True)  # 0.14 on
    registry.register("megatron.core.utils._te_version", Version(TE_API_VERSION))
    if has_module(FP4_UTILS):  # --fp4-format: 0.15 on
        register_fp4_utils(registry)
    register_dispatcher_marks(registry)


def _marking_chunk_orders(init: Callable) -> Callable:
    @functools.wraps(init)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        moe_fused.mark_identity_chunk_orders(self)
    return wrapped


def _marking_routing(preprocess: Callable) -> Callable:
    @functools.wraps(preprocess)
    def wrapped(self: Any, routing_map: Any, *args: Any, **kwargs: Any) -> Any:
        moe_fused.mark_dropless_routing(self, routing_map)
        return preprocess(self, routing_map, *args, **kwargs)
    return wrapped


def register_dispatcher_marks(registry: PatchRegistry) -> None:
    """The alltoall dispatcher marks its chunk orders at init (the identity with one rank: the chunk sort is
    skipped) and each routing map its `preprocess` reads, the one it then permutes (every token its top-k where
    the config routes dropless: the NPU permute kernel is taken without checking the map on the host)."""
    for name, wrap in (("__init__", _marking_chunk_orders), ("preprocess", _marking_routing)):
        target = f"{ALLTOALL_DISPATCHER}.{name}"
        registry.register(target, wrap(resolve(target)))


def register_fp4_utils(registry: PatchRegistry) -> None:
    """megatron.core.fp4_utils as with TE >= 2.7: it tests `import transformer_engine` once, at its import, and
    without TE defines get_fp4_recipe / get_fp4_context as no-ops (FP4 silently off). Its TE flags are raised and
    its functions are ours; `is_nvfp4tensor` follows from the flags and our FP4 parameter class."""
    for name in ("HAVE_TE", "HAVE_TE_FP4_TENSOR_CLASS"):
        registry.register(f"{FP4_UTILS}.{name}", True)
    registry.register(f"{FP4_UTILS}.FP4_TENSOR_CLASS", FP4Tensor, create=True)
    for name in FP4_FUNCTIONS:
        registry.register(f"{FP4_UTILS}.{name}", getattr(fp4, name), create=True)
