"""The real `pretrain_gpt.py` of every Megatron-LM tree in MEGATRON_LM_TREES (paths separated by os.pathsep, one
per release; skipped without it): TP2 + sequence parallelism in FP8 and HiF8 through `python -m
mindspeed_te.launch`, as a user of that release launches it. The plugin's megatron-core tests run per release in
tests/megatron_matrix.py."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from tests.megatron_matrix import ROOT, build_dataset_helpers, helpers_env, python_path, tree_release, trees

TREES = trees()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not TREES, reason="needs MEGATRON_LM_TREES (Megatron-LM trees)")]

# Llama-style: RoPE (fused by default), SwiGLU, RMSNorm; Megatron's defaults otherwise (NCCL backend, fusions).
GPT = ("--transformer-impl transformer_engine --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
       "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --train-iters 3 "
       "--lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --log-interval 1 --eval-iters 1 "
       "--eval-interval 100 --seed 7 --position-embedding-type rope --swiglu --normalization RMSNorm "
       "--disable-bias-linear --untie-embeddings-and-output-weights --tensor-model-parallel-size 2 "
       "--sequence-parallel").split()


def _launch(tree, port: int, *flags: str) -> list[float]:
    """pretrain_gpt.py of `tree` on 2 processes; the 3 iterations' losses."""
    build_dataset_helpers(tree)
    # (CUDA_DEVICE_MAX_CONNECTIONS: every example script exports it; 0.12 to 0.14 refuse TP without it)
    env = dict(os.environ, **helpers_env(), PYTHONPATH=os.pathsep.join([python_path(tree), str(ROOT)]),
               MASTER_ADDR="127.0.0.1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}",
               "-m", "mindspeed_te.launch", str(tree / "pretrain_gpt.py"), *GPT, *flags]
    run = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [float(x) for x in re.findall(r"iteration\s+\d+/\s*3 \|.*?lm loss: ([0-9.E+-]+)", run.stdout)]


@pytest.mark.parametrize("tree", TREES, ids=lambda tree: tree_release(tree))
@pytest.mark.parametrize("flags", [("--fp8-format", "hif8", "--fp8-recipe", "delayed"),
                                   ("--fp8-format", "hif8", "--fp8-recipe", "hif8_delayed", "--bf16"),
                                   ("--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--bf16")],
                         ids=lambda flags: "-".join(flags[1:4:2]))
def test_pretrain_gpt_tp2_sequence_parallel_trains(tree, flags):
    """Each release's own training script and argument checks, the plugin's patches on that release: three
    finite losses near the uniform start over Megatron's padded vocabulary (256 entries under TP2: ln 256 = 5.55)."""
    port = 29700 + 10 * TREES.index(tree) + len(flags)
    losses = _launch(tree, port, *flags)
    assert len(losses) == 3 and all(math.isfinite(x) and 4.5 < x < 6.0 for x in losses), losses
