"""Checkpoints that cross between TransformerEngine and this plugin: TE's `_extra_state` loads here (safely), ours
is written in TE's format on request, and broken or inconsistent FP8 state is refused or repaired, never used.

The TE payloads are built from facts about TE's get_extra_state / set_extra_state (transformer_engine/pytorch/
module/base.py, TE 1.7-2.18) and its recipe module (transformer_engine/common/recipe), not by running TE: a stand-in
module registered as `transformer_engine.common.recipe` only while a payload is pickled (or unpickled, to see what
TE would get back), so pickle records TE's global names. TE 2.x's recipes are pydantic dataclasses; they pickle as
these stdlib dataclasses do (NEWOBJ of the class, BUILD with the instance __dict__)."""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import os
import pickle
import pickletools
import sys
import types
import warnings
from typing import Any, Callable, Iterator, NamedTuple, Optional, Union

import pytest
import torch

from mindspeed_te import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    FP8GlobalStateManager,
    GroupedLinear,
    HIF8DelayedScaling,
    MXFP8BlockScaling,
    fp8_autocast,
)
from mindspeed_te.modules import LayerNormLinear, LayerNormMLP, Linear
from mindspeed_te.modules.base import FP8ModuleBase, decode_extra_state, set_extra_state_format
from mindspeed_te.te_extra_state import EXTRA_STATE_FORMAT_ENV, GROUPED_LAYOUT_ENV, ExtraStateRefused

TE_RECIPE = "transformer_engine.common.recipe"


# TE's recipe module, as its pickles show it -------------------------------------------------------------------
class _FormatHelper(NamedTuple):
    max_fwd: float
    max_bwd: float


class TEFormat(enum.Enum):  # TE's recipe.Format
    E2M1 = _FormatHelper(max_fwd=6, max_bwd=6)
    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)


@dataclasses.dataclass(frozen=True)
class MMParams:
    use_split_accumulator: bool = True


@dataclasses.dataclass(frozen=True)
class QParams:
    power_2_scale: bool = False
    amax_epsilon: float = 0.0


class Recipe:
    pass


@dataclasses.dataclass
class TEDelayedScaling(Recipe):  # TE 2.2-2.18's fields (2.18 added backward_override)
    margin: int = 0
    fp8_format: TEFormat = TEFormat.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None


@dataclasses.dataclass
class TEFloat8CurrentScaling(Recipe):
    use_power_2_scales: bool = False
    fp8_format: TEFormat = TEFormat.HYBRID
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None


@dataclasses.dataclass
class TEFloat8BlockScaling(Recipe):
    use_f32_scales: bool = False
    fp8_format: TEFormat = TEFormat.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1


@dataclasses.dataclass
class TEMXFP8BlockScaling(Recipe):
    margin: int = 0
    fp8_format: TEFormat = TEFormat.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclasses.dataclass
class TENVFP4BlockScaling(Recipe):
    fp4_format: TEFormat = TEFormat.E2M1
    fp8_format: TEFormat = TEFormat.E4M3


TE_NAMES = {_FormatHelper: "_FormatHelper", TEFormat: "Format", MMParams: "MMParams", QParams: "QParams",
            Recipe: "Recipe", TEDelayedScaling: "DelayedScaling", TEFloat8CurrentScaling: "Float8CurrentScaling",
            TEFloat8BlockScaling: "Float8BlockScaling", TEMXFP8BlockScaling: "MXFP8BlockScaling",
            TENVFP4BlockScaling: "NVFP4BlockScaling"}


