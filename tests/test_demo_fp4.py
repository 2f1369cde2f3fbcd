"""The demo's FP4 runs (issue 32, item 5): each goes through Megatron's config path (`fp4`, `fp4_recipe`, the
--mxfp4-* fields, TE's NVTE_NVFP4_DISABLE_* switches) to the recipe and quantizers its TE* modules hold, and a
few steps of each stay finite and learn."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from mindspeed_te.demo.train import OPT_IN, RUNS, Run, base_run, nvfp4_switches, parse_args
from mindspeed_te.recipe import NVFP4_DISABLE_SWITCHES
from tests.demo_probe import probe_start

FP4_RUNS = [name for name, run in RUNS.items() if run.fp4_recipe is not None]

# A few steps of a tiny GPT per run through the demo's train(); then, per TE linear, the recipe it ran and the
# options of the quantizers its recipe states make.
_PROBE = probe_start(3) + textwrap.dedent("""

    def describe(q):
        return {"type": type(q).__name__, "rht": getattr(q, "with_rht", None),
                "sr": getattr(q, "stochastic_rounding", None), "tiles": getattr(q, "with_2d_quantization", None)}

    out = {}
    for name in sys.argv[1:]:
        result = demo.train(name, args, corpus, val, args.seed)
        gpt = built[demo.RUNS[name]][0]
        linears = {}
        for path, module in gpt.named_modules():
            if getattr(module, "fp8_states", None) is None:
                continue
            recipe = module.fp8_meta["recipe"]
            fwd, bwd = (state.make_quantizers() for state in module.fp8_states)
            linears[path] = {"recipe": type(recipe).__name__,
                             "fields": {k: getattr(recipe, k, None) for k in (
                                 "disable_rht", "disable_stochastic_rounding", "disable_2d_quantization",
                                 "random_hadamard_transform", "stochastic_rounding", "fp8_activations")},
                             "input": describe(fwd[0]), "weight": describe(fwd[1]), "grad": describe(bwd[0])}
        out[name] = {"train": result.train_losses, "val": result.val_losses[-1][1], "linears": linears,
                     "switches_after": sorted(k for k in os.environ if k.startswith("NVTE_NVFP4"))}
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def probe() -> dict:
    pytest.importorskip("megatron.core")
    env = {k: v for k, v in os.environ.items() if k not in NVFP4_DISABLE_SWITCHES}
    env["NVTE_NVFP4_DISABLE_RHT"] = "1"  # set outside: the runs must decide for themselves, and restore it
    run = subprocess.run([sys.executable, "-c", _PROBE, *FP4_RUNS], capture_output=True, text=True, timeout=900,
                         env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.split("RESULT", 1)[1])


def _expected(run: Run) -> dict:
    """What each quantizer must do, from the run's own flags: NVFP4 has TE's three stabilisers unless a switch
    turns one off; MXFP4 has what its --mxfp4-* flags turn on."""
    if run.fp4_recipe == "nvfp4":
        rht, sr = "NVTE_NVFP4_DISABLE_RHT" not in run.nvfp4_disabled, \
            "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING" not in run.nvfp4_disabled
        tiles = "NVTE_NVFP4_DISABLE_2D_QUANTIZATION" not in run.nvfp4_disabled
        return {"recipe": "NVFP4BlockScaling",
                "input": {"type": "NVFP4Quantizer", "rht": rht, "sr": False, "tiles": False},
                "weight": {"type": "NVFP4Quantizer", "rht": False, "sr": False, "tiles": tiles},
                "grad": {"type": "NVFP4Quantizer", "rht": rht, "sr": sr, "tiles": False}}
    rht = "mxfp4_random_hadamard_transform" in run.mxfp4_options
    sr = "mxfp4_stochastic_rounding" in run.mxfp4_options
    if "mxfp4_fp8_activations" in run.mxfp4_options:
        activation = {"type": "MXFP8Quantizer", "rht": None, "sr": None, "tiles": None}
        return {"recipe": "MXFP4BlockScaling", "input": activation, "grad": activation,
                "weight": {"type": "MXFP4Quantizer", "rht": False, "sr": False, "tiles": None}}
    return {"recipe": "MXFP4BlockScaling",
            "input": {"type": "MXFP4Quantizer", "rht": rht, "sr": False, "tiles": None},
            "weight": {"type": "MXFP4Quantizer", "rht": False, "sr": False, "tiles": None},
            "grad": {"type": "MXFP4Quantizer", "rht": rht, "sr": sr, "tiles": None}}


