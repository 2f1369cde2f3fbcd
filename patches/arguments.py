"""mindspeed_te's Megatron command-line flags, added through `parse_args`'s extra-arguments hook.

Flags: `--fp8-format hif8` (added to Megatron's own choices), `--fp8-recipe hif8_delayed` and its
`--hif8-*` settings, `--hif8-fwd-max` / `--hif8-bwd-max` (HiF8 target maxima, default 15 / 224),
`--fp8-step-recovery` (patches/training.py), `--fp8-numerics-report`, `--no-use-gmm-fp8` (MoE grouped GEMMs in
high precision), `--use-ascend-mc2` (fused matmul + communication kernels) and `--fp4-recipe mxfp4` (added to
Megatron's own choices where the release has --fp4-format: 0.15 on) with its `--mxfp4-*` options. Megatron
copies only TransformerConfig's own fields from the arguments into the config, so
`core_transformer_config_from_args` is wrapped to carry these over as config attributes, where the TE* modules
read them. `--fp8-dot-product-attention` / `--fp8-multi-head-attention` set TransformerConfig fields that
Megatron's parser has no flag for; Megatron copies them into the config itself.

`--fp8-recipe hif8_delayed` is delayed scaling with MindSpeed's HiF8 schedule. Megatron tests
`fp8_recipe == "delayed"` in about ten places (the outer autocast of a transformer block, MLA's and shared experts'
`save_original_input`, the distributed optimizer, `--first-last-layers-bf16`, ...), so after parsing
`args.fp8_recipe` is Megatron's own "delayed" and `args.hif8_delayed` (copied onto the config) carries the schedule
to `recipe_from_config`.
"""
from __future__ import annotations

import argparse
import functools
import os
from typing import Callable, Optional

from mindspeed_te.megatron.fp4 import FP4_RECIPES, MXFP4_OPTIONS, make_fp4_recipe, mxfp4_flags
from mindspeed_te.modules.attention import DPAFP8Settings
from mindspeed_te.patches.registry import resolve
from mindspeed_te.recipe import Format
from mindspeed_te.te_extra_state import EXTRA_STATE_FORMAT_ENV, EXTRA_STATE_FORMATS

# args attribute -> default; copied onto the TransformerConfig
CONFIG_FIELDS = {"use_gmm_fp8": True, "use_ascend_mc2": False, "hif8_fwd_max": None, "hif8_bwd_max": None,
                 "hif8_input_margin": 11, "hif8_weight_margin": 12, "hif8_grad_margin": 11,
                 "hif8_amax_collect_interval": 5, "hif8_scale_update_interval": 10, "hif8_amax_history_len": 128,
                 "fp8_step_recovery": False, "hif8_delayed": False, **dict.fromkeys(MXFP4_OPTIONS, False)}
# --fp8-recipe values added to Megatron's own
RECIPE_CHOICES = ("hif8_delayed",)
# what Megatron sees of --fp8-recipe hif8_delayed after parse_args (with args.hif8_delayed = True)
HIF8_DELAYED_AS = "delayed"
# --fp4-recipe values added to Megatron's own
FP4_RECIPE_CHOICES = ("mxfp4",)
# config.fp8_dot_product_attention / fp8_multi_head_attention, as flags (the recipes Megatron hands each to)
FP8_ATTENTION_FLAGS = {
    "--fp8-dot-product-attention": "Q, K, V and dO of core attention in FP8, only their codes kept for backward "
                                   "(the recipe's fp8_dpa; --fp8-recipe delayed, hif8_delayed or tensorwise, or mxfp8 "
                                   "with NVTE_DPA_FP8_RECIPE DelayedScaling or Float8CurrentScaling)",
    "--fp8-multi-head-attention": "the recipe's fp8_mha, which runs attention as --fp8-dot-product-attention does "
                                  "(--fp8-recipe delayed or hif8_delayed)",
}
FP8_ATTENTION_RECIPES = {"fp8_dot_product_attention": ("delayed", "hif8_delayed", "tensorwise"),
                         "fp8_multi_head_attention": ("delayed", "hif8_delayed")}
# NVTE_DPA_FP8_RECIPE values that run attention in FP8 under --fp8-recipe mxfp8 (whose recipe carries fp8_dpa)
MXFP8_DPA_RECIPES = ("DelayedScaling", "Float8CurrentScaling")
# E5M2 alone is not a training format (TransformerEngine refuses it too): gradients only, through hybrid.
FORMAT_CHOICES = tuple(f.name.lower() for f in Format if f is not Format.E5M2)


