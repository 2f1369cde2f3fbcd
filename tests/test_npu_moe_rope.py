"""torch_npu's MoE permutation and RoPE kernels: the simulator's kernels against numpy / float64 oracles written
from the documents (aclnnMoeTokenPermute & co., aclnnRotaryPositionEmbedding & co., torch_npu's docs) and their
contract; the NPU backend on the simulator against the reference backend, through the library's entry points
(moe_fused's TE functions, TE's apply_rotary_pos_emb, MLA's fused RoPE)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import ml_dtypes
import numpy as np
import pytest
import torch

from mindspeed_te.diagnostics import HostSyncCounter, LaunchCounter
from mindspeed_te.kernels.npu import NpuBackend
from mindspeed_te.kernels.permutation import EXPERTS_PER_TOKEN, TOPK_EXPERTS, TOPK_PROBS
from mindspeed_te.megatron import moe_fused
from mindspeed_te.megatron.mla_rope import fused_apply_mla_rope_for_kv, fused_apply_mla_rope_for_q
from mindspeed_te.modules.rope import apply_rotary_pos_emb
from mindspeed_te.testing.npu_sim import (
    NpuSimNotImplemented,
    NpuSocError,
    NpuTypeError,
    NpuValueError,
    make_simulator,
)

CHIPS = ["Ascend950PR", "Ascend910B3", "Ascend910_9392"]  # Ascend 950, Atlas A2, Atlas A3


def assert_raises(fn: Callable[[], Any], exc: type, *words: str) -> None:
    with pytest.raises(exc) as info:
        fn()
    assert isinstance(info.value, RuntimeError)  # like torch_npu's own errors
    for word in words:
        assert word in str(info.value), str(info.value)


def dyadic(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Multiples of 1/8 in [-8, 8): their products and short sums are exact in float32 and float64 alike, so that a
    kernel's float32 sum rounded once is the float64 oracle's value rounded once."""
    return (torch.randint(-64, 64, shape, generator=gen).double() / 8).to(dtype)


