"""Megatron-LM's own pretrain_gpt.py with its offloads (needs MEGATRON_LM_PATH, see test_launch_megatron.py): the
losses equal those of the same run without offload. --cpu-offloading-num-layers (megatron-core 0.16 on): the
first layer's activations went to host memory and came back, FP8 ones as 1-byte codes. --optimizer-cpu-offload:
the host optimizer updates the offloaded fraction of the parameters, mindspeed_te's FusedAdam the rest."""
from __future__ import annotations

import json
import re

import pytest

from tests.test_launch_megatron import MEGATRON, _launch, _losses, _losses_of_6, dataset_helpers  # noqa: F401

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not MEGATRON, reason="needs MEGATRON_LM_PATH (Megatron-LM checkout)")]

PROBE = ("-m", "tests.offload_probe")
# Large enough that an activation passes TE's offload threshold (256 Ki elements): 512 tokens x hidden 512;
# later flags win over the tiny defaults. Two micro-batches per step, as Megatron accumulates gradients.
SHAPE = ("--hidden-size", "512", "--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "1",
         "--global-batch-size", "2", "--bf16", "--hidden-dropout", "0", "--attention-dropout", "0")
OFFLOAD = ("--cpu-offloading-num-layers", "1")  # (0.16 on: it sets args.cpu_offloading, which has no flag)


def _probe(run) -> dict:
    return json.loads(re.search(r"^OFFLOADPROBE (.*)$", run.stdout, re.M).group(1))


@pytest.mark.parametrize("fp8", [(), ("--fp8-format", "hif8", "--fp8-recipe", "delayed"),
                                 ("--fp8-format", "e4m3", "--fp8-recipe", "mxfp8")],
                         ids=["bf16", "hif8-delayed", "mxfp8"])
def test_pretrain_gpt_with_cpu_offloading_trains_the_same(fp8):
    plain = _launch(*SHAPE, *fp8, launcher=PROBE, port=29651)
    offloaded = _launch(*SHAPE, *fp8, *OFFLOAD, launcher=PROBE, port=29653)
    assert _losses(offloaded) == _losses(plain) and len(_losses(plain)) == 3
    assert _probe(plain)["offloaded"] == 0
    probe = _probe(offloaded)
    # one schedule (the decoder block); every storage offloaded in 3 steps x 2 micro-batches is read back
    assert probe["schedules"] == 1 and probe["offloaded"] > 0 and probe["reloaded"] >= probe["offloaded"]
    codes = probe["bytes_by_element_size"].get("1", 0)
    assert (codes > 0) == bool(fp8), probe


@pytest.mark.parametrize("fraction", ["0.5", "1.0"])
def test_pretrain_gpt_with_optimizer_cpu_offload_trains_the_same(fraction):
    """Megatron requires --use-precision-aware-optimizer (and the distributed optimizer) for it; its hybrid
    optimizer splits the parameters by elements between torch's AdamW on the host and the device optimizer,
    each with float32 copies of the bf16 weights, and takes none of the precision-aware options: the same
    update as the distributed optimizer's default (float32 main weights and moments)."""
    flags = ("--bf16", "--use-distributed-optimizer", "--train-iters", "6")
    plain = _losses_of_6(_launch(*flags, launcher=PROBE, port=29655))
    run = _launch(*flags, "--use-precision-aware-optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction",
                  fraction, launcher=PROBE, port=29657)
    assert _losses_of_6(run) == plain and len(plain) == 6
    split = _probe(run)["optimizer"]
    total = split["host_elements"] + split["device_elements"]
    assert split["host_class"] == ["AdamW"]
    assert abs(split["host_elements"] - float(fraction) * total) <= 0.25 * total  # whole parameters move
    if fraction != "1.0":
        assert split["device_class"] == "mindspeed_te.optimizers.fused_adam.FusedAdam"
