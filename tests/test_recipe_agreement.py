"""Issue 12 item 4: at the first FP8 step the ranks compare their recipes with one small collective; a
mismatch raises on every rank naming both recipes, quickly, instead of hanging (two real gloo ranks)."""
import time

import torch
import torch.distributed as dist

from mindspeed_te import DelayedScaling, Float8CurrentScaling, Format, FP8GlobalStateManager, fp8_autocast
from mindspeed_te.modules import Linear
from tests.dist_utils import run_distributed


def _mismatch_worker(rank: int, world_size: int) -> dict:
    FP8GlobalStateManager.reset()
    recipe = DelayedScaling(fp8_format=Format.HIF8) if rank == 0 else Float8CurrentScaling(fp8_format=Format.HYBRID)
    layer = Linear(16, 16)
    start = time.monotonic()
    try:
        with fp8_autocast(fp8_recipe=recipe):
            layer(torch.randn(4, 16))
    except RuntimeError as err:
        return {"error": str(err), "seconds": time.monotonic() - start,
                "depth": FP8GlobalStateManager.quantization_state.autocast_depth}
    return {"error": None}


def test_recipe_mismatch_raises_on_every_rank_naming_both():
    results = run_distributed(_mismatch_worker, 2)
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} did not raise"
        assert "DelayedScaling(" in result["error"] and "Float8CurrentScaling(" in result["error"]
        assert "HIF8" in result["error"] and "HYBRID" in result["error"]
        assert result["seconds"] < 10 and result["depth"] == 0


def _agree_worker(rank: int, world_size: int) -> int:
    FP8GlobalStateManager.reset()
    calls = []
    real = dist.all_gather_into_tensor

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_gather_into_tensor = counting
    layer = Linear(16, 16)
    recipe = DelayedScaling(amax_compute_algo=lambda h: h.amax(dim=0))  # callables compare by name
    for _ in range(3):
        with fp8_autocast(fp8_recipe=recipe):
            layer(torch.randn(4, 16)).sum().backward()
    return len(calls)


def test_matching_recipes_are_compared_once():
    assert run_distributed(_agree_worker, 2) == [1, 1]
