"""Scaling recipes with TransformerEngine's names, fields and defaults (plus HiF8 and configurable targets).

A recipe is plain configuration: it says which element formats and which scaling strategy the quantized
GEMMs use. It holds no tensors; quantizers and the state manager turn it into state.
"""
from __future__ import annotations

import dataclasses
import enum
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, NamedTuple, Optional, Union

from mindspeed_te.formats import FP8Dtype
from mindspeed_te.fp4 import FP4Dtype

__all__ = [
    "Format",
    "QParams",
    "MMParams",
    "Recipe",
    "DelayedScaling",
    "HIF8DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "MXFP8BlockScaling",
    "FP4Format",
    "NVFP4BlockScaling",
    "MXFP4BlockScaling",
    "recipe_from_name",
    "recipe_to_config",
    "recipe_from_config",
]


class _FormatHelper(NamedTuple):
    """A Format's value, as in TransformerEngine (`Format.E4M3.value.max_fwd`), plus the element dtypes."""

    fwd: str
    bwd: str
    max_fwd: float
    max_bwd: float


class _FormatLimits:
    """The largest finite values of a format's forward and backward tensors (its value's max_fwd / max_bwd)."""

    value: _FormatHelper

    @property
    def max_fwd(self) -> float:
        return self.value.max_fwd

    @property
    def max_bwd(self) -> float:
        return self.value.max_bwd


class Format(_FormatLimits, enum.Enum):
    """TransformerEngine's recipe.Format, plus HIF8: element dtypes and default target maxima of forward
    tensors (activations, weights) and backward tensors (gradients). HiF8's targets 15 and 224 are the tops
    of its 3- and 2-mantissa-bit ranges (MindSpeed's choice); recipes can override them."""

    E4M3 = _FormatHelper("E4M3", "E4M3", 448.0, 448.0)
    E5M2 = _FormatHelper("E5M2", "E5M2", 57344.0, 57344.0)
    HYBRID = _FormatHelper("E4M3", "E5M2", 448.0, 57344.0)
    HIF8 = _FormatHelper("HIF8", "HIF8", 15.0, 224.0)

    @property
    def fwd_dtype(self) -> FP8Dtype:
        return FP8Dtype[self.value.fwd]

    @property
    def bwd_dtype(self) -> FP8Dtype:
        return FP8Dtype[self.value.bwd]

    @classmethod
    def from_name(cls, name: str) -> Format:
        """Format from Megatron's --fp8-format value (case-insensitive)."""
        key = str(name).strip().upper()
        if key not in cls.__members__:
            allowed = ", ".join(m.lower() for m in cls.__members__)
            raise ValueError(f"fp8 format {name!r} is not supported; allowed: {allowed}")
        return cls[key]


class FP4Format(_FormatLimits, enum.Enum):
    """TransformerEngine's `Format.E2M1` (max 6 forward and backward): the element format of the FP4 recipes.
    It is reached as `Format.E2M1`, TE's spelling, but is not a member of Format, whose members are the FP8
    formats (iterating Format, `Format.from_name` and `--fp8-format` list those only)."""

    E2M1 = _FormatHelper("E2M1", "E2M1", 6.0, 6.0)

    @property
    def fwd_dtype(self) -> FP4Dtype:
        return FP4Dtype[self.value.fwd]

    @property
    def bwd_dtype(self) -> FP4Dtype:
        return FP4Dtype[self.value.bwd]


Format.E2M1 = FP4Format.E2M1  # an attribute of the enum class, not a member


def _format_named(name: str) -> Union[Format, FP4Format]:
    """Format[name], or FP4Format.E2M1 for "E2M1" (a recipe description's format)."""
    return FP4Format[name] if name in FP4Format.__members__ else Format[name]


