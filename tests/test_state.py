"""FP8GlobalStateManager and the autocast / model-init context managers (single process)."""
import pytest
import torch

import mindspeed_te
from mindspeed_te import (
    DelayedScaling,
    Float8CurrentScaling,
    FP8GlobalStateManager,
    MXFP8BlockScaling,
    RecipeState,
    autocast,
    fp8_autocast,
    fp8_model_init,
    quantized_model_init,
)
from mindspeed_te.state import preserve_high_precision_init_val


def test_available_on_cpu():
    ok, reason = FP8GlobalStateManager.is_fp8_available()
    assert ok is True and reason == ""


def test_nesting_restores_outer_state():
    outer, inner = DelayedScaling(), Float8CurrentScaling()
    assert not FP8GlobalStateManager.is_fp8_enabled()
    with fp8_autocast(fp8_recipe=outer):
        assert FP8GlobalStateManager.get_fp8_recipe() is outer
        with fp8_autocast(enabled=False, calibrating=True, fp8_recipe=inner):
            assert not FP8GlobalStateManager.is_fp8_enabled()
            assert FP8GlobalStateManager.is_fp8_calibration()
            assert FP8GlobalStateManager.get_fp8_recipe() is inner
        assert FP8GlobalStateManager.is_fp8_enabled() and not FP8GlobalStateManager.is_fp8_calibration()
        assert FP8GlobalStateManager.get_fp8_recipe() is outer
    assert not FP8GlobalStateManager.is_fp8_enabled() and FP8GlobalStateManager.quantization_state.autocast_depth == 0


def test_default_recipe_is_delayed_scaling():
    with fp8_autocast():
        r = FP8GlobalStateManager.get_fp8_recipe()
    assert isinstance(r, DelayedScaling) and r.amax_history_len == 1024


def test_first_module_flag_once_per_outermost_region():
    with fp8_autocast():
        assert FP8GlobalStateManager.is_first_fp8_module()
        with fp8_autocast():
            assert not FP8GlobalStateManager.is_first_fp8_module()
        assert not FP8GlobalStateManager.is_first_fp8_module()
    with autocast(recipe=DelayedScaling()):
        assert FP8GlobalStateManager.is_first_fp8_module()


def test_bad_arguments_raise_and_leave_state_untouched():
    before = FP8GlobalStateManager.get_autocast_state()
    with pytest.raises(TypeError, match="fp8_recipe"):
        with fp8_autocast(fp8_recipe="delayed"):
            pass
    with pytest.raises(TypeError, match="fp8_group"):
        with fp8_autocast(fp8_group=3):
            pass
    with pytest.raises(TypeError, match="recipe"):
        with fp8_model_init(recipe=object()):
            pass
    assert FP8GlobalStateManager.get_autocast_state() == before
    assert FP8GlobalStateManager.quantization_state.autocast_depth == 0
    assert not FP8GlobalStateManager.with_fp8_parameters()


def _delayed_state(recipe, forward=True, n=3):
    state = RecipeState.create(recipe, forward=forward, num_quantizers=n)
    return state, state.make_quantizers()


def test_forward_update_at_outermost_exit_only():
    recipe = DelayedScaling(amax_history_len=2)
    state, qs = _delayed_state(recipe)
    with fp8_autocast(fp8_recipe=recipe):
        with fp8_autocast(fp8_recipe=recipe):
            FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(state)
            qs[0](torch.full((4,), 2.0))
        assert state.scale[0].item() == 1.0  # inner exit: no update yet
    assert state.scale[0].item() == 224.0
    assert state.amax_history[:, 0].tolist() == [0.0, 2.0]


def test_unregistered_state_keeps_history_and_scale():
    recipe = DelayedScaling(amax_history_len=2)
    state, qs = _delayed_state(recipe)
    state.scale.fill_(5.0)
    with fp8_autocast(fp8_recipe=recipe):
        pass
    assert state.scale.tolist() == [5.0, 5.0, 5.0] and not state.amax_history.any()


def test_backward_update_on_explicit_call():
    recipe = DelayedScaling(amax_history_len=1)
    state, qs = _delayed_state(recipe, forward=False, n=2)
    with fp8_autocast(fp8_recipe=recipe):
        FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(state)
    assert state.scale.tolist() == [1.0, 1.0]  # forward exit leaves backward states alone
    qs[1](torch.full((3,), 7.0))
    FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
    assert state.scale.tolist() == [1.0, 57344.0 / 7.0]


def test_calibration_updates_scales_without_enabling_fp8():
    recipe = DelayedScaling(amax_history_len=1)
    state, qs = _delayed_state(recipe)
    with fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe):
        # TE sets the first-module flag at every outermost entry, enabled or not
        assert FP8GlobalStateManager.is_first_fp8_module()
        FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(state)
        qs[2](torch.tensor([0.5, -4.0]))
    assert state.scale[2].item() == 112.0


