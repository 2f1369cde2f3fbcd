"""What every FP8 module shares: recipe states that follow the active recipe, registration for the
once-per-step amax reduction, and the module's FP8 metadata, TransformerEngine's `fp8_meta` dict, saved in
`_extra_state`."""
from __future__ import annotations

import io
import warnings
from typing import Any, Callable, ClassVar, Iterable, Literal, Optional, Union

import torch

from mindspeed_te.ops.wgrad_store import WeightGradStore
from mindspeed_te.quantized_tensor import QuantizedTensor, dequantize_if_quantized
from mindspeed_te.quantizers import Quantizer
from mindspeed_te.recipe import Recipe, recipe_from_config, recipe_to_config
from mindspeed_te.recipe_state import BACKWARD_ROLES, FORWARD_ROLES, DelayedScalingRecipeState, RecipeState
from mindspeed_te.scaling import current_scale, tensor_amax
from mindspeed_te.state import FP8GlobalStateManager, preserve_high_precision_init_val
from mindspeed_te.te_extra_state import (
    ExtraStateRefused,
    check_fp8_meta,
    encode_te_extra_state,
    is_te_payload,
    load_extra_state_payload,
    resolve_extra_state_format,
    te_no_state,
    te_payload_to_meta,
)

InitMethod = Optional[Callable[[torch.Tensor], object]]


EXTRA_STATE_VERSION = 2  # 2: slots in the module's fp8_meta_layout, the recipe stored; 1: per GEMM, no recipe
# (TransformerEngine's entries are read as version 1, with their recipe: TE keeps slots per GEMM)
# extra-state entry -> (forward?, dim along which its slots run)
EXTRA_STATE_SLOTS = {"fwd_amax_history": (True, 1), "fwd_scale": (True, 0),
                     "bwd_amax_history": (False, 1), "bwd_scale": (False, 0)}


