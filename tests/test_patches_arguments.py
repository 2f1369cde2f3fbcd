"""Command-line flags: hif8 in --fp8-format, our flags, validation, and the config hand-over."""
from __future__ import annotations

import argparse
import os
import sys

import pytest

from mindspeed_te.patches.arguments import (
    CONFIG_FIELDS,
    add_arguments,
    recipe_flag,
    use_hif8_delayed,
    validate_args,
    wrap_config_from_args,
    wrap_parse_args,
)


def _megatron_like_parse_args(argv: list[str]):
    """A stand-in with Megatron's parse_args contract: its own flags, then the extra-arguments provider."""

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        parser = argparse.ArgumentParser()
        parser.add_argument("--fp8-format", dest="fp8", default=None, choices=["e4m3", "hybrid"])
        parser.add_argument("--fp8-recipe", default="delayed",
                            choices=["tensorwise", "delayed", "mxfp8", "blockwise", "custom"])
        parser.add_argument("--transformer-impl", default="transformer_engine",
                            choices=["local", "transformer_engine"])
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return parser.parse_known_args(argv)[0] if ignore_unknown_args else parser.parse_args(argv)

    return parse_args


def _parse(argv: list[str], extra=None):
    return wrap_parse_args(_megatron_like_parse_args(argv))(extra)


def test_hif8_and_our_flags_parse_next_to_megatrons():
    args = _parse(["--fp8-format", "hif8", "--fp8-recipe", "tensorwise", "--hif8-fwd-max", "56",
                   "--no-use-gmm-fp8", "--use-ascend-mc2"])
    assert (args.fp8, args.fp8_recipe, args.hif8_fwd_max, args.hif8_bwd_max) == ("hif8", "tensorwise", 56.0, None)
    assert args.use_gmm_fp8 is False and args.use_ascend_mc2 is True
    defaults = _parse([])
    assert {name: getattr(defaults, name) for name in CONFIG_FIELDS} == CONFIG_FIELDS
    assert _parse(["--fp8-format", "e4m3"]).fp8 == "e4m3"  # Megatron's own choices still work


def test_hif8_delayed_reaches_megatron_as_delayed():
    """Megatron tests `fp8_recipe == "delayed"` in about ten places (a block's outer autocast, MLA's and shared
    experts' save_original_input, the distributed optimizer, ...): after parse_args it sees its own "delayed" and
    `hif8_delayed` carries the HiF8 schedule; validating again still names the flag the user gave."""
    args = _parse(["--fp8-format", "hif8", "--fp8-recipe", "hif8_delayed"])
    assert (args.fp8_recipe, args.hif8_delayed, recipe_flag(args)) == ("delayed", True, "hif8_delayed")
    validate_args(args)
    use_hif8_delayed(args)  # a second pass changes nothing
    assert (args.fp8_recipe, args.hif8_delayed) == ("delayed", True)
    for recipe in ("delayed", "tensorwise"):
        args = _parse(["--fp8-format", "hif8", "--fp8-recipe", recipe])
        assert (args.fp8_recipe, args.hif8_delayed, recipe_flag(args)) == (recipe, False, recipe)
    with pytest.raises(ValueError, match="--fp8-recipe hif8_delayed needs --fp8-format hif8"):
        validate_args(argparse.Namespace(fp8="e4m3", fp8_recipe="delayed", hif8_delayed=True))


def test_the_callers_extra_arguments_still_run():
    def extra(parser):
        parser.add_argument("--my-flag", type=int, default=3)
        return parser

    assert _parse(["--my-flag", "5", "--fp8-format", "hybrid"], extra).my_flag == 5