@contextlib.contextmanager
def te_installed() -> Iterator[types.ModuleType]:
    """`transformer_engine.common.recipe` in sys.modules (only) while pickling or unpickling TE's objects."""
    names = ("transformer_engine", "transformer_engine.common", TE_RECIPE)
    saved = {name: sys.modules.get(name) for name in names}
    modules = {name: types.ModuleType(name) for name in names}
    for cls, name in TE_NAMES.items():
        cls.__module__, cls.__qualname__ = TE_RECIPE, name
        setattr(modules[TE_RECIPE], name, cls)
    sys.modules.update(modules)
    try:
        yield modules[TE_RECIPE]
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def te2_entry(state: Any) -> torch.Tensor:
    """TE 2.x's get_extra_state: the dict pickled (default protocol) into a uint8 tensor."""
    with te_installed():
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def te1_bytesio(state: Any) -> io.BytesIO:
    """TE 1.x's get_extra_state (outside ONNX export): torch.save into an io.BytesIO."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer


def te_reads(entry: torch.Tensor) -> Any:
    """What TE 2.x's set_extra_state gets from an entry: pickle.loads of its bytes, with TE's classes."""
    with te_installed():
        return pickle.loads(entry.numpy().tobytes())


def te_218_action(data: bytes) -> str:
    """TE 2.18's classification of a pickled `_extra_state` without unpickling it (transformer_engine/pytorch/
    _extra_state.py), re-derived: "ignore" (no state: loaded without NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE) or
    "unsafe_load" (refused unless that opt-in is set). Empty -> ignore. From the opcodes: the strings, whether one
    is "recipe", whether one is a delayed-scaling key, and each global's (module, name) (GLOBAL's argument, or the
    last two strings before STACK_GLOBAL) mapped to its recipe policy. No global and no delayed key -> ignore; no
    "recipe" string (TE 1.x) -> unsafe; a DelayedScaling global or a delayed key -> unsafe; no known recipe
    global -> unsafe; otherwise (stateless recipes only) -> ignore. Undecodable -> unsafe."""
    if not data:
        return "ignore"
    policies = {"DelayedScaling": "stateful", "Float8CurrentScaling": "stateless", "MXFP8BlockScaling": "stateless",
                "Float8BlockScaling": "stateless", "NVFP4BlockScaling": "stateless", "CustomRecipe": "dynamic"}
    delayed = {"scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"}
    strings: list[str] = []
    found, has_global = set(), False
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name in {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "BINUNICODE8",
                               "SHORT_BINUNICODE"}:
                strings.append(arg.decode() if isinstance(arg, bytes) else arg)
            elif opcode.name in ("GLOBAL", "STACK_GLOBAL"):
                has_global = True
                ref = tuple(arg.split()) if opcode.name == "GLOBAL" else tuple(strings[-2:])
                if len(ref) == 2 and ref[0] == TE_RECIPE and ref[1] in policies:
                    found.add(policies[ref[1]])
    except Exception:  # noqa: BLE001
        return "unsafe_load"
    has_delayed = bool(delayed & set(strings))
    if not has_global and not has_delayed:
        return "ignore"
    if "recipe" not in strings or "stateful" in found or has_delayed or not found:
        return "unsafe_load"
    return "ignore"


def delayed_state(gemms: int, rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Distinct positive scales and amax histories (TE's keys), slots per GEMM."""
    g = torch.Generator().manual_seed(seed)
    return {"scale_fwd": torch.rand(3 * gemms, generator=g) + 0.5,
            "amax_history_fwd": torch.rand(rows, 3 * gemms, generator=g) * 4,
            "scale_bwd": torch.rand(2 * gemms, generator=g) + 0.5,
            "amax_history_bwd": torch.rand(rows, 2 * gemms, generator=g) * 4}


def extra(gemms: int, fmt: TEFormat = TEFormat.HYBRID) -> dict[str, Any]:
    return {"fp8_checkpoint": True, "num_gemms": gemms, "fp8_max_fwd": fmt.value.max_fwd,
            "fp8_max_bwd": fmt.value.max_bwd, "autocast_id_fwd_stack": []}


def assert_loaded(module, tensors: dict[str, torch.Tensor]) -> None:
    fwd, bwd = module.fp8_meta["scaling_fwd"], module.fp8_meta["scaling_bwd"]
    assert torch.equal(fwd.scale, tensors["scale_fwd"]) and torch.equal(fwd.amax_history, tensors["amax_history_fwd"])
    assert torch.equal(bwd.scale, tensors["scale_bwd"]) and torch.equal(bwd.amax_history, tensors["amax_history_bwd"])


# 1. TE's checkpoints load here ---------------------------------------------------------------------------------
@pytest.mark.parametrize("te_format, ours", [(TEFormat.HYBRID, Format.HYBRID), (TEFormat.E4M3, Format.E4M3)])
def test_te2_delayed_scaling_entry_loads_with_its_recipe(te_format, ours):
    tensors = delayed_state(1, 16)
    te_recipe = TEDelayedScaling(margin=1, fp8_format=te_format, amax_history_len=16, amax_compute_algo="most_recent",
                                 reduce_amax=False)
    entry = te2_entry({"recipe": te_recipe, **tensors, "extra_fp8_variables": extra(1, te_format)})
    layer = Linear(16, 8)
    layer.set_extra_state(entry)
    recipe = DelayedScaling(margin=1, fp8_format=ours, amax_history_len=16, amax_compute_algo="most_recent",
                            reduce_amax=False)
    assert layer.fp8_meta["recipe"].key() == recipe.key()
    assert_loaded(layer, tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same recipe under autocast keeps the loaded scales
        with fp8_autocast(fp8_recipe=recipe):
            layer(torch.randn(4, 16))


@pytest.mark.parametrize("form", ["BytesIO", "legacy torch.save", "onnx tensor"])
def test_te1_entry_without_recipe_loads(form):
    """TE 1.x stored no recipe (delayed scaling was its only one) and also scale_inv; the format comes from
    fp8_max_fwd / fp8_max_bwd, the history length from the tensors."""
    tensors = delayed_state(1, 5, seed=1)
    state = {**tensors, "scale_inv_fwd": 1 / tensors["scale_fwd"], "scale_inv_bwd": 1 / tensors["scale_bwd"],
             "extra_fp8_variables": extra(1, TEFormat.E4M3)}
    if form == "onnx tensor":  # TE 1.x under ONNX export: the pickle in a uint8 tensor
        entry = torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)
    elif form == "legacy torch.save":  # torch.save's stream before torch 1.6
        entry = io.BytesIO()
        torch.save(state, entry, _use_new_zipfile_serialization=False)
    else:
        entry = te1_bytesio(state)
    model = torch.nn.Sequential(Linear(16, 8))
    model.load_state_dict({**model.state_dict(), "0._extra_state": entry})
    assert model[0].fp8_meta["recipe"].key() == DelayedScaling(fp8_format=Format.E4M3, amax_history_len=5).key()
    assert_loaded(model[0], tensors)


