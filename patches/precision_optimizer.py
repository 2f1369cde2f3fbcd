"""Megatron's `--use-precision-aware-optimizer` (`--exp-avg-dtype` / `--exp-avg-sq-dtype` fp32|fp16|bf16|fp8,
`--main-params-dtype` fp32|fp16, `--main-grads-dtype` fp32|bf16) without TransformerEngine: Megatron gets
mindspeed_te's FusedAdam (mindspeed_te/optimizers) wherever it would take TE's.

Where megatron-core 0.16 touches TE's FusedAdam for these options, and what is patched here (only when neither
TE nor Apex is installed, as patches/optimizer.py):
- `OptimizerConfig.__post_init__` imports `transformer_engine.pytorch.optimizers.FusedAdam` and checks that its
  signature has `master_weight_dtype`, `exp_avg_dtype`, `exp_avg_sq_dtype`, `use_decoupled_grad` (a
  RuntimeError without TE); it also keeps `store_param_remainders` only for TE >= 2.1 (`is_te_min_version`,
  which patches/megatron_te.py answers as TE 2.8). While a precision-aware config checks itself, that import
  finds our FusedAdam (a module standing in for TE's, in sys.modules for that call only).
- `megatron.core.optimizer._get_megatron_optimizer_based_on_param_groups` builds `Adam(**kwargs)` from the
  module's `Adam` and passes the precision keywords only when `USING_PYTORCH_OPTIMIZER` is False: for a
  precision-aware config, that call sees `Adam` = our FusedAdam and the flag False (keywords: params, lr,
  weight_decay, betas, eps, adam_w_mode, exp_avg_dtype, exp_avg_sq_dtype; with
  `use_precision_aware_optimizer_no_fp8_or_ds_fp8` also master_weights=True, use_decoupled_grad=True,
  master_weight_dtype; store_param_remainders). Other configs keep torch's AdamW (patches/optimizer.py).
- `DistributedOptimizer.__init__` asserts the optimizer is its module's `Adam`, and `state_dict` /
  `load_state_dict` take the step from the param groups only with `HAVE_APEX_OR_TE` / `USING_TE_OPTIMIZER`:
  around these calls, for our FusedAdam, the module reads as with TE.
- The distributed optimizer's state goes through `get_unscaled_state` / `set_scaled_state` (the `param`
  key is the optimizer's `master_param`, int16 remainders with `store_param_remainders` and bf16) where the
  optimizer holds the master weights. Megatron also hands set_scaled_state the dp_reshardable format's
  `padding` flag, on which TE's FusedAdam fails as ours would: only the states are passed on. Where Megatron
  keeps float32 main parameters itself (FP8 parameters with a recipe other than delayed, --main-params-dtype
  fp32) it copies the raw optimizer states; here they go through `get_unscaled_state` / `set_scaled_state`
  too, so scaled moments are saved as their values.
- FP8 parameters in the other case (delayed scaling or --main-params-dtype fp16: the optimizer would update
  views of the FP8 parameters) are refused, naming the flags.

`--quant-states fp8|hif8|mxfp8` (MindSpeed's name, added here when megatron.training is present) chooses the
format of the moments that `--exp-avg-dtype fp8` / `--exp-avg-sq-dtype fp8` put in 8 bits: FP8 E4M3 with one
scale per tensor (TE's, the default), HiF8 with one scale per tensor, or MXFP8 (E4M3, one E8M0 scale per 32
elements). It is carried on the optimizer config as `quant_states`.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types
from typing import Any, Callable, Iterator

import torch

from mindspeed_te.optimizers import FusedAdam
from mindspeed_te.patches.registry import PatchRegistry, has_module, resolve
from mindspeed_te.quantized_tensor import QuantizedTensor

OPTIMIZER = "megatron.core.optimizer"
DISTRIB = f"{OPTIMIZER}.distrib_optimizer"
CONFIG = f"{OPTIMIZER}.optimizer_config"
TE_OPTIMIZERS = "transformer_engine.pytorch.optimizers"
ARGUMENTS = "megatron.training.arguments"
TRAINING = "megatron.training.training"
# --quant-states value -> the FusedAdam format of an 8-bit moment
# the keys of a parameter's entry in the distributed optimizer's state ("param": the main parameter)
STATES = ("param", "exp_avg", "exp_avg_sq")
QUANT_STATES = {"fp8": "e4m3", "hif8": "hif8", "mxfp8": "mxfp8"}


@contextlib.contextmanager
def module_values(module_name: str, **values: Any) -> Iterator[None]:
    """Set module attributes for the duration of one call, then restore them."""
    module = importlib.import_module(module_name)
    saved = {name: getattr(module, name) for name in values}
    vars(module).update(values)
    try:
        yield
    finally:
        vars(module).update(saved)


@contextlib.contextmanager
def _te_fused_adam_importable() -> Iterator[None]:
    """`from transformer_engine.pytorch.optimizers import FusedAdam` finds ours, for one call: the modules it
    needs are put in sys.modules where absent, and taken out again."""
    from mindspeed_te.patches.megatron_te import TE_API_VERSION

    made = {}
    for name in ("transformer_engine", "transformer_engine.pytorch", TE_OPTIMIZERS):
        module = types.ModuleType(name, "mindspeed_te's stand-in, while Megatron checks its optimizer config")
        module.__path__ = []
        made[name] = module
    made["transformer_engine"].__version__ = TE_API_VERSION
    made[TE_OPTIMIZERS].FusedAdam = FusedAdam
    added = [name for name in made if name not in sys.modules]
    for name in added:
        sys.modules[name] = made[name]
    try:
        yield
    finally:
        for name in added:
            if sys.modules.get(name) is made[name]:
                del sys.modules[name]


def _checked_with_our_fused_adam(post_init: Callable) -> Callable:
    @functools.wraps(post_init)
    def wrapped(self: Any) -> Any:
        if not getattr(self, "use_precision_aware_optimizer", False):
            return post_init(self)
        with _te_fused_adam_importable():
            return post_init(self)
    return wrapped


def _fused_adam_factory(config: Any) -> Callable[..., FusedAdam]:
    """FusedAdam(**Megatron's keywords), the 8-bit moments in the format `config.quant_states` names."""
    quant = getattr(config, "quant_states", None)

    def make(**kwargs: Any) -> FusedAdam:
        if quant is not None:
            for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
                if kwargs.get(key) is torch.uint8:
                    kwargs[key] = QUANT_STATES[quant]
        return FusedAdam(**kwargs)

    return make


def _refuse_fp8_params_in_optimizer(config: Any, param_groups: Any) -> None:
    if not getattr(config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
        return
    for group in param_groups or ():
        params = group["params"] if isinstance(group, dict) else [group]
        if any(isinstance(p, QuantizedTensor) for p in params):
            raise ValueError(
                "--use-precision-aware-optimizer with FP8 parameters (--fp8-param-gather) needs Megatron to keep "
                "float32 main parameters: use --fp8-recipe tensorwise, blockwise or mxfp8 with --main-params-dtype "
                "fp32 (with --fp8-recipe delayed or --main-params-dtype fp16 the optimizer would update views of the "
                "FP8 parameters, which mindspeed_te does not support)")


def _with_fused_adam(build: Callable) -> Callable:
    @functools.wraps(build)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        config = kwargs["config"] if "config" in kwargs else args[0]
        if not getattr(config, "use_precision_aware_optimizer", False) or config.optimizer != "adam" \
                or getattr(config, "optimizer_cpu_offload", False):
            return build(*args, **kwargs)
        _refuse_fp8_params_in_optimizer(config, kwargs["param_groups"] if "param_groups" in kwargs else
                                        (args[2] if len(args) > 2 else None))
        with module_values(OPTIMIZER, Adam=_fused_adam_factory(config), USING_PYTORCH_OPTIMIZER=False):
            return build(*args, **kwargs)
    return wrapped


def _as_with_te(method: Callable) -> Callable:
    """Run a DistributedOptimizer method over our FusedAdam with the module's TE flags up."""

    @functools.wraps(method)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if method.__name__ == "__init__":
            optimizer = kwargs["optimizer"] if "optimizer" in kwargs else (args[0] if args else None)
        else:
            optimizer = getattr(self, "optimizer", None)
        if not isinstance(optimizer, FusedAdam):
            return method(self, *args, **kwargs)
        with module_values(DISTRIB, Adam=FusedAdam, HAVE_APEX_OR_TE=True, USING_TE_OPTIMIZER=True):
            return method(self, *args, **kwargs)
    return wrapped


def _megatron_keeps_main_params(self: Any) -> bool:
    return isinstance(getattr(self, "optimizer", None), FusedAdam) \
        and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8


def _main_param(self: Any, model_param: Any) -> torch.Tensor:
    group_index, group_order = self.model_param_group_index_map[model_param]
    return self.optimizer.param_groups[group_index]["params"][group_order]


def _unscaled_states(get_states: Callable) -> Callable:
    @functools.wraps(get_states)
    def wrapped(self: Any, model_param: Any) -> dict:
        if not _megatron_keeps_main_params(self):
            return get_states(self, model_param)
        main = _main_param(self, model_param)
        return {"param": main, **{name: self.optimizer.get_unscaled_state(main, name)
                                  for name in self.optimizer.state[main]}}
    return wrapped


def _scaled_states(set_states: Callable) -> Callable:
    @functools.wraps(set_states)
    def wrapped(self: Any, model_param: Any, tensors: dict) -> Any:
        if not isinstance(getattr(self, "optimizer", None), FusedAdam):
            return set_states(self, model_param, tensors)
        # Megatron hands every key of the loaded bucket entry to set_scaled_state, the dp_reshardable format's
        # `padding` flag included (TE's FusedAdam fails on it too): only the states go on.
        tensors = {name: value for name, value in tensors.items() if name in STATES}
        if not _megatron_keeps_main_params(self):
            return set_states(self, model_param, tensors)
        main = _main_param(self, model_param)
        with torch.no_grad():
            main.copy_(tensors["param"])
        for name, value in tensors.items():
            if name != "param":
                self.optimizer.set_scaled_state(main, name, value.float())
        return None
    return wrapped


def _add_quant_states(add_args: Callable) -> Callable:
    @functools.wraps(add_args)
    def wrapped(parser: Any) -> Any:
        parser = add_args(parser)
        parser.add_argument("--quant-states", choices=tuple(QUANT_STATES), default=None,
                            help="mindspeed_te: the format of the optimizer moments that --exp-avg-dtype fp8 / "
                                 "--exp-avg-sq-dtype fp8 keep in 8 bits: fp8 (E4M3, one scale per tensor, as "
                                 "TransformerEngine), hif8 (HiF8, one scale per tensor) or mxfp8 (E4M3, one E8M0 "
                                 "scale per 32 elements). Needs --use-precision-aware-optimizer.")
        return parser
    return wrapped


def _config_with_quant_states(get_config: Callable) -> Callable:
    @functools.wraps(get_config)
    def wrapped(args: Any, *rest: Any, **kwargs: Any) -> Any:
        result = get_config(args, *rest, **kwargs)
        quant = getattr(args, "quant_states", None)
        if quant is None:
            return result
        if not getattr(args, "use_precision_aware_optimizer", False) or torch.uint8 not in (
                getattr(args, "exp_avg_dtype", None), getattr(args, "exp_avg_sq_dtype", None)):
            raise ValueError(f"--quant-states {quant} needs --use-precision-aware-optimizer and --exp-avg-dtype fp8 "
                             "and/or --exp-avg-sq-dtype fp8 (the moments it stores)")
        config = result[0] if isinstance(result, tuple) else result
        config.quant_states = quant
        return result
    return wrapped


def wrap_patch(registry: PatchRegistry, target: str, wrap: Callable) -> None:
    """Register wrap(current): around the replacement another patch of this registry already holds, if any."""
    existing = next((patch for patch in registry.patches if patch.target == target), None)
    if existing is None:
        registry.register(target, wrap(resolve(target)))
    else:
        registry.register(target, wrap(existing.replacement), force=True)


def register_precision_optimizer(registry: PatchRegistry) -> None:
    """Serve --use-precision-aware-optimizer with our FusedAdam when Megatron has neither TE nor Apex (call after
    patches/optimizer.py's registrations, whose distributed-optimizer wrappers these wrap)."""
    if resolve(f"{DISTRIB}.HAVE_APEX_OR_TE"):
        return
    build = f"{OPTIMIZER}._get_megatron_optimizer_based_on_param_groups"
    if not (hasattr(importlib.import_module(OPTIMIZER), "USING_PYTORCH_OPTIMIZER")
            and hasattr(importlib.import_module(OPTIMIZER), build.rpartition(".")[2])):
        return
    registry.register(build, _with_fused_adam(resolve(build)))
    registry.register(f"{CONFIG}.OptimizerConfig.__post_init__",
                      _checked_with_our_fused_adam(resolve(f"{CONFIG}.OptimizerConfig.__post_init__")))
    for name in ("__init__", "state_dict", "load_state_dict"):
        wrap_patch(registry, f"{DISTRIB}.DistributedOptimizer.{name}", _as_with_te)
    wrap_patch(registry, f"{DISTRIB}.DistributedOptimizer._get_main_param_and_optimizer_states", _unscaled_states)
    wrap_patch(registry, f"{DISTRIB}.DistributedOptimizer._set_main_param_and_optimizer_states", _scaled_states)
    if has_module(ARGUMENTS) and has_module(TRAINING):
        if hasattr(importlib.import_module(ARGUMENTS), "_add_experimental_args") \
                and hasattr(importlib.import_module(TRAINING), "get_megatron_optimizer_config"):
            registry.register(f"{ARGUMENTS}._add_experimental_args",
                              _add_quant_states(resolve(f"{ARGUMENTS}._add_experimental_args")))
            registry.register(f"{TRAINING}.get_megatron_optimizer_config",
                              _config_with_quant_states(resolve(f"{TRAINING}.get_megatron_optimizer_config")))
