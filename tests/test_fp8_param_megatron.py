"""Megatron-LM's pretrain_gpt.py with --fp8-param-gather on CPU (DP=2, gloo, distributed optimizer): weights
live only in FP8 (QuantizedTensors whose 1-byte codes sit in Megatron's uint8 parameter buffer), the
optimizer keeps fp32 main parameters and casts its shard back through our fp8_utils hooks, the parameter
all-gather moves 1 byte per weight element, losses stay within the recipe tolerance of the run without the
flag, and a distributed checkpoint of FP8 parameters resumes exactly."""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.test_launch_megatron import MEGATRON, _launch, _losses, _losses_of_6, dataset_helpers  # noqa: F401

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not MEGATRON, reason="needs MEGATRON_LM_PATH (Megatron-LM checkout)")]

DP2 = ("--bf16", "--use-distributed-optimizer")
FORMS = {"tensorwise": "Float8Tensor: data", "delayed": "Float8Tensor: data",
         "blockwise": "Float8BlockwiseQTensor: rowwise_data"}
PROBE = ("-m", "tests.fp8_param_probe")  # the launcher with a probe of the parameters and collectives


def _probe(run: subprocess.CompletedProcess) -> dict:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found = re.findall(r"^FP8PROBE (.*)$", run.stdout, re.MULTILINE)
    assert len(found) == 1, run.stdout[-3000:]
    return json.loads(found[0])


@pytest.mark.parametrize("recipe", [("e4m3", "tensorwise"), ("hif8", "delayed"), ("hybrid", "blockwise")],
                         ids=lambda r: "-".join(r))
def test_fp8_param_gather_trains_like_bf16_weights(recipe):
    fp8 = ("--fp8-format", recipe[0], "--fp8-recipe", recipe[1])
    plain = _launch(*DP2, *fp8, nproc=2, port=29601, launcher=PROBE)
    run = _launch(*DP2, *fp8, "--fp8-param-gather", nproc=2, port=29603, launcher=PROBE)
    reference, losses = _losses(plain), _losses(run)
    assert len(losses) == 3 == len(reference)
    assert all(abs(a - b) < 0.05 * b for a, b in zip(losses, reference)), (losses, reference)

    without, probe = _probe(plain), _probe(run)
    # Without the flag: high-precision weights, a bf16 buffer, nothing gathered as codes.
    assert without["quantized_params"] == 0 and "torch.uint8" not in without["buffer_dtypes"]
    assert "torch.uint8" not in without["gather"]
    # With it: the TE linears' weights are FP8 parameters (1-byte codes) living in Megatron's uint8 buffer...
    assert probe["quantized_params"] >= 8  # qkv, proj, fc1, fc2 of both layers
    assert probe["code_bytes_per_element"] == [1]
    assert "torch.uint8" in probe["buffer_dtypes"] and probe["codes_in_uint8_buffer"]
    # ...and the parameter all-gather moves them at 1 byte per element, every step (3 iterations; Megatron pads
    # each buffer to a multiple of the DP size, so at least the weights' elements each time).
    elements, size = probe["gather"]["torch.uint8"]
    assert size == elements >= 3 * probe["quantized_elements"]
    # The bytes moved for all parameters drop accordingly against the bf16 run (embeddings and norms stay bf16).
    total = sum(b for _, b in probe["gather"].values())
    assert total < 0.8 * sum(b for _, b in without["gather"].values())
    # No high-precision copy of an FP8 weight outlives the setup besides this rank's fp32 main shard: Megatron took
    # the initial values into its main shards and dropped them, no module caches a quantized weight, no module
    # attribute holds one in high precision; and the weights hold one data form (the columnwise one of
    # per-tensor and 128x128-tile weights is the rowwise data read transposed, never stored).
    copies = probe["copies"]
    assert copies["init_values"] == copies["cached_weights"] == copies["weight_shaped_attributes"] == 0
    assert copies["forms"] == [FORMS[recipe[1]]]
    assert 0 < copies["main_elements"] <= without["copies"]["main_elements"]


def test_dist_checkpoint_resume_with_fp8_parameters_is_exact(tmp_path):
    """--fp8-param-gather weights saved through Megatron's torch_dist checkpoint at iteration 3, with the
    distributed optimizer's state, and loaded again: every resumed loss is the uninterrupted run's. Iteration 4
    needs the weights' FP8 codes and scales and the delayed-scaling histories (_extra_state) back; 5 and 6 the
    fp32 main parameters, Adam's moments and its step (patches/optimizer.py).

    Megatron logs the first iteration of a run without resetting its loss accumulator, so the resumed run
    prints the mean of iterations 4 and 5 at iteration 5 (the uninterrupted run does the same at iteration 2)."""
    six = [*DP2, "--train-iters", "6", "--hidden-dropout", "0", "--attention-dropout", "0", "--fp8-format", "e4m3",
           "--fp8-recipe", "delayed", "--fp8-amax-history-len", "4", "--fp8-param-gather", "--ckpt-format",
           "torch_dist"]
    straight = _losses_of_6(_launch(*six, nproc=2, port=29611))
    saved = _launch(*six, "--save", str(tmp_path), "--save-interval", "3", "--exit-interval", "3", nproc=2,
                    port=29613, launcher=PROBE)
    assert _probe(saved)["quantized_params"] >= 8  # the checkpoint really holds FP8 parameters
    load = _launch(*six, "--load", str(tmp_path), nproc=2, port=29615, launcher=PROBE)
    assert _probe(load)["quantized_params"] >= 8
    assert "Loading distributed optimizer sharded state" in load.stdout + load.stderr
    resumed = _losses_of_6(load)
    assert sorted(resumed) == [4, 5, 6] and sorted(straight) == [1, 2, 3, 4, 5, 6]
    assert resumed[4] == straight[4] and resumed[6] == straight[6], (resumed, straight)
    # printed with 7 significant digits: the mean of two exact losses is exact to its last digit
    assert abs(resumed[5] - (straight[4] + straight[5]) / 2) <= 1.5e-6, (resumed, straight)
