"""Megatron-LM's own unit tests for the TE path, run on the CPU through mindspeed_te (the pytest plugin
`patches/megatron_tests.py`), single process. Needs a Megatron-LM checkout (tag core_v0.16.1) at
MEGATRON_LM_PATH; skipped without it.

The selection covers attention (sbhd, packed thd with fused RoPE, checkpointed), the transformer layer, the
TE MoE layer (grouped GEMMs, all-gather / all-to-all dispatchers, recompute, fp16), multi-token prediction
in FP8 and FP8 inference padding. Tests in these files that need more ranks than one (world size 2-8) are left
out of the verdict, known by the layout they ask Megatron for (the plugin tests/megatron_plugins/
megatron_world_size.py marks them), never by the words of an error; every other selected test must pass.

Distributed checkpointing (tests/unit_tests/dist_checkpointing) runs on the 8 gloo ranks Megatron's harness
asks for: save, reload under other TP/PP layouts and compare GPT, BERT and T5 models and the MLP built from
the TE specs (and across TE, local and op-fuser specs); and test_fp8.py and the TE grouped expert layers of
models/test_moe_experts.py, which import TransformerEngine themselves, with the plugin's
`--te-import-facade` (their TE names served by mindspeed_te's classes), among them
test_sequential_grouped_mlp_extra_state, which reads the experts' `fp8_meta` after a load without forward and
compares TE sequential and grouped experts slot by slot. Left out: test_mlp_glu.py's test_oom_is_handled (it
needs a CUDA out-of-memory error from torch.cat), test_mamba.py (needs the mamba-ssm CUDA kernels) and
Megatron's test_fp8_param.py (trains a 128k-vocabulary model; too slow on CPU)."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

MEGATRON = os.environ.get("MEGATRON_LM_PATH")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN = "mindspeed_te.patches.megatron_tests"  # named, not imported: importing it applies the patches
# Marks the tests whose model-parallel layout needs more ranks than the run has (junit property `needs_world_size`);
# its own folder goes on PYTHONPATH, since Megatron's checkout has a `tests` package of its own.
RANKS_PLUGIN = "megatron_world_size"
RANKS_PLUGIN_DIR = os.path.join(ROOT, "tests", "megatron_plugins")
NEEDS_WORLD_SIZE = "needs_world_size"
# Megatron-LM's unit-test harness (tests/unit_tests/conftest.py) imports these beyond its training code.
HARNESS_MISSING = [name for name in ("click", "requests") if importlib.util.find_spec(name) is None]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600),
              pytest.mark.skipif(not MEGATRON, reason="needs MEGATRON_LM_PATH (Megatron-LM checkout)"),
              pytest.mark.skipif(bool(HARNESS_MISSING), reason=f"Megatron-LM's unit-test harness needs "
                                 f"{' and '.join(HARNESS_MISSING)}: pip install click requests")]

UNIT = "tests/unit_tests/transformer/"
SELECTION = [
    UNIT + "test_attention.py::TestParallelAttention",
    UNIT + "test_attention_packed_seq.py",
    UNIT + "test_attention_no_rope.py",
    UNIT + "test_transformer_layer.py::TestParallelTransformerLayer",
    UNIT + "moe/test_moe_layer.py::TestMoELayerInit::test_te_moe_layer",
    UNIT + "moe/test_moe_layer.py::TestMoELayerRecompute",
    UNIT + "moe/test_moe_layer.py::TestMoELayerFP16",
    UNIT + "moe/test_moe_layer.py::TestInterleaveTransformerBlock",
    UNIT + "moe/test_grouped_mlp.py::TestTEGroupedMLP",
    UNIT + "test_multi_token_prediction.py::TestMultiTokenPrediction::test_fp8_support",
    UNIT + "test_multi_token_prediction.py::TestMultiTokenPrediction::test_packed_sequences",
    # FP8 inference padding of the TE linears (the file's other test patches transformer_engine itself).
    "tests/unit_tests/test_fp8_utils.py::TestFP8Padding::test_prepare_model_for_fp8_inference_basic",
]


def verdict(report: pathlib.Path, world_size: int = 1) -> tuple[dict[str, int], list[str]]:
    """Counts of a junit report's outcomes, and the failures. A failed test counts as "needs more ranks" only when
    the ranks plugin recorded that its layout needs a world size `world_size` does not divide; any other failure
    (whatever its message says) is a failure."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "needs more ranks": 0}
    failures = []
    for case in ET.parse(report).iter("testcase"):
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        needs = [int(p.get("value")) for p in case.iter("property") if p.get("name") == NEEDS_WORLD_SIZE]
        if outcome is None:
            counts["passed"] += 1
        elif outcome.tag == "skipped":
            counts["skipped"] += 1
        elif needs and all(world_size % n for n in needs):
            counts["needs more ranks"] += 1
        else:
            counts["failed"] += 1
            failures.append(f"{case.get('classname')}::{case.get('name')}: {(outcome.get('message') or '')[:200]}")
    return counts, failures


