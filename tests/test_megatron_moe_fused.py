"""The torch stand-ins for TE's fused MoE kernels (mindspeed_te.megatron.moe_fused), called through
megatron-core's own entry points with fused=True, against the same entry points unfused: outputs and
gradients, on whichever megatron-core release is importable (a case its release lacks is skipped)."""
from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch

pytest.importorskip("megatron.core")

import megatron.core.utils  # noqa: E402
from megatron.core.transformer.moe import moe_utils as mu  # noqa: E402
from packaging.version import Version  # noqa: E402

from mindspeed_te.megatron import moe_fused  # noqa: E402

EXACT = dict(rtol=0, atol=0)


@pytest.fixture
def bind(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
    """bind(gemm) puts the stand-ins where moe_utils looks for TE's kernels (te_general_gemm only when asked:
    Megatron's unfused router GEMM is chosen by that name being None), and reports a TE version that the
    newest releases' gates accept (>= 2.12: unpermute passes pad_offsets; >= 2.13: fused sqrtsoftplus)."""

    def apply(gemm: bool = False) -> None:
        monkeypatch.setattr(mu, "HAVE_TE", True, raising=False)
        monkeypatch.setattr(megatron.core.utils, "_te_version", Version("2.13.0"), raising=False)
        for name in moe_fused.__all__:
            value = getattr(moe_fused, name) if name != "te_general_gemm" or gemm else None
            monkeypatch.setattr(mu, name, value, raising=False)

    apply()
    return apply


def _fused_arg(name: str) -> None:
    """Skip unless this release's moe_utils.<name> takes `fused`."""
    fn = getattr(mu, name, None)
    if fn is None or "fused" not in inspect.signature(fn).parameters:
        pytest.skip(f"this megatron-core's {name} has no fused path")


def _run(fn: Callable[..., Any], *inputs: Any, seed: int = 0) -> tuple[list, list]:
    """fn on fresh leaves of the floating inputs; backward of a fixed random weighting (bfloat16 values, so
    that every output dtype receives the same gradient) of its differentiable outputs.
    -> (outputs, input gradients)."""
    leaves = [x.detach().clone().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point()
              else x for x in inputs]
    outs = fn(*leaves)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    gen = torch.Generator().manual_seed(seed)
    live = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    sum((o.double() * torch.randn(o.shape, generator=gen).bfloat16().double()).sum() for o in live).backward()
    grads = [x.grad for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
    return [o.detach() if isinstance(o, torch.Tensor) else o for o in outs], grads


def _assert_same(got: list, want: list, **tol: float) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None or g is None:
            assert g is None and w is None
        else:
            torch.testing.assert_close(g, w, **tol)


# ----------------------------------------------------------------------------------------------- permutation


def _routing(num_tokens: int, num_experts: int, topk: int, mode: str, gen: torch.Generator):
    """(probs [T, E] zero off the map, routing_map, num_out_tokens) as Megatron's router hands them over:
    dropless top-k, capacity-dropped (rows with fewer than topk experts, some with none) or dropped and
    padded to capacity (every expert exactly `capacity` tokens, padding ones with prob 0)."""
    scores = torch.softmax(torch.randn(num_tokens, num_experts, generator=gen), dim=-1)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, scores.topk(topk, dim=1).indices, True)
    probs = scores * routing_map
    if mode == "dropless":
        return probs, routing_map, num_tokens * topk
    capacity = max(1, num_tokens * topk // num_experts // 2)
    keep = torch.zeros_like(routing_map).scatter(0, probs.topk(capacity, dim=0).indices, True)
    if mode == "dropped":
        routing_map = routing_map & keep
        return probs * routing_map, routing_map, routing_map.sum()  # a tensor, as the alltoall dispatcher's
    return probs * keep, keep, capacity * num_experts


SHAPES = [(16, 8, 2, 32), (33, 6, 1, 8), (20, 16, 4, 24)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("mode", ["dropless", "dropped", "drop_and_pad"])
@pytest.mark.parametrize("shape", SHAPES)
def test_permute_and_unpermute_match_unfused(bind, shape, mode, with_probs, dtype):
    """permute then unpermute (Megatron's dispatch and combine), fused against unfused: permuted rows and
    probs, the restored tokens, and every gradient. float32 is exact; bfloat16 rows are summed in float32
    by the stand-ins (TE's precision), in bfloat16 by Megatron's unfused code."""
    num_tokens, num_experts, topk, hidden = shape
    gen = torch.Generator().manual_seed(sum(shape))
    probs, routing_map, num_out = _routing(num_tokens, num_experts, topk, mode, gen)
    tokens = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    expert_out = torch.randn(int(num_out), hidden, generator=gen).to(dtype)
    pad = mode == "drop_and_pad"
    tol = EXACT if dtype == torch.float32 else {}

    def dispatch(fused: bool) -> tuple[list, list, torch.Tensor]:
        def fn(tokens, probs=None):
            out = mu.permute(tokens, routing_map, probs=probs, num_out_tokens=num_out, fused=fused,
                             drop_and_pad=pad)
            mapping.append(out[2])
            return out[0], out[1]
        mapping: list = []
        outs, grads = _run(fn, tokens, *([probs] if with_probs else []))
        return outs, grads, mapping[0]

    def combine(fused: bool, mapping: torch.Tensor) -> tuple[list, list]:
        def fn(rows, merge=None):
            return mu.unpermute(rows, mapping, tokens.shape, probs=merge, routing_map=routing_map, fused=fused,
                                drop_and_pad=pad)
        return _run(fn, expert_out, *([probs] if with_probs else []), seed=1)

    want_outs, want_grads, want_map = dispatch(False)
    got_outs, got_grads, got_map = dispatch(True)
    _assert_same(got_outs, want_outs, **EXACT)  # a gather: exact in any dtype
    _assert_same(got_grads, want_grads, **tol)
    got, want = combine(True, got_map), combine(False, want_map)
    _assert_same(got[0], want[0], **tol)
    _assert_same(got[1], want[1], **tol)


def test_permute_counts_rows_and_handles_edge_sizes():
    """num_out_tokens None / -1 counts the routed pairs; more rows than pairs leave the extras out of every
    token's sum and gradient; fewer drop the last pairs; no tokens gives empty results."""
    gen = torch.Generator().manual_seed(3)
    probs, routing_map, num_out = _routing(12, 4, 2, "dropless", gen)
    tokens = torch.randn(12, 5, generator=gen)
    full, full_map = moe_fused.fused_permute(tokens, routing_map, num_out)
    for count in (None, -1, 0):
        out, row_map = moe_fused.fused_permute(tokens, routing_map, count)
        assert torch.equal(out, full) and torch.equal(row_map, full_map)
    x = tokens.clone().requires_grad_()
    wide, wide_map = moe_fused.fused_permute(x, routing_map, num_out + 5)
    assert wide.shape[0] == num_out + 5 and torch.equal(wide[:num_out], full)
    merged = moe_fused.fused_unpermute(wide, wide_map, restore_shape=tokens.shape)
    merged.sum().backward()
    assert torch.equal(merged, 2 * tokens) and torch.equal(x.grad, torch.full_like(tokens, 2.0))  # top-2 rows
    weighted = moe_fused.fused_unpermute(full, full_map, merging_probs=probs, restore_shape=tokens.shape)
    assert torch.equal(moe_fused.fused_unpermute(wide, wide_map, probs, tokens.shape), weighted)
    narrow, narrow_map = moe_fused.fused_permute(tokens, routing_map, num_out - 3)
    assert torch.equal(narrow, full[:-3]) and torch.equal(narrow_map, full_map[:, :-3])
    empty, empty_map = moe_fused.fused_permute(tokens[:0], routing_map[:0], num_out)
    assert empty.shape == (0, 5) and empty_map.shape == (2, 0)
    assert moe_fused.fused_unpermute(empty, empty_map, restore_shape=empty.shape).shape == (0, 5)


@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("order", ["by_local_expert", "random", "one rank", "one rank, restored"])
def test_sort_chunks_match_unfused(bind, order, with_probs):
    """sort_chunks_by_idxs (the alltoall dispatcher's regrouping of received chunks by local expert, and back), with
    empty chunks, sizes given as a tensor: a pure reordering, so exact in rows and gradients. The orders are marked
    as the patched dispatcher marks its own at init: with one rank they are the identity, which the fused sort
    leaves as it is (no launch); with three ranks they are not, and are sorted."""
    from mindspeed_te.diagnostics import LaunchCounter

    gen = torch.Generator().manual_seed(7)
    ranks, local = (1, 4) if order.startswith("one rank") else (3, 4)
    sizes = torch.randint(0, 5, (ranks * local,), generator=gen)
    sizes[[1, 3 if ranks == 1 else 6]] = 0
    chunks = torch.arange(ranks * local)  # as megatron-core's alltoall dispatcher makes its orders
    dispatcher = SimpleNamespace(tp_size=1, ep_size=ranks,
                                 sort_input_by_local_experts=chunks.reshape(-1, local).T.ravel(),
                                 restore_output_by_local_experts=chunks.reshape(local, -1).T.ravel())
    moe_fused.mark_identity_chunk_orders(dispatcher)
    if order == "random":
        idxs = torch.randperm(ranks * local, generator=gen)
    elif order.endswith("restored"):
        idxs = dispatcher.restore_output_by_local_experts
    else:
        idxs = dispatcher.sort_input_by_local_experts
    rows = torch.randn(int(sizes.sum()), 6, generator=gen)
    probs = torch.rand(rows.shape[0], generator=gen)

    def run(fused: bool):
        return _run(lambda x, p=None: mu.sort_chunks_by_idxs(x, sizes, idxs, probs=p, fused=fused),
                    rows, *([probs] if with_probs else []))

    with LaunchCounter() as fused:
        got = run(True)
    want = run(False)
    _assert_same(got[0], want[0], **EXACT)
    _assert_same(got[1], want[1], **EXACT)
    sorting = {"aten.repeat_interleave", "aten.index_select"}
    assert (sorting & set(fused.counts)) == (set() if ranks == 1 else sorting), fused.counts


# ---------------------------------------------------------------------------------------------------- router

ROUTER_CASES = [
    # score_function, use_pre_softmax, topk, (num_groups, group_topk), expert_bias, scaling_factor
    ("softmax", False, 2, None, False, None),
    ("softmax", True, 2, None, False, None),
    ("softmax", False, 1, None, False, None),
    ("softmax", True, 4, (4, 2), False, 2.5),
    ("softmax", False, 4, (4, 2), False, None),
    ("sigmoid", False, 1, None, False, None),
    ("sigmoid", False, 3, None, False, 1.5),
    ("sigmoid", False, 2, None, True, None),
    ("sigmoid", False, 4, (4, 2), True, 2.5),
    ("sigmoid", False, 6, (8, 3), False, None),
    ("sqrtsoftplus", False, 4, None, True, 1.5),
]


def _distinct_logits(num_tokens: int, num_experts: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Logits with no ties within a token even in bfloat16 (multiples of 1/8): top-k picks one answer."""
    ranks = torch.stack([torch.randperm(num_experts, generator=gen) for _ in range(num_tokens)])
    return ((ranks - num_experts / 2) / 8).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ROUTER_CASES, ids=lambda c: "-".join(map(str, c)))
def test_topk_routing_matches_unfused(bind, case, dtype):
    """topk_routing_with_score_function: routing probs, map and logits gradient. bfloat16 logits are compared
    with Megatron's unfused code on the same logits in float32, rounded (the stand-in keeps scores in float32,
    as TE does and Megatron >= 0.17 does)."""
    _fused_arg("topk_routing_with_score_function")
    score_function, pre_softmax, topk, groups, bias, scaling = case
    if score_function not in inspect.getsource(mu.topk_routing_with_score_function):
        pytest.skip(f"this megatron-core has no {score_function} score function")
    num_tokens, num_experts = 24, 16
    gen = torch.Generator().manual_seed(topk)
    logits = _distinct_logits(num_tokens, num_experts, dtype, gen)
    if dtype == torch.float32:
        logits = logits + 0.01 * torch.randn(logits.shape, generator=gen)
    kwargs = dict(use_pre_softmax=pre_softmax, scaling_factor=scaling, score_function=score_function,
                  num_groups=groups[0] if groups else None, group_topk=groups[1] if groups else None,
                  expert_bias=0.1 * torch.randn(num_experts, generator=gen) if bias else None)

    def run(fused: bool, x: torch.Tensor):
        return _run(lambda x: mu.topk_routing_with_score_function(x, topk, fused=fused, **kwargs), x)

    got = run(True, logits)
    want = run(False, logits.float())
    want = [[t.to(o.dtype) for t, o in zip(w, g)] for w, g in zip(want, got)]
    assert got[0][0].dtype == dtype and got[0][1].dtype == torch.bool
    assert torch.equal(got[0][1].sum(dim=1), torch.full((num_tokens,), topk))
    _assert_same(got[0], want[0], **EXACT)
    _assert_same(got[1], want[1], **EXACT)


def test_routing_outputs_are_new_tensors():
    """The router scatters into zeros it keeps (one launch each): its outputs and the logits' gradient are new
    tensors each call, so that writing into one call's leaves the next call's as Megatron's unfused code gives."""
    _fused_arg("topk_routing_with_score_function")  # (the releases with the fused router: its unfused form)
    gen = torch.Generator().manual_seed(0)
    logits = _distinct_logits(8, 6, torch.float32, gen).requires_grad_()
    seed = torch.randn(8, 6, generator=gen)
    first = moe_fused.fused_topk_with_score_function(logits, 2)
    first[0].backward(seed)
    for t in (*first, logits.grad):
        t.detach().fill_(True)
    logits.grad = None
    again = moe_fused.fused_topk_with_score_function(logits, 2)
    again[0].backward(seed)
    unfused = logits.detach().clone().requires_grad_()
    want = mu.topk_routing_with_score_function(unfused, 2)
    want[0].backward(seed)
    assert torch.equal(again[0], want[0]) and torch.equal(again[1], want[1])
    assert torch.equal(logits.grad, unfused.grad) and torch.equal(logits.grad != 0, again[1])


@pytest.mark.parametrize("topk", [1, 2, 5])
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_aux_loss_scores_match_unfused(bind, score_function, topk):
    """compute_routing_scores_for_aux_loss: the top-k map and float32 normalized scores, and their gradient."""
    _fused_arg("compute_routing_scores_for_aux_loss")
    if score_function not in inspect.getsource(mu.compute_routing_scores_for_aux_loss):
        pytest.skip(f"this megatron-core has no {score_function} score function")
    logits = torch.randn(20, 12, generator=torch.Generator().manual_seed(topk))

    def run(fused: bool):
        return _run(lambda x: mu.compute_routing_scores_for_aux_loss(x, topk, score_function, fused=fused), logits)

    got, want = run(True), run(False)
    assert got[0][0].dtype == torch.bool and got[0][1].dtype == torch.float32
    _assert_same(got[0], want[0], **EXACT)
    _assert_same(got[1], want[1], **EXACT)


@pytest.mark.parametrize("total", ["int", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_balancing_loss_matches_unfused(bind, dtype, total):
    """switch_load_balancing_loss_func: the loss and its probs gradient; the token count as an int or (with a
    padding mask) a float tensor. The loss comes in the probs' dtype, as TE's does (Megatron's unfused one is
    float32 for bfloat16 probs and a tensor count)."""
    _fused_arg("switch_load_balancing_loss_func")
    gen = torch.Generator().manual_seed(11)
    num_tokens, num_experts, topk = 30, 8, 2
    probs = torch.softmax(torch.randn(num_tokens, num_experts, generator=gen), dim=-1).to(dtype)
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(
        1, probs.topk(topk, dim=1).indices, True)
    tokens_per_expert = routing_map.sum(dim=0)
    total_tokens = num_tokens * 2 if total == "int" else tokens_per_expert.sum() / topk * 2

    def run(fused: bool):
        return _run(lambda p: mu.switch_load_balancing_loss_func(
            probs=p, tokens_per_expert=tokens_per_expert, total_num_tokens=total_tokens, topk=topk,
            num_experts=num_experts, moe_aux_loss_coeff=0.01, fused=fused), probs)

    got, want = run(True), run(False)
    assert got[0][0].dtype == dtype and got[0][0].dim() == 0
    tol = EXACT if dtype == torch.float32 else dict(check_dtype=False)
    _assert_same(got[0], want[0], **tol)
    _assert_same(got[1], want[1], **tol)


# ------------------------------------------------------------------------------------------------------ GEMM


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_gating_gemm_matches_unfused(bind, monkeypatch, dtype, with_bias):
    """router_gating_linear (RouterGatingLinearFunction) with te_general_gemm bound against the torch.mm path
    it takes when the name is None: float32 logits from 16-bit input and weight, and the three gradients."""
    if not hasattr(mu, "RouterGatingLinearFunction"):
        pytest.skip("this megatron-core has no router gating GEMM")
    takes_bias = "bias" in inspect.signature(mu.router_gating_linear).parameters
    if with_bias and not takes_bias:
        pytest.skip("this megatron-core's router GEMM takes no bias")
    gen = torch.Generator().manual_seed(5)
    inp = torch.randn(4, 6, 32, generator=gen).to(dtype)
    weight = torch.randn(8, 32, generator=gen).to(dtype)
    bias = [torch.randn(8, generator=gen).to(dtype) if with_bias else None] if takes_bias else []

    def run(gemm: bool):
        monkeypatch.setattr(mu, "te_general_gemm", moe_fused.te_general_gemm if gemm else None, raising=False)
        return _run(lambda *a: mu.router_gating_linear(*a, torch.float32), inp, weight, *bias)

    got, want = run(True), run(False)
    assert got[0][0].dtype == torch.float32 and got[0][0].shape == (4, 6, 8)
    _assert_same(got[0], want[0], **EXACT)
    _assert_same(got[1], want[1], **EXACT)


def test_general_gemm_layouts_and_out():
    """D = op(B) @ op(A) for TE's three layouts, bias added, out_dtype honoured, `out` written in place."""
    gen = torch.Generator().manual_seed(9)
    a, b = torch.randn(5, 7, generator=gen), torch.randn(3, 7, generator=gen)
    bias = torch.randn(5, generator=gen)
    d = moe_fused.te_general_gemm(a.bfloat16(), b.bfloat16(), torch.float32, layout="TN", bias=bias)
    assert len(d) == 4 and d[0].dtype == torch.float32
    torch.testing.assert_close(d[0], b.bfloat16().float() @ a.bfloat16().float().t() + bias, **EXACT)
    torch.testing.assert_close(moe_fused.te_general_gemm(a.t(), b, layout="NN")[0], b @ a.t(), **EXACT)
    out = torch.empty(7, 7)
    res = moe_fused.te_general_gemm(a, a, out=out, layout="NT", grad=True)[0]
    assert res is out
    torch.testing.assert_close(out, a.t() @ a, **EXACT)
    with pytest.raises(ValueError, match="layout"):
        moe_fused.te_general_gemm(a, b, layout="TT")


def test_config_accepts_permute_fusion_once_bound(bind):
    """TransformerConfig(moe_permute_fusion=True) checks the five permutation names in moe_utils."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if "moe_permute_fusion" not in inspect.signature(TransformerConfig).parameters:
        pytest.skip("this megatron-core has no moe_permute_fusion")
    TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                      moe_permute_fusion=True, add_bias_linear=False)
