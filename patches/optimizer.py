"""Megatron's distributed optimizer over torch's Adam (the optimizer Megatron falls back to without Apex or
TransformerEngine, as on a machine where mindspeed_te stands in for TE) saved and resumed exactly.

Three faults of megatron-core 0.16's `DistributedOptimizer` on that path, fixed here:
- `state_dict()` reads the Adam step from the per-parameter state, which torch creates at the first step, so a
  checkpoint cannot be loaded (nor saved) before one: it fails on `assert len(steps) == 1`. Loading always asks
  for it first. The state is created here as torch's Adam creates it at its first step (step 0, zero moments),
  which leaves the first step's update unchanged.
- `load_state_dict()` loses the step: it gives every parameter's state one shared `step` tensor (torch's Adam
  increments each parameter's step in place, so it would advance once per parameter per iteration), and the
  parameter state loaded after it copies back the step tensors captured when the load was prepared (the
  `dp_reshardable` format keeps `step` as a non-persistent object), so a resumed run restarted Adam's bias
  correction at step 0. Each parameter gets its own step, the checkpoint's, after the load here.
- `load_parameter_state_from_dp_reshardable()` (the format Megatron's training saves by default) copies into
  the main parameters with autograd on; with fp32 model parameters those are views of the parameters, and the
  copy fails ("a view of a leaf Variable that requires grad"). It runs under `torch.no_grad()` here, as its
  `fully_sharded_model_space` counterpart already does.
- megatron-core 0.15's `dp_reshardable` save fails on torch Adam's 0-dim `step` (an assert on its shape): it is
  left out of the saved buckets, as 0.16 does.

One more, on every path: FP8 and FP4 weights (`--fp8-param-gather`) carry a host copy of their high-precision
initial value, from which the optimizer builds its main shards and which it then drops, but only for the weights
whose range meets this rank's shard. The others kept that copy for the whole run; every weight of the
optimizer's buffers drops it once the optimizer is built.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from mindspeed_te.patches.optimizer_offload import register_optimizer_offload
from mindspeed_te.patches.precision_optimizer import register_precision_optimizer
from mindspeed_te.patches.registry import resolve

MODULE = "megatron.core.optimizer.distrib_optimizer"


def _create_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """The per-parameter state torch's Adam/AdamW creates lazily in its first step, created now."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or len(optimizer.state) > 0:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _state_dict_before_first_step(state_dict: Callable) -> Callable:
    @functools.wraps(state_dict)
    def wrapped(self: Any) -> Any:
        _create_adam_state(self.optimizer)
        return state_dict(self)
    return wrapped


def _own_step_per_parameter(load_state_dict: Callable) -> Callable:
    @functools.wraps(load_state_dict)
    def wrapped(self: Any, state_dict: Any) -> Any:
        result = load_state_dict(self, state_dict)
        steps = {group.get("step") for group in state_dict.get("optimizer", {}).get("param_groups", ())}
        if len(steps) == 1 and None not in steps:
            step = float(steps.pop())
            for state in self.optimizer.state.values():
                if "step" in state:
                    state["step"] = torch.tensor(step, dtype=torch.float32)
        return result
    return wrapped


def _without_step(get_states: Callable) -> Callable:
    """megatron-core 0.15's dp_reshardable save takes every optimizer state of a parameter for a slice of its
    bucket, which torch Adam's 0-dim `step` is not (the save asserts on its shape); 0.16 keeps it out of the
    buckets. The step is left out here as there: the load restores it from the param groups (above)."""

    @functools.wraps(get_states)
    def wrapped(self: Any, model_param: Any) -> dict:
        tensors = get_states(self, model_param)
        tensors.pop("step", None)
        return tensors
    return wrapped


def _keeping_step(set_states: Callable) -> Callable:
    """Before 0.15, loading the `fully_sharded_model_space` format copies every state torch Adam holds from the
    checkpoint, which has no `step` (a KeyError): the step is kept as it is here, and the load restores it from
    the param groups (above)."""

    @functools.wraps(set_states)
    def wrapped(self: Any, model_param: Any, tensors: dict) -> Any:
        if "step" not in tensors and not self.config.use_precision_aware_optimizer:
            group_index, group_order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        return set_states(self, model_param, tensors)
    return wrapped


def _dropping_init_values(init: Callable) -> Callable:
    @functools.wraps(init)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        for buffer in self.buffers:
            for param in buffer.params:
                if hasattr(param, "clear_high_precision_init_val"):
                    param.clear_high_precision_init_val()
    return wrapped


def register_optimizer(registry) -> None:
    """Patch the torch-Adam branch of the distributed optimizer when Megatron takes it (no Apex, no TE), and the
    initial values of quantized weights on every branch."""
    registry.register(f"{MODULE}.DistributedOptimizer.__init__",
                      _dropping_init_values(resolve(f"{MODULE}.DistributedOptimizer.__init__")))
    if resolve(f"{MODULE}.HAVE_APEX_OR_TE"):
        return
    optimizer = resolve(f"{MODULE}.DistributedOptimizer")
    if hasattr(optimizer, "load_parameter_state_from_dp_reshardable"):  # the format 0.15 added
        target = f"{MODULE}.DistributedOptimizer.load_parameter_state_from_dp_reshardable"
        registry.register(target, torch.no_grad()(resolve(target)))
        if "'step'" not in inspect.getsource(optimizer.sharded_param_state_dp_reshardable):  # 0.15
            target = f"{MODULE}.DistributedOptimizer._get_main_param_and_optimizer_states"
            registry.register(target, _without_step(resolve(target)))
    for name, wrap in (("state_dict", _state_dict_before_first_step), ("load_state_dict", _own_step_per_parameter),
                       ("_set_main_param_and_optimizer_states", _keeping_step)):
        target = f"{MODULE}.DistributedOptimizer.{name}"
        registry.register(target, wrap(resolve(target)))
    register_precision_optimizer(registry)  # --use-precision-aware-optimizer: our FusedAdam, around the above
    register_optimizer_offload(registry)  # --optimizer-cpu-offload on the training device, around the above
