"""patches/training.py without Megatron: FP8 modules get their model path as name, so the non-finite warning
names the layer (issue 12), and the step boundary reads the step's non-finite reports (issue 30); the
Megatron launch is in tests/test_launch_megatron.py."""
import math

import pytest
import torch

from mindspeed_te import Float8CurrentScaling, FP8GlobalStateManager, fp8_autocast
from mindspeed_te.modules import Linear
from mindspeed_te.patches.training import harvest_at_step_end, name_fp8_modules


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Linear(32, 32), Linear(32, 32, name="kept")])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](self.layers[0](x))


class _Wrapper(torch.nn.Module):  # Megatron's DDP and Float16Module keep the model as `.module`
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def test_fp8_modules_are_named_by_their_path_and_warnings_use_it():
    model = _Wrapper(_Wrapper(_Block()))
    x = torch.randn(16, 32, requires_grad=True)
    with fp8_autocast(fp8_recipe=Float8CurrentScaling()):  # states exist before the names are given
        model(x).sum().backward()
    name_fp8_modules([model])
    assert [m.name for m in model.module.module.layers] == ["layers.0", "kept"]
    bad = x.detach().clone()
    bad[0, 0] = math.nan
    with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        y = model(bad.requires_grad_())
    y.sum().backward()
    with pytest.warns(RuntimeWarning, match=r"entered quantized GEMMs at .*\blayers\.0 input"):
        FP8GlobalStateManager.harvest_nonfinite()


def test_the_step_boundary_harvests_the_reports_of_the_step_it_wraps():
    """train_step's wrapper reads the micro-batches' non-finite checks once train_step returns (where Megatron
    has synchronised the host already), not before: a fault in the second micro-batch is warned then."""
    layer = Linear(32, 32, name="decoder.layers.0.mlp.linear_fc1")
    reports = FP8GlobalStateManager.quantization_state.nonfinite_reports

    def train_step(micro_batches: int) -> str:
        for i in range(micro_batches):
            x = torch.randn(16, 32)
            if i == 1:
                x[3, 3] = math.nan
            with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
                y = layer(x.requires_grad_())
            y.sum().backward()
        assert len(reports) == micro_batches and FP8GlobalStateManager.get_nonfinite_counts()["steps"] == 0
        return "done"

    with pytest.warns(RuntimeWarning, match=r"at decoder\.layers\.0\.mlp\.linear_fc1 input"):
        assert harvest_at_step_end(train_step)(2) == "done"
    assert not reports
    assert FP8GlobalStateManager.get_nonfinite_counts() == {"steps": 1, "decoder.layers.0.mlp.linear_fc1 input": 1}
