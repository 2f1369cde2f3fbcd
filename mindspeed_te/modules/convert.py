"""Turn FP8 on in an existing torch model: swap its `nn.Linear` layers for `mindspeed_te.Linear`."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from mindspeed_te.modules.linear import Linear

LinearFilter = Callable[[str, torch.nn.Linear], bool]


def convert_linears(model: torch.nn.Module, filter_fn: Optional[LinearFilter] = None) -> torch.nn.Module:
    """Replace (in place) every `nn.Linear` for which `filter_fn(qualified_name, module)` is true (all when
    None) by a `mindspeed_te.Linear` holding the same parameters, and return the model. The new layers
    compute in high precision outside `fp8_autocast` and in FP8 inside it."""
    targets = [
        (name, module) for name, module in model.named_modules()
        if type(module) is torch.nn.Linear and (filter_fn is None or filter_fn(name, module))
    ]
    for name, old in targets:
        new = Linear(old.in_features, old.out_features, bias=old.bias is not None,
                     params_dtype=old.weight.dtype, device=old.weight.device)
        new.weight = old.weight
        if old.bias is not None:
            new.bias = old.bias
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return model