@pytest.mark.slow  # one subprocess: megatron-core's import and ten 3-step runs (14 s at a load average of 2.5)
@pytest.mark.parametrize("name", FP4_RUNS)
def test_fp4_run_builds_its_recipe_and_trains(probe, name):
    """Every TE linear of the GPT ran the run's recipe with the run's stabilisers, as its quantizers show; the
    losses are finite and fall; the run's NVFP4 switches did not outlive it (the one set outside is back)."""
    result, expected = probe[name], _expected(RUNS[name])
    assert len(result["linears"]) == 8  # QKV, projection, FC1, FC2 of 2 layers
    for path, linear in result["linears"].items():
        assert linear["recipe"] == expected["recipe"], path
        for role in ("input", "weight", "grad"):
            assert linear[role] == expected[role], (path, role)
    assert all(math.isfinite(x) for x in result["train"] + [result["val"]])
    assert result["train"][-1] < result["train"][0] and result["val"] < math.log(256)
    assert result["switches_after"] == ["NVTE_NVFP4_DISABLE_RHT"]


def test_default_runs_keep_an_nvfp4_and_an_mxfp4_run_with_stabilisers():
    default = parse_args([]).runs
    assert "nvfp4" in default and "mxfp4+rht+sr" in default
    assert not set(OPT_IN) & set(default) and set(default) | set(OPT_IN) == set(RUNS)
    assert RUNS["nvfp4"] == Run(fp4_recipe="nvfp4")  # TE's defaults: nothing disabled
    assert set(RUNS["nvfp4-no-stabilisers"].nvfp4_disabled) == set(NVFP4_DISABLE_SWITCHES)


@pytest.mark.parametrize("name,base", [("nvfp4-no-stabilisers", "nvfp4"), ("nvfp4-no-rht", "nvfp4"),
                                       ("mxfp4", "mxfp4+rht+sr"), ("mxfp4+sr", "mxfp4+rht+sr"),
                                       ("mxfp4-fp8-activations", "mxfp4-fp8-activations"), ("nvfp4", "nvfp4")])
def test_a_run_without_stabilisers_is_drawn_and_compared_with_its_stabilised_run(name, base):
    assert base_run(name) == base


@pytest.mark.parametrize("kwargs,message", [
    (dict(fp8_format="e4m3", fp4_recipe="nvfp4"), "fp4_recipe and fp8_format"),
    (dict(fp4_recipe="nvfp4", mxfp4_options=("mxfp4_stochastic_rounding",)), "mxfp4_options.*fp4_recipe='mxfp4'"),
    (dict(fp4_recipe="mxfp4", nvfp4_disabled=("NVTE_NVFP4_DISABLE_RHT",)), "nvfp4_disabled.*fp4_recipe='nvfp4'"),
    (dict(fp4_recipe="nvfp4", nvfp4_disabled=("NVTE_NVFP4_4OVER6",)), "allowed: NVTE_NVFP4_DISABLE_RHT"),
])
def test_a_bad_fp4_run_is_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Run(**kwargs)


def test_nvfp4_switches_are_the_runs_alone_and_restored(monkeypatch):
    monkeypatch.setenv("NVTE_NVFP4_DISABLE_2D_QUANTIZATION", "1")
    with nvfp4_switches(RUNS["nvfp4-no-rht"]):
        assert {k: os.environ.get(k) for k in NVFP4_DISABLE_SWITCHES} == {
            "NVTE_NVFP4_DISABLE_RHT": "1", "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING": None,
            "NVTE_NVFP4_DISABLE_2D_QUANTIZATION": None}
    assert os.environ.get("NVTE_NVFP4_DISABLE_2D_QUANTIZATION") == "1"
    assert "NVTE_NVFP4_DISABLE_RHT" not in os.environ