def _hif8_target(flag: str) -> Callable[[str], float]:
    """argparse type of a HiF8 target max: a number in (0, HiF8's largest finite value]."""
    limit = Format.HIF8.fwd_dtype.max

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number, got {text!r}") from None
        if not 0 < value <= limit:
            raise argparse.ArgumentTypeError(f"{flag} must be in (0, {limit:g}] (HiF8's largest finite value), "
                                             f"got {text}")
        return value

    return parse


def _at_least(flag: str, low: int) -> Callable[[str], int]:
    """argparse type of an integer flag with a lower bound."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{flag} must be >= {low}, got {value}")
        return value

    return parse


def _option(parser: argparse.ArgumentParser, flag: str) -> Optional[argparse.Action]:
    return next((action for action in parser._actions if flag in action.option_strings), None)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add our flags to Megatron's parser and let --fp8-format take hif8."""
    fp8_format = _option(parser, "--fp8-format")
    if fp8_format is None:
        parser.add_argument("--fp8-format", dest="fp8", default=None, choices=FORMAT_CHOICES,
                            help="FP8 element format: e4m3, hybrid or hif8")
    elif fp8_format.choices is not None:
        fp8_format.choices = [c for c in dict.fromkeys([*fp8_format.choices, *FORMAT_CHOICES]) if c != "e5m2"]
    fp8_recipe = _option(parser, "--fp8-recipe")
    if fp8_recipe is not None and fp8_recipe.choices is not None:
        fp8_recipe.choices = list(dict.fromkeys([*fp8_recipe.choices, *RECIPE_CHOICES]))
    fp4_recipe = _option(parser, "--fp4-recipe")
    if fp4_recipe is not None and fp4_recipe.choices is not None:
        fp4_recipe.choices = list(dict.fromkeys([*fp4_recipe.choices, *FP4_RECIPE_CHOICES]))
    if _option(parser, "--hif8-fwd-max") is not None:
        return parser  # added by an earlier hook: adding them twice would be an argparse conflict
    group = parser.add_argument_group("mindspeed_te")
    if fp4_recipe is not None:
        for dest, help_text in (
                ("mxfp4_random_hadamard_transform", "random Hadamard transform of the wgrad operands (inputs and "
                                                    "gradients), as NVFP4's"),
                ("mxfp4_stochastic_rounding", "stochastic rounding of the gradients, as NVFP4's"),
                ("mxfp4_fp8_activations", "inputs and gradients in MXFP8, weights in MXFP4 (the 950's MXFP8 x MXFP4 "
                                          "GEMM); not with the two above")):
            group.add_argument("--" + dest.replace("_", "-"), action="store_true",
                               help=f"--fp4-recipe mxfp4: {help_text} (NVFP4's are on by default; TE's "
                                    "NVTE_NVFP4_DISABLE_* variables turn them off)")
    parser.set_defaults(**dict.fromkeys(MXFP4_OPTIONS, False))  # also where the release has no FP4 flags
    parser.set_defaults(hif8_delayed=False)  # set by --fp8-recipe hif8_delayed, see use_hif8_delayed
    group.add_argument("--hif8-fwd-max", type=_hif8_target("--hif8-fwd-max"), default=None,
                       help="HiF8 target max of activations and weights (default 15)")
    group.add_argument("--hif8-bwd-max", type=_hif8_target("--hif8-bwd-max"), default=None,
                       help="HiF8 target max of gradients (default 224)")
    for kind, default in (("input", 11), ("weight", 12), ("grad", 11)):
        flag = f"--hif8-{kind}-margin"
        group.add_argument(flag, type=_at_least(flag, 0), default=default,
                           help=f"--fp8-recipe hif8_delayed: guard bits of {kind} tensors below 2^15 "
                                f"(default {default})")
    group.add_argument("--hif8-amax-collect-interval", type=_at_least("--hif8-amax-collect-interval", 0), default=5,
                       help="--fp8-recipe hif8_delayed: warm-up steps quantized with current scaling while the amax "
                            "history fills (default 5)")
    group.add_argument("--hif8-scale-update-interval", type=_at_least("--hif8-scale-update-interval", 1), default=10,
                       help="--fp8-recipe hif8_delayed: steps between history and scale updates after the warm-up "
                            "(default 10)")
    group.add_argument("--hif8-amax-history-len", type=_at_least("--hif8-amax-history-len", 1), default=128,
                       help="--fp8-recipe hif8_delayed: amax history length (default 128)")
    group.add_argument("--fp8-step-recovery", action="store_true",
                       help="on a non-finite loss or gradient, skip the step on every rank, reset the amax history "
                            "and retry the batch once")
    group.add_argument("--fp8-numerics-report", metavar="DIR", default=None,
                       help="write per-layer FP8 numerics (amax, scale, % saturated / flushed, SQNR, and the same "
                            "in HiF8 / E4M3 / MXFP8 / NVFP4 / MXFP4) as CSV, JSON and PNG heatmaps to DIR")
    group.add_argument("--fp8-numerics-interval", type=_at_least("--fp8-numerics-interval", 1), default=100,
                       help="--fp8-numerics-report: record every N iterations (default 100)")
    group.add_argument("--no-use-gmm-fp8", dest="use_gmm_fp8", action="store_false",
                       help="run MoE grouped GEMMs in high precision inside FP8 training")
    group.add_argument("--use-ascend-mc2", action="store_true",
                       help="fused matmul + all-gather / reduce-scatter kernels for tensor-parallel linears")
    for flag, help_text in FP8_ATTENTION_FLAGS.items():
        if _option(parser, flag) is None:  # TransformerConfig fields that Megatron's parser leaves out
            group.add_argument(flag, action="store_true", help=help_text)
    group.add_argument("--fp8-extra-state-format", choices=EXTRA_STATE_FORMATS, default=None,
                       help="the FP8 metadata format checkpoints get: mindspeed_te (default) or te, "
                            "TransformerEngine's, so that TE on GPUs resumes them (docs/te-checkpoints.md)")
    return parser


