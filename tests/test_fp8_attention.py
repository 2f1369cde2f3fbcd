"""FP8 attention (the recipes' fp8_dpa / fp8_mha) against an independent fake-quant reference.

The reference quantizes with ml_dtypes (E4M3 / E5M2) and en_dtypes (HiF8) through tests/oracles.py, with
scales from the oracles' rules, and runs the high-precision attention (DotProductAttention outside FP8, checked
against float64 in tests/test_attention.py) on the dequantized values, with autograd: Q, K, V quantized in
forward, dO in backward, and under delayed scaling O in forward and dQ, dK, dV together in backward, as
TransformerEngine's fused FP8 attention does. Forward outputs and gradients are compared bit for bit: the FP8
path runs the same attention on the same values."""
from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
import weakref
from typing import Callable, Optional

import numpy as np
import pytest
import torch

from mindspeed_te import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    FP8GlobalStateManager,
    HIF8DelayedScaling,
    MXFP4BlockScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    fp8_autocast,
)
from mindspeed_te.modules import DotProductAttention
from mindspeed_te.recipe import Format
from tests.oracles import DelayedReference, current_scale_inv, np_cast, np_decode

S, B, H, G, D = 12, 2, 4, 2, 16
# element format and target max (the amax an FP8 scale maps to) of forward and backward tensors, per case
FORMATS = {"e4m3": (("E4M3", 448.0), ("E4M3", 448.0)), "hybrid": (("E4M3", 448.0), ("E5M2", 57344.0)),
           "hif8": (("HIF8", 15.0), ("HIF8", 224.0)),
           "hif8 delayed warm-up": (("HIF8", 16.0), ("HIF8", 16.0))}  # 2^(15 - margin 11) for every role
RECIPES: dict[str, Callable[[], object]] = {
    "current e4m3": lambda: Float8CurrentScaling(fp8_format=Format.E4M3, fp8_dpa=True),
    "current hybrid": lambda: Float8CurrentScaling(fp8_dpa=True),
    "current hif8": lambda: Float8CurrentScaling(fp8_format=Format.HIF8, fp8_dpa=True),
    "delayed hybrid": lambda: DelayedScaling(fp8_dpa=True),
    "delayed hif8": lambda: DelayedScaling(fp8_format=Format.HIF8, fp8_dpa=True),
    "hif8 delayed warm-up": lambda: HIF8DelayedScaling(fp8_dpa=True),
}


@pytest.fixture(autouse=True)
def _fresh_state():
    FP8GlobalStateManager.reset()
    yield
    FP8GlobalStateManager.reset()


def qdq(tensors: list[torch.Tensor], fmt: str, scale_inv: np.float32) -> list[torch.Tensor]:
    """Each tensor quantized by the independent codec (x / scale_inv in float32, cast by ml_dtypes or
    en_dtypes, saturating) and dequantized (codes times scale_inv in float32, rounded to the tensor's dtype)."""
    out = []
    for t in tensors:
        codes = np_cast(t.detach().float().numpy() / np.float32(scale_inv), fmt)
        out.append(torch.from_numpy(np_decode(codes, fmt) * np.float32(scale_inv)).to(t.dtype).reshape(t.shape))
    return out


def amax(tensors: list[torch.Tensor]) -> float:
    return max(float(t.detach().float().abs().max()) for t in tensors)


class _GradQdq(torch.autograd.Function):
    """Identity forward, gradient quantize-dequantized (dO in backward)."""

    @staticmethod
    def forward(ctx, x, fake):
        ctx.fake = fake
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.fake(grad), None


def reference(attn: DotProductAttention, tensors: list[torch.Tensor], dout: torch.Tensor, case: str,
              scale_inv: Callable[[str, list[torch.Tensor]], np.float32], delayed: bool,
              **kwargs) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
    """(output, gradients of q, k, v and of the module's parameters) of the fake-quant reference. `scale_inv(role,
    tensors)` gives the scale of "qkv", "out", "dout", "dqkv" from the tensors quantized under it."""
    (fwd_fmt, _), (bwd_fmt, _) = FORMATS[case]
    qkv = [t.requires_grad_() for t in qdq(tensors, fwd_fmt, scale_inv("qkv", tensors))]
    out = attn(*qkv, **kwargs)
    if delayed:  # TE's kernel writes O in FP8 (straight through in backward)
        out = out + (qdq([out], fwd_fmt, scale_inv("out", [out]))[0] - out).detach()
    out = _GradQdq.apply(out, lambda g: qdq([g], bwd_fmt, scale_inv("dout", [g]))[0])
    params = list(attn.parameters())
    grads = list(torch.autograd.grad(out, qkv + params, dout, allow_unused=True))
    if delayed:
        grads[:3] = qdq(grads[:3], bwd_fmt, scale_inv("dqkv", grads[:3]))
    return out.detach(), grads


