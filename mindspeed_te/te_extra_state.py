"""TransformerEngine's `_extra_state` formats: read without running the checkpoint's code, written on request.

TE keeps a module's FP8 metadata in `_extra_state`. TE 2.0 and later: a uint8 tensor holding a pickle; TE 1.x:
an io.BytesIO holding a `torch.save` stream (the pickle in a tensor when exporting to ONNX). Either holds a dict:
"recipe" (TE 2.x: the recipe object, a class of `transformer_engine.common.recipe`), "scale_fwd" [n],
"amax_history_fwd" [L, n], "scale_bwd", "amax_history_bwd" (delayed scaling only; TE 1.x also "scale_inv_fwd" /
"scale_inv_bwd") and "extra_fp8_variables" (fp8_meta's plain values). No FP8 state: a pickled None (TE 1.x,
TE 2.0-2.4) or an empty tensor (TE 2.5 and later; TE 2.18 also for every recipe that keeps no state).

A pickle can run code when it is read, so one is read here by an unpickler that admits only TE's recipe classes
(as plain stand-ins), torch's tensor rebuilding and plain containers, and refuses any other global by name.
Slots: TE keeps a module's tensors GEMM by GEMM ("per_gemm"), except GroupedLinear before TE 2.3 ("per_role");
the metadata returned here is per GEMM, as this plugin's version-1 entries are.
"""
from __future__ import annotations

import copyreg
import io
import os
import pickle
import types
import warnings
from collections import OrderedDict
from typing import Any, ClassVar, Literal, Optional

import torch

from mindspeed_te.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    MXFP8BlockScaling,
    QParams,
    Recipe,
    recipe_from_config,
    recipe_to_config,
)

__all__ = [
    "EXTRA_STATE_FORMATS",
    "EXTRA_STATE_FORMAT_ENV",
    "GROUPED_LAYOUT_ENV",
    "TE_RECIPE_MODULE",
    "ExtraStateRefused",
    "TEObject",
    "check_fp8_meta",
    "encode_te_extra_state",
    "encode_te_payload",
    "is_te_payload",
    "load_extra_state_payload",
    "merge_te_expert_payloads",
    "resolve_extra_state_format",
    "split_te_grouped_payload",
    "te_no_state",
    "te_payload_to_meta",
]

TE_RECIPE_MODULE = "transformer_engine.common.recipe"
EXTRA_STATE_FORMATS = ("mindspeed_te", "te")
# Which format get_extra_state writes when a module's own extra_state_format is None.
EXTRA_STATE_FORMAT_ENV = "MINDSPEED_TE_EXTRA_STATE_FORMAT"
# TE GroupedLinear's slot layout: "per_role" (TE before 2.3) or "per_gemm" (TE 2.3 and later). Writing uses it
# (default per_gemm); reading uses it when the payload cannot tell.
GROUPED_LAYOUT_ENV = "MINDSPEED_TE_GROUPED_EXTRA_STATE_LAYOUT"
SlotLayout = Literal["per_gemm", "per_role"]

# TE's keys -> ours (the names EXTRA_STATE_SLOTS of modules/base.py uses)
TE_DELAYED_KEYS = {"scale_fwd": "fwd_scale", "amax_history_fwd": "fwd_amax_history",
                   "scale_bwd": "bwd_scale", "amax_history_bwd": "bwd_amax_history"}
ROLES_PER_GEMM = {"fwd": 3, "bwd": 2}  # input, weight, output; grad_output, grad_input
# TE's Format values (max_fwd, max_bwd), the same in every TE release that has the member
TE_FORMAT_MAXIMA = {"E2M1": (6, 6), "E4M3": (448, 448), "E5M2": (57344, 57344), "HYBRID": (448, 57344)}


class ExtraStateRefused(RuntimeError):
    """An `_extra_state` pickle names a global the restricted unpickler does not admit; nothing of it ran."""


# Stand-ins for TE's recipe objects ----------------------------------------------------------------------------
class TEObject:
    """An object of TE's recipe module as plain data: its TE class name (`te_name`) and attributes. Unpickling
    makes one without calling anything of TE; pickling one writes TE's global, so TE rebuilds its own class."""

    te_name: ClassVar[str] = "Recipe"

    def __new__(cls, *args: Any, **kwargs: Any) -> TEObject:  # NEWOBJ passes the class's __getnewargs__
        return object.__new__(cls)

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (__dict__, slots) of a class with __slots__
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict) or not all(isinstance(key, str) and not key.startswith("__") for key in state):
            raise pickle.UnpicklingError(f"state of TE's {self.te_name} must be a dict of plain attribute names")
        self.__dict__.update(state)

    def __reduce_ex__(self, protocol: int) -> tuple:
        return copyreg.__newobj__, (type(self),), dict(self.__dict__)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if not k.startswith("_"))
        return f"te.{self.te_name}({fields})"