def use_extra_state_format(args: argparse.Namespace) -> None:
    """--fp8-extra-state-format for every module of the run: through the variable their saves read."""
    if getattr(args, "fp8_extra_state_format", None) is not None:
        os.environ[EXTRA_STATE_FORMAT_ENV] = args.fp8_extra_state_format


def recipe_flag(args: argparse.Namespace) -> Optional[str]:
    """The --fp8-recipe the user gave: "hif8_delayed" also after `use_hif8_delayed` made it Megatron's delayed."""
    recipe = getattr(getattr(args, "fp8_recipe", None), "value", getattr(args, "fp8_recipe", None))
    return "hif8_delayed" if recipe == HIF8_DELAYED_AS and getattr(args, "hif8_delayed", False) else recipe


def use_hif8_delayed(args: argparse.Namespace) -> None:
    """--fp8-recipe hif8_delayed: Megatron's fp8_recipe becomes "delayed", so that its own delayed-scaling checks
    apply, and `hif8_delayed` (copied onto the config with the --hif8-* settings) selects HIF8DelayedScaling."""
    args.hif8_delayed = recipe_flag(args) == "hif8_delayed"
    if args.hif8_delayed:
        args.fp8_recipe = HIF8_DELAYED_AS


def validate_args(args: argparse.Namespace) -> None:
    """Reject flag combinations mindspeed_te cannot run, naming the flags."""
    fp8 = getattr(args, "fp8", None)
    if fp8 and getattr(args, "transformer_impl", "transformer_engine") != "transformer_engine":
        raise ValueError(f"--fp8-format {fp8} needs --transformer-impl transformer_engine "
                         f"(got --transformer-impl {args.transformer_impl})")
    recipe = recipe_flag(args)
    if recipe == "hif8_delayed" and fp8 != "hif8":
        raise ValueError(f"--fp8-recipe hif8_delayed needs --fp8-format hif8 (got --fp8-format {fp8})")
    if fp8 == "hif8" and recipe == "mxfp8":
        raise ValueError("--fp8-format hif8 does not work with --fp8-recipe mxfp8 (MX blocks hold E4M3/E5M2 "
                         "elements); use delayed, tensorwise or blockwise")
    validate_fp4_args(args)
    # Flags that would otherwise fail late (after the model is built) or be silently ignored.
    if recipe == "custom":
        raise ValueError("--fp8-recipe custom (--fp8-quantizer-factory) is not supported by mindspeed_te; allowed: "
                         "delayed, hif8_delayed, tensorwise, blockwise, mxfp8")
    if (fp8 and recipe == "mxfp8" and getattr(args, "fp8_param_gather", False)
            and not getattr(args, "reuse_grad_buf_for_mxfp8_param_ag", False)):
        raise ValueError("--fp8-param-gather with --fp8-recipe mxfp8 needs --reuse-grad-buf-for-mxfp8-param-ag: MXFP8 "
                         "weights keep a columnwise copy that cannot be rebuilt from gathered codes; or use "
                         "--fp8-recipe delayed, tensorwise or blockwise")
    for dest, recipes in FP8_ATTENTION_RECIPES.items():
        if not getattr(args, dest, False):
            continue
        flag = "--" + dest.replace("_", "-")
        dpa_recipe = DPAFP8Settings.from_env().recipe  # a bad NVTE_DPA_FP8_* value raises here, naming it
        dpa_flag = dest == "fp8_dot_product_attention"
        if dpa_flag and dpa_recipe in MXFP8_DPA_RECIPES:
            recipes += ("mxfp8",)
        if not fp8 or recipe not in recipes:
            hint = f" (or mxfp8 with NVTE_DPA_FP8_RECIPE={' or '.join(MXFP8_DPA_RECIPES)})" \
                if dpa_flag and "mxfp8" not in recipes else ""
            raise ValueError(f"{flag} needs --fp8-format and --fp8-recipe {', '.join(recipes)}{hint} (got "
                             f"--fp8-format {fp8}, --fp8-recipe {recipe}): the recipe Megatron builds would not carry "
                             "it, and attention would stay in high precision")
        if dpa_recipe == "MXFP8BlockScaling":
            raise ValueError(f"{flag} with NVTE_DPA_FP8_RECIPE=MXFP8BlockScaling: mindspeed_te has no MXFP8 attention, "
                             f"so attention would stay in high precision; use {' or '.join(MXFP8_DPA_RECIPES)}")
        if (getattr(args, "recompute_granularity", None) == "selective"
                and "core_attn" in (getattr(args, "recompute_modules", None) or ["core_attn"])):
            raise ValueError(f"{flag} with --recompute-granularity selective recomputing core_attn: Megatron's "
                             "recompute runs attention outside FP8 autocast, so its gradients would be high "
                             "precision attention's; FP8 attention keeps only Q, K, V codes already")
    if getattr(args, "use_te_activation_func", False):
        raise ValueError("--use-te-activation-func needs TransformerEngine's activation ops, which mindspeed_te does "
                         "not provide; leave it off (Megatron's own activation functions run)")
    if getattr(args, "fp8_step_recovery", False) and getattr(args, "check_for_nan_in_loss_and_grad", False):
        raise ValueError("--fp8-step-recovery needs --no-check-for-nan-in-loss-and-grad (Megatron's check stops the "
                         "run at the first NaN, before the step can be skipped and retried)")
    for flag in ("hif8_fwd_max", "hif8_bwd_max"):
        value = getattr(args, flag, None)
        if value is None:
            continue
        name = "--" + flag.replace("_", "-")
        if fp8 != "hif8":
            raise ValueError(f"{name} only applies with --fp8-format hif8 (got --fp8-format {fp8})")


