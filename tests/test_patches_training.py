"""patches/training.py without Megatron: FP8 modules get their model path as name, so the non-finite warning
names the layer (issue 12); the Megatron launch is in tests/test_launch_megatron.py."""
import math

import pytest
import torch

from mindspeed_te import Float8CurrentScaling, fp8_autocast
from mindspeed_te.modules import Linear
from mindspeed_te.patches.training import name_fp8_modules


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
    with pytest.warns(RuntimeWarning, match=r"entered quantized GEMMs at .*\blayers\.0 input"):
        y.sum().backward()
