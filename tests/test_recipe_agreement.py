"""Issue 12 item 4: at the first FP8 step the ranks compare their recipes with one small collective; a
mismatch raises on every rank naming both recipes, quickly, instead of hanging (two real gloo ranks)."""
import time

import pytest
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


def test_a_new_group_at_a_dead_groups_address_is_checked_afresh(monkeypatch):
    """The ranks' recipe check is remembered per group object, weakly: a group that is gone is forgotten, and a
    new group that CPython puts at the dead one's address (its id) is checked, not taken for the old one.
    (Single process: the collective is replaced by a record of the groups it would run on.)"""
    import gc

    from mindspeed_te.state import regions

    checked = []
    monkeypatch.setattr(regions, "check_same_on_all_ranks", lambda what, key, group: checked.append(group))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    recipe = Float8CurrentScaling()

    def make() -> dist.ProcessGroup:
        return dist.ProcessGroup(dist.HashStore(), 0, 1)

    group = make()
    for _ in range(2):
        with fp8_autocast(fp8_recipe=recipe, fp8_group=group):
            pass
    assert len(checked) == 1 and checked[0] is group  # once per group
    # the regions' record of their arguments is the last other holder of the group: drop it, and the group
    FP8GlobalStateManager.quantization_state.autocast_arguments.clear()
    address = id(group)
    checked.clear()
    del group
    gc.collect()
    kept = []
    for _ in range(5000):
        newcomer = make()
        if id(newcomer) == address:
            break
        kept.append(newcomer)
    else:
        pytest.skip("CPython put no new group at the freed address")
    with fp8_autocast(fp8_recipe=recipe, fp8_group=newcomer):
        pass
    assert len(checked) == 1 and checked[0] is newcomer