class FP8ModuleBase(torch.nn.Module):
    """Base of the TE-style modules. A module running `num_gemms` GEMMs owns one forward state
    (3 quantizers per GEMM: input, weight, output) and one backward state (grad_output, grad_input).

    They live in `fp8_meta`, TransformerEngine's dict of a module's FP8 metadata, so code written for TE
    reads and writes the very objects the forward quantizes with: "scaling_fwd" / "scaling_bwd" (the
    RecipeStates; delayed scaling's `amax_history` [L, n] and `scale` [n]), "recipe", "num_gemms",
    "fp8_max_fwd" / "fp8_max_bwd", "fp8_group" and "fp8_checkpoint". As in TE the states appear at the first
    FP8 (or calibration) forward, under fp8_model_init, or when a checkpoint's FP8 metadata is loaded.
    `fp8_meta_index(role, gemm)` says where a tensor's slot is."""

    # TransformerEngine's slot layouts: "per_gemm" puts GEMM g's input, weight, output at 3g, 3g+1, 3g+2 and
    # its grad_output, grad_input at 2g, 2g+1; "per_role" (TE's GroupedLinear before TE 2.3, and what
    # megatron-core 0.16.1's grouped-expert checkpoint conversion expects) puts all inputs first, then all
    # weights, then all outputs (grad_outputs, then grad_inputs).
    fp8_meta_layout: ClassVar[Literal["per_gemm", "per_role"]] = "per_gemm"

    def __init__(self, num_gemms: int = 1, extra_state_format: Optional[str] = None) -> None:
        super().__init__()
        self.num_gemms = num_gemms
        # "mindspeed_te" (this plugin's entry), "te" (TransformerEngine's), None: MINDSPEED_TE_EXTRA_STATE_FORMAT
        self.extra_state_format = extra_state_format
        if extra_state_format is not None:
            resolve_extra_state_format(extra_state_format)
        self.fp8_meta: dict[str, Any] = {"fp8_checkpoint": False, "fp8_group": None}
        self._keyed_recipe: Optional[Recipe] = None  # fp8_meta["recipe"] whose key() is cached below
        self._keyed_recipe_key: Optional[str] = None
        self._loaded_fp8_meta: Optional[dict[str, Any]] = None  # from a checkpoint, applied to matching states
        self._fp8_meta_from_checkpoint = False  # states made by a load, not yet used by a forward
        self.wgrad_store = WeightGradStore(False)
        self.wgrad_accumulation_and_reduce_hooks: list[Callable[[], None]] = []
        self._wgrad_computations_per_backward = 1

    # Delayed weight gradients (TE's delay_wgrad_compute, for Megatron's 1F1B overlap) -----------------------
    def init_wgrad_store(self, delay_wgrad_compute: bool, params: Iterable[torch.nn.Parameter],
                         computations_per_backward: int = 1) -> None:
        """Set up delayed wgrad compute for the linear `params` (weights and biases). As in TE they are marked
        `skip_backward_post_hook`: Megatron's DDP then registers its gradient hooks through
        `register_wgrad_accumulation_and_reduce_hooks`, to run at the end of `backward_dw()`."""
        self.wgrad_store = WeightGradStore(delay_wgrad_compute)
        self._wgrad_computations_per_backward = computations_per_backward
        if delay_wgrad_compute:
            for param in params:
                if param is not None:
                    param.skip_backward_post_hook = True

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        """A callable run at the end of every `backward_dw()` (Megatron's gradient accumulate/reduce hook)."""
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def need_backward_dw(self) -> bool:
        return self.wgrad_store.delay_wgrad_compute()

    def backward_dw(self) -> None:
        """Run the weight-gradient GEMMs the last backward of this module left for later (a no-op unless built
        with delay_wgrad_compute=True). Gradients land where the backward would have put them: added to
        `.grad`, or into `main_grad` with fused accumulation; then the registered hooks run."""
        if not self.need_backward_dw():
            return
        for _ in range(self._wgrad_computations_per_backward):
            for param, grad in self.wgrad_store.pop():
                if grad is not None:
                    param.grad = grad if param.grad is None else param.grad + grad
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()

    @property
    def fp8_states(self) -> Optional[tuple[RecipeState, RecipeState]]:
        """(fp8_meta["scaling_fwd"], fp8_meta["scaling_bwd"]), or None before they exist."""
        fwd, bwd = self.fp8_meta.get("scaling_fwd"), self.fp8_meta.get("scaling_bwd")
        return None if fwd is None or bwd is None else (fwd, bwd)

    @property
    def _fp8_recipe_key(self) -> Optional[str]:
        """key() of fp8_meta["recipe"] as it was when that recipe object was put there (once per object)."""
        recipe = self.fp8_meta.get("recipe")
        if recipe is not self._keyed_recipe:
            self._keyed_recipe, self._keyed_recipe_key = recipe, None if recipe is None else recipe.key()
        return self._keyed_recipe_key

    def fp8_meta_index(self, role: str, gemm: int = 0) -> int:
        """Slot of GEMM `gemm`'s tensor `role` ("input", "weight", "output" in fp8_meta["scaling_fwd"];
        "grad_output", "grad_input" in fp8_meta["scaling_bwd"]), in this module's `fp8_meta_layout`."""
        roles = FORWARD_ROLES if role in FORWARD_ROLES else BACKWARD_ROLES
        if role not in roles:
            raise ValueError(f"role must be one of {FORWARD_ROLES + BACKWARD_ROLES}, got {role!r}")
        if not 0 <= gemm < self.num_gemms:
            raise ValueError(f"gemm must be in [0, {self.num_gemms}) (num_gemms), got {gemm}")
        if self.fp8_meta_layout == "per_role":
            return roles.index(role) * self.num_gemms + gemm
        return len(roles) * gemm + roles.index(role)

    def per_gemm_order(self, forward: bool) -> list[int]:
        """For each slot of this module's layout, the slot of the same tensor in the "per_gemm" layout: a
        per-GEMM-ordered tensor indexed by it (`index_select`) is in this module's layout."""
        roles = FORWARD_ROLES if forward else BACKWARD_ROLES
        order = [0] * (len(roles) * self.num_gemms)
        for gemm in range(self.num_gemms):
            for position, role in enumerate(roles):
                order[self.fp8_meta_index(role, gemm)] = len(roles) * gemm + position
        return order

    def _states_for_current_recipe(self, device: torch.device,
                                   recipe: Optional[Recipe] = None) -> tuple[RecipeState, RecipeState]:
        recipe = recipe or FP8GlobalStateManager.get_fp8_recipe()
        if self.fp8_states is None or self._fp8_recipe_key != recipe.key():
            self._init_fp8_meta_tensors(recipe, device)
        return self.fp8_states

    def _init_fp8_meta_tensors(self, recipe: Recipe, device: torch.device) -> None:
        """New states for `recipe` in fp8_meta (TE's init_fp8_meta_tensors), then any checkpoint metadata
        that waited for them."""
        if self._fp8_meta_from_checkpoint and self.fp8_states is not None:
            warnings.warn(f"{type(self).__name__}: checkpoint FP8 metadata was made with {self._fp8_recipe_key}, "
                          f"the active recipe is {recipe.key()}; scales start fresh", stacklevel=4)
        self._fp8_meta_from_checkpoint = False
        self.fp8_meta.update(
            scaling_fwd=RecipeState.create(recipe, forward=True, num_quantizers=3 * self.num_gemms, device=device,
                                           roles=self._slot_roles(True)),
            scaling_bwd=RecipeState.create(recipe, forward=False, num_quantizers=2 * self.num_gemms, device=device,
                                           roles=self._slot_roles(False)),
            recipe=recipe, num_gemms=self.num_gemms, fp8_checkpoint=True,
            fp8_max_fwd=recipe.target_max(True), fp8_max_bwd=recipe.target_max(False))
        self._apply_loaded_fp8_meta()
        name = getattr(self, "name", None) or f"{type(self).__name__}@{id(self):x}"
        for state in self.fp8_states:
            FP8GlobalStateManager.watch_nonfinite(name, state)

    def _slot_roles(self, forward: bool) -> list[str]:
        roles = FORWARD_ROLES if forward else BACKWARD_ROLES
        order = self.per_gemm_order(forward)
        return [roles[slot % len(roles)] for slot in order]

    # Weights: created in high precision, or under fp8_model_init only in quantized form --------------------
    def create_weight(self, shape: tuple[int, ...], dtype: torch.dtype, device: Union[torch.device, str, None],
                      init_method: InitMethod, gemm: int = 0) -> torch.nn.Parameter:
        """The weight of GEMM `gemm`, initialized by `init_method` (Kaiming-uniform when None). Under
        `fp8_model_init` it is a QuantizedTensor made by this module's weight quantizer for the init recipe,
        and with `preserve_high_precision_init_val` the exact initial value stays on the CPU."""
        weight = torch.empty(shape, dtype=dtype, device=device)
        initialize_(weight, init_method)
        if not FP8GlobalStateManager.with_fp8_parameters():
            return torch.nn.Parameter(weight)
        param = torch.nn.Parameter(self._quantize_weight(weight, gemm))
        if FP8GlobalStateManager.with_high_precision_init_val():
            preserve_high_precision_init_val(param, weight)
        return param

    def _quantize_weight(self, weight: torch.Tensor, gemm: int) -> QuantizedTensor:
        recipe = FP8GlobalStateManager.get_fp8_model_init_recipe()
        fwd, _ = self._states_for_current_recipe(weight.device, recipe)
        index = self.fp8_meta_index("weight", gemm)
        if isinstance(fwd, DelayedScalingRecipeState):
            # Seed the weight's scale from its initial amax: the first forward then runs on well-scaled codes
            # (TransformerEngine starts from scale 1 and corrects it after the first step).
            margin = 2.0 ** recipe.margin
            fwd.scale[index] = current_scale(tensor_amax(weight).reshape(1), fwd.fp8_max)[0] / margin
        quantizer = fwd.make_quantizers()[index]
        quantizer.set_usage(rowwise=True, columnwise=True)  # fprop reads rowwise, dgrad columnwise
        return QuantizedTensor.from_storage(quantizer.quantize(weight), quantizer)

    def prepare_forward(self, device: torch.device) -> Optional[tuple[list[Quantizer], list[Quantizer], bool]]:
        """Quantizers for this call, or None outside FP8/calibration. Returns (forward quantizers, backward
        quantizers, whether this module is the step's first FP8 module)."""
        if not (FP8GlobalStateManager.is_fp8_enabled() or FP8GlobalStateManager.is_fp8_calibration()):
            return None
        fwd, bwd = self._states_for_current_recipe(device)
        self._fp8_meta_from_checkpoint = False
        phase = FP8GlobalStateManager.get_checkpoint_phase()
        if phase == "recompute":
            # Recompute with the forward scales of the first pass; its amaxes go to a throw-away copy.
            # The first pass's autograd graph runs backward (non-reentrant checkpointing), so the recompute
            # never reduces backward amaxes.
            frozen = FP8GlobalStateManager.pop_forward_state_for_recompute(fwd)
            return frozen.make_quantizers(), bwd.make_quantizers(), False
        group = self.fp8_meta["fp8_group"] = FP8GlobalStateManager.get_fp8_group()
        FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(fwd, group)
        FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(bwd, group)
        first = FP8GlobalStateManager.is_first_fp8_module()
        if phase == "forward":
            FP8GlobalStateManager.stash_forward_state_for_recompute(fwd)
        return fwd.make_quantizers(), bwd.make_quantizers(), first

    @staticmethod
    def calibrate(quantizers: list[Quantizer], *tensors: torch.Tensor) -> None:
        """Calibration (autocast enabled=False, calibrating=True): record delayed-scaling amaxes of the
        high-precision tensors so scales are ready when FP8 is turned on."""
        for quantizer, tensor in zip(quantizers, tensors):
            quantizer.calibrate(dequantize_if_quantized(tensor).detach())

    def has_delayed_state(self) -> bool:
        return self.fp8_states is not None and isinstance(self.fp8_states[0], DelayedScalingRecipeState)

    # Checkpointing: the FP8 metadata travels in the module's `_extra_state` entry ---------------------------
    def _te_grouped(self) -> bool:
        """Whether TransformerEngine keeps this module's slots as its GroupedLinear does (per role before TE 2.3,
        per GEMM since): the modules whose own layout is "per_role"."""
        return self.fp8_meta_layout == "per_role"

    def get_extra_state(self) -> torch.Tensor:
        """Serialized FP8 metadata (the recipe, amax histories and scales, slots in `fp8_meta_layout`) as a
        uint8 tensor, the form torch.distributed.checkpoint and Megatron's sharded checkpoints carry as an
        opaque object. Metadata loaded but not yet matched to states is saved as it was loaded. With
        `extra_state_format="te"` (or MINDSPEED_TE_EXTRA_STATE_FORMAT=te) it is TransformerEngine's entry."""
        name = type(self).__name__
        if resolve_extra_state_format(getattr(self, "extra_state_format", None), f"{name}.extra_state_format") == "te":
            return self._te_extra_state()
        if self.fp8_states is None and self._loaded_fp8_meta is not None:
            return encode_extra_state(self._loaded_fp8_meta)
        recipe = self.fp8_meta.get("recipe")
        meta: dict[str, Any] = {"version": EXTRA_STATE_VERSION, "recipe_key": self._fp8_recipe_key,
                                "recipe": None if recipe is None else recipe_to_config(recipe)}
        if self.has_delayed_state():
            fwd, bwd = self.fp8_states
            # Copies: the states' tensors are views into buffers shared with other modules' states.
            meta.update({f"{prefix}_{name}": getattr(state, name).to("cpu", copy=True)
                         for state, prefix in ((fwd, "fwd"), (bwd, "bwd")) for name in ("amax_history", "scale")})
            meta.update({f"{prefix}_steps": state.steps for state, prefix in ((fwd, "fwd"), (bwd, "bwd"))
                         if hasattr(state, "steps")})  # HIF8DelayedScaling: where warm-up and updates stand
        return encode_extra_state(meta)

    def _te_extra_state(self) -> torch.Tensor:
        """TransformerEngine's `_extra_state` for this module (see mindspeed_te/te_extra_state.py)."""
        name = type(self).__name__
        if self.fp8_states is None and self._loaded_fp8_meta is not None:
            meta = self._loaded_fp8_meta
            if meta.get("recipe") is None:
                raise RuntimeError(f"{name}: extra_state_format='te' cannot write the loaded FP8 metadata: its recipe "
                                   "(one with a callable) was not stored; run a forward under it first")
            recipe = recipe_from_config(meta["recipe"])
            tensors = {key: meta[key] for key in EXTRA_STATE_SLOTS if key in meta}
        elif self.fp8_states is not None:
            recipe = self.fp8_meta.get("recipe")
            tensors = {}
            if self.has_delayed_state():
                tensors = {f"{prefix}_{field}": getattr(state, field).to("cpu", copy=True)
                           for state, prefix in zip(self.fp8_states, ("fwd", "bwd"))
                           for field in ("amax_history", "scale")}
        else:
            return te_no_state()
        per_gemm = {}
        for key, value in tensors.items():  # this module's layout -> TE's (per GEMM)
            forward, dim = EXTRA_STATE_SLOTS[key]
            per_gemm[key] = value.index_select(dim, torch.argsort(torch.tensor(self.per_gemm_order(forward))))
        return encode_te_extra_state(recipe, per_gemm, self.num_gemms, name, grouped=self._te_grouped())

    def set_extra_state(self, state: Any) -> None:
        """Load FP8 metadata. As in TE, the checkpoint's recipe and states are in fp8_meta at once, before any
        forward; a recipe with callables (not stored) has its states filled at the first forward under it."""
        name = type(self).__name__
        meta = decode_extra_state(state, name, grouped=self._te_grouped())
        if meta is None:
            warnings.warn(f"{name}: the checkpoint has no FP8 metadata (saved without FP8, or by TransformerEngine "
                          "with a recipe that keeps none); scales start fresh", stacklevel=2)
            return
        if meta["recipe_key"] is None:
            warnings.warn(f"{name}: the checkpoint was saved before this module ran in FP8; scales start fresh",
                          stacklevel=2)
            return
        meta = check_fp8_meta(meta, name)  # non-finite or inconsistent state: an error, or a warned repair
        self._loaded_fp8_meta = self._upgrade_extra_state(meta)
        if meta.get("recipe") is not None:
            recipe = recipe_from_config(meta["recipe"])  # check_fp8_meta read it already
            self._fp8_meta_from_checkpoint = False  # replaced by the checkpoint's, no warning
            device = next((p.device for p in self.parameters()), torch.device("cpu"))
            self._states_for_current_recipe(device, recipe)
            self._fp8_meta_from_checkpoint = True
        if self.fp8_states is not None:
            self._apply_loaded_fp8_meta()

    def _upgrade_extra_state(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Version 1 kept every module's slots GEMM by GEMM; version 2 keeps them in `fp8_meta_layout`."""
        if meta["version"] == EXTRA_STATE_VERSION:
            return meta
        meta = dict(meta, version=EXTRA_STATE_VERSION)
        for key, (forward, dim) in EXTRA_STATE_SLOTS.items():
            order = self.per_gemm_order(forward)
            if key in meta and meta[key].shape[dim] == len(order):
                meta[key] = meta[key].index_select(dim, torch.tensor(order))
        return meta

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """With quantized weights, take the FP8 metadata first (as TransformerEngine does): a weight loaded
        from high-precision values (a distributed checkpoint) is then quantized with its saved scale, which
        gives back its saved codes, not codes under the scale this module was initialised with."""
        key = prefix + "_extra_state"
        if key in state_dict and any(isinstance(p, QuantizedTensor) for p in self.parameters(recurse=False)):
            self.set_extra_state(state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply_loaded_fp8_meta(self) -> None:
        meta, self._loaded_fp8_meta = self._loaded_fp8_meta, None
        if meta is None:
            return
        if meta["recipe_key"] != self._fp8_recipe_key:
            warnings.warn(f"{type(self).__name__}: checkpoint FP8 metadata was made with {meta['recipe_key']}, "
                          f"the active recipe is {self._fp8_recipe_key}; scales start fresh", stacklevel=2)
            return
        if not self.has_delayed_state():
            return
        fwd, bwd = self.fp8_states
        for state, prefix in ((fwd, "fwd"), (bwd, "bwd")):
            history, scale = meta[f"{prefix}_amax_history"], meta[f"{prefix}_scale"]
            if history.shape != state.amax_history.shape or scale.shape != state.scale.shape:
                raise RuntimeError(f"{type(self).__name__}: corrupt _extra_state, {prefix} amax history "
                                   f"{tuple(history.shape)} does not fit {tuple(state.amax_history.shape)}")
            state.amax_history.copy_(history)
            state.scale.copy_(scale)
            if hasattr(state, "steps") and f"{prefix}_steps" in meta:
                state.steps = int(meta[f"{prefix}_steps"])


def encode_extra_state(meta: dict[str, Any]) -> torch.Tensor:
    """FP8 metadata as the uint8 tensor an `_extra_state` entry holds."""
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def decode_extra_state(state: Any, owner: str, grouped: bool = False) -> Optional[dict[str, Any]]:
    """The metadata of an `_extra_state` entry, None for one without FP8 state; a clear error naming `owner` for
    anything unreadable. Reads this plugin's entries and TransformerEngine's (1.x and 2.x, see
    mindspeed_te/te_extra_state.py; `grouped`: the module is a GroupedLinear) without running pickled code."""
    if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
        return None
    if not isinstance(state, (torch.Tensor, io.BytesIO)):
        raise RuntimeError(f"{owner}: _extra_state must be a uint8 tensor or an io.BytesIO, got {type(state).__name__}")
    try:
        raw = state.detach().cpu().numpy().tobytes() if isinstance(state, torch.Tensor) else state.getvalue()
        payload = load_extra_state_payload(raw, owner)
    except ExtraStateRefused:
        raise
    except Exception as err:  # noqa: BLE001  (any decoding failure means the entry is corrupt)
        raise RuntimeError(f"{owner}: corrupt _extra_state in checkpoint, cannot read FP8 metadata ({err})") from err
    if payload is None:
        return None
    if isinstance(payload, dict) and payload.get("version") in (1, EXTRA_STATE_VERSION) and "recipe_key" in payload:
        return payload
    if is_te_payload(payload):
        return te_payload_to_meta(payload, owner, grouped=grouped)
    raise RuntimeError(f"{owner}: corrupt _extra_state in checkpoint, cannot read FP8 metadata (unknown layout: "
                       f"neither this plugin's entry nor TransformerEngine's, a {type(payload).__name__})")


def set_extra_state_format(model: torch.nn.Module, extra_state_format: Optional[str]) -> int:
    """Set `extra_state_format` ("mindspeed_te", "te", or None for MINDSPEED_TE_EXTRA_STATE_FORMAT) on every FP8
    module of `model`, e.g. to save a checkpoint TransformerEngine resumes from; returns how many."""
    if extra_state_format is not None:
        resolve_extra_state_format(extra_state_format)
    modules = [m for m in model.modules() if isinstance(m, FP8ModuleBase)]
    for module in modules:
        module.extra_state_format = extra_state_format
    return len(modules)


@torch.no_grad()
def initialize_(weight: torch.Tensor, init_method: InitMethod) -> None:
    """Initialize a weight in place (through `quantize_` for a quantized one)."""
    target = weight.dequantize() if isinstance(weight, QuantizedTensor) else weight
    if init_method is not None:
        init_method(target)
    else:
        torch.nn.init.kaiming_uniform_(target, a=5**0.5)
    if target is not weight:
        weight.quantize_(target)
