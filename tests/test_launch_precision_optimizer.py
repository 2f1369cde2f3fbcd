"""Megatron-LM's own pretrain_gpt.py with --use-precision-aware-optimizer on mindspeed_te's FusedAdam (no
TransformerEngine), on CPU: a torch_dist checkpoint saved at iteration 3 and resumed gives the uninterrupted
run's loss at iteration 4, and at iteration 6 the checkpoint of the resumed run equals the uninterrupted one's
in every tensor (weights, moments, master remainders); also with FP8 weights (--fp8-param-gather, where Megatron
keeps float32 main parameters). Needs MEGATRON_LM_PATH (see test_launch_megatron.py)."""
from __future__ import annotations

import os
import re

import pytest
import torch

from tests.test_launch_megatron import MEGATRON, _launch, _losses_of_6, dataset_helpers  # noqa: F401

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not MEGATRON, reason="needs MEGATRON_LM_PATH (Megatron-LM checkout)")]

RUN = ("--train-iters", "6", "--hidden-dropout", "0", "--attention-dropout", "0", "--bf16",  # later --train-iters wins
       "--use-distributed-optimizer", "--use-precision-aware-optimizer", "--ckpt-format", "torch_dist")


def _checkpoint_tensors(directory: str) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(directory, "all.pt")
    dcp_to_torch_save(os.path.join(directory, "iter_0000006"), out)

    def flat(tree: dict, prefix: str = "") -> dict:
        found = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                found.update(flat(value, f"{prefix}{key}."))
            elif isinstance(value, torch.Tensor):
                found[prefix + key] = value
        return found

    return flat(torch.load(out, weights_only=False))


FP8_MOMENTS = ("--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "fp8", "--main-grads-dtype", "bf16")
# the distributed optimizer's saved state: FusedAdam's master as int16 remainders (bf16 weights), or Megatron's
# own float32 main parameters (FP8 weights); the moments as their float32 values
REMAINDERS = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32, "param": torch.int16}
MAIN_PARAMS = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32, "param": torch.float32}


@pytest.mark.parametrize("flags, saved", [
    (FP8_MOMENTS, REMAINDERS),
    (("--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"), REMAINDERS),
    ((*FP8_MOMENTS, "--quant-states", "hif8"), REMAINDERS),
    ((*FP8_MOMENTS, "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--fp8-param-gather"), MAIN_PARAMS),
], ids=["fp8-moments-bf16-grads", "bf16-moments", "hif8-moments", "fp8-weights-fp8-moments"])
def test_precision_aware_optimizer_checkpoint_resumes_exactly(tmp_path, flags, saved):
    straight_dir, first_dir, resumed_dir = (str(tmp_path / name) for name in ("straight", "first", "resumed"))
    straight = _launch(*RUN, *flags, "--save", straight_dir, "--save-interval", "6", port=29631)
    losses = _losses_of_6(straight)
    _losses_of_6(_launch(*RUN, *flags, "--save", first_dir, "--save-interval", "3", "--exit-interval", "3",
                         port=29633))
    resumed = _losses_of_6(_launch(*RUN, *flags, "--load", first_dir, "--save", resumed_dir, "--save-interval", "6",
                                   port=29635))
    assert sorted(resumed) == [4, 5, 6] and sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert resumed[4] == losses[4]
    if "--quant-states" in flags:
        assert re.search(r"quant_states \.+ hif8", straight.stdout)
    ours, theirs = _checkpoint_tensors(straight_dir), _checkpoint_tensors(resumed_dir)
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key
    assert {key.rpartition(".")[2]: value.dtype for key, value in ours.items() if ".bucket_idx_" in key} == saved


def test_fp8_weights_with_delayed_scaling_are_refused():
    run = _launch(*FP8_MOMENTS, "--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer",
                  "--fp8-format", "e4m3", "--fp8-recipe", "delayed", "--fp8-param-gather", port=29639)
    assert run.returncode != 0
    assert "--use-precision-aware-optimizer with FP8 parameters (--fp8-param-gather) needs" in run.stdout + run.stderr


def test_quant_states_needs_the_precision_aware_optimizer():
    run = _launch("--bf16", "--use-distributed-optimizer", "--quant-states", "hif8", port=29637)
    assert run.returncode != 0
    assert "--quant-states hif8 needs --use-precision-aware-optimizer" in run.stdout + run.stderr
