"""FusedAdam: TransformerEngine's precision-aware Adam (`transformer_engine.pytorch.optimizers.FusedAdam`), with
its constructor keywords, state names, `get_unscaled_state` / `set_scaled_state` / `initialize_state` and
state-dict format, computed with torch's multi-tensor (`torch._foreach_*`) ops.

What Megatron's `--use-precision-aware-optimizer` asks of it: moments stored as float32, bfloat16, float16 or
FP8 (`exp_avg_dtype` / `exp_avg_sq_dtype`; torch.uint8 means FP8 E4M3, as in TE), master weights kept by the
optimizer (`master_weights`, `master_weight_dtype` float32 or float16) for 16-bit parameters that are views
into Megatron's parameter buffer, gradients read from `param.decoupled_grad` (`use_decoupled_grad`), and a
float32 master kept as the bfloat16 parameter plus a 16-bit remainder (`store_param_remainders`). Beyond TE,
the moments also take "hif8" (HiF8 codes, one scale per tensor) and "mxfp8" (E4M3 codes, one E8M0 scale per
32 elements). How each format is stored and scaled: mindspeed_te/optimizers/states.py.

The step, per parameter group: the states are decoded to float32 (nothing to do for float32 states), the Adam
update runs once over the group's lists, and the states are encoded again. The update is 8 foreach ops (weight
decay, lerp, mul, addcmul, sqrt, div, add, addcdiv), the same ops in the same order as torch.optim.AdamW
(torch.optim.Adam with `adam_w_mode=False`), so float32 states give torch's results bit for bit. The
parameter is updated from the float32 moments before they are rounded for storage, as TE's kernels do.
Parameters: float32 ones are updated in place; 16-bit ones from their master (or, without master weights,
from a float32 copy), then rounded back (one foreach copy); quantized ones (mindspeed_te's FP8 parameters,
`fp8_model_init`) need master weights and are quantized again from them with their own quantizer.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable
from copy import deepcopy
from itertools import chain
from typing import Any, Callable, Optional, Union

import torch

from mindspeed_te.optimizers import states
from mindspeed_te.optimizers.states import FORMATS, StateFormat
from mindspeed_te.quantized_tensor import QuantizedTensor

__all__ = ["FusedAdam", "FusedAdamConfigError", "MOMENT_FORMATS", "MASTER_FORMATS"]

STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")
MOMENT_FORMATS = ("fp32", "bf16", "fp16", "e4m3", "hif8", "mxfp8")
MASTER_FORMATS = ("fp32", "fp16")
_16BIT = (torch.float16, torch.bfloat16)

DtypeSpec = Union[torch.dtype, str, StateFormat]


class FusedAdamConfigError(ValueError, RuntimeError):
    """A keyword FusedAdam does not take (a RuntimeError too, as TransformerEngine raises)."""


class FusedAdam(torch.optim.Optimizer):
    """Adam / AdamW over parameter groups with low-precision optimizer states; TransformerEngine's keywords.

    Arguments:
        params: parameters or parameter groups, as for any torch optimizer.
        lr: learning rate (a float, or a tensor with `capturable`).
        betas: the moments' decay rates, each in [0, 1).
        eps: added to the second moment's square root.
        weight_decay: decoupled (AdamW) or L2 (Adam), by `adam_w_mode`.
        amsgrad: refused, as TE refuses it.
        bias_correction: divide the moments by 1 - beta^step.
        adam_w_mode: True for decoupled weight decay (AdamW).
        capturable: lr and step kept as tensors, no host sync in `step`; float32 master weights and both
            moments float32 or both bfloat16.
        master_weights: keep a high-precision copy of each parameter.
        master_weight_dtype: torch.float32 or torch.float16.
        exp_avg_dtype: the first moment's storage: torch.float32 / bfloat16 / float16 / uint8 (FP8 E4M3), or
            the names "fp32", "bf16", "fp16", "fp8" / "e4m3", "hif8", "mxfp8".
        exp_avg_sq_dtype: the second moment's storage, the same choices.
        use_decoupled_grad: read `param.decoupled_grad` instead of `param.grad` (Megatron's precision-aware
            optimizer).
        store_param_remainders: keep a bf16 parameter's float32 master as the parameter plus a 16-bit
            remainder (bf16 parameters with float32 master weights only).
        set_grad_none: deprecated, as in TE.
    """

    def __init__(
        self,
        params: Iterable[Union[torch.nn.Parameter, dict]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        bias_correction: bool = True,
        adam_w_mode: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        master_weight_dtype: DtypeSpec = torch.float32,
        exp_avg_dtype: DtypeSpec = torch.float32,
        exp_avg_sq_dtype: DtypeSpec = torch.float32,
        use_decoupled_grad: bool = False,
        store_param_remainders: bool = False,
        set_grad_none: Optional[bool] = None,
    ) -> None:
        if amsgrad:
            raise FusedAdamConfigError("FusedAdam: amsgrad=True is not supported (the AMSGrad variant; "
                                       "TransformerEngine's FusedAdam refuses it too)")
        _check_number("lr", lr, tensor_ok=True)
        _check_number("eps", eps)
        _check_number("weight_decay", weight_decay)
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2
                and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
            raise FusedAdamConfigError(f"FusedAdam: betas={betas!r} must be two numbers in [0, 1)")
        formats = {
            "exp_avg": _format(exp_avg_dtype, "exp_avg_dtype", MOMENT_FORMATS),
            "exp_avg_sq": _format(exp_avg_sq_dtype, "exp_avg_sq_dtype", MOMENT_FORMATS),
            "master_param": (_format(master_weight_dtype, "master_weight_dtype", MASTER_FORMATS)
                             if master_weights else FORMATS["fp32"]),
        }
        remainders = bool(store_param_remainders and master_weights and formats["master_param"].name == "fp32")
        if capturable:
            moments = (formats["exp_avg"].name, formats["exp_avg_sq"].name)
            if master_weights and formats["master_param"].name != "fp32":
                raise FusedAdamConfigError("FusedAdam: capturable=True needs master_weight_dtype=torch.float32, "
                                           f"got {master_weight_dtype!r}")
            if moments not in (("fp32", "fp32"), ("bf16", "bf16")):
                raise FusedAdamConfigError(
                    "FusedAdam: capturable=True needs exp_avg_dtype and exp_avg_sq_dtype both torch.float32 or "
                    f"both torch.bfloat16, got exp_avg_dtype={exp_avg_dtype!r}, exp_avg_sq_dtype={exp_avg_sq_dtype!r}")
            if remainders:
                raise FusedAdamConfigError("FusedAdam: capturable=True does not work with store_param_remainders=True")
            lr = torch.as_tensor(lr, dtype=torch.float32).reshape(())
        super().__init__(params, {"lr": lr, "bias_correction": bias_correction, "betas": tuple(betas), "eps": eps,
                                  "weight_decay": weight_decay})
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = capturable
        self.master_weights = master_weights
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = remainders
        self.formats = formats
        # TE's attributes: the dtypes as it names them (a format name where TE has no dtype for it)
        self.master_weight_dtype = formats["master_param"].te_dtype
        self.exp_avg_dtype = formats["exp_avg"].te_dtype or formats["exp_avg"].name
        self.exp_avg_sq_dtype = formats["exp_avg_sq"].te_dtype or formats["exp_avg_sq"].name
        self.name_to_dtype_map = {"exp_avg": self.exp_avg_dtype, "exp_avg_sq": self.exp_avg_sq_dtype,
                                  "master_param": self.master_weight_dtype}
        self._scales: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        if capturable:
            for group in self.param_groups:
                if group["params"]:
                    group["lr"] = group["lr"].to(group["params"][0].device)
        self.set_grad_none = set_grad_none
        if set_grad_none is not None:
            warnings.warn("set_grad_none kwarg in FusedAdam constructor is deprecated. Use set_to_none kwarg in "
                          "zero_grad instead.", DeprecationWarning, stacklevel=2)

    # Gradients ------------------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Reset `.grad` (or `.decoupled_grad` with use_decoupled_grad): None by default, else zeros."""
        if self.set_grad_none is not None:
            if set_to_none is not None and set_to_none != self.set_grad_none:
                raise ValueError(f"Called zero_grad with set_to_none={set_to_none}, but FusedAdam was initialized "
                                 f"with set_grad_none={self.set_grad_none}")
            set_to_none = self.set_grad_none
        set_to_none = True if set_to_none is None else set_to_none
        if not self.use_decoupled_grad:
            super().zero_grad(set_to_none=set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.decoupled_grad = None
                elif getattr(p, "decoupled_grad", None) is not None:
                    p.decoupled_grad.zero_()

    def _grad(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        return getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad

    # State ----------------------------------------------------------------------------------------------
    def _uses_remainders(self, p: torch.Tensor) -> bool:
        return self.store_param_remainders and p.dtype == torch.bfloat16 and not isinstance(p, QuantizedTensor)

    def _format(self, p: torch.Tensor, name: str) -> StateFormat:
        """A float32 parameter is its own master (its master_param state is the parameter), whatever
        master_weight_dtype says."""
        if name == "master_param" and _plain_fp32(p):
            return FORMATS["fp32"]
        return self.formats[name]

    def _initialize_state(self, param: torch.Tensor, state_name: str, zero_buffer: bool,
                          store_param_remainders: bool = False) -> None:
        """Create one state of `param` (TE's method): zeros when `zero_buffer` (and for remainders)."""
        fmt = self._format(param, state_name)
        if store_param_remainders and state_name == "master_param":
            data = torch.zeros(param.shape, dtype=torch.int16, device=param.device)
        elif state_name == "master_param" and _plain_fp32(param):
            data = param  # the parameter is the float32 master: one tensor, updated in place
        else:
            make = torch.zeros if zero_buffer else torch.empty
            data = make(param.shape, dtype=fmt.storage, device=param.device)
        self.state[param][state_name] = data
        scale = states.scale_like(fmt, param)
        if scale is not None and data is not param:
            self._scales.setdefault(param, {})[state_name] = scale

    def initialize_state(self, param: torch.Tensor, store_param_remainders: Optional[bool] = None) -> None:
        """Create the moments (zeros) and, with master weights, the master (the parameter's value, or zero
        remainders). Megatron calls it with the parameter alone."""
        if store_param_remainders is None:
            store_param_remainders = self._uses_remainders(param)
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)
        if self.master_weights:
            self._initialize_state(param, "master_param", zero_buffer=False,
                                   store_param_remainders=store_param_remainders)
            if not store_param_remainders:
                value = param.dequantize(dtype=torch.float32) if isinstance(param, QuantizedTensor) else param
                self.set_scaled_state(param, "master_param", value.detach().float().clone())

    def get_unscaled_state(self, param: torch.Tensor, state_name: str, skip_unscale: bool = False) -> torch.Tensor:
        """The state's float32 values (a new tensor, or the state itself when it is float32). A bfloat16 state
        stays bfloat16 with `skip_unscale`; remainders of a bfloat16 parameter's master come as int16."""
        stored = self.state[param][state_name]
        fmt = self._format(param, state_name)
        if stored.dtype == torch.int16 or fmt.name == "fp32" or (fmt.name == "bf16" and skip_unscale):
            return stored
        return states.decode(fmt, [stored], [self._scales[param][state_name]])[0]

    def set_scaled_state(self, param: torch.Tensor, state_name: str, unscaled_state: torch.Tensor) -> None:
        """Store float32 values into a state (created if missing), computing its scale; int16 remainders for the
        master of a bfloat16 parameter with store_param_remainders."""
        if state_name not in STATE_NAMES:
            raise KeyError(f"FusedAdam: no state {state_name!r}; states are {', '.join(STATE_NAMES)}")
        remainders = state_name == "master_param" and self._uses_remainders(param)
        expected = torch.int16 if remainders else torch.float32
        if unscaled_state.dtype != expected:
            raise TypeError(f"FusedAdam.set_scaled_state({state_name!r}) takes a {expected} tensor, got "
                            f"{unscaled_state.dtype}")
        state = self.state[param]
        if state_name not in state:
            self._initialize_state(param, state_name, zero_buffer=False, store_param_remainders=remainders)
        stored = state[state_name]
        fmt = self._format(param, state_name)
        value = unscaled_state.to(stored.device)
        if remainders or fmt.name == "fp32":
            if value.data_ptr() != stored.data_ptr():
                stored.copy_(value.view(stored.shape))
            return
        states.encode(fmt, [value.reshape(stored.shape).clone()], [stored], [self._scales[param][state_name]])

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict with every state as float32 values (int16 remainders stay int16), as TE's."""
        state_dict = super().state_dict()
        for index, param in self._index_to_param(state_dict["param_groups"]).items():
            if index in state_dict["state"]:
                state_dict["state"][index] = {name: self.get_unscaled_state(param, name)
                                              for name in state_dict["state"][index]}
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of float32 values (TE's format, or ours), storing each state in this optimizer's
        formats with new scales."""
        super().load_state_dict(state_dict)
        for index, param in self._index_to_param(deepcopy(state_dict["param_groups"])).items():
            if index not in state_dict["state"]:
                continue
            self.state[param] = {}
            self._scales.pop(param, None)
            for name, value in state_dict["state"][index].items():
                if value is None:
                    continue
                remainders = name == "master_param" and self._uses_remainders(param)
                self.set_scaled_state(param, name, value if remainders else value.float())

    def _index_to_param(self, saved_groups: list[dict]) -> dict[int, torch.Tensor]:
        return dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                        chain.from_iterable(g["params"] for g in self.param_groups)))

    # The step -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, grad_scaler: Any = None) -> Any:
        """One Adam step for every parameter with a gradient. `grad_scaler` is ignored, as TE ignores it
        without capturable; with capturable (TE's CUDA-graph path) it is refused."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scaler is not None and self.capturable:
            raise NotImplementedError("FusedAdam.step(grad_scaler=...) with capturable=True is not supported "
                                      "(unscale the gradients before the step)")
        for group in self.param_groups:
            self._advance(group)
            params, grads = [], []
            for p in group["params"]:
                if len(self.state[p]) == 0:
                    self.initialize_state(p)
                grad = self._grad(p)
                if grad is None or p.numel() == 0:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("FusedAdam does not support sparse gradients")
                if isinstance(p, QuantizedTensor) and not self.master_weights:
                    raise FusedAdamConfigError(f"FusedAdam: quantized parameters ({type(p).__name__}) need "
                                               "master_weights=True")
                if not (p.dtype in _16BIT or _plain_fp32(p) or isinstance(p, QuantizedTensor)):
                    raise RuntimeError(f"FusedAdam only updates float32, float16, bfloat16 and quantized "
                                       f"parameters, got {p.dtype}")
                params.append(p)
                grads.append(grad)
            if params:
                self._update_group(group, params, grads)
        return loss

    def _advance(self, group: dict) -> None:
        """TE's step counter: one per group, advanced also for a group with no parameter on this rank."""
        if self.capturable:
            device = group["params"][0].device if group["params"] else torch.device("cpu")
            if "step" not in group:
                group["step"] = torch.zeros(1, dtype=torch.int32, device=device)
            group["step"] += 1
        else:
            group["step"] = group.get("step", 0) + 1

    def _update_group(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        weights, write_back = self._working_weights(params)
        grads = _as_fp32(grads)
        moments = {}
        for name in ("exp_avg", "exp_avg_sq"):
            stored = [self.state[p][name] for p in params]
            scales = [self._scales.get(p, {}).get(name) for p in params]
            moments[name] = (states.decode(self.formats[name], stored, scales), stored, scales)
        exp_avgs, exp_avg_sqs = moments["exp_avg"][0], moments["exp_avg_sq"][0]
        if self.capturable:
            self._adam_capturable(group, weights, grads, exp_avgs, exp_avg_sqs)
        else:
            self._adam(group, weights, grads, exp_avgs, exp_avg_sqs)
        write_back()
        for name, (values, stored, scales) in moments.items():
            states.encode(self.formats[name], values, stored, scales)

    def _moments(self, group: dict, weights: list, grads: list, exp_avgs: list, exp_avg_sqs: list) -> None:
        """Weight decay (decoupled, or added to the gradient) and the two moments' updates, as torch's Adam(W)
        does them: the part both update paths share."""
        beta1, beta2 = group["betas"]
        lr, weight_decay = group["lr"], group["weight_decay"]
        if weight_decay != 0:
            if self.adam_w_mode:
                torch._foreach_mul_(weights, 1 - lr * weight_decay)
            else:
                grads = torch._foreach_add(grads, weights, alpha=weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)

    def _adam(self, group: dict, weights: list, grads: list, exp_avgs: list, exp_avg_sqs: list) -> None:
        """torch.optim.AdamW's (Adam's, with adam_w_mode=False) multi-tensor update, op for op."""
        beta1, beta2 = group["betas"]
        lr, eps, step = group["lr"], group["eps"], group["step"]
        self._moments(group, weights, grads, exp_avgs, exp_avg_sqs)
        bias_correction1 = 1 - beta1 ** float(step) if group["bias_correction"] else 1.0
        bias_correction2 = 1 - beta2 ** float(step) if group["bias_correction"] else 1.0
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2 ** 0.5)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(weights, exp_avgs, denom, value=-(lr / bias_correction1))

    def _adam_capturable(self, group: dict, weights: list, grads: list, exp_avgs: list, exp_avg_sqs: list) -> None:
        """The same update with lr and step as device tensors (no host sync)."""
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        step = group["step"].float().reshape(())
        self._moments(group, weights, grads, exp_avgs, exp_avg_sqs)
        one = torch.ones_like(step)
        bias_correction1 = 1 - beta1 ** step if group["bias_correction"] else one
        bias_correction2 = 1 - beta2 ** step if group["bias_correction"] else one
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2.sqrt())
        torch._foreach_add_(denom, eps)
        update = torch._foreach_div(exp_avgs, denom)
        torch._foreach_mul_(update, lr / bias_correction1)
        torch._foreach_sub_(weights, update)

    def _working_weights(self, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], Callable[[], None]]:
        """The float32 weights the update runs on (one per parameter, in order) and the function that writes
        them back: float32 parameters are their own working weights; float32 masters are updated in place and
        rounded into their 16-bit parameters; float16 masters and remainders are decoded and encoded again."""
        weights: list[Optional[torch.Tensor]] = [None] * len(params)
        kinds: dict[str, list[int]] = {"fp32": [], "master": [], "master16": [], "remainder": [], "copy": []}
        for i, p in enumerate(params):
            if _plain_fp32(p):
                weights[i] = p
                kinds["fp32"].append(i)
            elif not self.master_weights:
                kinds["copy"].append(i)
            elif self._uses_remainders(p):
                kinds["remainder"].append(i)
            elif self.formats["master_param"].name == "fp32":
                weights[i] = self.state[p]["master_param"]
                kinds["master"].append(i)
            else:
                kinds["master16"].append(i)
        pick = lambda name: [params[i] for i in kinds[name]]  # noqa: E731
        master16 = self.formats["master_param"]
        stored16 = [self.state[p]["master_param"] for p in pick("master16")]
        scales16 = [self._scales[p]["master_param"] for p in pick("master16")]
        remainders = [self.state[p]["master_param"] for p in pick("remainder")]
        for indices, values in ((kinds["copy"], _as_fp32([_value(p) for p in pick("copy")], copy=True)),
                                (kinds["master16"], states.decode(master16, stored16, scales16)),
                                (kinds["remainder"], states.join_remainders(pick("remainder"), remainders))):
            for i, value in zip(indices, values):
                weights[i] = value

        def write_back() -> None:
            for name in ("master", "master16", "copy"):
                targets = [(params[i], weights[i]) for i in kinds[name]]
                plain = [(p, w) for p, w in targets if not isinstance(p, QuantizedTensor)]
                if plain:
                    torch._foreach_copy_([p for p, _ in plain], [w for _, w in plain])
                for p, w in targets:
                    if isinstance(p, QuantizedTensor):
                        p.quantize_(w)
            states.encode(master16, [weights[i] for i in kinds["master16"]], stored16, scales16)
            states.split_remainders([weights[i] for i in kinds["remainder"]], pick("remainder"), remainders)

        return weights, write_back


def _plain_fp32(p: torch.Tensor) -> bool:
    return p.dtype == torch.float32 and not isinstance(p, QuantizedTensor)


def _value(p: torch.Tensor) -> torch.Tensor:
    return p.dequantize(dtype=torch.float32) if isinstance(p, QuantizedTensor) else p


def _as_fp32(tensors: list[torch.Tensor], copy: bool = False) -> list[torch.Tensor]:
    """The tensors as float32: the same tensors where they are float32 (unless `copy`), else new ones filled by
    one foreach copy."""
    out = [t if t.dtype == torch.float32 and not copy else torch.empty_like(t, dtype=torch.float32)
           for t in tensors]
    todo = [(o, t) for o, t in zip(out, tensors) if o is not t]
    if todo:
        torch._foreach_copy_([o for o, _ in todo], [t for _, t in todo])
    return out


def _format(spec: DtypeSpec, keyword: str, allowed: tuple[str, ...]) -> StateFormat:
    try:
        return states.state_format(spec, keyword, allowed)
    except ValueError as error:
        raise FusedAdamConfigError(str(error)) from None


def _check_number(keyword: str, value: Any, tensor_ok: bool = False) -> None:
    if tensor_ok and isinstance(value, torch.Tensor) and value.numel() == 1:
        value = float(value)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise FusedAdamConfigError(f"FusedAdam: {keyword}={value!r} must be a number >= 0")
