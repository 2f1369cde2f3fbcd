"""The FP8 hot path never synchronizes the host with the device: no .item(), .tolist(), bool(tensor) or
device-to-host copies in forward, backward or the scale update."""
import pytest
import torch

from mindspeed_te import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    FP8GlobalStateManager,
    MXFP8BlockScaling,
    fp8_autocast,
)
from mindspeed_te.diagnostics import HostSyncCounter
from mindspeed_te.modules import Linear


def test_counter_sees_syncs():
    t = torch.ones(3)
    with HostSyncCounter() as counter:
        t.sum().item()
        bool(t.any())
        t.tolist()
    assert counter.counts == {"item": 1, "bool": 1, "tolist": 1}


@pytest.mark.parametrize("recipe", [
    DelayedScaling(fp8_format=Format.HIF8), DelayedScaling(fp8_format=Format.HYBRID),
    Float8CurrentScaling(fp8_format=Format.HIF8), Float8BlockScaling(), MXFP8BlockScaling(),
], ids=lambda r: f"{type(r).__name__}-{r.fp8_format.name}")
def test_linear_step_has_no_host_sync(recipe):
    # The per-step NaN/Inf report is the one deliberate host read (tested below); off here.
    FP8GlobalStateManager.quantization_state.nonfinite_check = False
    layer = Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    for _ in range(2):  # the second step runs with scales produced by the first update
        with HostSyncCounter() as counter:
            with fp8_autocast(fp8_recipe=recipe):
                y = layer(x)
            y.sum().backward()
        assert counter.total == 0, dict(counter.counts)


def test_nonfinite_check_is_one_host_read_per_step():
    layers = [Linear(64, 64) for _ in range(3)]
    x = torch.randn(32, 64, requires_grad=True)
    for _ in range(2):
        with HostSyncCounter() as counter:
            with fp8_autocast(fp8_recipe=DelayedScaling()):
                y = layers[2](layers[1](layers[0](x)))
            y.sum().backward()
    assert dict(counter.counts) == {"tolist": 1}