@pytest.mark.parametrize("entry, kind", [
    (torch.empty(0, dtype=torch.uint8), "empty tensor (TE 2.5 and later without FP8; TE 2.18's stateless recipes)"),
    (torch.frombuffer(bytearray(pickle.dumps(None)), dtype=torch.uint8), "pickled None (TE 2.0-2.4 without FP8)"),
    (te1_bytesio(None), "torch.save of None (TE 1.x without FP8)")])
def test_te_entries_without_state_load_with_a_warning(entry, kind):
    layer = Linear(16, 8)
    with pytest.warns(UserWarning, match="no FP8 metadata"):
        layer.set_extra_state(entry)
    assert "scaling_fwd" not in layer.fp8_meta


@pytest.mark.parametrize("te_recipe, ours", [
    (TEFloat8CurrentScaling(fp8_format=TEFormat.E4M3), Float8CurrentScaling(fp8_format=Format.E4M3)),
    (TEFloat8BlockScaling(), Float8BlockScaling()),
    (TEMXFP8BlockScaling(), MXFP8BlockScaling())], ids=lambda r: type(r).__name__)
def test_te2_stateless_entries_map_their_recipe(te_recipe, ours):
    """TE 2.5-2.17 pickle a stateless recipe with no tensors: the recipe maps onto ours."""
    layer = Linear(16, 8)
    layer.set_extra_state(te2_entry({"recipe": te_recipe, "extra_fp8_variables": extra(1)}))
    assert layer.fp8_meta["recipe"].key() == ours.key()


def test_te2_2_current_scaling_qparams_map():
    """Before TE 2.8 Float8CurrentScaling had no use_power_2_scales, only per-role QParams (class attributes,
    pickled when set on the instance); they map onto ours."""
    te_recipe = TEFloat8CurrentScaling()
    te_recipe.fp8_quant_fwd_inp = QParams(power_2_scale=True, amax_epsilon=1e-3)
    layer = Linear(16, 8)
    layer.set_extra_state(te2_entry({"recipe": te_recipe, "extra_fp8_variables": extra(1)}))
    assert layer.fp8_meta["recipe"].fp8_quant_fwd_inp.power_2_scale is True
    assert layer.fp8_meta["recipe"].fp8_quant_fwd_inp.amax_epsilon == 1e-3


def test_te_recipe_without_counterpart_and_no_state_is_skipped_with_a_warning():
    layer = Linear(16, 8)
    with pytest.warns(UserWarning, match="no FP8 metadata"):
        layer.set_extra_state(te2_entry({"recipe": TENVFP4BlockScaling(), "extra_fp8_variables": extra(1)}))


@pytest.mark.parametrize("make", [lambda: LayerNormLinear(16, 8), lambda: LayerNormMLP(16, 32)],
                         ids=["LayerNormLinear", "LayerNormMLP"])
def test_te2_entries_of_other_modules_load(make):
    module = make()
    tensors = delayed_state(module.num_gemms, 4, seed=2)
    module.set_extra_state(te2_entry({"recipe": TEDelayedScaling(amax_history_len=4), **tensors,
                                      "extra_fp8_variables": extra(module.num_gemms)}))
    assert_loaded(module, tensors)


def per_role(tensors: dict[str, torch.Tensor], gemms: int) -> dict[str, torch.Tensor]:
    """TE's GroupedLinear before 2.3: each role's slots together (inputs, weights, outputs)."""
    out = {}
    for key, value in tensors.items():
        roles = 3 if key.endswith("fwd") else 2
        order = [roles * gemm + role for role in range(roles) for gemm in range(gemms)]
        out[key] = value.index_select(value.dim() - 1, torch.tensor(order))
    return out


def grouped_te_state(gemms: int, rows: int) -> dict[str, torch.Tensor]:
    """Per GEMM, with TE GroupedLinear's unused slots (output, grad_input) idle: history 0, scale 1."""
    tensors = delayed_state(gemms, rows, seed=3)
    for key, roles in (("fwd", 3), ("bwd", 2)):
        unused = [roles * g + roles - 1 for g in range(gemms)]
        tensors[f"scale_{key}"][unused] = 1.0
        tensors[f"amax_history_{key}"][:, unused] = 0.0
    return tensors


@pytest.mark.parametrize("era", ["TE 2.0-2.2 (per role)", "TE 2.3 and later (per GEMM)", "TE 1.x (per role)"])
def test_te_grouped_entries_of_either_layout_load(era):
    gemms, rows = 3, 4
    tensors = grouped_te_state(gemms, rows)
    written = tensors if "per GEMM" in era else per_role(tensors, gemms)
    state = {**written, "extra_fp8_variables": extra(gemms)}
    if "1.x" not in era:
        state["recipe"] = TEDelayedScaling(amax_history_len=rows)
    grouped = GroupedLinear(gemms, 16, 8)
    grouped.set_extra_state(te2_entry(state))
    assert_loaded(grouped, per_role(tensors, gemms))  # our GroupedLinear keeps TE's pre-2.3 layout


