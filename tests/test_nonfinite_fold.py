"""Issue 9: the quantizes of a step only note their non-finite flag updates; the state manager folds the whole
step's at once, before it checks the flags and at every step end (check on or off), and holds nothing past it."""
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
    y.backward(dy)  # the step's end: fold (forward and backward notes), then check: copied and cleared
    assert _pending() == []
    assert not forward_state.nonfinite.isnan().any()
    with pytest.warns(RuntimeWarning, match="fc input"):
        FP8GlobalStateManager.harvest_nonfinite()  # the step boundary reads the check
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
        assert FP8GlobalStateManager.harvest_nonfinite() == []  # nothing was checked
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


def test_copies_of_a_delayed_quantizer_hold_their_own_tensors():
    """A delayed-scaling quantizer reads its state's tensors, which are views into buffers shared by every
    module of its autocast key: a copy or a pickle takes a copy of its state holding that state's own columns
    (a pickle of a view would save the whole shared buffer), and writes none of the originals."""
    from mindspeed_te import DelayedScaling

    layers = [Linear(64, 64) for _ in range(3)]
    x, _ = _inputs()
    with fp8_autocast(fp8_recipe=DelayedScaling()):
        for layer in layers:
            layer(x)
    state = layers[1].fp8_states[0]
    shared = state.buffers.history
    assert state.amax_history._base is shared  # the key's buffers hold all three layers' columns
    quantizer = state.make_quantizers()[1]
    buffer = io.BytesIO()
    torch.save(quantizer, buffer)
    assert buffer.tell() < shared.nbytes
    buffer.seek(0)
    history = state.amax_history.clone()
    for twin in (copy.deepcopy(quantizer), torch.load(buffer, weights_only=False)):
        assert torch.equal(twin.scale, quantizer.scale) and torch.equal(twin.amax, quantizer.amax)
        assert twin.amax.untyped_storage().nbytes() == state.amax_history.numel() * 4  # its state's columns
        twin.quantize(x * 100)
        assert torch.equal(state.amax_history, history)  # the original state saw nothing


def test_fold_marks_exactly_the_flags_whose_scales_held_a_non_finite_value():
    """Random steps of notes against a per-element check in Python: float32 block scales (NaN/Inf anywhere),
    MX scale bytes (0xFF anywhere), one-element per-tensor scales, a flag noted several times, flags in two
    buffers (the shared one and a tensor of its own). A flag becomes NaN exactly when one of its notes held
    a non-finite value (a 0xFF byte), stays NaN after later clean folds, and clear_flags zeroes it."""
    from mindspeed_te.nonfinite import clear_flags, fold_nonfinite_pairs, take_flags

    g = torch.Generator().manual_seed(5)
    shared, own = take_flags(6), torch.zeros(1)
    flags = [shared[i : i + 1] for i in range(6)] + [own]
    expected = [False] * len(flags)
    for _ in range(4):
        pairs = []
        for _ in range(9):
            i = int(torch.randint(len(flags), (1,), generator=g))
            kind = int(torch.randint(3, (1,), generator=g))
            bad = bool(torch.rand(1, generator=g) < 0.2)
            if kind == 0:
                scales = torch.rand(int(torch.randint(1, 40, (1,), generator=g)), generator=g) + 0.5
                if bad:
                    scales[int(torch.randint(scales.numel(), (1,), generator=g))] = [math.nan, math.inf][i % 2]
            elif kind == 1:
                scales = torch.randint(0, 255, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g,
                                       dtype=torch.uint8)
                if bad:
                    scales[-1] = 0xFF
            else:
                scales = torch.tensor([math.inf if bad else 0.25])
            pairs.append((flags[i], scales, kind != 2))
            values = scales.tolist()
            expected[i] |= any(v == 0xFF for v in values) if kind == 1 else not all(map(math.isfinite, values))
        fold_nonfinite_pairs(pairs)
        assert [math.isnan(f.item()) for f in flags] == expected
    clear_flags(flags)
    assert not any(f.item() for f in flags)


def test_a_large_step_folds_its_notes_as_they_reach_the_bound(monkeypatch):
    """The notes of a step are folded as soon as they hold `PendingPairs.FOLD_AT` scale elements, so a long step
    of a large model keeps neither its scales nor an unbounded fold buffer; the flags and the step's report are
    those of one fold at its end."""
    from mindspeed_te.nonfinite import PendingPairs

    monkeypatch.setattr(PendingPairs, "FOLD_AT", 64 * 2)  # the MX scales of two 64x64 tensors
    layer = Linear(64, 64, name="fc")
    x, dy = _inputs(bad_at=(3, 4))
    with fp8_autocast(fp8_recipe=MXFP8BlockScaling()):
        y = layer(x)
    assert _pending() == [] and _pending().elements == 0  # input and weight: 128 scale bytes, folded
    assert layer.fp8_states[0].nonfinite.isnan().any()
    y.backward(dy)
    with pytest.warns(RuntimeWarning, match="fc input"):
        FP8GlobalStateManager.harvest_nonfinite()
    assert FP8GlobalStateManager.get_nonfinite_counts() == {"steps": 1, "fc input": 1}
