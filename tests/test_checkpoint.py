"""FP8 metadata in `_extra_state`: save -> load -> continue is bit-identical to not stopping."""
import io

import pytest
import torch

from mindspeed_te import DelayedScaling, Float8CurrentScaling, Format, FP8GlobalStateManager, fp8_autocast
from mindspeed_te.modules import Linear


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(Linear(64, 64), torch.nn.GELU(), Linear(64, 32))


def _steps(model, opt, recipe, first: int, count: int) -> list[torch.Tensor]:
    outs = []
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, 64, generator=g) * (1 + step)  # growing magnitudes exercise the amax history
        with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            y = model(x)
        loss = (y.float() ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        outs.append(y.detach())
    return outs


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("recipe", [DelayedScaling(fp8_format=Format.HIF8, amax_history_len=4),
                                    DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=2),
                                    Float8CurrentScaling(fp8_format=Format.E4M3)])
def test_resume_is_bit_identical(recipe):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _steps(model, opt, recipe, 0, 3)
    ckpt = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    assert "0._extra_state" in ckpt["model"] and "2._extra_state" in ckpt["model"]
    uninterrupted = _steps(model, opt, recipe, 3, 3)

    FP8GlobalStateManager.reset()
    resumed_model = _model()
    with torch.no_grad():  # different weights before loading, so the load must restore everything
        for p in resumed_model.parameters():
            p.add_(1.0)
    resumed_opt = torch.optim.SGD(resumed_model.parameters(), lr=0.01)
    resumed_model.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["opt"])
    resumed = _steps(resumed_model, resumed_opt, recipe, 3, 3)
    for a, b in zip(uninterrupted, resumed):
        assert torch.equal(a, b)


def test_checkpoint_from_another_recipe_loads_with_warning():
    recipe = DelayedScaling(fp8_format=Format.HIF8, amax_history_len=4)
    model = _model()
    _steps(model, torch.optim.SGD(model.parameters(), lr=0.01), recipe, 0, 2)
    state = model.state_dict()
    fresh = _model()
    fresh.load_state_dict(state)
    with pytest.warns(UserWarning, match="active recipe is"):
        _steps(fresh, torch.optim.SGD(fresh.parameters(), lr=0.01), DelayedScaling(fp8_format=Format.E4M3), 0, 1)


def test_checkpoint_without_fp8_loads_with_warning():
    model = _model()
    state = model.state_dict()  # never ran in FP8
    fresh = _model()
    with pytest.warns(UserWarning, match="before this module ran in FP8"):
        fresh.load_state_dict(state)
    state["0._extra_state"] = torch.empty(0, dtype=torch.uint8)
    with pytest.warns(UserWarning, match="no FP8 metadata"):
        fresh.load_state_dict(state)
    _steps(fresh, torch.optim.SGD(fresh.parameters(), lr=0.01), DelayedScaling(), 0, 1)


def test_corrupt_extra_state_is_a_clear_error():
    model = _model()
    state = model.state_dict()
    state["0._extra_state"] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="corrupt _extra_state"):
        _model().load_state_dict(state)