def test_ambiguous_grouped_entry_asks_for_the_layout(monkeypatch):
    """Never-updated histories cannot tell the layouts apart; where the two readings differ the environment
    variable decides."""
    gemms = 2
    tensors = {"scale_fwd": torch.tensor([2.0, 3.0, 1.0, 4.0, 5.0, 1.0]), "amax_history_fwd": torch.zeros(1, 6),
               "scale_bwd": torch.tensor([2.0, 1.0, 3.0, 1.0]), "amax_history_bwd": torch.zeros(1, 4)}
    # per GEMM (TE >= 2.3) reading: output/grad_input slots 2, 5 / 1, 3 are 1; per role: 4, 5 / 2, 3 are not all 1
    tensors["scale_fwd"][4] = 1.0
    tensors["scale_bwd"][2] = 1.0
    entry = te2_entry({"recipe": TEDelayedScaling(amax_history_len=1), **tensors,
                       "extra_fp8_variables": extra(gemms)})
    with pytest.raises(RuntimeError, match=GROUPED_LAYOUT_ENV):
        GroupedLinear(gemms, 16, 8).set_extra_state(entry)
    monkeypatch.setenv(GROUPED_LAYOUT_ENV, "per_gemm")
    grouped = GroupedLinear(gemms, 16, 8)
    grouped.set_extra_state(entry)
    assert_loaded(grouped, per_role(tensors, gemms))


def test_megatron_te_classes_load_te_entries():
    pytest.importorskip("megatron.core")
    from mindspeed_te.megatron import TEColumnParallelGroupedLinear, TEColumnParallelLinear
    from tests.test_megatron_linear import _config, _init

    linear = TEColumnParallelLinear(64, 96, config=_config(), init_method=_init, gather_output=False, bias=True,
                                    skip_bias_add=False, is_expert=False)
    tensors = delayed_state(1, 3)
    state = linear.state_dict()
    state["_extra_state"] = te2_entry({"recipe": TEDelayedScaling(amax_history_len=3), **tensors,
                                       "extra_fp8_variables": extra(1)})
    linear.load_state_dict(state)
    assert_loaded(linear, tensors)
    grouped = TEColumnParallelGroupedLinear(2, 64, 32, config=_config(num_moe_experts=2), init_method=_init,
                                            bias=True, skip_bias_add=False, is_expert=True)
    tensors = grouped_te_state(2, 3)
    state = grouped.state_dict()
    state["_extra_state"] = te2_entry({"recipe": TEDelayedScaling(amax_history_len=3), **per_role(tensors, 2),
                                       "extra_fp8_variables": extra(2)})
    grouped.load_state_dict(state)
    assert_loaded(grouped, per_role(tensors, 2))


def megatron_split(state: dict[str, Any], gemms: int) -> list[dict[str, Any]]:
    """megatron-core's TEGroupedLinear._split_extra_state (0.16.1), re-derived: piece i takes column i of every
    slot tensor viewed as [roles, gemms] (forward 3, backward 2 roles), whatever layout TE wrote, num_gemms=1."""
    pieces = []
    for i in range(gemms):
        piece = {"recipe": state["recipe"], "extra_fp8_variables": {**state["extra_fp8_variables"], "num_gemms": 1}}
        for key in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
            value = state[key]
            piece[key] = value.reshape(*value.shape[:-1], 3 if key.endswith("fwd") else 2, gemms)[..., i].clone()
        pieces.append(piece)
    return pieces


