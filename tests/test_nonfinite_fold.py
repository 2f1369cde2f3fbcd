"""Issue 9: the quantizes of a step only note their non-finite flag updates; the state manager folds the whole
step's at once, before it reads the flags and at every step end (check on or off), and holds nothing past it."""
import copy
import gc
import io
import math
import warnings
import weakref

import pytest
import torch

from mindspeed_te import Float8CurrentScaling, FP8GlobalStateManager, MXFP8BlockScaling, fp8_autocast
from mindspeed_te.modules import Linear

RECIPES = {"tensorwise": Float8CurrentScaling, "mxfp8": MXFP8BlockScaling}


def _inputs(bad_at=None):
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    if bad_at is not None:
        x[bad_at] = math.inf
    return x.requires_grad_(), dy


def _pending() -> list:
    return FP8GlobalStateManager.quantization_state.nonfinite_pending


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_flags_change_only_at_the_fold_and_the_step_end_reports(recipe):
    layer = Linear(64, 64, name="fc")
    x, dy = _inputs(bad_at=(3, 4))
    with fp8_autocast(fp8_recipe=RECIPES[recipe]()):
        y = layer(x)
    forward_state = layer.fp8_states[0]
    assert len(_pending()) == 2  # input and weight, noted
    assert not forward_state.nonfinite.any()  # not folded yet: no device op touched the flags
    with pytest.warns(RuntimeWarning, match="fc input"):
        y.backward(dy)  # the step's end: fold (forward and backward notes), then check
    assert _pending() == []
    assert FP8GlobalStateManager.get_nonfinite_counts() == {"steps": 1, "fc input": 1}


def test_with_the_check_off_the_step_end_still_folds():
    """`nonfinite_check` off only turns the automatic check off: the flags are folded at the step's end all
    the same, so nothing piles up and a later explicit check finds what the step quantized."""
    FP8GlobalStateManager.quantization_state.nonfinite_check = False
    layer = Linear(64, 64, name="fc")
    x, dy = _inputs(bad_at=(0, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no automatic report
        with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
            y = layer(x)
        y.backward(dy)
    assert _pending() == []
    assert layer.fp8_states[0].nonfinite.isnan().any()
    with pytest.warns(RuntimeWarning, match="fc input"):
        assert FP8GlobalStateManager.check_nonfinite() == ["fc input"]


def test_reset_drops_the_pending_notes_and_unhooks_the_watched_states():
    layer = Linear(64, 64)
    x, _ = _inputs()
    with fp8_autocast(fp8_recipe=MXFP8BlockScaling()):
        layer(x)
    assert _pending()
    FP8GlobalStateManager.reset()
    assert _pending() == []
    assert all(state.nonfinite_pending is None for state in layer.fp8_states)
    # The module outlives the reset unwatched: it folds its own updates, noting nothing no one would fold.
    with fp8_autocast(fp8_recipe=MXFP8BlockScaling()):
        layer(x)
    assert _pending() == []


def test_notes_of_a_deleted_module_are_released_at_the_step_end():
    layer = Linear(64, 64)
    x, _ = _inputs()
    with fp8_autocast(fp8_recipe=MXFP8BlockScaling()):
        y = layer(x)
    flag, scales, _ = _pending()[0]
    refs = [weakref.ref(flag), weakref.ref(scales)]
    del layer, y, flag, scales
    gc.collect()
    assert all(ref() is not None for ref in refs)  # held by the step's notes until its end
    with fp8_autocast(fp8_recipe=MXFP8BlockScaling()):  # no backward ran: the step ends here
        pass
    gc.collect()
    assert _pending() == [] and all(ref() is None for ref in refs)


def test_copies_and_pickles_of_a_quantizer_leave_the_step_notes_behind():
    """A saved FP8 parameter pickles its quantizer: the step's notes (other layers' tensors) are not saved."""
    layer = Linear(64, 64)
    x, _ = _inputs()
    with fp8_autocast(fp8_recipe=MXFP8BlockScaling()):
        layer(x)
    quantizer = layer.fp8_states[0].make_quantizers()[0]
    assert quantizer.nonfinite_pending is _pending() and _pending()
    buffer = io.BytesIO()
    torch.save(quantizer, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(quantizer), torch.load(buffer, weights_only=False)):
        assert twin.nonfinite_pending is None and torch.equal(twin.nonfinite, quantizer.nonfinite)
    assert quantizer.nonfinite_pending is _pending()
