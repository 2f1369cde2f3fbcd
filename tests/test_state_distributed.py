"""Cross-rank amax reduction on real gloo process groups of 2 and 4 processes.

Every rank quantizes different data; afterwards every rank must hold identical scales and histories, equal
to a single-process reference fed with the global (max over ranks) amaxes, and each step must issue exactly
one all-reduce per direction however many tensors are registered.
"""
import math

import pytest
import torch
import torch.distributed as dist

from mindspeed_te import DelayedScaling, Format, FP8GlobalStateManager, RecipeState, fp8_autocast
from tests.dist_utils import run_distributed
from tests.oracles import DelayedReference

STEPS = 4
MODULES = 5  # each with 3 forward and 2 backward quantizers


def _data(rank: int, step: int, module: int, index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(((rank * 31 + step) * 17 + module) * 7 + index)
    x = torch.randn(64, generator=g) * 2.0 ** (rank - step + module)
    if (rank, step, module, index) == (1, 2, 3, 0):
        x[5] = float("nan")  # one rank sees a NaN: every rank must ignore that amax identically
    return x


def _worker(rank: int, world_size: int, fmt_name: str) -> dict:
    FP8GlobalStateManager.reset()
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    recipe = DelayedScaling(fp8_format=Format[fmt_name], amax_history_len=3, amax_compute_algo="max")
    group = dist.new_group(list(range(world_size)))
    fwd = [RecipeState.create(recipe, forward=True, num_quantizers=3) for _ in range(MODULES)]
    bwd = [RecipeState.create(recipe, forward=False, num_quantizers=2) for _ in range(MODULES)]
    fq = [s.make_quantizers() for s in fwd]
    bq = [s.make_quantizers() for s in bwd]
    per_step_calls = []
    for step in range(STEPS):
        start = len(calls)
        with fp8_autocast(fp8_recipe=recipe, fp8_group=group):
            for m in range(MODULES):
                FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(fwd[m], group)
                FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(bwd[m], group)
                for i in range(3):
                    fq[m][i](_data(rank, step, m, i))
        fwd_calls = len(calls) - start
        for m in reversed(range(MODULES)):
            for i in range(2):
                bq[m][i](_data(rank, step, m, 3 + i))
        FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
        per_step_calls.append((fwd_calls, len(calls) - start - fwd_calls))
    dist.all_reduce = real_all_reduce
    return {
        "calls": per_step_calls,
        "sizes": calls,
        "fwd": [(s.amax_history.clone(), s.scale.clone()) for s in fwd],
        "bwd": [(s.amax_history.clone(), s.scale.clone()) for s in bwd],
    }


def _reference(world_size: int, fmt: Format, forward: bool, module: int, index: int) -> DelayedReference:
    target = fmt.max_fwd if forward else fmt.max_bwd
    ref = DelayedReference(3, target, 0.0, "max")
    for step in range(STEPS):
        amaxes = [_data(r, step, module, index if forward else 3 + index).abs().max().item()
                  for r in range(world_size)]
        ref.observe(math.nan if any(math.isnan(a) for a in amaxes) else max(amaxes))
        ref.update()
    return ref


@pytest.mark.parametrize(
    "world_size, fmt",
    [(2, Format.HYBRID), pytest.param(4, Format.HIF8, marks=pytest.mark.slow)],
)
def test_one_all_reduce_per_step_and_identical_global_scales(world_size, fmt):
    results = run_distributed(_worker, world_size, fmt.name)
    for res in results:
        assert res["calls"] == [(1, 1)] * STEPS
        assert set(res["sizes"]) == {MODULES * 3, MODULES * 2}
    for direction, n in (("fwd", 3), ("bwd", 2)):
        for m in range(MODULES):
            hist0, scale0 = results[0][direction][m]
            for res in results[1:]:
                assert torch.equal(res[direction][m][0], hist0) and torch.equal(res[direction][m][1], scale0)
            for i in range(n):
                ref = _reference(world_size, fmt, direction == "fwd", m, i)
                assert hist0[:, i].tolist() == ref.history
                assert scale0[i].item() == ref.scale


def test_reduce_amax_false_keeps_local_scales():
    results = run_distributed(_local_worker, 2)
    assert results[0]["calls"] == 0 and results[1]["calls"] == 0
    assert results[0]["scale"] == 448.0 / 1.0 and results[1]["scale"] == 448.0 / 2.0


def _local_worker(rank: int, world_size: int) -> dict:
    FP8GlobalStateManager.reset()
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(1) or real(*a, **k)
    recipe = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=1, reduce_amax=False)
    state = RecipeState.create(recipe, forward=True, num_quantizers=1)
    with fp8_autocast(fp8_recipe=recipe):
        FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(state)
        state.make_quantizers()[0](torch.full((4,), float(rank + 1)))
    dist.all_reduce = real
    return {"calls": len(calls), "scale": state.scale.item()}