def test_exception_in_region_restores_state_and_skips_reduction():
    recipe = DelayedScaling(amax_history_len=1)
    state, qs = _delayed_state(recipe)
    with pytest.raises(RuntimeError, match="boom"):
        with fp8_autocast(fp8_recipe=recipe):
            FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(state)
            qs[0](torch.full((2,), 4.0))
            raise RuntimeError("boom")
    assert not FP8GlobalStateManager.is_fp8_enabled() and FP8GlobalStateManager.quantization_state.autocast_depth == 0
    assert state.scale[0].item() == 1.0
    # The recorded amax is folded into the next completed step.
    with fp8_autocast(fp8_recipe=recipe):
        FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(state)
    assert state.scale[0].item() == 112.0


def test_nan_amax_never_reaches_scale_or_history():
    recipe = DelayedScaling(amax_history_len=3)
    state, qs = _delayed_state(recipe)
    for values in ([1.0, 2.0], [float("nan"), 1.0], [float("inf")]):
        with fp8_autocast(fp8_recipe=recipe):
            FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(state)
            qs[0](torch.tensor(values))
    assert torch.isfinite(state.amax_history).all() and torch.isfinite(state.scale).all()
    assert state.scale[0].item() == 224.0


def test_model_init_flags_and_high_precision_init_val():
    recipe = Float8CurrentScaling()
    with fp8_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        assert FP8GlobalStateManager.with_fp8_parameters()
        assert FP8GlobalStateManager.with_high_precision_init_val()
        assert FP8GlobalStateManager.get_fp8_model_init_recipe() is recipe
        with quantized_model_init(enabled=False):
            assert not FP8GlobalStateManager.with_fp8_parameters()
        assert FP8GlobalStateManager.with_fp8_parameters()
    assert not FP8GlobalStateManager.with_fp8_parameters()
    p = torch.nn.Parameter(torch.randn(3, 3))
    init = p.detach().clone()
    preserve_high_precision_init_val(p, p)
    with torch.no_grad():
        p.mul_(2)
    assert torch.equal(p.get_high_precision_init_val(), init)
    p.clear_high_precision_init_val()
    assert p.get_high_precision_init_val() is None


def test_model_init_recipe_is_the_active_recipe_inside():
    """TE's quantized_model_init sets the state's recipe: get_fp8_recipe() returns the init recipe inside the
    region (the default recipe when none is given), an autocast region nested inside overrides it, and the
    previous recipe is back after the region."""
    init, inner = Float8CurrentScaling(), DelayedScaling(amax_history_len=3)
    default = FP8GlobalStateManager.get_fp8_recipe()
    for context in (fp8_model_init, quantized_model_init):
        with context(recipe=init):
            assert FP8GlobalStateManager.get_fp8_recipe() is init
            assert not FP8GlobalStateManager.is_fp8_enabled()  # model init does not enable FP8 compute
            with fp8_autocast(fp8_recipe=inner):
                assert FP8GlobalStateManager.get_fp8_recipe() is inner
            assert FP8GlobalStateManager.get_fp8_recipe() is init
        assert FP8GlobalStateManager.get_fp8_recipe() == default
    with fp8_autocast(fp8_recipe=inner):
        with quantized_model_init(recipe=init):
            assert FP8GlobalStateManager.get_fp8_recipe() is init
        assert FP8GlobalStateManager.get_fp8_recipe() is inner
    with quantized_model_init():
        assert type(FP8GlobalStateManager.get_fp8_recipe()) is type(mindspeed_te.get_default_recipe())


class _Device:
    def __init__(self, kind: str) -> None:
        self.type = kind


@pytest.mark.parametrize("capability,expected", [((8, 9), DelayedScaling), ((9, 0), DelayedScaling),
                                                 ((10, 0), MXFP8BlockScaling), ((12, 0), Float8CurrentScaling)])
def test_default_recipe_follows_te_on_cuda(monkeypatch, capability, expected):
    """TE's get_default_recipe: MXFP8 where MXFP8 GEMMs exist for all layouts (compute capability 10.x),
    Float8CurrentScaling on 12.x (FP8 but not MXFP8 for all layouts), DelayedScaling before Blackwell."""
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: _Device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability)
    assert type(mindspeed_te.get_default_recipe()) is expected
    assert type(FP8GlobalStateManager.get_fp8_recipe()) is expected  # the recipe outside any region


@pytest.mark.parametrize("chip,expected", [("Ascend950PR", MXFP8BlockScaling), ("Ascend910B3", DelayedScaling)])
def test_default_recipe_on_npus_and_cpu(monkeypatch, use_backend, chip, expected):
    """The CPU emulates every format and has no native FP8 GEMM: DelayedScaling, TE's default for such
    devices. An NPU whose kernels include MX matmuls (the Ascend 950 series) gets MXFP8, as a Blackwell GPU
    does in TE; an NPU without FP8 keeps DelayedScaling (and fp8_autocast then refuses it)."""
    from mindspeed_te.kernels.npu import NpuBackend
    from mindspeed_te.testing.npu_sim import make_simulator

    assert type(mindspeed_te.get_default_recipe()) is DelayedScaling
    use_backend("npu")
    monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(make_simulator(chip)))
    assert type(mindspeed_te.get_default_recipe()) is expected
    if expected is MXFP8BlockScaling:
        with fp8_autocast():
            assert type(FP8GlobalStateManager.get_fp8_recipe()) is MXFP8BlockScaling
