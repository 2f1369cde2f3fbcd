"""Recipes: TransformerEngine's field names and defaults, HiF8 targets, validation on construction."""
import pytest

from mindspeed_te import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    FP8Dtype,
    MXFP8BlockScaling,
    QParams,
)
from mindspeed_te.recipe import recipe_from_config, recipe_from_name, recipe_to_config


def test_delayed_scaling_defaults_match_transformer_engine():
    r = DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo) == (0, Format.HYBRID, 1024, "max")
    assert r.scaling_factor_compute_algo is None and r.reduce_amax is True
    assert (r.fp8_dpa, r.fp8_mha) == (False, False)
    # TE's positional order starts with margin, fp8_format.
    assert DelayedScaling(1, Format.E4M3).margin == 1


def test_other_recipe_defaults():
    cur = Float8CurrentScaling()
    assert cur.fp8_format is Format.HYBRID
    assert not cur.fp8_quant_fwd_inp.power_2_scale and cur.fp8_quant_bwd_grad.amax_epsilon == 0.0
    blk = Float8BlockScaling()
    assert blk.fp8_format is Format.E4M3
    assert (blk.x_block_scaling_dim, blk.w_block_scaling_dim, blk.grad_block_scaling_dim) == (1, 2, 1)
    assert blk.fp8_quant_fwd_weight.power_2_scale
    mx = MXFP8BlockScaling()
    assert mx.fp8_format is Format.E4M3 and mx.scale_rounding == "ceil" and mx.margin == 0


ROLES = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")


@pytest.mark.parametrize("fmt, power_2", [(Format.E4M3, True), (Format.HYBRID, True), (Format.HIF8, False)])
def test_block_scaling_power_2_default_per_format(fmt, power_2, monkeypatch):
    """E4M3/HYBRID keep TE's power-of-2 tiles (off with NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1, as in TE);
    HiF8 defaults to the NPU block kernel's amax / target, whatever that variable says; Megatron's
    --fp8-recipe blockwise builds the same; a QParams passed explicitly is kept."""
    for r in (Float8BlockScaling(fp8_format=fmt), recipe_from_name("blockwise", fmt.name.lower())):
        assert [getattr(r, role) for role in ROLES] == [QParams(power_2_scale=power_2)] * 3
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    assert not Float8BlockScaling(fp8_format=fmt).fp8_quant_fwd_weight.power_2_scale
    explicit = QParams(power_2_scale=True, amax_epsilon=1e-6)
    r = Float8BlockScaling(fp8_format=fmt, fp8_quant_fwd_inp=explicit)
    assert r.fp8_quant_fwd_inp == explicit and r.fp8_quant_bwd_grad.power_2_scale is False
    assert recipe_from_config(recipe_to_config(r)) == r


def test_block_scaling_qparams_must_be_qparams():
    with pytest.raises(TypeError, match="Float8BlockScaling.fp8_quant_bwd_grad must be a QParams"):
        Float8BlockScaling(fp8_quant_bwd_grad=True)
    r = Float8BlockScaling(fp8_format=Format.HIF8)
    r.fp8_quant_fwd_weight = None
    with pytest.raises(TypeError, match="fp8_quant_fwd_weight"):
        r.validate()


def test_block_scaling_hif8_quantizers_take_the_kernel_rule():
    """The quantizers a HiF8 blockwise recipe makes use amax / target tiles unless asked for powers of 2."""
    from mindspeed_te import RecipeState

    for qparams, power_2 in ((None, False), (QParams(power_2_scale=True), True)):
        extra = {} if qparams is None else dict.fromkeys(ROLES, qparams)
        recipe = Float8BlockScaling(fp8_format=Format.HIF8, **extra)
        for forward in (True, False):
            state = RecipeState.create(recipe, forward=forward, num_quantizers=3 if forward else 2)
            assert [q.power_2_scale for q in state.make_quantizers()] == [power_2] * (3 if forward else 2)


def test_targets_and_dtypes():
    r = DelayedScaling(fp8_format=Format.HIF8)
    assert (r.target_max(True), r.target_max(False)) == (15.0, 224.0)
    assert r.fp8_dtype(True) is FP8Dtype.HIF8 and r.fp8_dtype(False) is FP8Dtype.HIF8
    r = Float8CurrentScaling(fp8_format=Format.HIF8, fwd_target_max=56.0, bwd_target_max=32768.0)
    assert (r.target_max(True), r.target_max(False)) == (56.0, 32768.0)
    h = DelayedScaling(fp8_format=Format.HYBRID)
    assert (h.target_max(True), h.target_max(False)) == (448.0, 57344.0)
    assert h.fp8_dtype(False) is FP8Dtype.E5M2


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: DelayedScaling(amax_history_len=0), "amax_history_len"),
        (lambda: DelayedScaling(amax_compute_algo="mean"), "amax_compute_algo"),
        (lambda: DelayedScaling(margin=-1), "margin"),
        (lambda: DelayedScaling(fp8_format=Format.E5M2), "fp8_format"),
        (lambda: DelayedScaling(fp8_format="hybrid"), "fp8_format"),
        (lambda: Float8CurrentScaling(fp8_format=Format.HIF8, fwd_target_max=40000.0), "fwd_target_max"),
        (lambda: Float8CurrentScaling(bwd_target_max=0.0), "bwd_target_max"),
        (lambda: Float8BlockScaling(x_block_scaling_dim=3), "x_block_scaling_dim"),
        (lambda: Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=2), "w_block_scaling_dim"),
        (lambda: MXFP8BlockScaling(fp8_format=Format.HIF8), "fp8_format"),
        (lambda: MXFP8BlockScaling(scale_rounding="nearest"), "scale_rounding"),
    ],
)
def test_invalid_recipes_raise_naming_the_field(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_recipe_from_megatron_flags():
    assert isinstance(recipe_from_name("tensorwise", "hif8"), Float8CurrentScaling)
    r = recipe_from_name("delayed", "hybrid", amax_history_len=1, amax_compute_algo="most_recent")
    assert r.amax_history_len == 1 and r.fp8_format is Format.HYBRID
    with pytest.raises(ValueError, match="--fp8-recipe"):
        recipe_from_name("custom2", "e4m3")


def test_key_distinguishes_configurations():
    assert DelayedScaling().key() == DelayedScaling().key()
    assert DelayedScaling().key() != DelayedScaling(margin=1).key()
    assert DelayedScaling().key() != Float8CurrentScaling().key()


def test_key_follows_a_field_set_after_it_was_asked_for():
    """key() is kept between calls (every module call asks for it), made again once any field is set, and not
    carried by a pickled or copied recipe."""
    import copy
    import pickle

    recipe = DelayedScaling()
    before = recipe.key()
    recipe.margin = 2
    assert recipe.key() == DelayedScaling(margin=2).key() != before
    recipe.amax_compute_algo = lambda history: history.amax(dim=0)
    with_callable = recipe.key()
    assert "<function" in with_callable
    for clone in (pickle.loads(pickle.dumps(DelayedScaling(margin=2))), copy.deepcopy(recipe)):
        assert "_key" not in vars(clone)
    assert copy.deepcopy(recipe).key() == with_callable


def test_override_linear_precision_only_wgrad():
    assert DelayedScaling().fp8_wgrad()
    assert not DelayedScaling(override_linear_precision=(False, False, True)).fp8_wgrad()
    with pytest.raises(ValueError, match="override_linear_precision"):
        Float8CurrentScaling(override_linear_precision=(True, False, False))