def megatron_merge(pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """megatron-core's merge_extra_states, re-derived: the pieces' slots side by side again (slot r * n + i of
    the whole is piece i's slot r)."""
    merged = {"recipe": pieces[0]["recipe"],
              "extra_fp8_variables": {**pieces[0]["extra_fp8_variables"], "num_gemms": len(pieces)}}
    for key in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
        merged[key] = torch.stack([p[key] for p in pieces], dim=-1).flatten(-2)
    return merged


def _with_pieces(state: dict[str, torch.Tensor], entries: list[torch.Tensor]) -> dict[str, Any]:
    """A module's state dict as a dist-checkpoint load gives it: `_extra_state`, `_extra_state1`, ..."""
    state = {k: v for k, v in state.items() if not k.startswith("_extra_state")}
    state.update({"_extra_state" if i == 0 else f"_extra_state{i}": e for i, e in enumerate(entries)})
    return state


def test_te_per_expert_entries_of_a_dist_checkpoint_merge():
    """Megatron's TEGroupedLinear under TE 2.0-2.2 (per-role slots) splits the entry per expert (expert i: forward
    slots i, n+i, 2n+i, backward i, n+i: its own entry, as one-GEMM entries with num_gemms=1); loading them here
    merges them back."""
    pytest.importorskip("megatron.core")
    from mindspeed_te.megatron import TEColumnParallelGroupedLinear
    from tests.test_megatron_linear import _config, _init

    grouped = TEColumnParallelGroupedLinear(2, 64, 32, config=_config(num_moe_experts=2), init_method=_init,
                                            bias=True, skip_bias_add=False, is_expert=True)
    tensors = grouped_te_state(2, 3)
    state = grouped.state_dict()
    for i in range(2):
        piece = {key: value[..., [g for g in range(value.shape[-1]) if g // (value.shape[-1] // 2) == i]]
                 for key, value in tensors.items()}
        state["_extra_state" if i == 0 else f"_extra_state{i}"] = te2_entry(
            {"recipe": TEDelayedScaling(amax_history_len=3), **piece, "extra_fp8_variables": extra(1)})
    grouped.load_state_dict(state)
    assert_loaded(grouped, per_role(tensors, 2))


@pytest.mark.parametrize("gemms", [2, 3])
def test_te_2_3_per_expert_entries_of_a_dist_checkpoint_merge(gemms):
    """Under TE 2.3 and later (per-GEMM slots) Megatron's split is the same column cut, so piece i holds slots of
    several experts (for 2 experts: input 0, output 0, weight 1 / weight 0, input 1, output 1). Loading them here
    puts them side by side as Megatron does and reads the whole entry per GEMM: every expert gets its own."""
    pytest.importorskip("megatron.core")
    from mindspeed_te.megatron import TEColumnParallelGroupedLinear
    from tests.test_megatron_linear import _config, _init

    tensors = grouped_te_state(gemms, 3)
    whole = {"recipe": TEDelayedScaling(amax_history_len=3), **tensors, "extra_fp8_variables": extra(gemms)}
    pieces = megatron_split(whole, gemms)
    assert not torch.equal(pieces[0]["scale_fwd"], tensors["scale_fwd"][:3])  # not expert 0's own slots
    grouped = TEColumnParallelGroupedLinear(gemms, 64, 32, config=_config(num_moe_experts=gemms), init_method=_init,
                                            bias=False, skip_bias_add=False, is_expert=True)
    grouped.load_state_dict(_with_pieces(grouped.state_dict(), [te2_entry(p) for p in pieces]))
    assert_loaded(grouped, per_role(tensors, gemms))


def test_mixed_per_expert_entries_are_an_error():
    pytest.importorskip("megatron.core")
    from mindspeed_te.megatron import TEColumnParallelGroupedLinear
    from tests.test_megatron_linear import _config, _init

    grouped = TEColumnParallelGroupedLinear(2, 64, 32, config=_config(num_moe_experts=2), init_method=_init,
                                            bias=False, skip_bias_add=False, is_expert=True)
    te_piece = te2_entry({"recipe": TEDelayedScaling(amax_history_len=3), **grouped_te_state(1, 3),
                          "extra_fp8_variables": extra(1)})
    ours = grouped.state_dict()["_extra_state"]
    with pytest.raises(RuntimeError, match="mix TransformerEngine's entries with others"):
        grouped.load_state_dict(_with_pieces(grouped.state_dict(), [te_piece, ours]))


def _trained_grouped(gemms: int, seed: int = 0):
    from mindspeed_te.megatron import TEColumnParallelGroupedLinear
    from tests.test_megatron_linear import _config, _init

    torch.manual_seed(seed)
    grouped = TEColumnParallelGroupedLinear(gemms, 64, 32, config=_config(num_moe_experts=gemms), init_method=_init,
                                            bias=False, skip_bias_add=False, is_expert=True)
    splits = [3 + 2 * g for g in range(gemms)]
    for step in range(3):
        with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=4)):
            out, _ = grouped(torch.randn(sum(splits), 64) * (step + 1), splits)
        out.sum().backward()
    return grouped


@pytest.mark.parametrize("layout", [None, "per_role"], ids=["TE 2.3 and later", "TE 2.0-2.2"])
def test_grouped_te_format_per_expert_entries_are_megatrons(monkeypatch, layout):
    """With extra_state_format='te' the per-expert entries of a distributed checkpoint are TE's: the pieces
    megatron-core cuts from TE's GroupedLinear entry (num_gemms=1, one expert's worth of slots), so Megatron's
    merge gives TE its whole entry back; under TE 2.0-2.2's layout each piece is the expert's own entry (as a
    sequential expert's linear keeps it). A fresh module here loads them back exactly."""
    pytest.importorskip("megatron.core")
    if layout is not None:
        monkeypatch.setenv(GROUPED_LAYOUT_ENV, layout)
    gemms = 3
    source = _trained_grouped(gemms)
    source.extra_state_format = "te"
    whole = te_reads(source.state_dict()["_extra_state"])
    pieces = source._split_extra_state(source.state_dict()["_extra_state"])
    read = [te_reads(piece) for piece in pieces]
    for piece, raw in zip(read, pieces):
        assert type(piece["recipe"]) is TEDelayedScaling and piece["extra_fp8_variables"]["num_gemms"] == 1
        assert piece["scale_fwd"].shape == (3,) and piece["amax_history_bwd"].shape == (4, 2)
        assert te_218_action(raw.numpy().tobytes()) == "unsafe_load"  # as TE's own delayed-scaling entries
    merged = megatron_merge(read)
    for key in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
        assert torch.equal(merged[key], whole[key]), key
    assert merged["extra_fp8_variables"]["num_gemms"] == gemms
    fwd, bwd = source.fp8_states
    if layout == "per_role":  # sequential-expert form: piece i is expert i's input, weight, output
        for i, piece in enumerate(read):
            assert torch.equal(piece["amax_history_fwd"], fwd.amax_history[:, [i, gemms + i, 2 * gemms + i]])
            assert torch.equal(piece["scale_bwd"], bwd.scale[[i, gemms + i]])
    target = _trained_grouped(gemms, seed=5)
    target.load_state_dict(_with_pieces(source.state_dict(), pieces))
    for ours, theirs in zip(target.fp8_states, source.fp8_states):
        assert torch.equal(ours.amax_history, theirs.amax_history) and torch.equal(ours.scale, theirs.scale)


# 2. Safely: nothing in a checkpoint runs ------------------------------------------------------------------------
RAN: list[str] = []


def _side_effect(tag: str) -> None:
    RAN.append(tag)


class _RunsCode:
    def __reduce__(self):
        return _side_effect, ("custom __reduce__",)


class _RunsShell:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def _attacks(tmp_path) -> dict[str, Any]:
    marker = str(tmp_path / "ran")
    tensors = delayed_state(1, 2)
    return {
        "os.system": {**tensors, "recipe": _RunsShell(marker), "extra_fp8_variables": {}},
        "custom __reduce__": {**tensors, "extra_fp8_variables": {"x": _RunsCode()}},
        "callable in the recipe": {"recipe": TEDelayedScaling(amax_compute_algo=_side_effect), **tensors,
                                   "extra_fp8_variables": {}},
    }


@pytest.mark.parametrize("attack, global_name", [("os.system", "system"),
                                                 ("custom __reduce__", "_side_effect"),
                                                 ("callable in the recipe", "_side_effect")])
@pytest.mark.parametrize("form", ["pickle in a tensor", "torch.save in a BytesIO"])
def test_pickles_that_would_run_code_are_refused_and_nothing_runs(tmp_path, attack, global_name, form):
    state = _attacks(tmp_path)[attack]
    with te_installed():
        entry = (torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8) if form.startswith("pickle")
                 else te1_bytesio(state))
    RAN.clear()
    model = torch.nn.Sequential(Linear(16, 8))
    with pytest.raises(ExtraStateRefused, match=rf"Linear: refusing .*global \S*{global_name}"):
        model.load_state_dict({**model.state_dict(), "0._extra_state": entry})
    assert RAN == [] and not (tmp_path / "ran").exists()
    assert "scaling_fwd" not in model[0].fp8_meta