def validate_fp4_args(args: argparse.Namespace) -> None:
    """Refuse what Megatron or TransformerEngine would refuse about --fp4-format (later, or only on a GPU),
    and the recipe options TE has that mindspeed_te does not implement, naming the flags or fields."""
    fp4 = getattr(args, "fp4", None)
    # --fp4-param-gather: dest fp4_param up to 0.16, fp4_param_gather from 0.17
    param_gather = getattr(args, "fp4_param", False) or getattr(args, "fp4_param_gather", False)
    if param_gather and not fp4:
        raise ValueError("--fp4-param-gather needs --fp4-format e2m1 (the weights it keeps in FP4)")
    if mxfp4_flags(args) and not fp4:
        raise ValueError(f"{' '.join(mxfp4_flags(args))}: only with --fp4-format e2m1 --fp4-recipe mxfp4")
    if not fp4:
        return
    if getattr(args, "fp8", None):
        raise ValueError(f"--fp4-format {fp4} and --fp8-format {args.fp8} cannot be used together; choose one")
    if getattr(args, "transformer_impl", "transformer_engine") != "transformer_engine":
        raise ValueError(f"--fp4-format {fp4} needs --transformer-impl transformer_engine "
                         f"(got --transformer-impl {args.transformer_impl})")
    recipe = getattr(getattr(args, "fp4_recipe", None), "value", getattr(args, "fp4_recipe", None)) or "nvfp4"
    if recipe not in FP4_RECIPES:
        raise ValueError(f"--fp4-recipe {recipe} is not supported by mindspeed_te (custom quantizer factories "
                         f"are TransformerEngine's); allowed: {', '.join(FP4_RECIPES)}")
    try:
        made = make_fp4_recipe(recipe, args)  # NVFP4BlockScaling reads TE's NVTE_NVFP4_* switches
    except ValueError as error:
        raise ValueError(f"--fp4-recipe {recipe}: {error}") from error
    _check_fp4_dims(args, recipe, 16 if recipe == "nvfp4" else 32)
    if param_gather and getattr(args, "use_distributed_optimizer", False) \
            and not made.fp4_quant_fwd_weight.fp4_2d_quantization:
        raise ValueError(f"--fp4-param-gather with --use-distributed-optimizer needs --fp4-recipe nvfp4 with its "
                         f"16x16 weight tiles (got --fp4-recipe {recipe}"
                         f"{', NVTE_NVFP4_DISABLE_2D_QUANTIZATION=1' if recipe == 'nvfp4' else ''}): other FP4 "
                         "weights keep a columnwise copy that cannot be rebuilt from the gathered codes; or leave "
                         "out --use-distributed-optimizer")


