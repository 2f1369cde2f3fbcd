"""Megatron's MoE layer (TE spec, all-to-all token dispatcher) with expert parallelism over gloo on CPU,
against the same experts on one process."""
from __future__ import annotations

import dataclasses
import re
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.dist_utils import run_distributed  # noqa: E402

NUM_EXPERTS, HIDDEN = 4, 32


def _tokens(rank: int) -> torch.Tensor:
    return torch.randn(8, 2, HIDDEN, generator=torch.Generator().manual_seed(100 + rank))


def _moe_worker(rank: int, world: int, ep: int, full: dict | None, token_rank: int | None, fp8: str | None,
                fused: bool = False) -> dict:
    """Forward + backward of one MoE layer with expert parallelism `ep`; `full` (a one-process layer's
    parameters) sets the weights, each EP rank taking its experts' share; `fused`: TE's fused permutation and chunk
    sort (--moe-permute-fusion)."""
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mindspeed_te.megatron.fp8 import get_fp8_context
    from mindspeed_te.patches.device_cpu import register_device_cpu
    from mindspeed_te.patches.megatron_te import register_megatron_te
    from mindspeed_te.patches.registry import PatchRegistry

    registry = PatchRegistry()
    register_megatron_te(registry)
    register_device_cpu(registry)
    registry.apply()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(5)
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_moe_experts=NUM_EXPERTS, moe_router_topk=2,
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True, expert_model_parallel_size=ep,
        moe_aux_loss_coeff=0.0, add_bias_linear=False, use_cpu_initialization=True, fp8=fp8, moe_permute_fusion=fused,
        fp8_recipe="tensorwise" if fp8 else "delayed")
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=True)
    layer = build_module(spec.submodules.mlp, config=config)
    local = NUM_EXPERTS // ep
    if full is not None:
        with torch.no_grad():
            for name, param in layer.named_parameters():
                match = re.fullmatch(r"(experts\..*weight)(\d+)", name)
                source = f"{match[1]}{rank * local + int(match[2])}" if match else name
                param.copy_(full[source])
    x = _tokens(rank if token_rank is None else token_rank).requires_grad_()
    with get_fp8_context(config):
        out, _ = layer(x)
    out.backward(torch.ones_like(out))
    result = {"out": out.detach(), "dx": x.grad, "params": {n: p.detach().clone() for n, p in layer.named_parameters()},
              "types": {type(m).__name__ for m in layer.modules()}}
    parallel_state.destroy_model_parallel()
    registry.revert()
    return result


@pytest.mark.slow
@pytest.mark.parametrize("fp8, fused", [(None, False), ("hif8", False), (None, True)])
def test_moe_alltoall_with_expert_parallelism_matches_one_process(fp8, fused):
    """EP=2: each rank's tokens travel to the rank holding their experts and back. Per-token results equal
    the same experts on one process (fp32 exactly up to summation order; HiF8 tensorwise quantizes each
    expert's tokens together, so to format precision). Fused: TE's chunk sort regroups the two ranks' chunks by
    local expert, where one process's orders are the identity and it sorts nothing."""
    reference = run_distributed(_moe_worker, 1, 1, None, 0, fp8, fused)[0]
    singles = [run_distributed(_moe_worker, 1, 1, reference["params"], r, fp8, fused)[0] for r in range(2)]
    ranks = run_distributed(_moe_worker, 2, 2, reference["params"], None, fp8, fused)
    assert "TEColumnParallelGroupedLinear" in ranks[0]["types"]
    tol = dict(rtol=1e-5, atol=1e-6) if fp8 is None else dict(rtol=0.1, atol=0.05)
    for single, ep in zip(singles, ranks):
        assert torch.allclose(ep["out"], single["out"], **tol)
        assert torch.allclose(ep["dx"], single["dx"], **tol)


def _bench_moe_worker(rank: int, world: int) -> dict:
    """The launch bench's bf16 MoE layer (4 experts, top-2, alltoall dispatcher with the fused permutation, one rank)
    on the simulated 950PR: each routing map the permute was given (its mark, its rows' expert counts) and the
    launches of a second forward + backward."""
    warnings.filterwarnings("ignore")
    from mindspeed_te.bench.launches import npu_simulated
    from mindspeed_te.bench.layer import HIDDEN, build_block, megatron_world
    from mindspeed_te.diagnostics import LaunchCounter
    from mindspeed_te.kernels.npu import NpuBackend
    from mindspeed_te.kernels.permutation import EXPERTS_PER_TOKEN

    maps = []
    permute = NpuBackend.moe_permute

    def recording(self, tokens, routing_map, num_out_tokens, probs=None):
        maps.append((getattr(routing_map, EXPERTS_PER_TOKEN, None), routing_map.sum(dim=1).unique().tolist()))
        return permute(self, tokens, routing_map, num_out_tokens, probs)

    NpuBackend.moe_permute = recording
    try:
        with megatron_world(cpu_adaptor=True), npu_simulated("Ascend950PR") as npu:
            block = build_block(1, None, moe=True)
            x = torch.randn(128, 2, HIDDEN, generator=torch.Generator().manual_seed(0)).bfloat16().requires_grad_()
            for _ in range(2):
                with LaunchCounter(npu) as counter:
                    out = block(x, attention_mask=None)
                    out.backward(torch.ones_like(out))
    finally:
        NpuBackend.moe_permute = permute
    return {"maps": maps, "counts": dict(counter.counts)}


def test_one_rank_moe_layer_skips_the_chunk_sort_and_the_permute_check():
    """Issue 30, the MoE layer as the 950 runs it (the launch bench's, bf16): its experts' fprop, dgrad and wgrad are
    one npu_grouped_matmul each (fc1, fc2); with one rank the alltoall dispatcher's chunk orders are the identity,
    marked so at init, and no chunk sort runs (before: 34 launches per micro-batch); its dropless config marks each
    routing map top-2 and the permute kernel is taken without checking the map (before: 2 ops and a 1-byte host
    read). What the mark promises holds: every row of every map has exactly 2 experts."""
    result = run_distributed(_bench_moe_worker, 1)[0]
    assert result["maps"] and all(mark == 2 and rows == [2] for mark, rows in result["maps"]), result["maps"]
    counts = result["counts"]
    assert counts["torch_npu.npu_grouped_matmul"] == 6 and counts["torch_npu.npu_moe_token_permute"] == 1
    for sort_or_check in ("aten.repeat_interleave", "aten.cumsum", "aten.all", "aten._local_scalar_dense"):
        assert sort_or_check not in counts, counts
    # --moe-router-fusion (megatron-core 0.14 on): the routing probs and map and the top-k's gradient are each one
    # scatter onto zeros the router keeps; the permute places the router's top-k probs as they are, so nothing is
    # gathered from the dense probs, and their gradient reaches the router's softmax without a scatter
    from megatron.core.transformer.transformer_config import TransformerConfig

    if "moe_router_fusion" in {f.name for f in dataclasses.fields(TransformerConfig)}:
        assert counts["aten.scatter"] == 3 and "aten.gather" not in counts, counts
        for zeros in ("aten.zeros", "aten.zeros_like", "aten.new_zeros", "aten.scatter_add"):
            assert zeros not in counts, counts