def current_scales(case: str) -> Callable[[str, list[torch.Tensor]], np.float32]:
    """Current scaling's scale of each tensor: its amax over the target max of its direction."""
    (_, fwd_target), (_, bwd_target) = FORMATS[case]
    return lambda role, tensors: current_scale_inv(amax(tensors), fwd_target if role in ("qkv", "out")
                                                   else bwd_target)


def _inputs(dtype=torch.bfloat16, s_k=S, groups=G, thd=False):
    g = torch.Generator().manual_seed(5)
    if thd:
        return [torch.randn(S, n, D, generator=g).to(dtype) * 2 for n in (H, groups, groups)]
    return [torch.randn(s, B, n, D, generator=g).to(dtype) * 2 for s, n in ((S, H), (s_k, groups), (s_k, groups))]


def _run(attn: DotProductAttention, recipe, tensors: list[torch.Tensor], dout: torch.Tensor, **kwargs):
    """(output, gradients of q, k, v and of the module's parameters) of `attn` under `recipe`'s autocast."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    with fp8_autocast(fp8_recipe=recipe):
        out = attn(*leaves, **kwargs)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves] + [p.grad for p in attn.parameters()]


def _assert_equal(got, want):
    assert got.dtype == want.dtype and torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("case", list(RECIPES))
def test_forward_and_gradients_equal_the_fake_quant_reference(case):
    """Causal GQA attention in bfloat16, one step of each recipe: output and q, k, v gradients bit for bit."""
    fmt_case = case.split(" ", 1)[1] if case.startswith(("current", "delayed")) else case
    delayed = "delayed" in case
    tensors = _inputs()
    dout = torch.randn(S, B, H * D, generator=torch.Generator().manual_seed(6)).bfloat16()
    attn = DotProductAttention(H, D, num_gqa_groups=G, attn_mask_type="causal")
    out, grads = _run(attn, RECIPES[case](), tensors, dout)
    # delayed scaling's first step quantizes with scale 1 (HiF8's warm-up with current scaling)
    scales = (lambda role, t: np.float32(1.0)) if case.startswith("delayed") else current_scales(fmt_case)
    want, want_grads = reference(attn, tensors, dout, fmt_case, scales, delayed)
    _assert_equal(out, want)
    for got, expected in zip(grads, want_grads):
        _assert_equal(got, expected)
    plain = attn(*tensors).float()
    assert 0 < (out.float() - plain).norm() / plain.norm() < 0.1


def _check_delayed_steps(attn: DotProductAttention, recipe, case: str, history_len: int, algo: str,
                         factors: tuple[float, ...]) -> None:
    """Steps of delayed-scaling attention in float32, inputs scaled by `factors`: each equals the reference that
    quantizes Q, K, V, O, dO and dQKV with target / amax from its own slot's history (`DelayedReference`: the
    first step's scale is 1), updated after every step: at the autocast region's exit (forward) and at the end
    of the first FP8 module's backward (backward)."""
    tensors = _inputs(torch.float32)
    (_, fwd_target), (_, bwd_target) = FORMATS[case]
    history = {role: DelayedReference(history_len, fwd_target if role in ("qkv", "out") else bwd_target, algo=algo)
               for role in ("qkv", "out", "dout", "dqkv")}

    def scale_inv(role: str, quantized: list[torch.Tensor]) -> np.float32:
        history[role].observe(amax(quantized))
        return np.float32(1.0) / np.float32(history[role].scale)

    gen = torch.Generator().manual_seed(7)
    for factor in factors:
        step, dout = [t * factor for t in tensors], torch.randn(S, B, H * D, generator=gen)
        out, grads = _run(attn, recipe, step, dout)
        want, want_grads = reference(attn, step, dout, case, scale_inv, delayed=True)
        _assert_equal(out, want)
        for got, expected in zip(grads, want_grads):
            _assert_equal(got, expected)
        for ref in history.values():
            ref.update()


def test_delayed_scaling_takes_its_scales_from_the_amax_history():
    """Two steps of DelayedScaling (HYBRID): the second quantizes Q, K, V, O, dO and dQKV with 448 / amax
    (57344 / amax backward) of the first step's, each from its own slot."""
    attn = DotProductAttention(H, D, num_gqa_groups=G, attn_mask_type="causal")
    _check_delayed_steps(attn, DelayedScaling(fp8_dpa=True), "hybrid", 1024, "max", (1.0, 1.5))


def test_fp8_mha_runs_attention_in_fp8_as_fp8_dpa():
    """TE forces fp8_dpa on when fp8_mha is set; here the module's output stays in high precision."""
    tensors, dout = _inputs(), torch.ones(S, B, H * D, dtype=torch.bfloat16)
    attn = DotProductAttention(H, D, num_gqa_groups=G)
    dpa = _run(attn, Float8CurrentScaling(fp8_dpa=True), tensors, dout)
    mha = _run(attn, Float8CurrentScaling(fp8_mha=True), tensors, dout)
    for got, want in zip([mha[0], *mha[1]], [dpa[0], *dpa[1]]):
        _assert_equal(got, want)