def _check_fp4_dims(args: argparse.Namespace, recipe: str, block: int) -> None:
    """Every FP4 GEMM operand needs both dims of its 2-D form in whole blocks (both forms are quantized, the
    columnwise one along the tokens): refused here, naming the flags, rather than at the first forward."""
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    cp = getattr(args, "context_parallel_size", 1) or 1
    heads, kv_channels = getattr(args, "num_attention_heads", None), getattr(args, "kv_channels", None)
    dims = {"--hidden-size": getattr(args, "hidden_size", None),
            "--ffn-hidden-size / --tensor-model-parallel-size": _per_rank(getattr(args, "ffn_hidden_size", None), tp),
            "--num-attention-heads x --kv-channels / --tensor-model-parallel-size":
                _per_rank(heads * kv_channels if heads and kv_channels else None, tp),
            "--seq-length x --micro-batch-size / --context-parallel-size":
                _per_rank(getattr(args, "seq_length", None) * getattr(args, "micro_batch_size", 1)
                          if getattr(args, "seq_length", None) else None, cp)}
    bad = [f"{flags} = {value}" for flags, value in dims.items() if value is not None and value % block]
    if bad:
        raise ValueError(f"--fp4-recipe {recipe} quantizes in blocks of {block}, which must divide: {'; '.join(bad)}")


def _per_rank(total: Optional[int], ranks: int) -> Optional[int]:
    return None if total is None else total // ranks


def wrap_parse_args(parse_args: Callable) -> Callable:
    """Megatron's parse_args with our flags added before the caller's extra arguments, then validated, and
    --fp8-recipe hif8_delayed handed to Megatron as delayed (`use_hif8_delayed`)."""

    @functools.wraps(parse_args)
    def wrapped(extra_args_provider: Optional[Callable] = None, ignore_unknown_args: bool = False):
        def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
            parser = add_arguments(parser)
            return extra_args_provider(parser) if extra_args_provider is not None else parser

        args = parse_args(provider, ignore_unknown_args)
        validate_args(args)
        use_hif8_delayed(args)
        use_extra_state_format(args)
        return args

    return wrapped


def wrap_config_from_args(config_from_args: Callable) -> Callable:
    """Megatron's core_transformer_config_from_args, then our flags copied onto the config."""

    @functools.wraps(config_from_args)
    def wrapped(args, *rest, **kwargs):
        config = config_from_args(args, *rest, **kwargs)
        for name, default in CONFIG_FIELDS.items():
            setattr(config, name, getattr(args, name, default))
        return config

    return wrapped


def register_arguments(registry) -> None:
    """Hook parse_args and core_transformer_config_from_args of megatron.training.arguments."""
    for target, wrap in (("megatron.training.arguments.parse_args", wrap_parse_args),
                         ("megatron.training.arguments.core_transformer_config_from_args", wrap_config_from_args)):
        registry.register(target, wrap(resolve(target)))
