"""--use-ascend-mc2 on 2 gloo processes: the fused all-gather+matmul / matmul+reduce-scatter / all-reduce
kernels (simulated over the real process group) give what separate collectives give, in high precision and
MXFP8; other FP8 recipes fall back to separate collectives."""
import os
import warnings

import pytest
import torch

from tests.dist_utils import run_distributed

# Both weight dims per rank within the fused kernels' contraction range [256, 65535) in every layout.
S, B, K, N = 16, 2, 512, 512
LAYOUTS = [("column", True), ("row", True), ("row", False)]


def _worker(rank: int, world: int) -> dict:
    import mindspeed_te.kernels.npu as npu_kernels
    from mindspeed_te import Float8CurrentScaling, FP8GlobalStateManager, fp8_autocast
    from mindspeed_te.kernels.npu import NpuBackend
    from mindspeed_te.modules import Linear
    from mindspeed_te.testing.npu_sim import make_simulator

    os.environ["MINDSPEED_TE_BACKEND"] = "npu"
    sim = make_simulator()
    npu_kernels.get_npu_backend = lambda: NpuBackend(sim)
    group = torch.distributed.new_group(list(range(world)))
    g = torch.Generator().manual_seed(0)
    w_full = torch.randn(N, K, generator=g) * 0.1
    x_full = torch.randn(S, B, K, generator=g)
    dy_full = torch.randn(S, B, N, generator=g)
    out = {}
    for mode, sp in LAYOUTS:
        for mc2 in (False, True):
            FP8GlobalStateManager.reset()
            layer = Linear(K, N, parallel_mode=mode, sequence_parallel=sp, tp_group=group, bias=True,
                           use_ascend_mc2=mc2, params_dtype=torch.bfloat16)
            with torch.no_grad():
                layer.weight.copy_(w_full.chunk(world, 0 if mode == "column" else 1)[rank])
                layer.bias.fill_(0.5)
            if mode == "column":
                x = x_full.chunk(world, 0)[rank] if sp else x_full
                dy = dy_full.chunk(world, 2)[rank]
            else:
                x = x_full.chunk(world, 2)[rank]
                dy = dy_full.chunk(world, 0)[rank] if sp else dy_full
            x = x.bfloat16().requires_grad_()
            sim.reset_counts()
            y = layer(x)
            y.backward(dy.bfloat16())
            out[(mode, sp, mc2)] = (y.detach().float(), x.grad.float(), layer.weight.grad.float(),
                                    dict(sim.launch_counts))
    # FP8 with mc2: one warning, separate collectives.
    layer = Linear(K, N, parallel_mode="row", sequence_parallel=True, tp_group=group, use_ascend_mc2=True,
                   params_dtype=torch.bfloat16)
    sim.reset_counts()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with fp8_autocast(fp8_recipe=Float8CurrentScaling()):
                layer(x_full.chunk(world, 2)[rank].bfloat16())
    out["fp8"] = ([str(w.message) for w in caught if "mc2" in str(w.message)], dict(sim.launch_counts))
    # Layers the fused kernels cannot take warn once and use separate collectives: MXFP8 whose weight dim per
    # rank is no multiple of 64 (E8M0 scales go in pairs; row: 576/2 = 288), and any weight dim per rank
    # outside [256, 65535) (row: 64/2 = 32, Megatron's projections in a small model), in high precision too.
    from dataclasses import replace

    from mindspeed_te import MXFP8BlockScaling

    # A group size the kernels' bindings refuse (only 2..32 are taken): separate collectives, with the reason.
    capabilities = NpuBackend.capabilities
    NpuBackend.capabilities = replace(capabilities, fused_communication_world_sizes=(4, 8))
    try:
        layer = Linear(K, N, parallel_mode="row", sequence_parallel=True, tp_group=group, use_ascend_mc2=True,
                       params_dtype=torch.bfloat16)
        sim.reset_counts()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layer(x_full.chunk(world, 2)[rank].bfloat16())
        out["world"] = ([str(w.message) for w in caught if "mc2" in str(w.message)], dict(sim.launch_counts))
    finally:
        NpuBackend.capabilities = capabilities
    for name, k, recipe in (("mx_odd", 576, MXFP8BlockScaling()), ("small", 64, None)):
        layer = Linear(k, N, parallel_mode="row", sequence_parallel=True, tp_group=group, use_ascend_mc2=True,
                       params_dtype=torch.bfloat16)
        sim.reset_counts()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                y = layer(torch.randn(S, B, k // world, generator=g).bfloat16())
        out[name] = ([str(w.message) for w in caught if "mc2" in str(w.message)], dict(sim.launch_counts),
                     tuple(y.shape))
    return out


def test_mc2_matches_separate_collectives():
    results = run_distributed(_worker, 2)
    for res in results:
        for mode, sp in LAYOUTS:
            plain, fused = res[(mode, sp, False)], res[(mode, sp, True)]
            for a, b in zip(plain[:3], fused[:3]):
                assert torch.allclose(a, b, rtol=2e-2, atol=2e-2), (mode, sp)
            kernels = fused[3]
            if mode == "column":
                assert kernels == {"npu_all_gather_base_mm": 1, "npu_mm_reduce_scatter_base": 1}
            elif sp:
                assert kernels == {"npu_mm_reduce_scatter_base": 1, "npu_all_gather_base_mm": 1}
            else:
                assert kernels == {"npu_mm_all_reduce_base": 1}
            assert not any("base_mm" in k or "mm_" in k for k in plain[3])
        messages, kernels = res["fp8"]
        assert len(messages) == 1 and "other FP8 recipes" in messages[0]
        assert "npu_mm_reduce_scatter_base" not in kernels and kernels.get("npu_quant_matmul", 0) == 2
        messages, kernels = res["world"]
        assert len(messages) == 1 and "tensor-parallel sizes 4, 8 (got 2)" in messages[0]
        assert not any("mm" in name and "matmul" not in name for name in kernels)
        messages, kernels, shape = res["mx_odd"]
        assert len(messages) == 1 and "divisible by 64" in messages[0] and "(512, 288)" in messages[0]
        assert "npu_mm_reduce_scatter_base" not in kernels and shape == (S // 2, B, N)
        messages, kernels, shape = res["small"]
        assert len(messages) == 1 and "in [256, 65535)" in messages[0] and "(512, 32)" in messages[0]
        assert "npu_mm_reduce_scatter_base" not in kernels and shape == (S // 2, B, N)


def _mx_worker(rank: int, world: int, chip: str) -> dict:
    import mindspeed_te.kernels.npu as npu_kernels
    from mindspeed_te import FP8GlobalStateManager, MXFP8BlockScaling, fp8_autocast
    from mindspeed_te.kernels.npu import NpuBackend
    from mindspeed_te.modules import Linear
    from mindspeed_te.testing.npu_sim import make_simulator

    os.environ["MINDSPEED_TE_BACKEND"] = "npu"
    sim = make_simulator(chip)
    npu_kernels.get_npu_backend = lambda: NpuBackend(sim)
    group = torch.distributed.new_group(list(range(world)))
    s, k, n = 64, 512, 512
    g = torch.Generator().manual_seed(1)
    w_full, x_full, dy_full = (torch.randn(n, k, generator=g) * 0.1, torch.randn(s, 1, k, generator=g),
                               torch.randn(s, 1, n, generator=g))
    out = {}
    for mode in ("column", "row"):
        for mc2 in (False, True):
            FP8GlobalStateManager.reset()
            layer = Linear(k, n, parallel_mode=mode, sequence_parallel=True, tp_group=group, bias=False,
                           use_ascend_mc2=mc2, params_dtype=torch.bfloat16)
            with torch.no_grad():
                layer.weight.copy_(w_full.chunk(world, 0 if mode == "column" else 1)[rank])
            x = (x_full.chunk(world, 0)[rank] if mode == "column" else x_full.chunk(world, 2)[rank])
            dy = dy_full.chunk(world, 2)[rank] if mode == "column" else dy_full.chunk(world, 0)[rank]
            x = x.bfloat16().requires_grad_()
            sim.reset_counts()
            with fp8_autocast(fp8_recipe=MXFP8BlockScaling()):
                y = layer(x)
            y.backward(dy.bfloat16())
            out[(mode, mc2)] = (y.detach().float(), x.grad.float(), layer.weight.grad.float(),
                                dict(sim.launch_counts))
    # 40 tokens per rank: blocks of 32 would straddle the ranks in the gathered columnwise form
    x = torch.randn(40, 1, k, generator=g).bfloat16()
    for mc2 in (False, True):
        FP8GlobalStateManager.reset()
        layer = Linear(k, n, parallel_mode="column", sequence_parallel=True, tp_group=group, bias=False,
                       use_ascend_mc2=mc2, params_dtype=torch.bfloat16)
        with torch.no_grad():
            layer.weight.copy_(w_full.chunk(world, 0)[rank])
        xi = x.clone().requires_grad_()
        sim.reset_counts()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with fp8_autocast(fp8_recipe=MXFP8BlockScaling()):
                y = layer(xi)
            y.backward(torch.ones_like(y))
        out[("odd tokens", mc2)] = (y.detach(), xi.grad, layer.weight.grad, dict(sim.launch_counts),
                                    [str(w.message) for w in caught if "mc2" in str(w.message)])
    return out


@pytest.mark.parametrize("chip", ["Ascend950PR", "Ascend950DT"])
def test_mc2_mxfp8_matches_separate_collectives(chip):
    """MXFP8 through the quant mc2 kernels (the base ones pass groupSize 0, which E8M0 scales cannot take). On
    either chip (Ascend 950PR/950DT) the weight's columnwise form comes from the dual-axis quantize, not laid out
    as those kernels take x2 (transposed only): the dgrad copies it. Tokens per rank not whole 32-blocks (MXFP8
    takes any row count) go through separate collectives: the gathered columnwise form would have blocks
    straddling the ranks."""
    for res in run_distributed(_mx_worker, 2, chip):
        for mode in ("column", "row"):
            plain, fused = res[(mode, False)], res[(mode, True)]
            for a, b in zip(plain[:3], fused[:3]):
                # Equal GEMMs; only the reduce-scatter sums in fp32 before rounding to bf16 (separate
                # collectives sum bf16 values), which moves results by about one bf16 ulp.
                assert ((a - b).norm() / a.norm()).item() < 5e-3, mode
            assert fused[3]["npu_all_gather_quant_mm"] == 1 and fused[3]["npu_quant_mm_reduce_scatter"] == 1
            assert not any("base_mm" in name for name in fused[3])
            assert fused[3]["npu_quant_matmul"] == 1  # only the wgrad GEMM stays unfused
            assert plain[3]["npu_quant_matmul"] == 3
            assert "npu_dynamic_mx_quant_with_dual_axis" in fused[3]
        # tokens per rank not whole 32-blocks: separate collectives, said once, the same bits
        plain, fused = res[("odd tokens", False)], res[("odd tokens", True)]
        assert len(fused[4]) == 1 and "multiple of 32 tokens per rank (got 40)" in fused[4][0], fused[4]
        assert "npu_all_gather_quant_mm" not in fused[3] and not plain[4]
        for a, b in zip(plain[:3], fused[:3]):
            assert torch.equal(a, b)
