"""mindspeed_te's Megatron command-line flags, added through `parse_args`'s extra-arguments hook.

Flags: `--fp8-format hif8` (added to Megatron's own choices), `--fp8-recipe hif8_delayed` and its
`--hif8-*` settings, `--hif8-fwd-max` / `--hif8-bwd-max` (HiF8 target maxima, default 15 / 224),
`--fp8-step-recovery` (patches/training.py), `--fp8-numerics-report`, `--no-use-gmm-fp8` (MoE grouped GEMMs in
high precision) and `--use-ascend-mc2` (fused matmul + communication kernels). Megatron copies only
TransformerConfig's own fields from the arguments into the config, so `core_transformer_config_from_args` is
wrapped to carry these over as config attributes, where the TE* modules read them.

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

from mindspeed_te.patches.registry import resolve
from mindspeed_te.recipe import Format
from mindspeed_te.te_extra_state import EXTRA_STATE_FORMAT_ENV, EXTRA_STATE_FORMATS

# args attribute -> default; copied onto the TransformerConfig
CONFIG_FIELDS = {"use_gmm_fp8": True, "use_ascend_mc2": False, "hif8_fwd_max": None, "hif8_bwd_max": None,
                 "hif8_input_margin": 11, "hif8_weight_margin": 12, "hif8_grad_margin": 11,
                 "hif8_amax_collect_interval": 5, "hif8_scale_update_interval": 10, "hif8_amax_history_len": 128,
                 "fp8_step_recovery": False, "hif8_delayed": False}
# --fp8-recipe values added to Megatron's own
RECIPE_CHOICES = ("hif8_delayed",)
# what Megatron sees of --fp8-recipe hif8_delayed after parse_args (with args.hif8_delayed = True)
HIF8_DELAYED_AS = "delayed"
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
    if _option(parser, "--hif8-fwd-max") is not None:
        return parser  # added by an earlier hook: adding them twice would be an argparse conflict
    group = parser.add_argument_group("mindspeed_te")
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
                            "in HiF8 / E4M3 / MXFP8) as CSV, JSON and PNG heatmaps to DIR")
    group.add_argument("--fp8-numerics-interval", type=_at_least("--fp8-numerics-interval", 1), default=100,
                       help="--fp8-numerics-report: record every N iterations (default 100)")
    group.add_argument("--no-use-gmm-fp8", dest="use_gmm_fp8", action="store_false",
                       help="run MoE grouped GEMMs in high precision inside FP8 training")
    group.add_argument("--use-ascend-mc2", action="store_true",
                       help="fused matmul + all-gather / reduce-scatter kernels for tensor-parallel linears")
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
    # Flags that would otherwise fail late (after the model is built) or be silently ignored.
    if getattr(args, "fp4", None):
        raise ValueError(f"--fp4-format {args.fp4} is not supported by mindspeed_te (it quantizes to FP8 and HiF8); "
                         "use --fp8-format e4m3|hybrid|hif8")
    if recipe == "custom":
        raise ValueError("--fp8-recipe custom (--fp8-quantizer-factory) is not supported by mindspeed_te; allowed: "
                         "delayed, hif8_delayed, tensorwise, blockwise, mxfp8")
    if (fp8 and recipe == "mxfp8" and getattr(args, "fp8_param_gather", False)
            and not getattr(args, "reuse_grad_buf_for_mxfp8_param_ag", False)):
        raise ValueError("--fp8-param-gather with --fp8-recipe mxfp8 needs --reuse-grad-buf-for-mxfp8-param-ag: MXFP8 "
                         "weights keep a columnwise copy that cannot be rebuilt from gathered codes; or use "
                         "--fp8-recipe delayed, tensorwise or blockwise")
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