@pytest.mark.parametrize("recipe", ["current hybrid", "delayed hybrid"])
def test_backward_keeps_the_codes_only(recipe):
    """What the forward leaves for backward: the 1-byte codes of Q, K and V and their scale, nothing of the
    bfloat16 inputs (high-precision attention keeps them, and its output, for torch's backward)."""
    from mindspeed_te.bench.memory import LiveStorages

    leaves = [t.requires_grad_() for t in _inputs()]
    numel = sum(t.numel() for t in leaves)

    attn = DotProductAttention(H, D, num_gqa_groups=G, attn_mask_type="causal")
    with fp8_autocast(fp8_recipe=RECIPES[recipe]()):
        attn(*leaves).float().sum().backward()  # the module's FP8 metadata is made

    def forward(fp8: bool) -> tuple[int, list[weakref.ref], list[torch.Tensor]]:
        tensors = [t * 1.0 for t in leaves]  # freed unless attention keeps them (a scalar product saves nothing)
        refs = [weakref.ref(t) for t in tensors]
        tracker, hooked = LiveStorages(), []
        with (fp8_autocast(enabled=fp8, fp8_recipe=RECIPES[recipe]()), tracker,
              torch.autograd.graph.saved_tensors_hooks(lambda t: hooked.append(t) or t, lambda t: t)):
            out = attn(*tensors)
        del tensors
        held = tracker.live_bytes(leave_out=(out,))
        out.float().sum().backward()
        return held, refs, hooked

    held, refs, hooked = forward(fp8=True)
    assert numel <= held <= numel + 16  # the codes, a 4-byte scale
    assert all(ref() is None for ref in refs)
    assert not hooked  # torch's saved-tensor hooks see nothing (the codes go through `stash`)
    held_hp, refs_hp, hooked_hp = forward(fp8=False)
    assert hooked_hp and refs_hp[0]() is not None  # torch keeps q (k and v: their GQA copies)