@dataclass(frozen=True)
class QParams:
    """Quantization parameters of one tensor role (input, weight or gradient). The last three are TE's FP4
    options (the FP4 recipes set them; FP8 recipes ignore them, and the repr shows them only when set, so FP8
    recipe keys are as before): a random Hadamard transform of the columnwise (wgrad) form, stochastic
    rounding, 16x16 2-D block scales."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False

    def __repr__(self) -> str:
        shown = [f.name for f in dataclasses.fields(self)
                 if f.name in ("power_2_scale", "amax_epsilon") or getattr(self, f.name)]
        return "QParams(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in shown) + ")"

    def __post_init__(self) -> None:
        if not isinstance(self.amax_epsilon, (int, float)) or self.amax_epsilon < 0:
            raise ValueError(f"QParams.amax_epsilon must be a number >= 0, got {self.amax_epsilon!r}")


@dataclass(frozen=True)
class MMParams:
    """GEMM parameters; kept for TransformerEngine compatibility (every backend here accumulates in fp32)."""

    use_split_accumulator: bool = True


def _check_format(recipe: Recipe, allowed: tuple[Format, ...]) -> None:
    if not isinstance(recipe.fp8_format, Format):
        raise TypeError(f"{type(recipe).__name__}.fp8_format must be a Format, got {recipe.fp8_format!r}")
    if recipe.fp8_format not in allowed:
        names = ", ".join(f"Format.{f.name}" for f in allowed)
        raise ValueError(
            f"{type(recipe).__name__}.fp8_format={recipe.fp8_format} is not supported; allowed: {names}"
        )


def _check_target(recipe: Recipe, name: str, value: Optional[float], dtype: FP8Dtype) -> None:
    if value is None:
        return
    if not isinstance(value, (int, float)) or not 0 < value <= dtype.max:
        raise ValueError(
            f"{type(recipe).__name__}.{name} must be in (0, {dtype.max}] for {dtype.name}, got {value!r}"
        )


class Recipe:
    """Base class of the recipes. Every recipe has `fp8_format` and the two targets `fwd_target_max` /
    `bwd_target_max`, which override the value a tensor's amax is mapped to (None: the format's default,
    e.g. 448 for E4M3, 15 / 224 for HiF8); they come last so TE's positional order is kept."""

    _ALLOWED_FORMATS: ClassVar[tuple[Format, ...]] = (Format.E4M3, Format.HYBRID, Format.HIF8)
    fp8_format: Format
    override_linear_precision: tuple[bool, bool, bool]
    fwd_target_max: Optional[float]
    bwd_target_max: Optional[float]

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field; raises ValueError/TypeError naming the field. Run at construction and again
        whenever an autocast region or model-init region takes the recipe (fields may change after)."""
        _check_format(self, self._ALLOWED_FORMATS)
        olp = tuple(self.override_linear_precision)
        if len(olp) != 3 or olp[0] or olp[1]:
            raise ValueError(
                f"{type(self).__name__}.override_linear_precision must be (False, False, wgrad_in_high_precision), "
                f"got {self.override_linear_precision!r}: only the weight-gradient GEMM can stay in high precision"
            )
        _check_target(self, "fwd_target_max", self.fwd_target_max, self.fp8_format.fwd_dtype)
        _check_target(self, "bwd_target_max", self.bwd_target_max, self.fp8_format.bwd_dtype)

    def target_max(self, forward: bool) -> float:
        """The value the amax of a forward (activation/weight) or backward (gradient) tensor maps to."""
        override = self.fwd_target_max if forward else self.bwd_target_max
        if override is not None:
            return float(override)
        return self.fp8_format.max_fwd if forward else self.fp8_format.max_bwd

    def fp8_wgrad(self) -> bool:
        """False when the weight-gradient GEMM runs in high precision (Megatron's --no-fp8-wgrad)."""
        return not self.override_linear_precision[2]

    def fp8_dtype(self, forward: bool) -> FP8Dtype:
        """Element format of forward or backward tensors."""
        return self.fp8_format.fwd_dtype if forward else self.fp8_format.bwd_dtype

    # Recipe kind predicates, as in TransformerEngine.
    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        return isinstance(self, Float8CurrentScaling)

    def float8_per_tensor_scaling(self) -> bool:
        return isinstance(self, (DelayedScaling, Float8CurrentScaling))

    def float8_block_scaling(self) -> bool:
        return isinstance(self, Float8BlockScaling)

    def mxfp8(self) -> bool:
        return isinstance(self, MXFP8BlockScaling)

    def nvfp4(self) -> bool:
        return isinstance(self, NVFP4BlockScaling)

    def mxfp4(self) -> bool:
        return isinstance(self, MXFP4BlockScaling)

    def key(self) -> str:
        """A string identifying the recipe's configuration (used for amax-reduction grouping and checkpoints).
        Every FP8 module call asks for it, so it is kept until a field is set again."""
        key = self.__dict__.get("_key")
        if key is None:
            parts = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.init]
            key = self.__dict__["_key"] = f"{type(self).__name__}({', '.join(parts)})"
        return key

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        self.__dict__.pop("_key", None)  # key() is made again from the fields

    def __getstate__(self) -> dict[str, Any]:
        """The fields without the kept key: in another process a callable field's address differs."""
        state = dict(self.__dict__)
        state.pop("_key", None)
        return state

    def portable_key(self) -> str:
        """`key()` with callables named by module and qualified name instead of their address, so equal
        configurations give equal strings in different processes."""
        return re.sub(r"<function (\S+) at 0x[0-9a-f]+>", r"<function \1>", self.key())