def np64(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


def bf16(values: Any) -> np.ndarray:
    """float64 values (exact in float32 here) rounded once to bfloat16 (ml_dtypes), as float64."""
    return np.asarray(values, np.float64).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def topk_indices(tokens: int, experts: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[tokens, k] int64: distinct experts per token, ascending (as a routing map's rows give them)."""
    return torch.stack([torch.randperm(experts, generator=gen)[:k].sort().values for _ in range(tokens)])


# Simulator: npu_moe_token_permute / unpermute against numpy oracles ----------------------------------------------
def permute_oracle(tokens: np.ndarray, indices: np.ndarray, num_out: int) -> tuple[np.ndarray, np.ndarray]:
    """aclnnMoeTokenPermute: "sortedIndicesFirst=argSort(Indices)", "sortedIndicesOut=argSort(sortedIndicesFirst)",
    permuteTokens[sortedIndicesOut[i]] = tokens[i // topK] (stable sorts: op-plugin's test)."""
    topk = indices.shape[1]
    first = np.argsort(indices.reshape(-1), kind="stable")
    sorted_out = np.argsort(first, kind="stable")
    permuted = np.empty((indices.size, tokens.shape[1]))
    for i in range(indices.size):
        permuted[sorted_out[i]] = tokens[i // topk]
    return permuted[:num_out], sorted_out


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("tokens, experts, topk", [(7, 5, 2), (12, 8, 1), (9, 4, 4)])
def test_permute_kernel_is_the_documents_stable_sort(chip, tokens, experts, topk):
    gen = torch.Generator().manual_seed(tokens * topk)
    sim = make_simulator(chip)
    x = dyadic((tokens, 6), gen)
    indices = topk_indices(tokens, experts, topk, gen)
    for num_out, rows in [(None, tokens * topk), (0, tokens * topk), (tokens * topk + 3, tokens * topk),
                          (tokens, tokens), (-2, tokens * topk - 2)]:
        permuted, sorted_indices = sim.npu_moe_token_permute(x, indices, num_out)
        want, want_sorted = permute_oracle(np64(x), indices.numpy(), rows)
        assert permuted.dtype == torch.bfloat16 and sorted_indices.dtype == torch.int32
        np.testing.assert_array_equal(np64(permuted), want)
        np.testing.assert_array_equal(sorted_indices.numpy(), want_sorted)
    # repeated experts in a row, an index past the experts: the sort is all the kernel knows
    repeated = torch.tensor([[3, 3], [0, 7], [3, 0]])
    permuted, sorted_indices = sim.npu_moe_token_permute(x[:3], repeated)
    np.testing.assert_array_equal(np64(permuted), permute_oracle(np64(x[:3]), repeated.numpy(), 6)[0])


@pytest.mark.parametrize("topk", [1, 3])
def test_permute_and_unpermute_backward_are_one_grad_kernel_each(topk):
    """derivatives.yaml: npu_moe_token_permute's backward is npu_moe_token_permute_grad_v2, npu_moe_token_unpermute's
    npu_moe_token_unpermute_grad_v2 (with the probs' gradient); the values by aclnnMoeTokenPermuteGrad's
    "inputGrad = permutedOutputGrad.indexSelect(0, sortedIndices) ... .sum(dim = 1)" and aclnnMoeTokenUnpermute(Grad)'s
    formulas, against float64 (exact for these dyadic values)."""
    gen = torch.Generator().manual_seed(topk)
    sim = make_simulator()
    n, hidden = 6, 5
    x = dyadic((n, hidden), gen).requires_grad_()
    probs = dyadic((n, topk), gen).requires_grad_()
    indices = topk_indices(n, 4, topk, gen)
    permuted, sorted_indices = sim.npu_moe_token_permute(x, indices)
    rows = permuted * 2  # an "expert" between the two kernels
    out = sim.npu_moe_token_unpermute(rows, sorted_indices, probs=probs)
    dy = dyadic((n, hidden), gen)
    sim.reset_counts()
    out.backward(dy)
    assert sim.launch_counts == {"npu_moe_token_unpermute_grad_v2": 1, "npu_moe_token_permute_grad_v2": 1}
    s = sorted_indices.long().numpy()
    t, p, g = np64(rows), np64(probs), np64(dy)
    want_out = np.stack([sum(t[s[i * topk + j]] * p[i, j] for j in range(topk)) for i in range(n)])
    np.testing.assert_array_equal(np64(out), bf16(want_out))
    want_probs = np.array([[(g[i] * t[s[i * topk + j]]).sum() for j in range(topk)] for i in range(n)])
    np.testing.assert_array_equal(np64(probs.grad), bf16(want_probs))
    grad_rows = np.empty_like(t)
    for i in range(n):
        for j in range(topk):
            grad_rows[s[i * topk + j]] = bf16(g[i] * p[i, j])  # the grad kernel's bfloat16 output
    grad_rows = bf16(2 * grad_rows)  # the "expert"'s backward
    want_x = np.stack([sum(grad_rows[s[i * topk + j]] for j in range(topk)) for i in range(n)])
    np.testing.assert_array_equal(np64(x.grad), bf16(want_x))
    assert x.grad.dtype == probs.grad.dtype == torch.bfloat16
    # without probs: "topK_num=1", out[i] = permuted[sortedIndices[i]]
    flat = sim.npu_moe_token_unpermute(rows.detach(), sorted_indices)
    np.testing.assert_array_equal(np64(flat), t[s])


def test_moe_kernels_contract():
    """torch_npu doc: tokens / permuted_tokens / probs bfloat16, indices 2-D int64, "topK小于等于512", padded_mode
    only False; CANN: indices "值大于等于0小于16777215", sortedIndices int32 "取值范围是[0, tokens_num * topK_num - 1]，
    且没有重复索引", restoreShapeOptional "当前仅支持nullptr", the grad kernels' shapes and dtypes; the chips
    aclnnMoeTokenPermute lists (950, A2, A3)."""
    sim = make_simulator()
    x, idx = torch.ones(4, 8, dtype=torch.bfloat16), torch.tensor([[0, 1], [1, 2], [0, 2], [1, 3]])
    permuted, s = sim.npu_moe_token_permute(x, idx)
    probs = torch.ones(4, 2, dtype=torch.bfloat16)
    sim.npu_moe_token_unpermute(permuted, s, probs=probs)
    assert_raises(lambda: sim.npu_moe_token_permute(x.float(), idx), NpuTypeError, "tokens")
    assert_raises(lambda: sim.npu_moe_token_permute(x, idx.int()), NpuTypeError, "indices")
    assert_raises(lambda: sim.npu_moe_token_permute(x, idx.reshape(-1)), NpuValueError, "indices")
    assert_raises(lambda: sim.npu_moe_token_permute(x[:3], idx), NpuValueError, "indices")
    assert_raises(lambda: sim.npu_moe_token_permute(x, -idx), NpuValueError, "indices")
    assert_raises(lambda: sim.npu_moe_token_permute(x, torch.zeros(4, 513, dtype=torch.long)), NpuValueError, "topK")
    assert_raises(lambda: sim.npu_moe_token_permute(x, idx, padded_mode=True), NpuValueError, "padded_mode")
    assert_raises(lambda: sim.npu_moe_token_permute(x, idx, -9), NpuValueError, "num_out_tokens")
    assert_raises(lambda: sim.npu_moe_token_unpermute(permuted.float(), s, probs=probs), NpuTypeError, "permuted")
    assert_raises(lambda: sim.npu_moe_token_unpermute(permuted, s.long(), probs=probs), NpuTypeError, "sorted")
    assert_raises(lambda: sim.npu_moe_token_unpermute(permuted, s, probs=probs.float()), NpuTypeError, "probs")
    assert_raises(lambda: sim.npu_moe_token_unpermute(permuted, s, probs=probs[:3]), NpuValueError, "probs")
    assert_raises(lambda: sim.npu_moe_token_unpermute(permuted, torch.zeros_like(s), probs=probs), NpuValueError,
                  "sorted_indices")
    assert_raises(lambda: sim.npu_moe_token_unpermute(permuted, s, probs=probs, restore_shape=(4, 8)), NpuValueError,
                  "restore_shape")
    assert_raises(lambda: sim.npu_moe_token_permute_grad_v2(permuted, s, 4, torch.float32, 2), NpuTypeError,
                  "tokens_dtype")
    assert_raises(lambda: sim.npu_moe_token_permute_grad_v2(permuted, s, 3, torch.bfloat16, 2), NpuValueError,
                  "grad_permuted_tokens")
    assert_raises(lambda: sim.npu_moe_token_unpermute_grad_v2(x, s, 8, torch.bfloat16, probs), NpuValueError,
                  "permuted_tokens")
    assert_raises(lambda: sim.npu_moe_token_unpermute_grad_v2(x, s, 8, torch.float32, probs,
                                                              permuted_tokens=permuted), NpuTypeError, "dtype")
    assert sim.launch_counts == {"npu_moe_token_permute": 1, "npu_moe_token_unpermute": 1}  # refusals launch nothing
    for chip in ("Ascend910A", "Ascend310P3"):
        assert_raises(lambda chip=chip: make_simulator(chip).npu_moe_token_permute(x, idx), NpuSocError, chip)


# Simulator: npu_rotary_mul against float64 ------------------------------------------------------------------
def rotary_oracle(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, mode: str) -> np.ndarray:
    """aclnnRotaryPositionEmbedding's formulas, element by element in float64."""
    d = x.shape[-1]
    out = np.empty_like(x)
    for c in range(d):
        if mode == "half":
            other, sign = (c + d // 2, -1) if c < d // 2 else (c - d // 2, 1)
            out[..., c] = x[..., c] * cos[..., c] + sign * x[..., other] * sin[..., c]
        elif mode == "interleave":
            other, sign = (c + 1, -1) if c % 2 == 0 else (c - 1, 1)
            out[..., c] = x[..., c] * cos[..., c] + sign * x[..., other] * sin[..., c]
        elif mode == "quarter":
            q, r = divmod(c, d // 4)
            other, sign = ((q + 1) * (d // 4) + r, -1) if q % 2 == 0 else ((q - 1) * (d // 4) + r, 1)
            out[..., c] = x[..., c] * cos[..., c] + sign * x[..., other] * sin[..., c]
        else:  # interleave-half: x_part1 = cat(x[::2], x[1::2]), x_part2 = cat(-x[1::2], x[::2])
            h = d // 2
            part1 = x[..., 2 * c] if c < h else x[..., 2 * (c - h) + 1]
            part2 = -x[..., 2 * c + 1] if c < h else x[..., 2 * (c - h)]
            out[..., c] = part1 * cos[..., c] + part2 * sin[..., c]
    return out


def rounded_once(got: torch.Tensor, exact: np.ndarray, terms: np.ndarray) -> None:
    """got is exact rounded once to its dtype: within half its ulp, plus float32's rounding of the terms."""
    ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}[got.dtype]
    bound = ulp * np.abs(exact) + 2.0**-23 * terms + 1e-30
    assert (np.abs(np64(got) - exact) <= bound).all(), np.abs(np64(got) - exact).max()


@pytest.mark.parametrize("chip, mode", [("Ascend950PR", "half"), ("Ascend950PR", "interleave"),
                                        ("Ascend950DT", "quarter"), ("Ascend950PR", "interleave-half"),
                                        ("Ascend910B3", "half"), ("Ascend910_9392", "interleave")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_mul_is_the_documents_formula_in_float32(chip, mode, dtype):
    """Forward y = x * cos + rotate(x) * sin and the grad kernel's dx (aclnnRotaryPositionEmbeddingGrad's formulas:
    the transposed rotation), dcos = sum(dy * x), dsin = sum(dy * rotate(x)) over the broadcast dims, against float64
    autograd of the forward oracle; one grad kernel."""
    gen = torch.Generator().manual_seed(len(mode))
    sim = make_simulator(chip)
    x = torch.randn(5, 2, 3, 16, generator=gen).to(dtype).requires_grad_()
    angles = torch.rand(5, 1, 1, 16, generator=gen) * 6
    cos, sin = (f(angles).to(dtype).requires_grad_() for f in (torch.cos, torch.sin))
    y = sim.npu_rotary_mul(x, cos, sin, mode)
    assert y.dtype == dtype and y.shape == x.shape
    exact = rotary_oracle(np64(x), np64(cos), np64(sin), mode)
    terms = np.abs(np64(x)).max() * (np.abs(np64(cos)) + np.abs(np64(sin)))  # >= |x cos| + |rot(x) sin|
    rounded_once(y, exact, terms)
    dy = torch.randn(y.shape, generator=gen).to(dtype)
    sim.reset_counts()
    y.backward(dy)
    assert sim.launch_counts == {"npu_rotary_mul_backward": 1}
    x64, c64, s64 = (torch.from_numpy(np64(t)).requires_grad_() for t in (x, cos, sin))
    y64 = torch.from_numpy(rotary_oracle(x64.detach().numpy(), c64.detach().numpy(), s64.detach().numpy(), mode))
    # float64 autograd of the same formula: y is linear in x, cos and sin, so the oracle is its transpose applied
    jac = torch.autograd.functional.vjp(
        lambda a, b, c: _torch_rotary(a, b, c, mode), (x64, c64, s64), torch.from_numpy(np64(dy)))[1]
    assert torch.allclose(y64, _torch_rotary(x64, c64, s64, mode).detach())
    tol = dict(rtol=2.0**-7, atol=2.0**-7) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for got, want in zip((x.grad, cos.grad, sin.grad), jac):
        torch.testing.assert_close(got.double(), want, **tol)


def _torch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> torch.Tensor:
    """The same formula in float64 torch ops (differentiable), checked against `rotary_oracle` above."""
    d = x.shape[-1]
    if mode == "half":
        part1, part2 = x, torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)
    elif mode == "interleave":
        part1, part2 = x, torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).reshape(x.shape)
    elif mode == "quarter":
        q = [x[..., i * d // 4:(i + 1) * d // 4] for i in range(4)]
        part1, part2 = x, torch.cat((-q[1], q[0], -q[3], q[2]), dim=-1)
    else:
        part1 = torch.cat((x[..., ::2], x[..., 1::2]), dim=-1)
        part2 = torch.cat((-x[..., 1::2], x[..., ::2]), dim=-1)
    return part1 * cos + part2 * sin


def test_rotary_mul_contract():
    """950: 4 dims, "最后一维...小于等于1024", even (quarter: by 4), tables "与x数据类型一致", of one shape and
    broadcasting to x; modes half / interleave / quarter / interleave-half. A2/A3 (jit_compile=False): half and
    interleave only (op-plugin), "D < 896", r1 / r2 "数据范围：[-1, 1]", the SBND / BSND table layouts with B, N < 1000
    (interleave: S11D / 1S1D, B * N < 1000), B * N <= 1024 when the tables need a gradient."""
    sim, a2 = make_simulator(), make_simulator("Ascend910B3")
    x = torch.randn(4, 2, 3, 8)
    cos = torch.rand(4, 1, 1, 8)
    sim.npu_rotary_mul(x, cos * 3, cos, "interleave-half")  # no data range on the 950
    a2.npu_rotary_mul(x, cos, cos)
    a2.npu_rotary_mul(x.transpose(0, 1), cos.transpose(0, 1), cos.transpose(0, 1), "interleave")  # BSND, 1S1D
    assert_raises(lambda: sim.npu_rotary_mul(x, cos.bfloat16(), cos), NpuTypeError, "r1")
    assert_raises(lambda: sim.npu_rotary_mul(x, cos, cos[:, :, :, :4]), NpuValueError, "r1")
    assert_raises(lambda: sim.npu_rotary_mul(x[0], cos[0], cos[0]), NpuValueError, "input")
    assert_raises(lambda: sim.npu_rotary_mul(x, cos[:2], cos[:2]), NpuValueError, "broadcast")
    assert_raises(lambda: sim.npu_rotary_mul(torch.randn(1, 1, 1, 1026), torch.ones(1, 1, 1, 1026),
                                             torch.ones(1, 1, 1, 1026)), NpuValueError, "1024")
    assert_raises(lambda: sim.npu_rotary_mul(x[..., :6], cos[..., :6], cos[..., :6], "quarter"), NpuValueError, "4")
    assert_raises(lambda: sim.npu_rotary_mul(x, cos, cos, "rotate"), NpuValueError, "rotary_mode")
    assert_raises(lambda: sim.npu_rotary_mul(x, cos, cos, rotate=torch.eye(8)), NpuValueError, "rotate")
    assert_raises(lambda: a2.npu_rotary_mul(x, cos, cos, "interleave-half"), NpuValueError, "rotary_mode")
    assert_raises(lambda: a2.npu_rotary_mul(x, cos * 2, cos), NpuValueError, "[-1, 1]")
    big = torch.randn(1, 1, 1, 896)
    assert_raises(lambda: a2.npu_rotary_mul(big, big.clamp(-1, 1), big.clamp(-1, 1)), NpuValueError, "896")
    assert_raises(lambda: a2.npu_rotary_mul(x, cos[:1], cos[:1]), NpuValueError, "layout")
    assert_raises(lambda: a2.npu_rotary_mul(x, cos.expand(4, 2, 1, 8), cos.expand(4, 2, 1, 8), "interleave"),
                  NpuValueError, "layout")
    wide = torch.randn(2, 40, 30, 8)  # SBND with B * N = 1200: half takes it, interleave does not
    table = torch.rand(2, 1, 1, 8)
    a2.npu_rotary_mul(wide, table, table)
    assert_raises(lambda: a2.npu_rotary_mul(wide, table, table, "interleave"), NpuValueError, "layout")
    needs_grad = table.clone().requires_grad_()
    assert_raises(lambda: a2.npu_rotary_mul(wide, needs_grad, needs_grad), NpuValueError, "layout")
    bnsd = torch.rand(1, 1, 3, 8)  # x read as BNSD with an 11SD table
    assert_raises(lambda: a2.npu_rotary_mul(x, bnsd, bnsd), NpuSimNotImplemented, "BNSD")
    assert_raises(lambda: make_simulator("Ascend910A").npu_rotary_mul(x, cos, cos), NpuSocError, "Ascend910A")
    y = sim.npu_rotary_mul(x, cos, cos).detach().requires_grad_()
    assert_raises(lambda: sim.npu_rotary_mul_backward(y.bfloat16(), x, cos, cos), NpuTypeError, "grad")


# The NPU backend against the reference ----------------------------------------------------------------------------
def _on(use_backend: Any, monkeypatch: pytest.MonkeyPatch, chip: Optional[str]) -> Any:
    """The reference backend (chip None) or the NPU backend on a fresh simulator of `chip`; returns the simulator."""
    if chip is None:
        use_backend("reference")
        return None
    sim = make_simulator(chip)
    use_backend("npu")
    monkeypatch.setattr("mindspeed_te.kernels.npu.get_npu_backend", lambda: NpuBackend(sim))
    return sim


def _moe_layer(tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, num_out: Any,
               merge: Optional[torch.Tensor], gen_seed: int) -> list[Optional[torch.Tensor]]:
    """Megatron's fused dispatch and combine through TE's functions: permute with probs, an "expert" (rows times
    their probs), unpermute (merging probs when given); backward of a fixed weighting. -> outputs and gradients."""
    x, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
    m = None if merge is None else merge.clone().requires_grad_()
    permuted, permuted_probs, row_map = moe_fused.fused_permute_with_probs(x, p, routing_map, num_out)
    rows = (permuted.float() * permuted_probs.float().unsqueeze(1)).to(permuted.dtype)
    out = moe_fused.fused_unpermute(rows, row_map, merging_probs=m, restore_shape=x.shape)
    gen = torch.Generator().manual_seed(gen_seed)
    out.backward(torch.randn(out.shape, generator=gen).to(out.dtype))
    return [permuted.detach(), permuted_probs.detach(), out.detach(), x.grad, p.grad,
            None if m is None else m.grad]


def _routing(tokens: int, experts: int, topk: int, gen: torch.Generator, dtype: torch.dtype = torch.bfloat16
             ) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.softmax(torch.randn(tokens, experts, generator=gen), dim=-1)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, scores.topk(topk, dim=1).indices, True)
    return (scores * routing_map).to(dtype), routing_map


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("shape", [(16, 8, 2, 32), (33, 6, 1, 8), (20, 16, 4, 24)])
@pytest.mark.parametrize("merge", [None, "bf16", "fp32"])
@pytest.mark.parametrize("router_topk", [False, True])
def test_dropless_permutation_equals_the_reference_bit_for_bit(chip, shape, merge, router_topk, monkeypatch,
                                                               use_backend):
    """Dropless routing (every token to topk experts, num_out_tokens = tokens * topk): the permute and unpermute
    kernels give the reference's rows, probs, sums and every gradient bit for bit (both sum a token's rows in float32
    in expert order and round once). float32 merging probs are not a dtype the unpermute kernel takes: the
    reference sums then, on the kernel's map turned into the reference's. `router_topk`: the map marked dropless
    and holding the router's top-k experts (best first), as the fused router and the patched dispatcher leave it:
    top-1 and top-2 permute in that order, unsorted, with the same bits (a token's two rows sum alike either way)."""
    tokens, experts, topk, hidden = shape
    gen = torch.Generator().manual_seed(sum(shape))
    probs, routing_map = _routing(tokens, experts, topk, gen)
    if router_topk:
        setattr(routing_map, EXPERTS_PER_TOKEN, topk)
        setattr(routing_map, TOPK_EXPERTS, probs.float().topk(topk, dim=1).indices)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    merging = None if merge is None else (probs.float() if merge == "fp32" else probs)
    _on(use_backend, monkeypatch, None)
    want = _moe_layer(x, probs, routing_map, tokens * topk, merging, 1)
    sim = _on(use_backend, monkeypatch, chip)
    got = _moe_layer(x, probs, routing_map, tokens * topk, merging, 1)
    for g, w in zip(got, want):
        assert (g is None and w is None) or torch.equal(g, w)
    kernels = {"npu_moe_token_permute": 1, "npu_moe_token_permute_grad_v2": 1}
    if merge != "fp32":
        kernels.update(npu_moe_token_unpermute=1, npu_moe_token_unpermute_grad_v2=1)
    assert sim.launch_counts == kernels


@pytest.mark.parametrize("case", ["capacity-dropped", "dropped and padded", "float32 tokens", "routed pairs",
                                  "fewer rows"])
def test_maps_the_kernels_do_not_take_stay_with_the_reference(case, monkeypatch, use_backend):
    """Rows with other than num_out_tokens / tokens experts (Megatron's capacity drop: a tensor count; drop and pad:
    an integer count whose rows are uneven, found by the rows check), float32 tokens, num_out_tokens -1 and fewer
    rows than the routed pairs: no kernel, the reference's results."""
    gen = torch.Generator().manual_seed(3)
    probs, routing_map = _routing(24, 6, 2, gen)
    num_out: Any = 48
    x = torch.randn(24, 16, generator=gen).bfloat16()
    if case == "capacity-dropped":
        routing_map[::3, :] = False
        routing_map[::3, 0] = True
        routing_map[1::5, :] = False
        num_out = routing_map.sum()
    elif case == "dropped and padded":
        keep = torch.zeros_like(routing_map).scatter(0, probs.float().topk(8, dim=0).indices, True)
        routing_map, num_out = keep, 48  # every expert 8 tokens: 48 rows, uneven per token
    elif case == "float32 tokens":
        x = x.float()
    elif case == "routed pairs":
        num_out = -1
    else:
        num_out = 40
    probs = probs * routing_map
    _on(use_backend, monkeypatch, None)
    want = _moe_layer(x, probs, routing_map, num_out, None, 2)
    sim = _on(use_backend, monkeypatch, "Ascend950PR")
    got = _moe_layer(x, probs, routing_map, num_out, None, 2)
    for g, w in zip(got, want):
        assert (g is None and w is None) or torch.equal(g, w)
    assert sim.total_launches() == 0


def test_megatron_fused_permute_runs_the_kernels(monkeypatch, use_backend):
    """megatron-core's own permute / unpermute with fused=True (TE's functions bound where moe_utils looks for them)
    on the NPU backend: the unfused path's rows, probs and restored tokens (float32 sums rounded once against
    Megatron's bfloat16 ones: the restored tokens within a bfloat16 rounding)."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.moe import moe_utils as mu

    monkeypatch.setattr(mu, "HAVE_TE", True, raising=False)
    for name in ("fused_permute", "fused_permute_with_probs", "fused_unpermute"):
        monkeypatch.setattr(mu, name, getattr(moe_fused, name), raising=False)
    gen = torch.Generator().manual_seed(5)
    probs, routing_map = _routing(32, 8, 2, gen)
    x = torch.randn(32, 16, generator=gen).bfloat16()
    want = mu.permute(x, routing_map, probs=probs, num_out_tokens=64, fused=False)
    sim = _on(use_backend, monkeypatch, "Ascend950PR")
    got = mu.permute(x, routing_map, probs=probs, num_out_tokens=64, fused=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    restored = mu.unpermute(got[0], got[2], restore_shape=x.shape, routing_map=routing_map, fused=True)
    unfused = mu.unpermute(want[0], want[2], restore_shape=x.shape, routing_map=routing_map, fused=False)
    torch.testing.assert_close(restored, unfused)
    torch.testing.assert_close(restored, (x.float() * 2).bfloat16())  # each token's two rows
    assert sim.launch_counts == {"npu_moe_token_permute": 1, "npu_moe_token_unpermute": 1}


def test_the_routers_order_is_taken_only_where_the_sum_cannot_tell(monkeypatch, use_backend):
    """A token's rows 1, 2^-24, 2^-24, 2^-8 (experts 0..3) sum in float32 to 1 + 2^-8 (bfloat16 1) in expert order
    and to 1 + 2^-8 + 2^-23 (bfloat16 1 + 2^-7) in the router's (best first: 3, 2, 1, 0). So a top-4 map permutes
    with its experts sorted even where it holds the router's top-k, and unpermutes to the reference's bits."""
    x = torch.ones(1, 4).bfloat16()
    routing_map = torch.ones(1, 4, dtype=torch.bool)
    rows = torch.tensor([1.0, 2.0**-24, 2.0**-24, 2.0**-8]).bfloat16().unsqueeze(1).expand(4, 4).contiguous()
    _on(use_backend, monkeypatch, None)
    _, row_map = moe_fused.fused_permute(x, routing_map, 4)
    want = moe_fused.fused_unpermute(rows, row_map, restore_shape=x.shape)
    assert torch.equal(want, torch.ones(1, 4).bfloat16())
    _on(use_backend, monkeypatch, "Ascend950PR")
    setattr(routing_map, EXPERTS_PER_TOKEN, 4)
    setattr(routing_map, TOPK_EXPERTS, torch.tensor([[3, 2, 1, 0]]))
    _, row_map = moe_fused.fused_permute(x, routing_map, 4)
    assert torch.equal(moe_fused.fused_unpermute(rows, row_map, restore_shape=x.shape), want)


def _routed_layer(topk: int, change: Optional[str] = None, npu: Any = None) -> tuple[list[torch.Tensor], Any]:
    """The fused router's probs and map (dropless, as the dispatcher marks it) through permute with probs, rows
    times their probs, unpermute; backward. `change`: "forget" drops the probs' top-k attribute, "write" scales
    the probs in place after the router. -> (outputs and the gradients of the tokens and the logits, launches
    with `npu`'s kernels)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 8, generator=gen).bfloat16().requires_grad_()
    x = torch.randn(16, 32, generator=gen).bfloat16().requires_grad_()
    with LaunchCounter(npu) as counter:
        probs, routing_map = moe_fused.fused_topk_with_score_function(logits, topk)
        setattr(routing_map, EXPERTS_PER_TOKEN, topk)
        if change == "forget":
            delattr(probs, TOPK_PROBS)
        elif change == "write":
            probs.mul_(2)
        permuted, permuted_probs, row_map = moe_fused.fused_permute_with_probs(x, probs, routing_map, 16 * topk)
        rows = (permuted.float() * permuted_probs.float().unsqueeze(1)).to(permuted.dtype)
        out = moe_fused.fused_unpermute(rows, row_map, restore_shape=x.shape)
        out.backward(torch.randn(out.shape, generator=gen).to(out.dtype))
    return [permuted_probs.detach(), out.detach(), x.grad, logits.grad], counter.counts


@pytest.mark.parametrize("topk", [1, 2])
def test_the_routers_topk_probs_are_placed_as_they_are(topk, monkeypatch, use_backend):
    """The fused router's probs carry the top-k probs they were scattered from (`TOPK_PROBS`). Where the permute
    kernel takes the router's experts unsorted (dropless top-1 / top-2), those are placed at the permuted rows as
    they are: no gather from the dense probs, and their gradient is one index_select into the router's softmax (no
    scatter into the dense probs' gradient and gather back out of it): -3 launches, the reference's bits in every
    output and in the logits' gradient. Probs written in place after the router take the dense probs, as written."""
    for change in (None, "write"):
        _on(use_backend, monkeypatch, None)
        want, _ = _routed_layer(topk, change)
        _on(use_backend, monkeypatch, "Ascend950PR")
        got, _ = _routed_layer(topk, change)
        for g, w in zip(got, want):
            assert torch.equal(g, w), change
    sim = _on(use_backend, monkeypatch, "Ascend950PR")
    _, direct = _routed_layer(topk, npu=sim)
    _, dense = _routed_layer(topk, "forget", npu=sim)
    assert dense - direct == {"aten.gather": 2, "aten.scatter": 1} and not direct - dense, (dense, direct)


def test_permute_reads_the_host_once_and_rope_never(monkeypatch, use_backend):
    """The permute kernel needs every row routed to exactly k experts, which an integer num_out_tokens does not
    promise (Megatron's drop-and-pad and flex dispatchers pass integers with uneven rows): one 1-byte read per
    permute, unless the map is marked with that k (as the patched alltoall dispatcher marks its dropless maps; a
    mark of another k is checked still). The unpermute and RoPE kernels read nothing."""
    sim = _on(use_backend, monkeypatch, "Ascend950PR")
    gen = torch.Generator().manual_seed(6)
    probs, routing_map = _routing(16, 4, 2, gen)
    x = torch.randn(16, 8, generator=gen).bfloat16()
    with HostSyncCounter() as counter:
        permuted, row_map = moe_fused.fused_permute(x, routing_map, 32)
    assert dict(counter.counts) == {"bool": 1}
    for mark, reads in ((3, {"bool": 1}), (2, {})):
        setattr(routing_map, EXPERTS_PER_TOKEN, mark)
        with HostSyncCounter() as counter:
            again, again_map = moe_fused.fused_permute(x, routing_map, 32)
        assert dict(counter.counts) == reads and torch.equal(again, permuted) and torch.equal(again_map, row_map)
    assert sim.launch_counts == {"npu_moe_token_permute": 3}
    with HostSyncCounter() as counter:
        moe_fused.fused_unpermute(permuted, row_map, restore_shape=x.shape)
        apply_rotary_pos_emb(torch.randn(4, 2, 2, 8).bfloat16(), _angles(4, 8))
    assert counter.total == 0, dict(counter.counts)


def test_a_row_map_of_another_backend_is_refused(monkeypatch, use_backend):
    sim = _on(use_backend, monkeypatch, "Ascend950PR")
    gen = torch.Generator().manual_seed(6)
    _, routing_map = _routing(16, 4, 2, gen)
    permuted, row_map = moe_fused.fused_permute(torch.randn(16, 8).bfloat16(), routing_map, 32)
    with pytest.raises(ValueError, match="not one the NPU backend's moe_permute made"):
        moe_fused.fused_unpermute(permuted, row_map.clone(), restore_shape=(16, 8))
    assert sim.launch_counts == {"npu_moe_token_permute": 1}


def _angles(positions: int, dim: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(positions).float(), inv)
    return torch.cat((freqs, freqs), dim=-1).view(positions, 1, 1, dim)


def _run(fn: Callable[..., Any], inputs: list[torch.Tensor], seed: int = 9) -> tuple[list, list]:
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    outs = list(out) if isinstance(out, tuple) else [out]
    gen = torch.Generator().manual_seed(seed)
    torch.autograd.backward(outs, [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs])
    return [o.detach() for o in outs], [t.grad for t in leaves]


def _close_to_reference(got: list, want: list, dtype: torch.dtype) -> None:
    """float32: bit for bit (the kernel's float32 products and sum are the reference's ops). 16-bit: the kernel
    rounds x·cos + rot(x)·sin once, the reference (TE's unfused arithmetic) each product and the sum in x's dtype,
    three roundings of terms up to |x|·|table| (tables up to 1.3 here): within 2^-6 of the tensor's largest
    magnitude (4 bfloat16 ulps of it; seen: at most 2)."""
    for g, w in zip(got, want):
        if dtype == torch.float32:
            assert torch.equal(g, w)
        else:
            error = (g.double() - w.double()).abs().max()
            assert error <= 2.0**-6 * w.double().abs().max(), error


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt, interleaved", [("sbhd", False), ("sbhd", True), ("bshd", False), ("thd", False),
                                              ("thd", True)])
def test_te_rope_takes_the_rotary_kernel(chip, dtype, fmt, interleaved, monkeypatch, use_backend):
    """TE's apply_rotary_pos_emb (Megatron's fused_apply_rotary_pos_emb / _thd): npu_rotary_mul and its one backward
    kernel on the rotated channels (a partial rotation here), the reference's results (see `_close_to_reference`)."""
    gen = torch.Generator().manual_seed(7)
    t = torch.randn(*((2, 12) if fmt == "bshd" else (12, 2)), 3, 16, generator=gen).to(dtype)
    kwargs = {}
    if fmt == "thd":
        t, kwargs = torch.randn(20, 3, 16, generator=gen).to(dtype), {"cu_seqlens": torch.tensor([0, 7, 20])}
    freqs = _angles(24, 12)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return apply_rotary_pos_emb(x, freqs, fmt, interleaved=interleaved, **kwargs)

    _on(use_backend, monkeypatch, None)
    want = _run(fn, [t])
    sim = _on(use_backend, monkeypatch, chip)
    got = _run(fn, [t])
    _close_to_reference(got[0] + got[1], want[0] + want[1], dtype)
    assert sim.launch_counts == {"npu_rotary_mul": 1, "npu_rotary_mul_backward": 1}


QK, EMB, V, HEADS = 6, 8, 5, 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
def test_mla_rope_takes_the_interleave_half_kernel_on_the_950(dtype, packed, monkeypatch, use_backend):
    """MLA's fused YaRN RoPE: the 950's "interleave-half" mode does the de-interleave and rotation in one kernel
    each way (tables with mscale > 1: no data range there); Atlas A2/A3 have no such mode and a [-1, 1] table range,
    so they stay on the reference (bit for bit)."""
    gen = torch.Generator().manual_seed(8)
    angles = torch.rand(16, 1, 1, EMB, generator=gen) * 3
    cos, sin = (torch.cos(angles) * 1.3).to(dtype), (torch.sin(angles) * 1.3).to(dtype)
    lead, extra = ((14,), {"cu_seqlens_q": torch.tensor([0, 5, 14])}) if packed else ((7, 2), {})
    q = torch.randn(*lead, HEADS, QK + EMB, generator=gen).to(dtype)
    kv = torch.randn(*lead, HEADS, QK + V, generator=gen).to(dtype)
    k_pe = torch.randn(*lead, 1, EMB, generator=gen).to(dtype)
    kv_extra = {"cu_seqlens_kv": extra["cu_seqlens_q"]} if packed else {}

    def fn(q, kv, k_pe):
        return (fused_apply_mla_rope_for_q(q, cos, sin, QK, EMB, **extra),
                *fused_apply_mla_rope_for_kv(kv, k_pe, cos, sin, EMB, QK, V, **kv_extra))

    _on(use_backend, monkeypatch, None)
    want = _run(fn, [q, kv, k_pe])
    sim = _on(use_backend, monkeypatch, "Ascend950PR")
    got = _run(fn, [q, kv, k_pe])
    _close_to_reference(got[0] + got[1], want[0] + want[1], dtype)
    assert sim.launch_counts == {"npu_rotary_mul": 2, "npu_rotary_mul_backward": 2}
    sim = _on(use_backend, monkeypatch, "Ascend910B3")
    got = _run(fn, [q, kv, k_pe])
    assert all(torch.equal(g, w) for g, w in zip(got[0] + got[1], want[0] + want[1]))
    assert sim.total_launches() == 0


def test_rotary_operands_the_kernel_does_not_take_stay_with_the_reference(monkeypatch, use_backend):
    """Tables that need a gradient, mixed dtypes, a last dim past the kernel's, a table layout A2/A3 lack (one
    table for all positions: 111D), or tables not known to lie in [-1, 1] on A2/A3: the reference's ops, no
    kernel."""
    x = torch.randn(4, 2, 3, 8)
    cos, sin = torch.rand(4, 1, 1, 8), torch.rand(4, 1, 1, 8)
    cases = [
        ("Ascend950PR", dict(x=x, cos=cos.clone().requires_grad_(), sin=sin), "half", True),
        ("Ascend950PR", dict(x=x.bfloat16(), cos=cos, sin=sin), "half", True),
        ("Ascend950PR", dict(x=torch.randn(1, 1, 1, 1030), cos=torch.rand(1, 1, 1, 1030),
                             sin=torch.rand(1, 1, 1, 1030)), "half", True),
        ("Ascend910B3", dict(x=x, cos=cos[:1], sin=sin[:1]), "half", True),
        ("Ascend910B3", dict(x=x, cos=cos, sin=sin), "half", False),
        ("Ascend910B3", dict(x=x, cos=cos, sin=sin), "interleave-half", False),
        ("Ascend910A", dict(x=x, cos=cos, sin=sin), "half", True),
    ]
    from mindspeed_te.kernels import get_backend

    for chip, operands, mode, unit in cases:
        _on(use_backend, monkeypatch, None)
        want = get_backend().rotary(**operands, mode=mode, unit_tables=unit)
        sim = _on(use_backend, monkeypatch, chip)
        got = get_backend().rotary(**operands, mode=mode, unit_tables=unit)
        assert torch.equal(got, want) and sim.total_launches() == 0, (chip, mode)
