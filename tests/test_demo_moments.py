"""The demo's runs with 8-bit Adam moments (issue 33, item 5) and its run-to-run noise (`--seeds`).

The 8-bit runs go through Megatron's own precision-aware optimizer, as `--use-precision-aware-optimizer
--exp-avg-dtype fp8 --exp-avg-sq-dtype fp8 --quant-states ...` would: checked here on the demo's own builder
(mindspeed_te's FusedAdam is the inner optimizer, its moments are 8-bit codes) against the run with fp32
moments, which the same path with float32 moments reproduces to float32 rounding."""
from __future__ import annotations

import csv
import json
import math
import statistics
import subprocess
import sys
import textwrap

import pytest

from mindspeed_te.demo.seeds import format_noise, noise
from mindspeed_te.demo.train import RUNS, Run, RunResult, base_run
from tests.demo_probe import probe_start

# A few steps of a tiny GPT through the demo's train(), the optimizer caught as build() returns it.
_PROBE = probe_start(5) + textwrap.dedent("""
    import torch
    from megatron.core import optimizer as megatron_optimizer

    def inner(optimizer):
        return optimizer.chained_optimizers[0].optimizer if hasattr(optimizer, "chained_optimizers") \\
            else optimizer.optimizer

    out = {}
    for name in sys.argv[1:]:
        result = demo.train(name, args, corpus, val, args.seed)
        optimizer = inner(built[demo.RUNS[name]][2])
        states = [optimizer.state[p] for group in optimizer.param_groups for p in group["params"]]
        out[name] = {"train": result.train_losses, "val": result.val_losses[-1][1],
                     "optimizer": f"{type(optimizer).__module__}.{type(optimizer).__name__}",
                     "dtypes": sorted({str(s[k].dtype) for s in states for k in ("exp_avg", "exp_avg_sq")}),
                     "moment_bytes": sum(s[k].nbytes for s in states for k in ("exp_avg", "exp_avg_sq")),
                     "params": sum(p.numel() for group in optimizer.param_groups for p in group["params"])}

    # The same build with float32 moments through the precision-aware path: as --exp-avg-dtype fp32.
    config = megatron_optimizer.OptimizerConfig

    class Fp32Moments(config):
        def __init__(self, **kwargs):
            super().__init__(**{**kwargs, "exp_avg_dtype": torch.float32, "exp_avg_sq_dtype": torch.float32})

    megatron_optimizer.OptimizerConfig = Fp32Moments
    result = demo.train("hif8-delayed+hif8-moments", args, corpus, val, args.seed)
    out["precision-aware, fp32 moments"] = {"train": result.train_losses, "val": result.val_losses[-1][1]}
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def probe() -> dict:
    pytest.importorskip("megatron.core")
    run = subprocess.run([sys.executable, "-c", _PROBE, "hif8-delayed", "hif8-delayed+hif8-moments",
                          "e4m3-mxfp8", "e4m3-mxfp8+mxfp8-moments"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.split("RESULT", 1)[1])


@pytest.mark.slow  # one subprocess: megatron-core's import and five short runs (~15 s on an idle machine)
@pytest.mark.parametrize("name, storage", [("hif8-delayed+hif8-moments", ["torch.uint8"]),  # HiF8 codes
                                           ("e4m3-mxfp8+mxfp8-moments", ["torch.float8_e4m3fn"])])
def test_8bit_moment_runs_use_our_fused_adam_with_8bit_states(probe, name, storage):
    run, base = probe[name], probe[base_run(name)]
    assert run["optimizer"] == "mindspeed_te.optimizers.fused_adam.FusedAdam"
    assert run["dtypes"] == storage
    assert run["moment_bytes"] == 2 * run["params"]  # one byte per element of each moment
    assert all(math.isfinite(x) for x in run["train"] + [run["val"]])
    assert run["train"][-1] < run["train"][0]
    # The first loss comes before any update. The second follows an update computed from the float32 moments
    # before they are stored (TE's rule), so 8-bit storage shows from the third loss on: where the same path
    # with float32 moments still gives the base's losses bit for bit (the next test).
    assert run["train"][:2] == base["train"][:2]
    assert run["train"][2:4] != base["train"][2:4]
    assert run["val"] == pytest.approx(base["val"], abs=0.05)


@pytest.mark.slow
def test_precision_aware_path_with_fp32_moments_reproduces_the_default_run(probe):
    """The 8-bit runs differ from their base in the moments only: Megatron's distributed optimizer and our
    FusedAdam with float32 moments give the default run's losses (its mixed-precision optimizer and torch's
    AdamW) to float32 rounding: the first four losses bit for bit (8-bit moments change the third), then
    within float32 rounding of a gradient norm summed in another order, grown over a step."""
    same, base = probe["precision-aware, fp32 moments"], probe["hif8-delayed"]
    assert same["train"][:4] == base["train"][:4]
    assert same["train"] == pytest.approx(base["train"], rel=1e-5)
    assert same["val"] == pytest.approx(base["val"], rel=1e-4)


def test_every_8bit_run_has_its_fp32_base_among_the_runs():
    variants = [name for name, run in RUNS.items() if run.quant_states is not None]
    assert {RUNS[name].quant_states for name in variants} == {"hif8", "mxfp8"}
    for name in variants:
        base = base_run(name)
        assert base != name and RUNS[base] == Run(RUNS[name].fp8_format, RUNS[name].fp8_recipe)
    assert base_run("bf16") == "bf16"


def test_a_run_with_an_unknown_moment_format_is_refused():
    with pytest.raises(ValueError, match="quant_states='fp4'.*hif8"):
        Run("hif8", "delayed", quant_states="fp4")


def _result(name: str, val: float) -> RunResult:
    return RunResult(name, train_losses=[val], val_losses=[(1, 9.0), (2, val)])


def test_noise_is_the_spread_over_seeds_and_the_seed_by_seed_difference_to_the_base():
    losses = {"hif8-delayed": [2.0, 2.2, 2.4], "hif8-delayed+hif8-moments": [2.1, 2.1, 2.5]}
    by_seed = {seed: [_result(name, values[i]) for name, values in losses.items()] for i, seed in enumerate((7, 8, 9))}
    rows = {row.run: row for row in noise(by_seed, base_run)}
    assert rows["hif8-delayed"].mean == pytest.approx(2.2)
    assert rows["hif8-delayed"].std == pytest.approx(0.2)  # sample deviation: sqrt((0.04 + 0 + 0.04) / 2)
    assert rows["hif8-delayed"].differences is None
    assert rows["hif8-delayed+hif8-moments"].base == "hif8-delayed"
    assert rows["hif8-delayed+hif8-moments"].differences == pytest.approx([0.1, -0.1, 0.1])
    table = format_noise(list(rows.values()))
    assert "+0.0333, 0.1000 (vs hif8-delayed)" in table


@pytest.mark.slow  # a subprocess: megatron-core's import and four short runs
def test_seeds_option_writes_every_run_and_seed(tmp_path):
    runs = ["e4m3-mxfp8", "e4m3-mxfp8+mxfp8-moments"]
    subprocess.run([sys.executable, "-m", "mindspeed_te.demo", "--out", str(tmp_path), "--steps", "4",
                    "--eval-interval", "4", "--eval-batches", "1", "--hidden", "64", "--seq-length", "64",
                    "--batch-size", "4", "--runs", ",".join(runs), "--numerics-run", "e4m3-mxfp8", "--seeds", "2",
                    "--seed", "5"], check=True, capture_output=True, text=True, timeout=600)
    with open(tmp_path / "seeds.csv") as f:
        rows = {(r["run"], int(r["seed"])): float(r["val_loss"]) for r in csv.DictReader(f)}
    assert set(rows) == {(run, seed) for run in runs for seed in (5, 6)}
    with open(tmp_path / "summary.csv") as f:
        summary = {r["run"]: float(r["val_loss"]) for r in csv.DictReader(f)}
    assert summary == {run: rows[run, 5] for run in runs}  # the table and figures show --seed
    assert all(rows[run, 5] != rows[run, 6] for run in runs)  # another seed: other weights and batches
    assert statistics.stdev([rows["e4m3-mxfp8", 5], rows["e4m3-mxfp8", 6]]) < 0.1


@pytest.mark.parametrize("argv, flag", [(["--seeds", "0"], "--seeds"),
                                        (["--runs", "hif8-delayed+fp4-moments"], "--runs")])
def test_bad_seed_and_run_options_name_the_option(argv, flag, capsys):
    from mindspeed_te.demo.train import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert flag in capsys.readouterr().err

