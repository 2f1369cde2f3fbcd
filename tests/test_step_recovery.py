"""--fp8-step-recovery (issue 12 item 2): a NaN on one rank of two makes both ranks skip the step together,
reset the amax histories and retry the batch; the retried run equals the run without the fault."""
import math

import pytest
import torch
import torch.distributed as dist

from mindspeed_te import DelayedScaling, Float8CurrentScaling, Format, fp8_autocast
from mindspeed_te.modules import Linear
from mindspeed_te.recipe import HIF8DelayedScaling
from mindspeed_te.recovery import ReplayIterator, StepRecovery
from tests.dist_utils import run_distributed

RECIPES = {
    "delayed": lambda: DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4),
    "hif8_delayed": lambda: HIF8DelayedScaling(amax_collect_interval=1, scale_update_interval=1, amax_history_len=4),
    "tensorwise": lambda: Float8CurrentScaling(fp8_format=Format.HIF8),
}
STEPS = 3


def _train(rank: int, world_size: int, recipe_name: str, fault: dict) -> dict:
    """Three data-parallel steps of a two-layer model; `fault` = {"rank", "step", "where", "attempts"} puts a
    NaN into layer 1's output ("activation") or into its gradient ("gradient") on one rank."""
    torch.manual_seed(0)
    layers = torch.nn.Sequential(Linear(32, 32, name="fc1"), Linear(32, 32, name="fc2"))
    optimizer = torch.optim.SGD(layers.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    batches = ReplayIterator(iter([torch.randn(16, 32, generator=g) for _ in range(STEPS)]))
    recovery = StepRecovery()
    recipe = RECIPES[recipe_name]()
    attempts: list[dict] = []
    current = {"step": 0}

    def poison(tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        out.view(-1)[5] = math.nan
        return out

    def attempt() -> float:
        step = current["step"]
        n = sum(a["step"] == step for a in attempts)
        fwd = layers[0].fp8_states[0] if layers[0].fp8_states is not None else None
        attempts.append({"step": step, "history": None if fwd is None or not hasattr(fwd, "amax_history")
                         else (fwd.amax_history.abs().sum().item(), fwd.scale.tolist())})
        faulty = fault and rank == fault["rank"] and step == fault["step"] and n < fault["attempts"]
        x = next(batches)
        with fp8_autocast(fp8_recipe=recipe):
            h = layers[0](x)
            if faulty and fault["where"] == "activation":
                h = poison(h)
            elif faulty:
                h.register_hook(poison)
            y = layers[1](h)
        loss = y.square().mean()
        loss.backward()
        grads = [p.grad for p in layers.parameters()]
        if not recovery.failed(loss.detach(), grads):
            for grad in grads:  # data parallelism: average the gradients
                dist.all_reduce(grad)
                grad.div_(world_size)
            optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    losses = []
    for step in range(STEPS):
        current["step"] = step
        losses.append(recovery.run(attempt, [batches]))
    return {"losses": losses, "params": [p.detach().clone() for p in layers.parameters()],
            "retried": recovery.retried, "skipped": recovery.skipped, "attempts": attempts}


@pytest.mark.slow
@pytest.mark.parametrize("recipe_name, step", [("delayed", 0), ("hif8_delayed", 0), ("tensorwise", 1)])
@pytest.mark.parametrize("where", ["activation", "gradient"])
def test_fault_on_one_rank_is_skipped_together_and_retried(recipe_name, step, where):
    fault = {"rank": 1, "step": step, "where": where, "attempts": 1}
    faulty = run_distributed(_train, 2, recipe_name, fault)
    reference = run_distributed(_train, 2, recipe_name, {})
    for rank in range(2):
        got, want = faulty[rank], reference[rank]
        assert (got["retried"], got["skipped"]) == (1, 0), rank  # both ranks retried, rank 0 had no fault
        assert (want["retried"], want["skipped"]) == (0, 0)
        assert len(got["attempts"]) == STEPS + 1
        retry = got["attempts"][step + 1]
        if retry["history"] is not None:  # the failed attempt's amaxes were forgotten: a new state's history
            assert retry["history"][0] == 0.0 and set(retry["history"][1]) == {1.0}
        assert got["losses"] == want["losses"]
        for p, q in zip(got["params"], want["params"]):
            assert torch.equal(p, q)


@pytest.mark.slow
def test_second_failure_skips_the_batch_on_every_rank():
    fault = {"rank": 0, "step": 1, "where": "activation", "attempts": 2}
    faulty = run_distributed(_train, 2, "tensorwise", fault)
    for rank in range(2):
        got = faulty[rank]
        assert (got["retried"], got["skipped"]) == (1, 1)
        assert math.isnan(got["losses"][1]) == (rank == 0)  # rank 1's loss was finite, it skipped all the same
        assert all(torch.isfinite(p).all() for p in got["params"])
    for p, q in zip(faulty[0]["params"], faulty[1]["params"]):
        assert torch.equal(p, q)  # the ranks stayed in step


def test_replay_iterator_refeeds_an_attempt():
    it = ReplayIterator(iter(range(5)))
    assert [next(it), next(it)] == [0, 1]
    it.rewind()
    assert [next(it), next(it), next(it)] == [0, 1, 2]
    it.commit()
    it.rewind()
    assert list(it) == [3, 4]


def test_single_process_failure_is_local_and_retries_are_bounded():
    recovery = StepRecovery(retries=1)
    calls = []

    def attempt():
        calls.append(1)
        return recovery.failed(torch.tensor(math.inf))

    assert recovery.run(attempt) is True and len(calls) == 2 and (recovery.retried, recovery.skipped) == (1, 1)
    assert recovery.failed(torch.tensor(1.0), [torch.ones(3), None]) is False
    with pytest.raises(ValueError, match="retries"):
        StepRecovery(retries=-1)