@pytest.mark.parametrize("argv,message", [
    (["--fp8-format", "hif8", "--transformer-impl", "local"], "needs --transformer-impl transformer_engine"),
    (["--fp8-format", "hif8", "--fp8-recipe", "mxfp8"], "hif8 does not work with --fp8-recipe mxfp8"),
    (["--fp8-format", "e4m3", "--hif8-bwd-max", "224"], "--hif8-bwd-max only applies with --fp8-format hif8"),
])
def test_bad_combinations_name_the_flags(argv, message):
    with pytest.raises(ValueError, match=message):
        _parse(argv)


@pytest.mark.parametrize("fields,message", [
    (dict(fp4="e2m1", fp8="e4m3"), "--fp4-format e2m1 and --fp8-format e4m3 cannot be used together"),
    (dict(fp8="e4m3", fp8_recipe="custom"), "--fp8-recipe custom"),
    (dict(fp8="e4m3", fp8_recipe="mxfp8", fp8_param_gather=True), "needs --reuse-grad-buf-for-mxfp8-param-ag"),
    (dict(use_te_activation_func=True), "--use-te-activation-func needs TransformerEngine"),
])
def test_megatron_flags_without_a_mindspeed_te_counterpart_are_refused_at_parse_time(fields, message):
    """Megatron flags that would fail only after the model is built (custom recipes, MXFP8 parameter gather,
    TE's activation ops, FP4 with FP8) stop the launch at once, naming the flag; the combinations that work
    pass."""
    base = dict(fp8=None, fp8_recipe="delayed", transformer_impl="transformer_engine")
    with pytest.raises(ValueError, match=message):
        validate_args(argparse.Namespace(**{**base, **fields}))
    for fine in (dict(fp8="e4m3", fp8_recipe="mxfp8", fp8_param_gather=True, reuse_grad_buf_for_mxfp8_param_ag=True),
                 dict(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te"),
                 dict(fp8="e4m3", fp8_recipe="tensorwise", fp8_param_gather=True)):
        validate_args(argparse.Namespace(**{**base, **fine}))


def test_step_recovery_needs_megatrons_nan_check_off():
    """Megatron's --check-for-nan-in-loss-and-grad (on by default) ends the run at the first NaN loss."""
    def extra(parser):
        parser.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                            dest="check_for_nan_in_loss_and_grad")
        return parser

    with pytest.raises(ValueError, match="--fp8-step-recovery needs --no-check-for-nan-in-loss-and-grad"):
        _parse(["--fp8-step-recovery"], extra)
    assert _parse(["--fp8-step-recovery", "--no-check-for-nan-in-loss-and-grad"], extra).fp8_step_recovery


@pytest.mark.parametrize("argv,message", [
    (["--fp8-format", "hif8", "--hif8-fwd-max", "1e6"],
     "argument --hif8-fwd-max: --hif8-fwd-max must be in (0, 32768]"),
    (["--fp8-format", "hif8", "--hif8-bwd-max", "-1"], "argument --hif8-bwd-max: --hif8-bwd-max must be in (0, 32768]"),
    (["--fp8-format", "hif8", "--hif8-fwd-max", "big"], "--hif8-fwd-max must be a number, got 'big'"),
    (["--fp8-format", "e5m2"], "argument --fp8-format"),
])
def test_bad_values_fail_at_parse_time_naming_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit):
        _parse(argv)
    assert message in capsys.readouterr().err


def test_adding_the_flags_twice_is_harmless():
    parser = add_arguments(add_arguments(argparse.ArgumentParser()))
    assert parser.parse_args(["--fp8-format", "hif8", "--hif8-fwd-max", "8"]).hif8_fwd_max == 8.0


def test_unknown_format_is_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit):
        _parse(["--fp8-format", "e2m1"])
    assert "invalid choice: 'e2m1'" in capsys.readouterr().err


def test_a_parser_without_fp8_format_gets_one():
    parser = add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--fp8-format", "hif8"])
    assert args.fp8 == "hif8"
    validate_args(args)