def test_admitted_names_cannot_be_used_to_reach_others():
    """Admitted names are checked where they are called: a tensor rebuilt with backward hooks, or from anything
    but a storage, is refused."""
    from collections import OrderedDict

    class _Rebuilt:
        def __init__(self, *args: Any) -> None:
            self.args = args

        def __reduce__(self):
            return torch._utils._rebuild_tensor_v2, self.args

    storage = torch.ones(1)._typed_storage()
    for args, match in (((storage, 0, (1,), (1,), False, OrderedDict(hook=OrderedDict)), "backward hooks"),
                        (("not a storage", 0, (1,), (1,), False, OrderedDict()), "from a torch storage")):
        entry = torch.frombuffer(bytearray(pickle.dumps({"scale_fwd": _Rebuilt(*args)})), dtype=torch.uint8)
        with pytest.raises(RuntimeError, match=match):
            decode_extra_state(entry, "Linear")


def test_unreadable_bytes_are_a_clear_error():
    with pytest.raises(RuntimeError, match="Linear: corrupt _extra_state"):
        decode_extra_state(torch.tensor([0x80, 4, 1, 2], dtype=torch.uint8), "Linear")
    with pytest.raises(RuntimeError, match="unknown layout"):
        decode_extra_state(torch.frombuffer(bytearray(pickle.dumps([1, 2])), dtype=torch.uint8), "Linear")


# 3. Our checkpoints load in TE -----------------------------------------------------------------------------------
def _train(model, recipe, first: int, count: int) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    outs = []
    for step in range(first, first + count):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)) * (1 + step)
        with fp8_autocast(fp8_recipe=recipe):
            y = model(x)
        opt.zero_grad()
        (y.float() ** 2).mean().backward()
        opt.step()
        outs.append(y.detach())
    return outs


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(Linear(16, 16), torch.nn.GELU(), Linear(16, 8))


def test_te_format_is_what_te_writes_and_reads():
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4, margin=1, amax_compute_algo="most_recent")
    model = _model()
    _train(model, recipe, 0, 3)
    assert set_extra_state_format(model, "te") == 2
    entry = model.state_dict()["0._extra_state"]
    assert entry.dtype == torch.uint8 and entry.dim() == 1
    assert b"mindspeed_te" not in entry.numpy().tobytes()  # every global is TE's or torch's
    state = te_reads(entry)
    assert list(state) == ["recipe", "scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd",
                           "extra_fp8_variables"]
    te_recipe = state["recipe"]
    assert type(te_recipe) is TEDelayedScaling and te_recipe.fp8_format is TEFormat.HYBRID
    assert (te_recipe.margin, te_recipe.amax_history_len, te_recipe.amax_compute_algo, te_recipe.reduce_amax) == \
        (1, 4, "most_recent", True)
    assert te_recipe.backward_override is None  # not written: TE's class default
    fwd, bwd = model[0].fp8_meta["scaling_fwd"], model[0].fp8_meta["scaling_bwd"]
    assert torch.equal(state["scale_fwd"], fwd.scale) and torch.equal(state["amax_history_fwd"], fwd.amax_history)
    assert torch.equal(state["scale_bwd"], bwd.scale) and torch.equal(state["amax_history_bwd"], bwd.amax_history)
    assert state["amax_history_fwd"].shape == (te_recipe.amax_history_len, 3)  # TE copies into [L, 3 * num_gemms]
    assert state["scale_fwd"].dtype == torch.float32 and state["scale_fwd"].device.type == "cpu"
    assert state["extra_fp8_variables"] == {"fp8_checkpoint": True, "num_gemms": 1, "fp8_max_fwd": 448,
                                            "fp8_max_bwd": 57344}
    # TE 2.18 classifies it as it classifies its own delayed-scaling entry: loaded only with the opt-in
    te_own = te2_entry({"recipe": TEDelayedScaling(amax_history_len=4), **delayed_state(1, 4),
                        "extra_fp8_variables": extra(1)})
    assert te_218_action(entry.numpy().tobytes()) == te_218_action(te_own.numpy().tobytes()) == "unsafe_load"


