"""Megatron-LM's pretrain_gpt.py with --fp8-param-gather on CPU (DP=2, gloo, distributed optimizer): weights
live only in FP8, the optimizer keeps fp32 main parameters and casts its shard back through our fp8_utils
hooks; losses stay within the recipe tolerance of the run without the flag, and a dist-checkpoint resume
gives the uninterrupted run's losses exactly."""
from __future__ import annotations

import pytest

from tests.test_launch_megatron import MEGATRON, _launch, _losses, _losses_of_6, dataset_helpers  # noqa: F401

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not MEGATRON, reason="needs MEGATRON_LM_PATH (Megatron-LM checkout)")]

DP2 = ("--bf16", "--use-distributed-optimizer")


@pytest.mark.parametrize("recipe", [("e4m3", "tensorwise"), ("hif8", "delayed"), ("hybrid", "blockwise")],
                         ids=lambda r: "-".join(r))
def test_fp8_param_gather_trains_like_bf16_weights(recipe):
    fp8 = ("--fp8-format", recipe[0], "--fp8-recipe", recipe[1])
    reference = _losses(_launch(*DP2, *fp8, nproc=2, port=29601))
    run = _launch(*DP2, *fp8, "--fp8-param-gather", nproc=2, port=29603)
    losses = _losses(run)
    assert len(losses) == 3 == len(reference)
    assert all(abs(a - b) < 0.05 * b for a, b in zip(losses, reference)), (losses, reference)


def test_fp8_param_gather_checkpoint_resume_is_exact(tmp_path):
    six = ["--train-iters", "6", "--hidden-dropout", "0", "--attention-dropout", "0", *DP2, "--fp8-param-gather",
           "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"]
    straight = _losses_of_6(_launch(*six, nproc=2, port=29605))
    _launch(*six, "--save", str(tmp_path), "--save-interval", "3", "--exit-interval", "3", nproc=2, port=29607)
    resumed = _losses_of_6(_launch(*six, "--load", str(tmp_path), nproc=2, port=29609))
    assert sorted(resumed) == [4, 5, 6]
    assert resumed == {i: straight[i] for i in (4, 5, 6)}