class TETuple(tuple):
    """A NamedTuple of TE's recipe module (`_FormatHelper`, TE 1.x's `_OverrideLinearPrecision`) as a tuple."""

    __slots__ = ()
    te_name: ClassVar[str] = ""

    def __new__(cls, *values: Any) -> TETuple:
        return tuple.__new__(cls, values)

    def __getnewargs__(self) -> tuple:
        return tuple(self)


def _te_class(name: str, base: type) -> type:
    return type(name, (base,), {"te_name": name, "__te_global__": (TE_RECIPE_MODULE, name), "__module__": __name__,
                                "__qualname__": f"TE{name}"})


TE_RECIPE_CLASSES = ("Recipe", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling",
                     "NVFP4BlockScaling", "CustomRecipe", "MMParams", "QParams")
TE_CLASSES: dict[str, type] = {name: _te_class(name, TEObject) for name in TE_RECIPE_CLASSES}
TE_CLASSES.update({name: _te_class(name, TETuple) for name in ("_FormatHelper", "_OverrideLinearPrecision")})


class TEFormat:
    """A member of TE's recipe.Format. Pickled as TE pickles an Enum member: Format(<its _FormatHelper value>)."""

    def __init__(self, name: str) -> None:
        if name not in TE_FORMAT_MAXIMA:
            raise ValueError(f"TE's Format has no member {name!r}; known: {', '.join(TE_FORMAT_MAXIMA)}")
        self.name = name

    def __reduce__(self) -> tuple:
        return te_format, (TE_CLASSES["_FormatHelper"](*TE_FORMAT_MAXIMA[self.name]),)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TEFormat) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"te.Format.{self.name}"


def te_format(value: Any) -> TEFormat:
    """TE's `Format(value)`: the member whose value (max_fwd, max_bwd) is `value`."""
    try:
        maxima = tuple(float(v) for v in value)
    except (TypeError, ValueError) as err:
        raise pickle.UnpicklingError(f"TE Format value must be (max_fwd, max_bwd), got {value!r}") from err
    for name, known in TE_FORMAT_MAXIMA.items():
        if maxima == tuple(float(v) for v in known):
            return TEFormat(name)
    raise pickle.UnpicklingError(f"TE Format value {value!r} is none of {TE_FORMAT_MAXIMA}")


te_format.__te_global__ = (TE_RECIPE_MODULE, "Format")  # type: ignore[attr-defined]


# The restricted unpickler ---------------------------------------------------------------------------------------
def _rebuild_tensor(storage: Any, storage_offset: int, size: tuple, stride: tuple, requires_grad: bool = False,
                    backward_hooks: Any = None, metadata: Any = None) -> torch.Tensor:
    """torch._utils._rebuild_tensor_v2 for a plain CPU tensor of a storage; no hooks, no autograd."""
    if not isinstance(storage, torch.storage.TypedStorage):
        raise pickle.UnpicklingError(f"a tensor must be rebuilt from a torch storage, got {type(storage).__name__}")
    if backward_hooks:
        raise pickle.UnpicklingError("a tensor in _extra_state must not carry backward hooks")
    if not (isinstance(storage_offset, int) and all(isinstance(v, int) for v in (*size, *stride))):
        raise pickle.UnpicklingError("a tensor's offset, size and stride must be integers")
    return torch._utils._rebuild_tensor(storage, storage_offset, tuple(size), tuple(stride))


def _load_storage_from_bytes(data: Any) -> torch.storage.TypedStorage:
    """torch.storage._load_from_bytes (how a pickled tensor holds its storage), read weights-only onto the CPU."""
    if not isinstance(data, (bytes, bytearray)):
        raise pickle.UnpicklingError(f"a storage must be rebuilt from bytes, got {type(data).__name__}")
    storage = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if not isinstance(storage, torch.storage.TypedStorage):
        raise pickle.UnpicklingError(f"expected a torch storage, got {type(storage).__name__}")
    return storage


ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    **{(TE_RECIPE_MODULE, name): cls for name, cls in TE_CLASSES.items()},
    (TE_RECIPE_MODULE, "Format"): te_format,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch.storage", "_load_from_bytes"): _load_storage_from_bytes,
    ("collections", "OrderedDict"): OrderedDict,
}


def _allowed_global(module: str, name: str) -> Any:
    found = ALLOWED_GLOBALS.get((module, name))
    if found is None and module == "torch" and name.endswith("Storage"):  # storage types: a dtype marker only
        try:
            found = torch.serialization.StorageType(name)
        except (KeyError, AttributeError):
            found = None
    return found


class _RestrictedUnpickler(pickle.Unpickler):
    owner: ClassVar[str] = "module"

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed_global(module, name)
        if found is None:
            raise ExtraStateRefused(
                f"{self.owner}: refusing to read _extra_state: its pickle names the global {module}.{name}, and "
                "unpickling an arbitrary global can run code. Admitted: TransformerEngine's recipe classes and "
                f"Format ({TE_RECIPE_MODULE}), torch's tensor rebuilding (torch._utils._rebuild_tensor_v2, "
                "torch.storage._load_from_bytes, storage types), collections.OrderedDict and plain containers")
        return found