def test_config_receives_our_fields():
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import TransformerConfig

    def config_from_args(args, config_class=None):
        return (config_class or TransformerConfig)(num_layers=1, hidden_size=8, num_attention_heads=1, fp8=args.fp8)

    args = _parse(["--fp8-format", "hif8", "--hif8-fwd-max", "56", "--no-use-gmm-fp8"])
    config = wrap_config_from_args(config_from_args)(args)
    assert (config.fp8, config.hif8_fwd_max, config.use_gmm_fp8, config.use_ascend_mc2) == ("hif8", 56.0, False, False)

    from mindspeed_te.megatron.common import recipe_from_config

    assert recipe_from_config(config).fwd_target_max == 56.0


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_PATH"), reason="needs MEGATRON_LM_PATH (Megatron-LM checkout)")
def test_real_megatron_parse_args(monkeypatch):
    monkeypatch.syspath_prepend(os.environ["MEGATRON_LM_PATH"])
    from megatron.training import arguments

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--fp8-format", "hif8", "--fp8-recipe", "tensorwise",
                                      "--transformer-impl", "transformer_engine", "--no-use-gmm-fp8"])
    args = wrap_parse_args(arguments.parse_args)(None, True)
    assert (args.fp8, args.use_gmm_fp8) == ("hif8", False)


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_PATH"), reason="needs MEGATRON_LM_PATH (Megatron-LM checkout)")
def test_real_megatron_sees_hif8_delayed_as_delayed(monkeypatch):
    """Megatron's own parse_args, validate_args and core_transformer_config_from_args (MLA): its config says
    delayed, and the recipe built from it is HIF8DelayedScaling with the --hif8-* settings."""
    monkeypatch.syspath_prepend(os.environ["MEGATRON_LM_PATH"])
    from megatron.core.enums import Fp8Recipe
    from megatron.training import arguments

    from mindspeed_te.megatron.common import recipe_from_config
    from mindspeed_te.recipe import HIF8DelayedScaling

    monkeypatch.setattr(sys, "argv", [
        "pretrain_gpt.py", "--fp8-format", "hif8", "--fp8-recipe", "hif8_delayed", "--hif8-scale-update-interval", "3",
        "--transformer-impl", "transformer_engine", "--multi-latent-attention", "--num-layers", "2",
        "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "1", "--global-batch-size", "1", "--bf16", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "256"])
    args = wrap_parse_args(arguments.parse_args)(None, False)
    arguments.validate_args(args, {})
    config = wrap_config_from_args(arguments.core_transformer_config_from_args)(args)
    assert type(config).__name__ == "MLATransformerConfig"
    assert args.fp8_recipe == config.fp8_recipe == Fp8Recipe.delayed and config.hif8_delayed
    recipe = recipe_from_config(config)
    assert isinstance(recipe, HIF8DelayedScaling) and recipe.scale_update_interval == 3


def test_extra_state_format_flag_makes_every_module_write_tes_format(monkeypatch):
    """--fp8-extra-state-format te: a module saved after parse_args writes TransformerEngine's entry (a pickled
    dict, not this plugin's torch.save stream); without the flag nothing changes; other values are refused."""
    import pickle

    import torch

    from mindspeed_te import Linear
    from mindspeed_te.te_extra_state import EXTRA_STATE_FORMAT_ENV

    monkeypatch.setenv(EXTRA_STATE_FORMAT_ENV, "")  # restored (unset) after the test, which the flag sets
    monkeypatch.delenv(EXTRA_STATE_FORMAT_ENV)
    assert _parse([]).fp8_extra_state_format is None and EXTRA_STATE_FORMAT_ENV not in os.environ
    _parse(["--fp8-extra-state-format", "te"])
    assert os.environ[EXTRA_STATE_FORMAT_ENV] == "te"
    payload = Linear(16, 16).get_extra_state()
    assert payload.dtype == torch.uint8 and pickle.loads(payload.numpy().tobytes()) is None  # TE's "no FP8 state"
    with pytest.raises(SystemExit):
        _parse(["--fp8-extra-state-format", "pickle"])