CASES = {  # name -> (constructor arguments, forward keyword arguments, inputs)
    "padding": (dict(attn_mask_type="padding"), "mask", {}),
    "padding_causal": (dict(attn_mask_type="padding_causal"), "mask", {}),
    "causal_bottom_right": (dict(attn_mask_type="causal_bottom_right"), None, dict(s_k=S + 4)),
    "sliding window": (dict(attn_mask_type="causal", window_size=(3, 0)), None, {}),
    "no_mask, mha": (dict(attn_mask_type="no_mask", num_gqa_groups=H), None, dict(groups=H)),
    "mqa, off-by-one": (dict(attn_mask_type="causal", num_gqa_groups=1, softmax_type="off-by-one"), None,
                        dict(groups=1)),
    "learnable offset": (dict(attn_mask_type="causal", softmax_type="learnable"), None, {}),
    "thd": (dict(attn_mask_type="padding_causal", qkv_format="thd"), "packed", dict(thd=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_masks_layouts_and_softmax_types(case):
    """Every mask, GQA / MQA / MHA, sliding window, packed sequences (thd, padded) and softmax offsets: FP8
    attention (current scaling, HYBRID) equals the reference, gradients of a learnable offset included."""
    args, call, shape = CASES[case]
    tensors = _inputs(**shape)
    kwargs: dict = {}
    if call == "mask":
        mask = torch.zeros(B, 1, S, S, dtype=torch.bool)
        mask[0, ..., 9:] = True
        mask[1, :, 4, :] = True  # a query that sees no key
        kwargs["attention_mask"] = mask
    elif call == "packed":
        cu, padded = torch.tensor([0, 5, 8, 10], dtype=torch.int32), torch.tensor([0, 6, 10, 12], dtype=torch.int32)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)
    args = dict(dict(num_gqa_groups=G), **args)
    attn = DotProductAttention(H, D, **args)
    if attn.softmax_offset is not None:
        with torch.no_grad():
            attn.softmax_offset.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    dout = torch.randn(*tensors[0].shape[:-2], H * D, generator=torch.Generator().manual_seed(8)).bfloat16()
    out, grads = _run(attn, Float8CurrentScaling(fp8_dpa=True), tensors, dout, **kwargs)
    for p in attn.parameters():
        p.grad = None
    want, want_grads = reference(attn, tensors, dout, "hybrid", current_scales("hybrid"), False, **kwargs)
    _assert_equal(out, want)
    assert len(grads) == len(want_grads) == 3 + len(list(attn.parameters()))
    for got, expected in zip(grads, want_grads):
        _assert_equal(got, expected)


@pytest.mark.parametrize("recipe", ["current hybrid", "delayed hif8"])
def test_simulated_npu_runs_fp8_attention_on_npu_fusion_attention(recipe, use_backend):
    """On the NPU backend (torch_npu simulated) the quantizes are the NPU's and attention is
    `npu_fusion_attention`, run in forward and again in backward: outputs and gradients equal the reference
    backend's bit for bit."""
    from mindspeed_te.kernels import get_backend

    tensors = _inputs()
    dout = torch.randn(S, B, H * D, generator=torch.Generator().manual_seed(10)).bfloat16()
    results = []
    for backend in ("reference", "npu"):
        use_backend(backend)
        attn = DotProductAttention(H, D, num_gqa_groups=G, attn_mask_type="causal")
        results.append(_run(attn, RECIPES[recipe](), tensors, dout))
    assert get_backend().npu.launch_counts["npu_fusion_attention"] == 2
    (want, want_grads), (got, grads) = results
    _assert_equal(got, want)
    for g, w in zip(grads, want_grads):
        _assert_equal(g, w)


def test_dropout_draws_the_same_mask_in_the_recompute():
    """Dropout through an RNG tracker: the forward draws the reference's mask from the tracker (the same
    output), the backward's recompute draws it again from the saved state (the same gradients) without
    advancing the tracker, and a later call draws a new mask."""
    from mindspeed_te.megatron.misc import TECudaRNGStatesTracker

    tracker = TECudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 11)
    attn = DotProductAttention(H, D, num_gqa_groups=G, attention_dropout=0.5, attn_mask_type="causal",
                               get_rng_state_tracker=lambda: tracker)
    tensors, dout = _inputs(), torch.randn(S, B, H * D, generator=torch.Generator().manual_seed(9)).bfloat16()
    start = tracker.get_states()
    out, grads = _run(attn, Float8CurrentScaling(fp8_dpa=True), tensors, dout)
    after = tracker.get_states()
    tracker.set_states(start)
    want, want_grads = reference(attn, tensors, dout, "hybrid", current_scales("hybrid"), False)
    assert torch.equal(tracker.get_states()["model-parallel-rng"], after["model-parallel-rng"])
    _assert_equal(out, want)
    for got, expected in zip(grads, want_grads):
        _assert_equal(got, expected)
    again, _ = _run(attn, Float8CurrentScaling(fp8_dpa=True), tensors, dout)
    assert not torch.equal(again, out)


def test_fp8_metadata_is_checkpointed_as_te_keeps_dpa_s():
    """Delayed scaling's amax histories and scales travel in `_extra_state` (TE's DPA: 3 GEMMs' slots, 9 forward
    and 6 backward) and load into a new module; a state dict saved before attention kept any loads too."""
    attn = DotProductAttention(H, D, num_gqa_groups=G)
    _run(attn, DelayedScaling(fp8_dpa=True, amax_history_len=4), _inputs(), torch.ones(S, B, H * D).bfloat16())
    fwd, bwd = attn.fp8_states
    assert fwd.amax_history.shape == (4, 9) and bwd.amax_history.shape == (4, 6)
    assert fwd.scale[2] != 1 and fwd.scale[3] != 1 and bwd.scale[0] != 1 and bwd.scale[3] != 1  # QKV, O, dQKV, dO
    loaded = DotProductAttention(H, D, num_gqa_groups=G)
    loaded.load_state_dict(attn.state_dict())
    for state, want in zip(loaded.fp8_states, (fwd, bwd)):
        assert torch.equal(state.amax_history, want.amax_history) and torch.equal(state.scale, want.scale)
    DotProductAttention(H, D, num_gqa_groups=G).load_state_dict({})  # strict: no `_extra_state` needed


# NVTE_DPA_FP8_RECIPE: TE's table of attention recipes under other linear recipes.
# name -> (linear recipe, NVTE_DPA_FP8_* settings, the attention recipe's class, its FORMATS case)
DPA_CASES: dict[str, tuple[Callable[[], object], dict[str, str], type, str]] = {
    "mxfp8 -> current": (lambda: MXFP8BlockScaling(fp8_dpa=True), {"NVTE_DPA_FP8_RECIPE": "Float8CurrentScaling"},
                         Float8CurrentScaling, "e4m3"),
    "mxfp8 hybrid -> current": (lambda: MXFP8BlockScaling(fp8_format=Format.HYBRID, fp8_dpa=True),
                                {"NVTE_DPA_FP8_RECIPE": "Float8CurrentScaling"}, Float8CurrentScaling, "hybrid"),
    "mxfp8 -> delayed": (lambda: MXFP8BlockScaling(fp8_dpa=True), {"NVTE_DPA_FP8_RECIPE": "DelayedScaling"},
                         DelayedScaling, "e4m3"),
    "current -> delayed": (lambda: Float8CurrentScaling(fp8_dpa=True), {"NVTE_DPA_FP8_RECIPE": "DelayedScaling"},
                           DelayedScaling, "hybrid"),
    "current, unset": (lambda: Float8CurrentScaling(fp8_dpa=True), {}, Float8CurrentScaling, "hybrid"),
    "delayed -> current": (lambda: DelayedScaling(fp8_mha=True), {"NVTE_DPA_FP8_RECIPE": "Float8CurrentScaling"},
                           Float8CurrentScaling, "hybrid"),
    "delayed, delayed": (lambda: DelayedScaling(fp8_dpa=True), {"NVTE_DPA_FP8_RECIPE": "DelayedScaling"},
                         DelayedScaling, "hybrid"),
    "hif8 delayed -> current": (lambda: HIF8DelayedScaling(fp8_dpa=True),
                                {"NVTE_DPA_FP8_RECIPE": "Float8CurrentScaling"}, Float8CurrentScaling, "hif8"),
    "nvfp4 -> current e4m3": (lambda: NVFP4BlockScaling(fp8_dpa=True),
                              {"NVTE_DPA_FP8_RECIPE": "Float8CurrentScaling", "NVTE_DPA_FP8_FORMAT": "E4M3"},
                              Float8CurrentScaling, "e4m3"),
    "nvfp4 -> delayed": (lambda: NVFP4BlockScaling(fp8_dpa=True), {"NVTE_DPA_FP8_RECIPE": "DelayedScaling"},
                         DelayedScaling, "hybrid"),
    "mxfp4 -> current hif8": (lambda: MXFP4BlockScaling(fp8_dpa=True),
                              {"NVTE_DPA_FP8_RECIPE": "Float8CurrentScaling", "NVTE_DPA_FP8_FORMAT": "HIF8"},
                              Float8CurrentScaling, "hif8"),
}


def _attention_with_env(monkeypatch, env: dict[str, str]) -> DotProductAttention:
    """A DotProductAttention made with `env` set: it reads the NVTE_DPA_FP8_* variables when made, as TE at
    import (the variables are unset again after the test)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return DotProductAttention(H, D, num_gqa_groups=G, attn_mask_type="causal")


@pytest.mark.parametrize("case", list(DPA_CASES))
def test_nvte_dpa_fp8_recipe_runs_attention_under_te_s_choice(case, monkeypatch):
    """Each row of TE's table: attention runs under the recipe it names, made from the linear recipe's fp8_dpa /
    fp8_mha and format (NVTE_DPA_FP8_FORMAT's under FP4 linears), and equals the reference of that recipe bit
    for bit: current scaling's scales, or delayed scaling's first step (scale 1)."""
    linear, env, kind, fmt_case = DPA_CASES[case]
    attn = _attention_with_env(monkeypatch, env)
    tensors = _inputs()
    dout = torch.randn(S, B, H * D, generator=torch.Generator().manual_seed(6)).bfloat16()
    recipe = linear()
    out, grads = _run(attn, recipe, tensors, dout)
    chosen = attn.fp8_meta["recipe"]
    assert type(chosen) is kind and (chosen.fp8_dpa, chosen.fp8_mha) == (recipe.fp8_dpa, recipe.fp8_mha)
    if chosen is not recipe:
        assert chosen.fp8_format is Format[fmt_case.upper()]
    delayed = kind is DelayedScaling
    scales = (lambda role, t: np.float32(1.0)) if delayed else current_scales(fmt_case)
    want, want_grads = reference(attn, tensors, dout, fmt_case, scales, delayed)
    _assert_equal(out, want)
    for got, expected in zip(grads, want_grads):
        _assert_equal(got, expected)


def test_delayed_attention_under_mxfp8_linears_keeps_its_own_amax_history(monkeypatch):
    """NVTE_DPA_FP8_RECIPE=DelayedScaling under MXFP8 linears, with the NVTE_DPA_FP8DS_* settings: attention's own
    delayed recipe (3-step history, "max", no amax reduction) takes its scales from its amax history step after
    step, as the reference does; "most_recent" would differ at the fourth step."""
    env = {"NVTE_DPA_FP8_RECIPE": "DelayedScaling", "NVTE_DPA_FP8DS_AMAX_HISTLEN": "3",
           "NVTE_DPA_FP8DS_AMAX_ALGO": "max", "NVTE_DPA_FP8DS_REDUCE_AMAX": "0"}
    attn = _attention_with_env(monkeypatch, env)
    recipe = MXFP8BlockScaling(fp8_dpa=True)
    _check_delayed_steps(attn, recipe, "e4m3", 3, "max", (1.0, 2.0, 0.5, 0.25))
    assert attn.fp8_meta["recipe"] == DelayedScaling(fp8_format=Format.E4M3, amax_history_len=3,
                                                     amax_compute_algo="max", reduce_amax=False, fp8_dpa=True)
    assert attn.fp8_states[0].amax_history.shape == (3, 9)


@pytest.mark.parametrize("linear,env,warning", [
    (lambda: DelayedScaling(fp8_dpa=True), {"NVTE_DPA_FP8_RECIPE": "F16"}, None),
    (lambda: MXFP8BlockScaling(fp8_dpa=True), {"NVTE_DPA_FP8_RECIPE": "F16"}, None),
    (lambda: MXFP8BlockScaling(fp8_dpa=True), {}, r"under MXFP8BlockScaling: .*NVTE_DPA_FP8_RECIPE chooses"),
    (lambda: Float8CurrentScaling(fp8_dpa=True), {"NVTE_DPA_FP8_RECIPE": "MXFP8BlockScaling"},
     r"under MXFP8BlockScaling \(NVTE_DPA_FP8_RECIPE\)"),
    (lambda: Float8BlockScaling(fp8_dpa=True), {"NVTE_DPA_FP8_RECIPE": "DelayedScaling"}, "under Float8BlockScaling"),
    (lambda: NVFP4BlockScaling(fp8_dpa=True), {}, "under NVFP4BlockScaling"),
])
def test_attention_stays_in_high_precision_where_te_s_choice_is_not_fp8_per_tensor(linear, env, warning,
                                                                                    monkeypatch):
    """NVTE_DPA_FP8_RECIPE=F16 keeps attention in high precision without a word, as TE does; MXFP8 attention (the
    linear recipe's, or NVTE_DPA_FP8_RECIPE's) and the recipes TE has no row for warn, naming the recipe, and
    stay in high precision: the output and gradients are those of attention outside FP8, and no FP8 state is
    made."""
    attn = _attention_with_env(monkeypatch, env)
    tensors, dout = _inputs(), torch.ones(S, B, H * D, dtype=torch.bfloat16)
    if warning is None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, grads = _run(attn, linear(), tensors, dout)
    else:
        with pytest.warns(UserWarning, match=warning):
            out, grads = _run(attn, linear(), tensors, dout)
    leaves = [t.clone().requires_grad_() for t in tensors]
    want = attn(*leaves)
    want.backward(dout)
    _assert_equal(out, want.detach())
    for got, expected in zip(grads, [t.grad for t in leaves]):
        _assert_equal(got, expected)
    assert attn.fp8_states is None


@pytest.mark.parametrize("name,value,message", [
    ("NVTE_DPA_FP8_RECIPE", "Delayed", "NVTE_DPA_FP8_RECIPE must be one of 'F16', 'DelayedScaling', "
                                       "'Float8CurrentScaling', 'MXFP8BlockScaling' or unset, got 'Delayed'"),
    ("NVTE_DPA_FP8_FORMAT", "E5M2", "NVTE_DPA_FP8_FORMAT must be one of 'HYBRID', 'E4M3', 'HIF8', got 'E5M2'"),
    ("NVTE_DPA_FP8DS_AMAX_ALGO", "mean", "NVTE_DPA_FP8DS_AMAX_ALGO must be one of 'most_recent', 'max', got 'mean'"),
    ("NVTE_DPA_FP8DS_AMAX_HISTLEN", "0", "NVTE_DPA_FP8DS_AMAX_HISTLEN must be an integer >= 1, got '0'"),
    ("NVTE_DPA_FP8DS_AMAX_HISTLEN", "two", "NVTE_DPA_FP8DS_AMAX_HISTLEN must be an integer >= 1, got 'two'"),
    ("NVTE_DPA_FP8DS_REDUCE_AMAX", "yes", "NVTE_DPA_FP8DS_REDUCE_AMAX must be one of '1', '0', got 'yes'"),
])
def test_bad_nvte_dpa_fp8_values_are_refused_naming_the_variable(name, value, message, monkeypatch):
    """A value TE does not take (or no recipe here takes: all-E5M2) is refused when the module is made."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        DotProductAttention(H, D)


def test_megatron_block_with_fp8_dot_product_attention():
    """Megatron's TransformerBlock (TE spec, bf16) with config.fp8_dot_product_attention: Megatron's recipe
    carries fp8_dpa to every core attention (delayed, tensorwise, hif8_delayed), whose output is FP8 attention's:
    not the high-precision one, close to it; forward and backward run, and delayed scaling records the
    attention's amaxes in its own slots."""
    from mindspeed_te.bench.gpt import megatron_world
    from mindspeed_te.bench.layer import build_block

    x = torch.randn(64, 2, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    with megatron_world():
        for fp8 in (("hybrid", "delayed"), ("e4m3", "tensorwise"), ("hif8", "hif8_delayed")):
            outputs = {}
            for dpa in (False, True):
                block = build_block(1, fp8, moe=False, fp8_dot_product_attention=dpa)
                attention = block.layers[0].self_attention.core_attention
                seen = []
                attention.register_forward_hook(lambda _m, _i, out, seen=seen: seen.append(out.detach()))
                inp = x.clone().requires_grad_()
                block(inp, attention_mask=None).float().square().mean().backward()
                outputs[dpa] = seen[0]
                assert torch.isfinite(inp.grad).all()
            error = (outputs[True].float() - outputs[False].float()).norm() / outputs[False].float().norm()
            assert 0 < error < 0.1, (fp8, error)
            recipe = attention.fp8_meta["recipe"]
            assert recipe.fp8_dpa
            if recipe.delayed():
                fwd, bwd = attention.fp8_states
                assert fwd.scale[2] != 1 and bwd.scale[3] != 1  # QKV and dO slots updated after the step


@pytest.mark.parametrize("dpa_recipe", ["Float8CurrentScaling", "DelayedScaling"])
def test_megatron_block_with_mxfp8_linears_and_nvte_dpa_fp8_recipe(dpa_recipe, monkeypatch):
    """Megatron's TransformerBlock (TE spec, bf16) with --fp8-recipe mxfp8, config.fp8_dot_product_attention and
    NVTE_DPA_FP8_RECIPE: Megatron's MXFP8 recipe carries fp8_dpa (as megatron-core 0.18 on does), and core
    attention runs in FP8 under the recipe the variable names, close to high precision. Delayed attention's
    amaxes are reduced and its scales updated, forward at the autocast's exit and backward after the first FP8
    module's (linear_qkv, MXFP8) backward."""
    from mindspeed_te.bench.gpt import megatron_world
    from mindspeed_te.bench.layer import build_block

    x = torch.randn(64, 2, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    outputs = {}
    with megatron_world():
        for dpa in (False, True):
            if dpa:
                monkeypatch.setenv("NVTE_DPA_FP8_RECIPE", dpa_recipe)
            block = build_block(1, ("e4m3", "mxfp8"), moe=False, fp8_dot_product_attention=dpa)
            attention = block.layers[0].self_attention.core_attention
            attention.register_forward_hook(lambda _m, _i, out, dpa=dpa: outputs.update({dpa: out.detach()}))
            inp = x.clone().requires_grad_()
            block(inp, attention_mask=None).float().square().mean().backward()
            assert torch.isfinite(inp.grad).all()
    error = (outputs[True].float() - outputs[False].float()).norm() / outputs[False].float().norm()
    assert 0 < error < 0.1, error
    recipe = attention.fp8_meta["recipe"]
    assert type(recipe).__name__ == dpa_recipe and recipe.fp8_dpa and recipe.fp8_format is Format.E4M3
    if recipe.delayed():
        fwd, bwd = attention.fp8_states
        assert fwd.scale[2] != 1 and bwd.scale[3] != 1  # QKV and dO slots updated after the step


def test_the_flags_reach_the_recipe_and_are_refused_where_it_would_drop_them():
    """--fp8-dot-product-attention / --fp8-multi-head-attention (TransformerConfig fields Megatron's parser has no
    flag for) parse, and are refused with a recipe that would not carry them or an NVTE_DPA_FP8_RECIPE that keeps
    attention in high precision (it would be silently), a bad NVTE_DPA_FP8_* value, and Megatron's selective
    recompute of core attention (it reruns attention outside FP8 autocast). --fp8-recipe mxfp8 carries
    fp8_dpa when NVTE_DPA_FP8_RECIPE makes its attention per-tensor."""
    from mindspeed_te.patches.arguments import validate_args
    from tests.test_patches_arguments import _parse

    args = _parse(["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-dot-product-attention"])
    assert args.fp8_dot_product_attention and not args.fp8_multi_head_attention
    assert _parse(["--fp8-format", "hif8", "--fp8-recipe", "hif8_delayed", "--fp8-multi-head-attention"]
                  ).fp8_multi_head_attention
    with pytest.raises(ValueError, match="--fp8-dot-product-attention needs --fp8-format and --fp8-recipe delayed, "
                                         "hif8_delayed, tensorwise .*--fp8-recipe mxfp8"):
        _parse(["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--fp8-dot-product-attention"])
    with pytest.raises(ValueError, match="--fp8-multi-head-attention needs .* delayed, hif8_delayed "):
        _parse(["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--fp8-multi-head-attention"])
    with pytest.raises(ValueError, match="--fp8-format None"):
        _parse(["--fp8-dot-product-attention"])
    mxfp8 = ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--fp8-dot-product-attention"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("NVTE_DPA_FP8_RECIPE", "Float8CurrentScaling")  # MXFP8 linears, current-scaling attention
        assert _parse(mxfp8).fp8_dot_product_attention
        env.setenv("NVTE_DPA_FP8_RECIPE", "MXFP8BlockScaling")
        with pytest.raises(ValueError, match="NVTE_DPA_FP8_RECIPE=MXFP8BlockScaling: mindspeed_te has no MXFP8 "
                                             "attention"):
            _parse(["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-dot-product-attention"])
        env.setenv("NVTE_DPA_FP8_RECIPE", "DS")
        with pytest.raises(ValueError, match="NVTE_DPA_FP8_RECIPE must be one of"):
            _parse(mxfp8)
    args = argparse.Namespace(fp8="hybrid", fp8_recipe="delayed", fp8_dot_product_attention=True,
                              recompute_granularity="selective", recompute_modules=None)
    with pytest.raises(ValueError, match="--fp8-dot-product-attention with --recompute-granularity selective "
                                         "recomputing core_attn"):
        validate_args(args)
    validate_args(argparse.Namespace(**{**vars(args), "recompute_modules": ["mlp"]}))


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_PATH"), reason="needs MEGATRON_LM_PATH (Megatron-LM checkout)")
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "mxfp8"])
def test_real_megatron_hands_fp8_dot_product_attention_to_the_recipe(monkeypatch, recipe):
    """Megatron's own parse_args, validate_args and core_transformer_config_from_args: the flag becomes
    config.fp8_dot_product_attention, and the recipe built from the config has fp8_dpa (mxfp8: with
    NVTE_DPA_FP8_RECIPE=Float8CurrentScaling, its attention's recipe)."""
    monkeypatch.syspath_prepend(os.environ["MEGATRON_LM_PATH"])
    if recipe == "mxfp8":
        monkeypatch.setenv("NVTE_DPA_FP8_RECIPE", "Float8CurrentScaling")
    from megatron.training import arguments

    from mindspeed_te.megatron.common import recipe_from_config
    from mindspeed_te.patches.arguments import wrap_config_from_args, wrap_parse_args

    monkeypatch.setattr(sys, "argv", [
        "pretrain_gpt.py", "--fp8-format", "hybrid", "--fp8-recipe", recipe, "--fp8-dot-product-attention",
        "--transformer-impl", "transformer_engine", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "1", "--global-batch-size", "1", "--bf16", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "256"])
    args = wrap_parse_args(arguments.parse_args)(None, False)
    arguments.validate_args(args, {})
    config = wrap_config_from_args(arguments.core_transformer_config_from_args)(args)
    assert config.fp8_dot_product_attention and recipe_from_config(config).fp8_dpa


def _fp8_cp_worker(rank: int, world: int, *args):
    """tests/test_attention.py's context-parallel worker inside FP8 autocast (current scaling)."""
    from tests.test_attention import _te_attention_worker

    with fp8_autocast(fp8_recipe=Float8CurrentScaling(fp8_dpa=True)):
        return _te_attention_worker(rank, world, *args)


@pytest.mark.slow
@pytest.mark.parametrize("fmt,window,softmax_type", [("sbhd", None, "vanilla"), ("sbhd", (3, 0), "off-by-one"),
                                                     ("thd", None, "learnable")])
def test_context_parallel_fp8_attention_matches_one_process(fmt, window, softmax_type):
    """CP=2 over gloo: the backward's recompute gathers the keys and values again (and reduce-scatters their
    gradients) in the same order on every rank, and current scaling reduces each amax over the CP group, so every
    rank's output and gradients equal FP8 attention on one process (which differs from high precision)."""
    from tests.dist_utils import run_distributed
    from tests.test_attention import _te_attention_worker

    g = torch.Generator().manual_seed(11)
    cu = torch.tensor([0, 8, 20, 24], dtype=torch.int32)
    tokens = S if fmt == "sbhd" else int(cu[-1])
    shape = (tokens, B, H, D) if fmt == "sbhd" else (tokens, H, D)
    kv_shape = shape[:-2] + (2, D)
    full = {"q": torch.randn(shape, generator=g), "k": torch.randn(kv_shape, generator=g),
            "v": torch.randn(kv_shape, generator=g), "dout": torch.randn(shape[:-2] + (H * D,), generator=g),
            "offset": torch.tensor([0.3, -0.7, 1.1, 0.0]), "cu": cu}
    single = run_distributed(_fp8_cp_worker, 1, fmt, window, softmax_type, full)[0]
    plain = run_distributed(_te_attention_worker, 1, fmt, window, softmax_type, full)[0]
    assert not torch.allclose(single["out"], plain["out"], atol=1e-3)
    for part in run_distributed(_fp8_cp_worker, 2, fmt, window, softmax_type, full):
        index = part["index"]
        for name in ("out", "dq", "dk", "dv"):
            assert torch.allclose(part[name], single[name][index], atol=1e-5), name