@dataclass
class DelayedScaling(Recipe):
    """Scale from the amax history of previous steps; amaxes are reduced across ranks once per step."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[Literal["max", "most_recent"], Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    override_linear_precision: tuple[bool, bool, bool] = (False, False, False)
    fwd_target_max: Optional[float] = None
    bwd_target_max: Optional[float] = None

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.margin, (int, float)) or self.margin < 0:
            raise ValueError(f"DelayedScaling.margin must be a number >= 0, got {self.margin!r}")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(
                f"DelayedScaling.amax_history_len must be an integer >= 1, got {self.amax_history_len!r}"
            )
        if not (callable(self.amax_compute_algo) or self.amax_compute_algo in ("max", "most_recent")):
            raise ValueError(
                "DelayedScaling.amax_compute_algo must be 'max', 'most_recent' or a callable, "
                f"got {self.amax_compute_algo!r}"
            )
        if self.scaling_factor_compute_algo is not None and not callable(self.scaling_factor_compute_algo):
            raise ValueError("DelayedScaling.scaling_factor_compute_algo must be None or a callable")


@dataclass
class HIF8DelayedScaling(DelayedScaling):
    """MindSpeed's `hif8_delayed` recipe (HiF8 delayed tensor scaling, as in Huawei's DeepSeek-V3 HiF8
    pre-training): the first `amax_collect_interval` steps quantize with current scaling while the amax
    history fills; afterwards the delayed scales are used, and the history and scales are updated only
    every `scale_update_interval` steps (the amax of the steps in between is max-accumulated). Per-tensor
    margins are guard bits below HiF8's largest value 2^15: an input/activation amax maps to
    2^(15 - hif8_input_margin), a weight's to 2^(15 - hif8_weight_margin), a gradient's to
    2^(15 - hif8_grad_margin) (16, 8 and 16 with the defaults)."""

    fp8_format: Format = Format.HIF8
    amax_history_len: int = 128
    hif8_input_margin: int = 11
    hif8_weight_margin: int = 12
    hif8_grad_margin: int = 11
    amax_collect_interval: int = 5
    scale_update_interval: int = 10

    _ALLOWED_FORMATS: ClassVar[tuple[Format, ...]] = (Format.HIF8,)

    def validate(self) -> None:
        super().validate()
        name = type(self).__name__
        for field_name in ("hif8_input_margin", "hif8_weight_margin", "hif8_grad_margin"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or not 0 <= value <= 30:
                raise ValueError(f"{name}.{field_name} must be an integer in [0, 30] (guard bits below 2^15), "
                                 f"got {value!r}")
        if not isinstance(self.amax_collect_interval, int) or self.amax_collect_interval < 0:
            raise ValueError(f"{name}.amax_collect_interval must be an integer >= 0, "
                             f"got {self.amax_collect_interval!r}")
        if not isinstance(self.scale_update_interval, int) or self.scale_update_interval < 1:
            raise ValueError(f"{name}.scale_update_interval must be an integer >= 1, "
                             f"got {self.scale_update_interval!r}")
        for field_name in ("margin", "fwd_target_max", "bwd_target_max", "scaling_factor_compute_algo"):
            if getattr(self, field_name) not in (0, None):
                raise ValueError(f"{name}.{field_name} is not used: the per-tensor hif8_*_margin fields set the "
                                 "targets")

    def role_target(self, role: str) -> float:
        """The value the amax of a tensor in `role` (input, weight, output, grad_output, grad_input) maps to."""
        margin = {"input": self.hif8_input_margin, "output": self.hif8_input_margin,
                  "weight": self.hif8_weight_margin}.get(role, self.hif8_grad_margin)
        return 2.0 ** (15 - margin)

    def updates_at(self, step: int) -> bool:
        """Whether the history and scales are updated at the end of step `step` (1-based): every step of the
        warm-up, then every `scale_update_interval` steps."""
        collect = self.amax_collect_interval
        return step <= collect or (step - collect) % self.scale_update_interval == 0


def _power_2_default(env_name: str, default: bool) -> bool:
    return os.getenv(env_name, "1" if default else "0") == "1"


@dataclass
class Float8CurrentScaling(Recipe):
    """Scale every tensor by its own amax at the moment it is quantized ("tensorwise")."""

    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp: QParams = field(
        default_factory=lambda: QParams(_power_2_default("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", False))
    )
    fp8_quant_fwd_weight: QParams = field(
        default_factory=lambda: QParams(_power_2_default("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", False))
    )
    fp8_quant_bwd_grad: QParams = field(
        default_factory=lambda: QParams(_power_2_default("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", False))
    )
    fp8_gemm_fprop: MMParams = field(default_factory=lambda: MMParams(use_split_accumulator=False))
    fp8_gemm_dgrad: MMParams = field(default_factory=MMParams)
    fp8_gemm_wgrad: MMParams = field(default_factory=MMParams)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    override_linear_precision: tuple[bool, bool, bool] = (False, False, False)
    fwd_target_max: Optional[float] = None
    bwd_target_max: Optional[float] = None


_BLOCK_QPARAMS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")


@dataclass
class Float8BlockScaling(Recipe):
    """Scale 1x128 tiles (activations, gradients) and 128x128 tiles (weights).

    A QParams field left out (None) takes the format's default at construction. E4M3 / HYBRID: TE's,
    power-of-2 scales (`NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1` turns them off). HIF8, which TE lacks:
    power_2_scale=False, the rule of the NPU's block kernel (npu_dynamic_block_quant), since no NPU kernel
    makes power-of-2 HiF8 tile scales: a tile's scale_inv is amax / target in one float32 division (the tile's
    amax in float32, the role's target max: 15 forward, 224 backward by default; 1 for an all-zero tile, NaN
    for one holding NaN/Inf, at least 1/FLT_MAX) and its codes are x / scale_inv rounded half away from zero to
    HiF8. The kernel takes the targets 15, 56, 224 and 32768; others get the same rule from torch ops. Pass
    QParams(power_2_scale=True) for power-of-2 HiF8 tiles (the NPU then computes their scales with torch ops).
    """

    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: Optional[QParams] = None
    fp8_quant_fwd_weight: Optional[QParams] = None
    fp8_quant_bwd_grad: Optional[QParams] = None
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = field(default_factory=MMParams)
    fp8_gemm_dgrad: MMParams = field(default_factory=MMParams)
    fp8_gemm_wgrad: MMParams = field(default_factory=MMParams)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    override_linear_precision: tuple[bool, bool, bool] = (False, False, False)
    fwd_target_max: Optional[float] = None
    bwd_target_max: Optional[float] = None

    def __post_init__(self) -> None:
        for name in _BLOCK_QPARAMS:
            if getattr(self, name) is None:
                setattr(self, name, self.default_qparams(self.fp8_format))
        super().__post_init__()

    @staticmethod
    def default_qparams(fp8_format: Format) -> QParams:
        """The QParams a role gets when none is passed: power-of-2 scales (TE's default) except for HiF8."""
        if fp8_format is Format.HIF8:
            return QParams(power_2_scale=False)
        return QParams(not _power_2_default("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", False))

    def validate(self) -> None:
        super().validate()
        for name in _BLOCK_QPARAMS:
            if not isinstance(getattr(self, name), QParams):
                raise TypeError(f"Float8BlockScaling.{name} must be a QParams, got {getattr(self, name)!r}")
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            if getattr(self, name) not in (1, 2):
                raise ValueError(f"Float8BlockScaling.{name} must be 1 (1x128 tiles) or 2 (128x128 tiles)")
        if self.x_block_scaling_dim == 2 and self.w_block_scaling_dim == 2:
            raise ValueError("Float8BlockScaling: x_block_scaling_dim=2 with w_block_scaling_dim=2 is not supported")
        for first, second in (("x", "w"), ("x", "grad"), ("w", "grad")):
            if getattr(self, f"{first}_block_scaling_dim") == 2 and getattr(self, f"{second}_block_scaling_dim") == 2:
                raise ValueError(f"Float8BlockScaling: {first}_block_scaling_dim=2 with {second}_block_scaling_dim=2 "
                                 "is not supported (one operand of every GEMM must use 1x128 tiles)")


@dataclass
class MXFP8BlockScaling(Recipe):
    """Blocks of 32 consecutive elements share one power-of-2 (E8M0) scale.

    `scale_rounding` chooses how the block exponent is found: "ceil" (TransformerEngine's rule,
    2^ceil(log2(amax / fmt_max)), nothing saturates) or "floor" (the OCP MX spec's minimal rule,
    floor(log2(amax)) - emax, with saturation)."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    scale_rounding: Literal["ceil", "floor"] = "ceil"
    override_linear_precision: tuple[bool, bool, bool] = (False, False, False)
    fwd_target_max: Optional[float] = None
    bwd_target_max: Optional[float] = None

    _ALLOWED_FORMATS: ClassVar[tuple[Format, ...]] = (Format.E4M3, Format.HYBRID)

    def validate(self) -> None:
        super().validate()
        if self.fwd_target_max is not None or self.bwd_target_max is not None:
            raise ValueError("MXFP8BlockScaling takes no fwd_target_max/bwd_target_max: E8M0 scales use the format max")
        if self.scale_rounding not in ("ceil", "floor"):
            raise ValueError(
                f"MXFP8BlockScaling.scale_rounding must be 'ceil' or 'floor', got {self.scale_rounding!r}"
            )


def _env_flag(name: str) -> Callable[[], bool]:
    """A default read from the environment at construction ("1": True), as TE's class-level os.getenv reads it
    at import."""
    return lambda: os.getenv(name, "0") == "1"


def _env_text(name: str, default: str) -> Callable[[], str]:
    return lambda: os.getenv(name, default)


_FP4_ROLES = ("fp4_quant_fwd_inp", "fp4_quant_fwd_weight", "fp4_quant_bwd_grad")


class _FP4Recipe(Recipe):
    """What the FP4 recipes share: E2M1 elements (`fp4_format`, TE's `Format.E2M1`), and per role the QParams
    `fp4_quant_fwd_inp` (inputs and outputs), `fp4_quant_fwd_weight`, `fp4_quant_bwd_grad` (gradients), made
    from the fields at construction. As in TE they are plain attributes, which may be replaced afterwards (TE's
    own tests do); they are part of `key()`. `fwd_target_max` / `bwd_target_max` must stay None (the formats
    fix where an amax maps: 6 for E2M1 elements, 448 for NVFP4's E4M3 block scales)."""

    fp4_format: FP4Format
    fp4_quant_fwd_inp: QParams
    fp4_quant_fwd_weight: QParams
    fp4_quant_bwd_grad: QParams

    def _role_qparams(self) -> tuple[QParams, QParams, QParams]:
        raise NotImplementedError

    def __post_init__(self) -> None:
        for name, value in zip(_FP4_ROLES, self._role_qparams()):
            setattr(self, name, value)
        super().__post_init__()

    def qparams_changed(self) -> bool:
        """Whether a role's QParams was replaced after construction (then the fields no longer describe it)."""
        return tuple(getattr(self, name, None) for name in _FP4_ROLES) != self._role_qparams()

    def validate(self) -> None:
        super().validate()
        name = type(self).__name__
        if self.fp4_format is not FP4Format.E2M1:
            raise ValueError(f"{name}.fp4_format must be Format.E2M1, got {self.fp4_format!r}")
        if self.fwd_target_max is not None or self.bwd_target_max is not None:
            raise ValueError(f"{name} takes no fwd_target_max/bwd_target_max: E2M1 (6) and its scale formats fix "
                             "the targets")
        for role in _FP4_ROLES:
            if not isinstance(getattr(self, role, None), QParams):
                raise TypeError(f"{name}.{role} must be a QParams, got {getattr(self, role, None)!r}")

    def key(self) -> str:
        key = self.__dict__.get("_key")
        if key is None:
            roles = ", ".join(f"{role}={getattr(self, role, None)!r}" for role in _FP4_ROLES)
            key = self.__dict__["_key"] = f"{Recipe.key(self)}[{roles}]"
        return key


_NVFP4_4OVER6_SCOPES = ("none", "weights", "activations", "all")
# TE's variables that turn NVFP4's stabilisers off, each on by default: the Hadamard transform, stochastic
# rounding, the 16x16 weight tiles
NVFP4_DISABLE_SWITCHES = ("NVTE_NVFP4_DISABLE_RHT", "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING",
                          "NVTE_NVFP4_DISABLE_2D_QUANTIZATION")


@dataclass
class NVFP4BlockScaling(_FP4Recipe):
    """TransformerEngine's NVFP4 recipe: E2M1 elements, one E4M3 scale per 16 consecutive elements under one
    float32 per-tensor scale from the tensor's amax (the rules in mindspeed_te/fp4.py, bit for bit TE's), both
    layouts quantized from the high-precision tensor. TE's fields, defaults and environment switches (read
    at construction):

    - disable_rht (NVTE_NVFP4_DISABLE_RHT=1): no random Hadamard transform; otherwise the columnwise (wgrad)
      forms of inputs and gradients are transformed in 16-element runs along the token dim before their amax
      and cast (both wgrad operands alike, so the GEMM's product is unchanged);
    - disable_stochastic_rounding (NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=1): gradients round to nearest
      instead of stochastically;
    - disable_2d_quantization (NVTE_NVFP4_DISABLE_2D_QUANTIZATION=1): weights use 1x16 blocks instead of 16x16
      tiles (with tiles the columnwise form is the exact transpose of the rowwise one);
    - row_scaled_activation (NVTE_NVFP4_ROW_SCALED_ACTIVATION), nvfp4_4over6 (NVTE_NVFP4_4OVER6, 'none' |
      'weights' | 'activations' | 'all'), nvfp4_4over6_e4m3_use_256 (NVTE_NVFP4_4OVER6_E4M3_USE_256, default
      'all'), nvfp4_4over6_err_mode (NVTE_NVFP4_4OVER6_ERR_MODE, 'MAE' | 'MSE'), backward_override
      (NVTE_BACKWARD_OVERRIDE, None | 'high_precision' | 'dequantized'): TE 2.16+'s options; only their
      defaults are implemented here, another value is refused naming the field;
    - fp4_format (Format.E2M1 only), fp8_format (Format.E4M3 only: the block scales' format), fp8_dpa, fp8_mha.

    Then ours: override_linear_precision (only the wgrad GEMM may stay in high precision), fwd_target_max /
    bwd_target_max (None only). The per-role QParams (TE's): fp4_quant_fwd_inp = QParams(random_hadamard_
    transform=not disable_rht), fp4_quant_fwd_weight = QParams(fp4_2d_quantization=not disable_2d_quantization),
    fp4_quant_bwd_grad = QParams(random_hadamard_transform=not disable_rht, stochastic_rounding=not
    disable_stochastic_rounding); power_2_scale and amax_epsilon are ignored, as in TE. Tensors need both dims
    of their 2-D form divisible by 16.
    """

    disable_rht: bool = field(default_factory=_env_flag("NVTE_NVFP4_DISABLE_RHT"))
    disable_stochastic_rounding: bool = field(default_factory=_env_flag("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING"))
    disable_2d_quantization: bool = field(default_factory=_env_flag("NVTE_NVFP4_DISABLE_2D_QUANTIZATION"))
    row_scaled_activation: bool = field(default_factory=_env_flag("NVTE_NVFP4_ROW_SCALED_ACTIVATION"))
    nvfp4_4over6: str = field(default_factory=_env_text("NVTE_NVFP4_4OVER6", "none"))
    nvfp4_4over6_e4m3_use_256: str = field(default_factory=_env_text("NVTE_NVFP4_4OVER6_E4M3_USE_256", "all"))
    nvfp4_4over6_err_mode: str = field(
        default_factory=lambda: os.getenv("NVTE_NVFP4_4OVER6_ERR_MODE", "MAE").upper())
    fp4_format: FP4Format = FP4Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=lambda: os.getenv("NVTE_BACKWARD_OVERRIDE", None))
    override_linear_precision: tuple[bool, bool, bool] = (False, False, False)
    fwd_target_max: Optional[float] = None
    bwd_target_max: Optional[float] = None

    _ALLOWED_FORMATS: ClassVar[tuple[Format, ...]] = (Format.E4M3,)

    def _role_qparams(self) -> tuple[QParams, QParams, QParams]:
        return (QParams(random_hadamard_transform=not self.disable_rht),
                QParams(fp4_2d_quantization=not self.disable_2d_quantization),
                QParams(random_hadamard_transform=not self.disable_rht,
                        stochastic_rounding=not self.disable_stochastic_rounding))

    def validate(self) -> None:
        super().validate()
        checks = (("nvfp4_4over6", _NVFP4_4OVER6_SCOPES), ("nvfp4_4over6_e4m3_use_256", _NVFP4_4OVER6_SCOPES),
                  ("nvfp4_4over6_err_mode", ("MAE", "MSE")), ("backward_override", (None, "high_precision",
                                                                                     "dequantized")))
        for name, allowed in checks:
            if getattr(self, name) not in allowed:
                raise ValueError(f"NVFP4BlockScaling.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name, default in (("row_scaled_activation", False), ("nvfp4_4over6", "none"), ("backward_override", None)):
            if getattr(self, name) != default:
                raise ValueError(f"NVFP4BlockScaling.{name}={getattr(self, name)!r} is TransformerEngine's but not "
                                 f"implemented here (only {default!r}); unset its environment variable")


@dataclass
class MXFP4BlockScaling(_FP4Recipe):
    """MXFP4 as the Ascend 950 runs it (ours; TE has no MXFP4 recipe): E2M1 elements, one E8M0 (power-of-2)
    scale per 32 consecutive elements, by the OCP MX rule by default: a block's scale is 2^(floor(log2(amax)) -
    2), 2 being E2M1's emax (6 = 1.5 * 2^2), and elements saturate to +-6 (`scale_rounding="ceil"`:
    2^ceil(log2(amax / 6)), nothing saturates). Tensors need both dims of their 2-D form divisible by 32.

    - random_hadamard_transform: the columnwise (wgrad) forms of inputs and gradients are transformed as in
      NVFP4BlockScaling (16-element runs, TE's signs) before their blocks are scaled;
    - stochastic_rounding: gradients round stochastically (TE's rule, mindspeed_te/fp4.py);
    - fp8_activations: weights in MXFP4, inputs and gradients in MXFP8 (fp8_format's forward / backward
      element, E4M3 by default, HYBRID for E5M2 gradients) with the same scale rule: the 950's MXFP8 x MXFP4
      GEMM. The stabilisers act on FP4 tensors only, so they cannot be combined with it.
    - fp4_format (Format.E2M1), fp8_format, fp8_dpa, fp8_mha, override_linear_precision, fwd_target_max /
      bwd_target_max (None only) as in the other recipes.

    Per role: fp4_quant_fwd_inp = QParams(random_hadamard_transform=...), fp4_quant_fwd_weight = QParams(),
    fp4_quant_bwd_grad = QParams(random_hadamard_transform=..., stochastic_rounding=...); MX blocks are 1x32,
    so fp4_2d_quantization is refused.
    """

    fp4_format: FP4Format = FP4Format.E2M1
    fp8_format: Format = Format.E4M3
    scale_rounding: Literal["floor", "ceil"] = "floor"
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp8_activations: bool = False
    fp8_dpa: bool = False
    fp8_mha: bool = False
    override_linear_precision: tuple[bool, bool, bool] = (False, False, False)
    fwd_target_max: Optional[float] = None
    bwd_target_max: Optional[float] = None

    _ALLOWED_FORMATS: ClassVar[tuple[Format, ...]] = (Format.E4M3, Format.HYBRID)

    def _role_qparams(self) -> tuple[QParams, QParams, QParams]:
        return (QParams(random_hadamard_transform=self.random_hadamard_transform), QParams(),
                QParams(random_hadamard_transform=self.random_hadamard_transform,
                        stochastic_rounding=self.stochastic_rounding))

    def validate(self) -> None:
        super().validate()
        if self.scale_rounding not in ("floor", "ceil"):
            raise ValueError(f"MXFP4BlockScaling.scale_rounding must be 'floor' or 'ceil', got {self.scale_rounding!r}")
        for role in _FP4_ROLES:
            if getattr(self, role).fp4_2d_quantization:
                raise ValueError(f"MXFP4BlockScaling.{role}: fp4_2d_quantization is not an MX layout (1x32 blocks)")
        if self.fp8_activations and any(getattr(self, role).random_hadamard_transform
                                        or getattr(self, role).stochastic_rounding for role in _FP4_ROLES):
            raise ValueError("MXFP4BlockScaling.fp8_activations: inputs and gradients are MXFP8, and "
                             "random_hadamard_transform / stochastic_rounding act on FP4 tensors only")


_RECIPE_NAMES = {
    "delayed": DelayedScaling,
    "hif8_delayed": HIF8DelayedScaling,
    "tensorwise": Float8CurrentScaling,
    "blockwise": Float8BlockScaling,
    "mxfp8": MXFP8BlockScaling,
}


def recipe_from_name(name: str, fp8_format: Union[Format, str], **kwargs) -> Recipe:
    """Build a recipe from Megatron's `--fp8-recipe` and `--fp8-format` values."""
    if name not in _RECIPE_NAMES:
        raise ValueError(f"--fp8-recipe {name!r} is not supported; allowed: {', '.join(_RECIPE_NAMES)}")
    fmt = fp8_format if isinstance(fp8_format, Format) else Format.from_name(fp8_format)
    return _RECIPE_NAMES[name](fp8_format=fmt, **kwargs)


_RECIPE_TYPES = {cls.__name__: cls for cls in (*_RECIPE_NAMES.values(), NVFP4BlockScaling, MXFP4BlockScaling)}
_FIELD_TYPES = {cls.__name__: cls for cls in (QParams, MMParams)}


def recipe_to_config(recipe: Recipe) -> Optional[dict]:
    """The recipe as plain values (a checkpoint reads them back without unpickling classes), or None when it
    cannot be rebuilt from them: a callable field, or a recipe class of the caller's own."""
    if _RECIPE_TYPES.get(type(recipe).__name__) is not type(recipe):
        return None
    if isinstance(recipe, _FP4Recipe) and recipe.qparams_changed():
        return None  # a role's QParams replaced after construction: not a field
    fields = {}
    for f in dataclasses.fields(recipe):
        if not f.init:
            continue
        value = getattr(recipe, f.name)
        if isinstance(value, (Format, FP4Format)):
            value = {"Format": value.name}
        elif type(value).__name__ in _FIELD_TYPES:
            value = {type(value).__name__: dataclasses.asdict(value)}
        elif callable(value):
            return None
        fields[f.name] = value
    return {"type": type(recipe).__name__, "fields": fields}


def recipe_from_config(config: dict) -> Recipe:
    """The recipe `recipe_to_config` described; ValueError for a description it did not write."""
    try:
        fields = {}
        for name, value in config["fields"].items():
            if isinstance(value, dict) and "Format" in value:
                value = _format_named(value["Format"])
            elif isinstance(value, dict):
                (kind, params), = value.items()
                value = _FIELD_TYPES[kind](**params)
            fields[name] = value
        return _RECIPE_TYPES[config["type"]](**fields)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ValueError(f"not a recipe description written by recipe_to_config: {config!r} ({err})") from err