def _restricted_pickle_module(owner: str) -> types.ModuleType:
    """A `pickle_module` for torch.load whose Unpickler is the restricted one (torch's own wrapper subclasses it
    and maps storage types before asking it)."""
    module = types.ModuleType("mindspeed_te_restricted_pickle")
    unpickler = type("Unpickler", (_RestrictedUnpickler,), {"owner": owner})
    module.Unpickler = unpickler  # type: ignore[attr-defined]
    module.load = lambda file, **kwargs: unpickler(file, **kwargs).load()  # type: ignore[attr-defined]
    return module


def load_extra_state_payload(raw: bytes, owner: str) -> Any:
    """The object an `_extra_state` entry holds, read without running its code: a `torch.save` stream (this
    plugin's entries, TE 1.x's io.BytesIO) or a plain pickle (TE 2.x). Raises ExtraStateRefused naming the global
    for a pickle that names anything outside ALLOWED_GLOBALS; other errors for bytes that are neither."""
    if raw[:4] == b"PK\x03\x04" or _is_legacy_torch_save(raw, owner):
        try:
            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            pass  # a global torch's weights-only unpickler does not know (TE's recipe classes): ask ours
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False,
                          pickle_module=_restricted_pickle_module(owner))
    return _restricted_pickle_module(owner).Unpickler(io.BytesIO(raw)).load()


def _is_legacy_torch_save(raw: bytes, owner: str) -> bool:
    """A torch.save stream of before torch 1.6 starts with a pickled magic number."""
    if raw[:2] != b"\x80\x02":
        return False
    try:
        return _restricted_pickle_module(owner).Unpickler(io.BytesIO(raw)).load() == torch.serialization.MAGIC_NUMBER
    except Exception:  # noqa: BLE001  (not a torch.save stream; the caller reads it as a plain pickle)
        return False


def is_te_payload(obj: Any) -> bool:
    """Whether an unpickled `_extra_state` is TE's dict."""
    return isinstance(obj, dict) and ("extra_fp8_variables" in obj or "recipe" in obj
                                      or any(key in obj for key in TE_DELAYED_KEYS))


# TE -> this plugin --------------------------------------------------------------------------------------------
def _our_format(value: Any, default: Format, owner: str) -> Format:
    if value is None:
        return default
    if not isinstance(value, TEFormat):
        raise RuntimeError(f"{owner}: the checkpoint's TE recipe has fp8_format {value!r}, not a TE Format")
    if value.name not in Format.__members__:
        raise RuntimeError(f"{owner}: the checkpoint's TE recipe uses Format.{value.name}, which this plugin does "
                           f"not have (it has {', '.join(m for m in Format.__members__ if m in TE_FORMAT_MAXIMA)})")
    return Format[value.name]


def _qparams(value: Any, default_power_2: Optional[bool]) -> Optional[QParams]:
    if isinstance(value, TEObject) and value.te_name == "QParams":
        return QParams(power_2_scale=bool(value.__dict__.get("power_2_scale", False)),
                       amax_epsilon=float(value.__dict__.get("amax_epsilon", 0.0)))
    return None if default_power_2 is None else QParams(power_2_scale=default_power_2)


def _mmparams(value: Any) -> Optional[MMParams]:
    if isinstance(value, TEObject) and value.te_name == "MMParams":
        return MMParams(use_split_accumulator=bool(value.__dict__.get("use_split_accumulator", True)))
    return None


# TE fields read into ours, fields TE keeps as bookkeeping (dropped silently), and TE-only options (dropped with a
# warning when not at their default, since they change the computation, not the stored state)
_TE_BOOKKEEPING = {"_cached_repr", "interval"}
_TE_ONLY_DEFAULTS = {"backward_override": None}