def megatron_pytest_env(**extra: str) -> dict[str, str]:
    """The environment of a pytest run in Megatron's checkout: this repository and the ranks plugin importable."""
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + RANKS_PLUGIN_DIR,
                PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""), **extra)


def test_megatrons_te_path_unit_tests_pass_on_cpu(tmp_path):
    report = tmp_path / "junit.xml"
    env = megatron_pytest_env(MASTER_ADDR="127.0.0.1", MASTER_PORT="29731", WORLD_SIZE="1", LOCAL_RANK="0")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", PLUGIN, "-p", RANKS_PLUGIN, "-o", "addopts=", "-p",
         "no:cacheprovider", "-q", "--timeout", "300", f"--junitxml={report}", *SELECTION],
        cwd=MEGATRON, env=env, capture_output=True, text=True, timeout=3500)
    assert report.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    counts, failures = verdict(report)
    print(f"Megatron TE-path unit tests on CPU: {counts}")
    assert not failures, "\n".join(failures)
    assert counts["passed"] >= 60, counts  # the selection really ran


# Megatron's dist_checkpointing tests run on 8 gloo ranks (the layouts they ask for go up to TP x PP = 8).
DIST = "tests/unit_tests/dist_checkpointing/"
DIST_SELECTION = [
    DIST + "models/test_gpt_model.py",
    DIST + "models/test_bert_model.py",
    DIST + "models/test_t5_model.py",
    DIST + "models/test_mlp_glu.py::TestParallelMLPWithGLU::test_parallel_reconfiguration_e2e",
]
# These import transformer_engine themselves: served by the plugin's facade. Of the expert layers, the TE
# grouped MLP: saved and reloaded as TE sequential experts and back, under other TP/EP layouts, and as a
# torch state dict; and their FP8 metadata (fp8_meta) carried between the two kinds of expert layers.
FP8_FACADE_SELECTION = [DIST + "test_fp8.py", DIST + "models/test_moe_experts.py"]
FP8_FACADE_CASES = ("TestFP8 or torch_native or (interchangeable and te_grouped)"
                    " or (reconfiguration_e2e and te_grouped and [False-tp) or sequential_grouped_mlp_extra_state")
RANKS = 8


def _run_on_ranks(log_dir: pathlib.Path, selection: list[str], *options: str) -> list[str]:
    """pytest on RANKS gloo ranks under torch.distributed.run, each rank's output in its own file under
    `log_dir`; returns each rank's summary line. A rank stuck in a collective after another one failed is
    stopped by the per-test timeout (thread method: a signal cannot interrupt gloo), so the failure is
    reported instead of hanging."""
    env = dict(os.environ, PYTHONPATH=ROOT,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={RANKS}", "--master-port=29733",
         "--redirects=3", f"--log-dir={log_dir}", "-m",
         "pytest", "-p", PLUGIN, "-o", "addopts=", "-p", "no:cacheprovider", "-q", "-W", "ignore",
         "--timeout", "600", "--timeout-method", "thread", *options, *selection],
        cwd=MEGATRON, env=env, capture_output=True, text=True, timeout=3000)
    outputs = {int(path.parent.name): path.read_text() for path in log_dir.glob("*/attempt_*/*/stdout.log")}
    summaries = [match.group(1) for rank in sorted(outputs)
                 for match in [re.search(r"^=*\s*(\d+ passed.*?) in [\d.]+s", outputs[rank], re.M)] if match]
    failing = next((text for text in outputs.values() if "passed in" not in text), run.stderr)
    assert run.returncode == 0 and len(summaries) == RANKS, failing[-5000:]
    assert not any(word in s for s in summaries for word in ("failed", "error", "skipped")), summaries
    return summaries


def test_megatrons_te_dist_checkpointing_tests_pass_on_8_cpu_ranks(tmp_path):
    summaries = _run_on_ranks(tmp_path, DIST_SELECTION)
    print(f"Megatron TE-spec dist_checkpointing tests on {RANKS} CPU ranks: {summaries}")
    assert all(int(s.split()[0]) >= 60 for s in summaries), summaries  # the selection really ran


def test_megatrons_fp8_dist_checkpointing_tests_pass_through_the_te_import_facade(tmp_path):
    summaries = _run_on_ranks(tmp_path, FP8_FACADE_SELECTION, "--te-import-facade", "-k", FP8_FACADE_CASES)
    print(f"Megatron dist_checkpointing test_fp8.py and TE expert layers on {RANKS} CPU ranks: {summaries}")
    assert all(int(s.split()[0]) >= 55 for s in summaries), summaries
