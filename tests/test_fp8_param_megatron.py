"""Megatron-LM's pretrain_gpt.py with --fp8-param-gather on CPU (DP=2, gloo, distributed optimizer): weights
live only in FP8, the optimizer keeps fp32 main parameters and casts its shard back through our fp8_utils
hooks; losses stay within the recipe tolerance of the run without the flag."""
from __future__ import annotations

import pytest

from tests.test_launch_megatron import MEGATRON, _launch, _losses, dataset_helpers  # noqa: F401

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