def recipe_from_te(te_recipe: TEObject, owner: str) -> Optional[Recipe]:
    """This plugin's recipe for a TE recipe object; None for TE recipes that have no counterpart here and keep no
    state (NVFP4BlockScaling, CustomRecipe). Raises RuntimeError naming the field that cannot be carried over."""
    name, fields = te_recipe.te_name, dict(te_recipe.__dict__)
    get = fields.get
    dropped = {key: get(key) for key, default in _TE_ONLY_DEFAULTS.items() if get(key, default) != default}
    if dropped:
        warnings.warn(f"{owner}: the checkpoint's TE {name} sets {dropped}, which this plugin has no counterpart "
                      "for; dropped (the scales and amax histories load as saved)", stacklevel=4)
    common = {"fp8_dpa": bool(get("fp8_dpa", False)), "fp8_mha": bool(get("fp8_mha", False))}
    try:
        if name == "DelayedScaling":
            algo = get("amax_compute_algo", "max")
            if get("scaling_factor_compute_algo") is not None or algo not in ("max", "most_recent"):
                raise ValueError("amax_compute_algo / scaling_factor_compute_algo must be TE's built-in ones")
            olp = get("override_linear_precision")  # TE 1.x
            return DelayedScaling(margin=get("margin", 0), fp8_format=_our_format(get("fp8_format"), Format.HYBRID,
                                                                                 owner),
                                  amax_history_len=get("amax_history_len", 1024), amax_compute_algo=algo,
                                  reduce_amax=bool(get("reduce_amax", True)),
                                  override_linear_precision=tuple(bool(v) for v in olp) if olp else (False,) * 3,
                                  **common)
        if name == "Float8CurrentScaling":
            power_2 = get("use_power_2_scales")  # TE 2.8 and later; before, per-role QParams
            kwargs = {role: _qparams(get(role), None if power_2 is None else bool(power_2))
                      for role in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")}
            kwargs.update({gemm: _mmparams(get(gemm)) for gemm in ("fp8_gemm_fprop", "fp8_gemm_dgrad",
                                                                   "fp8_gemm_wgrad")})
            return Float8CurrentScaling(fp8_format=_our_format(get("fp8_format"), Format.HYBRID, owner),
                                        **{k: v for k, v in kwargs.items() if v is not None}, **common)
        if name == "Float8BlockScaling":
            f32 = get("use_f32_scales")
            kwargs = {role: _qparams(get(role), None if f32 is None else not f32)
                      for role in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")}
            kwargs.update({gemm: _mmparams(get(gemm)) for gemm in ("fp8_gemm_fprop", "fp8_gemm_dgrad",
                                                                   "fp8_gemm_wgrad")})
            kwargs.update({dim: get(dim) for dim in ("x_block_scaling_dim", "w_block_scaling_dim",
                                                     "grad_block_scaling_dim")})
            return Float8BlockScaling(fp8_format=_our_format(get("fp8_format"), Format.E4M3, owner),
                                      **{k: v for k, v in kwargs.items() if v is not None}, **common)
        if name == "MXFP8BlockScaling":
            return MXFP8BlockScaling(margin=get("margin", 0),
                                     fp8_format=_our_format(get("fp8_format"), Format.E4M3, owner), **common)
    except (TypeError, ValueError) as err:
        shown = {k: v for k, v in fields.items() if k not in _TE_BOOKKEEPING}
        raise RuntimeError(f"{owner}: the checkpoint's TE recipe {name}({shown}) has no counterpart here: {err}") \
            from err
    return None


def _format_from_maxima(extra: dict, owner: str) -> Format:
    """TE 1.x stored no recipe; its fp8_meta's fp8_max_fwd / fp8_max_bwd name the format (TE's default HYBRID
    when absent)."""
    maxima = (extra.get("fp8_max_fwd"), extra.get("fp8_max_bwd"))
    if maxima == (None, None):
        return Format.HYBRID
    for name, known in TE_FORMAT_MAXIMA.items():
        if all(isinstance(v, (int, float)) for v in maxima) and tuple(map(float, maxima)) == tuple(map(float, known)):
            return _our_format(TEFormat(name), Format.HYBRID, owner)
    raise RuntimeError(f"{owner}: the checkpoint's fp8_max_fwd / fp8_max_bwd {maxima} match no TE Format "
                       f"({TE_FORMAT_MAXIMA})")


def _float_tensor(payload: dict, key: str, owner: str) -> torch.Tensor:
    value = payload[key]
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise RuntimeError(f"{owner}: the checkpoint's {key} must be a float tensor, got {type(value).__name__}"
                           f"{'' if not isinstance(value, torch.Tensor) else ' of ' + str(value.dtype)}")
    return value.detach().to("cpu", torch.float32, copy=True)


def te_payload_to_meta(payload: dict, owner: str, grouped: bool = False) -> Optional[dict[str, Any]]:
    """This plugin's metadata (version 1: slots per GEMM) for TE's `_extra_state` dict; None when it keeps no
    state here. `grouped`: the loading module is a GroupedLinear, whose TE layout depends on the TE release.
    Raises RuntimeError, naming `owner`, for a payload whose parts contradict each other."""
    extra = payload.get("extra_fp8_variables", {})
    if not isinstance(extra, dict):
        raise RuntimeError(f"{owner}: the checkpoint's extra_fp8_variables must be a dict, got {type(extra).__name__}")
    present = [key for key in TE_DELAYED_KEYS if key in payload]
    te_recipe = payload.get("recipe")
    if "recipe" not in payload:  # TE 1.x: delayed scaling was its only recipe
        if not present:
            return None
        _require_all(present, "TE 1.x delayed scaling", owner)
        rows = payload["amax_history_fwd"].shape[0] if isinstance(payload["amax_history_fwd"], torch.Tensor) else 0
        recipe: Optional[Recipe] = DelayedScaling(fp8_format=_format_from_maxima(extra, owner),
                                                  amax_history_len=max(int(rows), 1))
    elif not isinstance(te_recipe, TEObject):
        raise RuntimeError(f"{owner}: the checkpoint's recipe is {type(te_recipe).__name__}, not a TE recipe")
    else:
        recipe = recipe_from_te(te_recipe, owner)
        if recipe is None:
            if present:
                raise RuntimeError(f"{owner}: the checkpoint holds delayed-scaling scales ({', '.join(present)}) for "
                                   f"the TE recipe {te_recipe.te_name}, which keeps none")
            return None
        if recipe.delayed():
            _require_all(present, f"its TE recipe {te_recipe.te_name}", owner)
        elif present:
            raise RuntimeError(f"{owner}: the checkpoint holds delayed-scaling scales ({', '.join(present)}) but its "
                               f"recipe is TE's {te_recipe.te_name}, a recipe of another kind; it is inconsistent")
    meta: dict[str, Any] = {"version": 1, "recipe_key": recipe.key(), "recipe": recipe_to_config(recipe)}
    if not recipe.delayed():
        return meta
    tensors = {ours: _float_tensor(payload, te_key, owner) for te_key, ours in TE_DELAYED_KEYS.items()}
    gemms = _check_delayed_shapes(tensors, recipe.amax_history_len, owner, "the checkpoint")
    num_gemms = extra.get("num_gemms")
    if isinstance(num_gemms, int) and num_gemms != gemms:
        raise RuntimeError(f"{owner}: the checkpoint's extra_fp8_variables say num_gemms={num_gemms}, its scales "
                           f"hold {gemms} GEMMs' slots")
    if grouped and gemms > 1:
        layout = te_grouped_layout(tensors, owner, te_1x="recipe" not in payload)
        if layout == "per_role":
            tensors = reorder_slots(tensors, "per_role", "per_gemm")
    meta.update(tensors)
    return meta


def _require_all(present: list[str], what: str, owner: str) -> None:
    missing = [key for key in TE_DELAYED_KEYS if key not in present]
    if missing:
        raise RuntimeError(f"{owner}: the checkpoint's delayed-scaling state for {what} lacks {', '.join(missing)} "
                           f"(has {', '.join(present) or 'none of them'}); it is inconsistent")


def _check_delayed_shapes(tensors: dict[str, torch.Tensor], history_len: Optional[int], owner: str,
                          source: str) -> int:
    """Scale [n] and amax history [L, n] per direction, L the recipe's amax_history_len, n = 3 GEMMs forward and 2
    backward; the number of GEMMs."""
    gemms = {}
    for prefix, roles in ROLES_PER_GEMM.items():
        scale, history = tensors[f"{prefix}_scale"], tensors[f"{prefix}_amax_history"]
        if scale.dim() != 1 or history.dim() != 2 or history.shape[1] != scale.shape[0] or scale.shape[0] % roles:
            raise RuntimeError(f"{owner}: {source}'s {prefix} scale {tuple(scale.shape)} and amax history "
                               f"{tuple(history.shape)} must be [n] and [L, n] with n a multiple of {roles}")
        if history_len is not None and history.shape[0] != history_len:
            raise RuntimeError(f"{owner}: {source}'s {prefix} amax history has {history.shape[0]} rows, its recipe "
                               f"says amax_history_len={history_len}; it is inconsistent")
        gemms[prefix] = scale.shape[0] // roles
    if gemms["fwd"] != gemms["bwd"]:
        raise RuntimeError(f"{owner}: {source} holds forward slots of {gemms['fwd']} GEMMs and backward slots of "
                           f"{gemms['bwd']}; it is inconsistent")
    return gemms["fwd"]


def _order(layout_from: SlotLayout, layout_to: SlotLayout, roles: int, gemms: int) -> list[int]:
    """For each slot of `layout_to`, the slot of the same tensor in `layout_from`."""
    def slot(layout: SlotLayout, role: int, gemm: int) -> int:
        return roles * gemm + role if layout == "per_gemm" else role * gemms + gemm

    order = [0] * (roles * gemms)
    for gemm in range(gemms):
        for role in range(roles):
            order[slot(layout_to, role, gemm)] = slot(layout_from, role, gemm)
    return order


def reorder_slots(tensors: dict[str, torch.Tensor], layout_from: SlotLayout,
                  layout_to: SlotLayout) -> dict[str, torch.Tensor]:
    """The delayed-scaling tensors (our keys) with their slots moved from one layout to the other."""
    moved = dict(tensors)
    for prefix, roles in ROLES_PER_GEMM.items():
        for name, dim in (("scale", 0), ("amax_history", 1)):
            key = f"{prefix}_{name}"
            if key in tensors:
                gemms = tensors[key].shape[dim] // roles
                moved[key] = tensors[key].index_select(dim, torch.tensor(_order(layout_from, layout_to, roles, gemms)))
    return moved


def _grouped_layout_env() -> Optional[SlotLayout]:
    value = os.getenv(GROUPED_LAYOUT_ENV)
    if not value:
        return None
    if value not in ("per_role", "per_gemm"):
        raise ValueError(f"{GROUPED_LAYOUT_ENV} must be per_role (TE before 2.3) or per_gemm (TE 2.3 and later), "
                         f"got {value!r}")
    return value  # type: ignore[return-value]


def te_grouped_layout(tensors: dict[str, torch.Tensor], owner: str, te_1x: bool = False) -> SlotLayout:
    """The layout TE's GroupedLinear wrote these slots in. Its output and grad_input slots are never used (their
    amax history stays 0, their scale 1), at the end of each role block before TE 2.3 and last in each GEMM's
    block from 2.3: the layout whose unused slots are idle is the one. GROUPED_LAYOUT_ENV decides when both are
    (or neither is); TE 1.x predates 2.3."""
    if te_1x:
        return "per_role"
    forced = _grouped_layout_env()
    if forced is not None:
        return forced
    gemms = tensors["fwd_scale"].shape[0] // ROLES_PER_GEMM["fwd"]

    def idle(layout: SlotLayout) -> bool:
        for prefix, roles in ROLES_PER_GEMM.items():
            unused = [roles * gemms - gemms + g if layout == "per_role" else roles * g + roles - 1
                      for g in range(gemms)]
            history, scale = tensors[f"{prefix}_amax_history"][:, unused], tensors[f"{prefix}_scale"][unused]
            if bool((history != 0).any()) or bool((scale != 1).any()):
                return False
        return True

    fits = [layout for layout in ("per_role", "per_gemm") if idle(layout)]
    if len(fits) == 1:
        return fits[0]
    as_per_role = reorder_slots(tensors, "per_role", "per_gemm")
    if all(torch.equal(as_per_role[key], tensors[key]) for key in tensors):
        return "per_gemm"  # both readings give the same values
    raise RuntimeError(f"{owner}: cannot tell whether TE before 2.3 (per_role slots) or TE 2.3 and later (per_gemm "
                       f"slots) wrote this GroupedLinear _extra_state ({'both' if fits else 'neither'} layouts' "
                       f"unused output/grad_input slots are idle); set {GROUPED_LAYOUT_ENV}=per_role or per_gemm")


# Checks of loaded metadata (ours or TE's) -----------------------------------------------------------------------
def check_fp8_meta(meta: dict[str, Any], owner: str) -> dict[str, Any]:
    """Loaded delayed-scaling metadata, checked before any of it is used. A scale that is not finite and > 0 is
    an error (no scale can be made up); a non-finite or negative amax in a history is set to 0, the value this
    plugin's update records for a step without a usable amax (a warning names the module); tensors of a recipe
    that keeps none, a delayed recipe without them, or histories whose length is not the recipe's are errors."""
    slots = [key for key in TE_DELAYED_KEYS.values() if key in meta]
    recipe = None
    if meta.get("recipe") is not None:
        try:
            recipe = recipe_from_config(meta["recipe"])
        except ValueError as err:
            raise RuntimeError(f"{owner}: corrupt _extra_state in checkpoint, cannot read its recipe ({err})") from err
        if recipe.delayed() and len(slots) != len(TE_DELAYED_KEYS):
            raise RuntimeError(f"{owner}: the checkpoint's recipe is {type(recipe).__name__} but its _extra_state "
                               f"holds {', '.join(slots) or 'no scales'}; it is inconsistent")
        if not recipe.delayed() and slots:
            raise RuntimeError(f"{owner}: the checkpoint holds delayed-scaling scales but its recipe is "
                               f"{type(recipe).__name__}, a recipe of another kind; it is inconsistent")
    if not slots:
        return meta
    if len(slots) != len(TE_DELAYED_KEYS):
        raise RuntimeError(f"{owner}: the checkpoint's _extra_state holds {', '.join(slots)} only; it is inconsistent")
    meta = dict(meta)
    for key in slots:
        if not isinstance(meta[key], torch.Tensor) or not meta[key].is_floating_point():
            raise RuntimeError(f"{owner}: the checkpoint's {key} must be a float tensor")
    _check_delayed_shapes({key: meta[key] for key in slots}, getattr(recipe, "amax_history_len", None), owner,
                          "the checkpoint")
    for prefix in ROLES_PER_GEMM:
        scale = meta[f"{prefix}_scale"]
        bad = (~torch.isfinite(scale) | (scale <= 0)).nonzero().flatten().tolist()
        if bad:
            raise RuntimeError(f"{owner}: the checkpoint's {prefix} scales at slots {bad} are "
                               f"{scale[bad].tolist()}; a scale must be finite and > 0")
        history = meta[f"{prefix}_amax_history"]
        unusable = ~torch.isfinite(history) | (history < 0)
        if bool(unusable.any()):
            warnings.warn(f"{owner}: the checkpoint's {prefix} amax history has {int(unusable.sum())} non-finite or "
                          "negative entries; they are set to 0 (no amax recorded for that step)", stacklevel=3)
            meta[f"{prefix}_amax_history"] = torch.where(unusable, torch.zeros_like(history), history)
    return meta


# This plugin -> TE ----------------------------------------------------------------------------------------------
def resolve_extra_state_format(value: Optional[str], owner: str = "extra_state_format") -> str:
    """The `_extra_state` format to write: `value`, or EXTRA_STATE_FORMAT_ENV when it is None (default
    "mindspeed_te")."""
    chosen = value if value is not None else (os.getenv(EXTRA_STATE_FORMAT_ENV) or "mindspeed_te")
    if chosen not in EXTRA_STATE_FORMATS:
        source = owner if value is not None else EXTRA_STATE_FORMAT_ENV
        raise ValueError(f"{source} must be one of {', '.join(EXTRA_STATE_FORMATS)}, got {chosen!r}")
    return chosen


def te_no_state() -> torch.Tensor:
    """A module without FP8 state in TE's format: None pickled. Every TE release reads it as "no FP8 state" (TE
    2.18 without its unsafe-pickle opt-in: it names no global), where TE 2.0-2.4 cannot read an empty tensor."""
    return torch.frombuffer(bytearray(pickle.dumps(None, protocol=4)), dtype=torch.uint8)


def _te_number(value: float) -> float:
    return int(value) if float(value).is_integer() else value


def recipe_to_te(recipe: Recipe, owner: str) -> TEObject:
    """TE's DelayedScaling for ours; ValueError naming what TE cannot express (HiF8, targets, callables)."""
    if type(recipe) is not DelayedScaling:
        raise ValueError(f"{owner}: extra_state_format='te' writes delayed-scaling state only for a DelayedScaling "
                         f"recipe TE has; {type(recipe).__name__} is this plugin's own (TE has no HiF8)")
    if recipe.fp8_format.name not in TE_FORMAT_MAXIMA:
        raise ValueError(f"{owner}: extra_state_format='te' needs a format TE has (E4M3, HYBRID), got "
                         f"Format.{recipe.fp8_format.name}")
    if recipe.fwd_target_max is not None or recipe.bwd_target_max is not None:
        raise ValueError(f"{owner}: extra_state_format='te': TE scales to the format's maximum; this recipe's "
                         f"fwd_target_max={recipe.fwd_target_max} / bwd_target_max={recipe.bwd_target_max} scales "
                         "would be wrong there")
    if callable(recipe.amax_compute_algo) or recipe.scaling_factor_compute_algo is not None:
        raise ValueError(f"{owner}: extra_state_format='te' cannot store a callable amax_compute_algo / "
                         "scaling_factor_compute_algo (TE would unpickle code); use 'max' or 'most_recent'")
    if recipe.override_linear_precision[2]:
        warnings.warn(f"{owner}: TE 2.x recipes have no weight-gradient-only high precision "
                      "(override_linear_precision); the TE recipe written leaves it out", stacklevel=4)
    return TE_CLASSES["DelayedScaling"](
        margin=recipe.margin, fp8_format=TEFormat(recipe.fp8_format.name), amax_history_len=recipe.amax_history_len,
        amax_compute_algo=recipe.amax_compute_algo, scaling_factor_compute_algo=None, reduce_amax=recipe.reduce_amax,
        fp8_dpa=recipe.fp8_dpa, fp8_mha=recipe.fp8_mha)


class _TEPickler(pickle._Pickler):  # type: ignore[name-defined]  # the Python pickler: its save_global is ours
    """Writes the stand-ins' TE globals (transformer_engine.common.recipe.<name>) without importing TE."""

    dispatch = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]
    dispatch[types.FunctionType] = lambda self, obj: self.save_global(obj)  # the table holds the base method

    def save_global(self, obj: Any, name: Optional[str] = None) -> None:
        te_global = vars(obj).get("__te_global__") if hasattr(obj, "__dict__") else None
        if te_global is None:
            super().save_global(obj, name)
            return
        module, qualname = te_global
        if self.proto >= 4:
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


def encode_te_extra_state(recipe: Optional[Recipe], tensors: dict[str, torch.Tensor], num_gemms: int, owner: str,
                          grouped: bool = False) -> torch.Tensor:
    """TE's `_extra_state` (TE 2.x's form) for a module running `recipe` with delayed-scaling `tensors` (our keys,
    slots per GEMM): a uint8 tensor holding a pickled dict of TE's DelayedScaling, scale_fwd, amax_history_fwd,
    scale_bwd, amax_history_bwd and extra_fp8_variables. A module without delayed-scaling state: te_no_state()
    (TE keeps nothing for the other recipes either). A grouped module's slots follow GROUPED_LAYOUT_ENV
    (per_gemm, TE 2.3 and later, by default)."""
    if recipe is None or not recipe.delayed():
        return te_no_state()
    te_recipe = recipe_to_te(recipe, owner)
    _check_delayed_shapes(tensors, recipe.amax_history_len, owner, "the module")
    if grouped and _grouped_layout_env() == "per_role":
        tensors = reorder_slots(tensors, "per_gemm", "per_role")
    state: dict[str, Any] = {"recipe": te_recipe}
    state.update({te_key: tensors[ours].detach().to("cpu", torch.float32, copy=True)
                  for te_key, ours in TE_DELAYED_KEYS.items()})
    maxima = TE_FORMAT_MAXIMA[recipe.fp8_format.name]
    state["extra_fp8_variables"] = {"fp8_checkpoint": True, "num_gemms": num_gemms,
                                    "fp8_max_fwd": _te_number(maxima[0]), "fp8_max_bwd": _te_number(maxima[1])}
    return encode_te_payload(state)


def encode_te_payload(state: dict[str, Any]) -> torch.Tensor:
    """A TE `_extra_state` dict (the stand-ins of TE's recipe objects included) as TE 2.x's uint8 tensor."""
    buffer = io.BytesIO()
    _TEPickler(buffer, protocol=4).dump(state)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


# Megatron's per-expert pieces of TE's GroupedLinear entry ---------------------------------------------------------
# megatron-core's TEGroupedLinear (0.16.1 and later) checkpoints TE's GroupedLinear entry per expert: piece i takes,
# of every slot tensor viewed as [roles, num_gemms] along its slot axis, column i (forward slots i, n+i, 2n+i;
# backward i, n+i), and says num_gemms=1; on load it puts the columns back side by side. That is the per-role
# layout's split, whatever layout TE used: under TE before 2.3 piece i is expert i's own entry (what a sequential
# expert's linear keeps); under TE 2.3 and later (per GEMM) it holds slots of several experts, and only the merge
# with as many experts per rank as at the save puts them back where they were.
_TE_SLOT_ROLES = {"scale_fwd": 3, "amax_history_fwd": 3, "scale_inv_fwd": 3,
                  "scale_bwd": 2, "amax_history_bwd": 2, "scale_inv_bwd": 2}  # scale_inv: TE 1.x


def split_te_grouped_payload(payload: dict[str, Any], num_gemms: int, owner: str) -> list[dict[str, Any]]:
    """Megatron's per-expert pieces of TE's GroupedLinear `_extra_state` dict (see above), one per local expert."""
    pieces = []
    for gemm in range(num_gemms):
        piece = {key: value for key, value in payload.items() if key not in _TE_SLOT_ROLES}
        extra = payload.get("extra_fp8_variables")
        if isinstance(extra, dict):
            piece["extra_fp8_variables"] = {**extra, "num_gemms": 1}
        for key, roles in _TE_SLOT_ROLES.items():
            if key in payload:
                value = payload[key]
                if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[-1] != roles * num_gemms:
                    raise RuntimeError(f"{owner}: TE's {key} must have {roles} x {num_gemms} slots along its last "
                                       f"axis, got {getattr(value, 'shape', type(value).__name__)}")
                piece[key] = value.reshape(*value.shape[:-1], roles, num_gemms)[..., gemm].clone()
        pieces.append(piece)
    return pieces


def merge_te_expert_payloads(pieces: list[dict[str, Any]], owner: str) -> dict[str, Any]:
    """TE's GroupedLinear `_extra_state` dict of Megatron's per-expert pieces (see above), as megatron-core's
    TEGroupedLinear merges them: slot r * n + i of the whole is slot r of piece i; the first piece's recipe and
    extra_fp8_variables, with num_gemms=n. Its layout is the writer's: the reader tells it (te_grouped_layout)."""
    merged = {key: value for key, value in pieces[0].items() if key not in _TE_SLOT_ROLES}
    extra = pieces[0].get("extra_fp8_variables")
    if isinstance(extra, dict):
        merged["extra_fp8_variables"] = {**extra, "num_gemms": len(pieces)}
    for key, roles in _TE_SLOT_ROLES.items():
        present = [key in piece for piece in pieces]
        if not any(present):
            continue
        values = [piece.get(key) for piece in pieces]
        if not all(present) or not all(isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[-1] == roles
                                       and v.shape == values[0].shape for v in values):
            raise RuntimeError(f"{owner}: the checkpoint's per-expert {key} entries must each hold {roles} slots of "
                               f"one shape; got {[getattr(v, 'shape', type(v).__name__) for v in values]}")
        stacked = torch.stack(values, dim=-1)  # [..., roles, n]
        merged[key] = stacked.reshape(*stacked.shape[:-2], roles * len(pieces))
    return merged