def test_te_format_without_state_is_read_by_every_te_release():
    """Before any FP8 step, and for recipes that keep no state, the entry is None pickled: TE 2.0-2.17 unpickle
    it to None, TE 2.18 ignores it without the opt-in, TE 1.x's pickle branch returns on None."""
    layer = Linear(16, 8)
    layer.extra_state_format = "te"
    stateless = Linear(16, 8)
    stateless.extra_state_format = "te"
    _train(stateless, Float8CurrentScaling(), 0, 1)
    for entry in (layer.get_extra_state(), stateless.get_extra_state()):
        assert entry.numel() > 0 and te_reads(entry) is None
        assert te_218_action(entry.numpy().tobytes()) == "ignore"
    assert te_218_action(b"") == "ignore"


def test_resume_from_te_format_is_bit_identical(monkeypatch):
    recipe = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=3)
    model = _model()
    _train(model, recipe, 0, 3)
    monkeypatch.setenv(EXTRA_STATE_FORMAT_ENV, "te")
    ckpt = {key: value.clone() for key, value in model.state_dict().items()}  # the weights go on changing
    assert te_reads(ckpt["0._extra_state"])["recipe"].fp8_format is TEFormat.E4M3
    monkeypatch.delenv(EXTRA_STATE_FORMAT_ENV)
    uninterrupted = _train(model, recipe, 3, 2)
    FP8GlobalStateManager.reset()
    resumed = _model()
    resumed.load_state_dict(ckpt)
    for a, b in zip(uninterrupted, _train(resumed, recipe, 3, 2)):
        assert torch.equal(a, b)


def test_te_entry_round_trips_through_this_plugin():
    """A TE checkpoint loaded here and saved in TE's format gives TE back its recipe, scales and histories."""
    tensors = delayed_state(2, 6, seed=4)
    te_recipe = TEDelayedScaling(margin=2, fp8_format=TEFormat.E4M3, amax_history_len=6, fp8_dpa=True)
    mlp = LayerNormMLP(16, 32)
    mlp.set_extra_state(te2_entry({"recipe": te_recipe, **tensors, "extra_fp8_variables": extra(2, TEFormat.E4M3)}))
    mlp.extra_state_format = "te"
    state = te_reads(mlp.get_extra_state())
    assert {k: v for k, v in vars(state["recipe"]).items() if k != "backward_override"} == \
        {k: v for k, v in vars(te_recipe).items() if k != "backward_override"}
    for key, value in tensors.items():
        assert torch.equal(state[key], value)
    assert state["extra_fp8_variables"]["num_gemms"] == 2


def test_te_format_of_metadata_waiting_for_its_recipe_is_a_clear_error():
    """Metadata of a recipe with a callable waits for a forward under it; its recipe was not stored."""
    recipe = DelayedScaling(amax_history_len=2, amax_compute_algo=lambda h: h.amax(0))
    source = Linear(16, 8)
    _train(torch.nn.Sequential(source), recipe, 0, 1)
    target = Linear(16, 8)
    target.set_extra_state(source.get_extra_state())
    target.extra_state_format = "te"
    with pytest.raises(RuntimeError, match="run a forward under it first"):
        target.get_extra_state()


@pytest.mark.parametrize("layout", [None, "per_gemm", "per_role"])
def test_grouped_te_format_layouts(monkeypatch, layout):
    """Written per GEMM (TE 2.3 and later) unless the environment asks for TE 2.0-2.2's per-role slots; read back
    either way."""
    if layout is not None:
        monkeypatch.setenv(GROUPED_LAYOUT_ENV, layout)
    grouped = GroupedLinear(2, 16, 8)
    grouped.extra_state_format = "te"
    recipe = DelayedScaling(amax_history_len=2)
    with fp8_autocast(fp8_recipe=recipe):
        grouped(torch.randn(6, 16), [2, 4]).sum().backward()
    state = te_reads(grouped.get_extra_state())
    fwd = grouped.fp8_meta["scaling_fwd"]
    per_gemm = [grouped.fp8_meta_index(role, g) for g in range(2) for role in ("input", "weight", "output")]
    expected = fwd.scale if layout == "per_role" else fwd.scale[per_gemm]
    assert torch.equal(state["scale_fwd"], expected)
    fresh = GroupedLinear(2, 16, 8)
    fresh.set_extra_state(grouped.get_extra_state())
    assert torch.equal(fresh.fp8_meta["scaling_fwd"].scale, fwd.scale)
    assert torch.equal(fresh.fp8_meta["scaling_bwd"].amax_history, grouped.fp8_meta["scaling_bwd"].amax_history)


@pytest.mark.parametrize("recipe, match", [
    (HIF8DelayedScaling(), "HIF8DelayedScaling"),
    (DelayedScaling(fp8_format=Format.HIF8), "Format.HIF8"),
    (DelayedScaling(fwd_target_max=240.0), "fwd_target_max"),
    (DelayedScaling(amax_compute_algo=lambda h: h.amax(0)), "callable")], ids=["hif8_delayed", "hif8", "target",
                                                                              "callable"])
def test_te_format_refuses_what_te_cannot_express(recipe, match):
    layer = Linear(16, 8)
    _train(torch.nn.Sequential(layer), recipe, 0, 1)
    layer.extra_state_format = "te"
    with pytest.raises(ValueError, match=match):
        layer.get_extra_state()


def test_bad_format_names_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="extra_state_format must be one of mindspeed_te, te"):
        FP8ModuleBase(1, extra_state_format="TE")
    with pytest.raises(ValueError, match="extra_state_format"):
        set_extra_state_format(_model(), "nvidia")
    monkeypatch.setenv(EXTRA_STATE_FORMAT_ENV, "pickle")
    with pytest.raises(ValueError, match=EXTRA_STATE_FORMAT_ENV):
        Linear(16, 8).get_extra_state()


def test_megatron_te_class_writes_te_format():
    pytest.importorskip("megatron.core")
    from mindspeed_te.megatron import TEColumnParallelLinear
    from tests.test_megatron_linear import _config, _init

    linear = TEColumnParallelLinear(64, 96, config=_config(), init_method=_init, gather_output=False, bias=True,
                                    skip_bias_add=False, is_expert=False)
    with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=2)):
        linear(torch.randn(4, 2, 64))[0].sum().backward()
    set_extra_state_format(linear, "te")
    state = te_reads(linear.state_dict()["_extra_state"])
    assert torch.equal(state["scale_fwd"], linear.fp8_meta["scaling_fwd"].scale)


# 5. Non-finite or inconsistent state: an error or a documented repair -------------------------------------------
def _entry(**changes: Any) -> torch.Tensor:
    state = {"recipe": TEDelayedScaling(amax_history_len=4), **delayed_state(1, 4), "extra_fp8_variables": extra(1)}
    state.update(changes)
    return te2_entry({k: v for k, v in state.items() if v is not None})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_bad_scales_are_an_error(bad):
    scale = torch.ones(3)
    scale[1] = bad
    with pytest.raises(RuntimeError, match=r"Linear: the checkpoint's fwd scales at slots \[1\].*finite and > 0"):
        Linear(16, 8).set_extra_state(_entry(scale_fwd=scale))


def test_bad_scales_in_our_own_format_are_an_error_too():
    layer = Linear(16, 8)
    _train(torch.nn.Sequential(layer), DelayedScaling(amax_history_len=2), 0, 1)
    layer.fp8_meta["scaling_bwd"].scale[0] = float("nan")
    with pytest.raises(RuntimeError, match="bwd scales at slots \\[0\\]"):
        Linear(16, 8).set_extra_state(layer.get_extra_state())


def test_non_finite_amaxes_are_zeroed_with_a_warning():
    history = torch.ones(4, 2) * 3
    history[0, 1], history[2, 0] = float("nan"), float("inf")
    layer = Linear(16, 8)
    with pytest.warns(UserWarning, match="bwd amax history has 2 non-finite or negative entries; they are set to 0"):
        layer.set_extra_state(_entry(amax_history_bwd=history))
    expected = history.clone()
    expected[0, 1] = expected[2, 0] = 0.0
    assert torch.equal(layer.fp8_meta["scaling_bwd"].amax_history, expected)


@pytest.mark.parametrize("changes, match", [
    ({"amax_history_fwd": torch.ones(7, 3)}, "fwd amax history has 7 rows, its recipe says amax_history_len=4"),
    ({"recipe": TEFloat8CurrentScaling()}, "recipe of another kind"),
    ({"amax_history_bwd": None}, "lacks amax_history_bwd"),
    ({"scale_bwd": torch.ones(3)}, "n a multiple of 2"),
    ({"extra_fp8_variables": extra(2)}, "num_gemms=2"),
    ({"recipe": TEDelayedScaling(fp8_format=TEFormat.E2M1, amax_history_len=4)}, "Format.E2M1"),
    ({"recipe": "DelayedScaling"}, "not a TE recipe"),
], ids=["history length", "recipe kind", "missing tensor", "slot count", "num_gemms", "format", "recipe type"])
def test_inconsistent_te_entries_are_an_error(changes, match):
    with pytest.raises(RuntimeError, match=match):
        Linear(16, 8).set_extra_state(_entry(**changes))


def test_te_entry_for_another_gemm_count_is_an_error():
    entry = te2_entry({"recipe": TEDelayedScaling(amax_history_len=4), **delayed_state(2, 4),
                       "extra_fp8_variables": extra(2)})
    with pytest.raises(RuntimeError, match="does not fit"):
        Linear(16, 8).set_extra_state(entry)


def test_te_entry_under_another_active_recipe_starts_fresh_with_a_warning():
    """The documented repair: the checkpoint's scales belong to its recipe; another active recipe starts fresh."""
    layer = Linear(16, 8)
    layer.set_extra_state(_entry())
    with pytest.warns(UserWarning, match="active recipe is"):
        with fp8_autocast(fp8_recipe=DelayedScaling(fp8_format=Format.E4M3, amax_history_len=4)):
            layer(torch.randn(4, 16))


def test_backward_override_is_dropped_with_a_warning():
    with pytest.warns(UserWarning, match="backward_override"):
        Linear(16, 8).set_extra_state(_entry(recipe=TEDelayedScaling(amax_history_len=4,
                                                                     backward_override="high_precision")))
