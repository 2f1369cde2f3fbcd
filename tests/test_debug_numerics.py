"""The numerics report (mindspeed_te.debug) against closed-form cases, and its zero cost when off."""
import json
import math

import pytest
import torch

from mindspeed_te import DelayedScaling, Format, FP8GlobalStateManager, fp8_autocast
from mindspeed_te.debug import NumericsReport, count, numerics, reset_counters, tensor_stats
from mindspeed_te.formats import FP8Dtype
from mindspeed_te.modules import Linear
from mindspeed_te.quantizers import Float8Quantizer


def _fixed_scale(dtype: FP8Dtype) -> Float8Quantizer:
    return Float8Quantizer(torch.ones(1), torch.zeros(1), dtype)


def test_saturated_fraction_is_exact():
    # 100 of 1000 values lie beyond E4M3's max (448) at scale 1: exactly 10 % saturated, none flushed.
    x = torch.ones(10, 100)
    x[:, :10] = 1000.0
    stats = tensor_stats(x, _fixed_scale(FP8Dtype.E4M3).quantize(x))
    assert stats.saturated_pct == pytest.approx(10.0)
    assert stats.flushed_pct == 0.0
    assert stats.amax == 1000.0 and stats.scale == 1.0


def test_flushed_fraction_is_exact():
    # E4M3's smallest subnormal is 2^-9; 2^-12 rounds to zero. A quarter of the elements are 2^-12.
    x = torch.ones(4, 64)
    x[1] = 2.0 ** -12
    stats = tensor_stats(x, _fixed_scale(FP8Dtype.E4M3).quantize(x))
    assert stats.flushed_pct == pytest.approx(25.0)
    assert stats.saturated_pct == 0.0


def test_sqnr_and_relative_error_of_a_tie():
    # 1.0625 lies halfway between the E4M3 neighbours 1.0 and 1.125: the error is 1/16 either way, so
    # SQNR = 20 log10(1.0625 / 0.0625) = 20 log10(17) and the relative error 1/17.
    x = torch.full((8, 32), 1.0625)
    stats = tensor_stats(x, _fixed_scale(FP8Dtype.E4M3).quantize(x))
    assert stats.sqnr_db == pytest.approx(20 * math.log10(17), rel=1e-9)
    assert stats.rel_error == pytest.approx(1 / 17, rel=1e-9)
    exact = torch.full((8, 32), 1.125)
    assert tensor_stats(exact, _fixed_scale(FP8Dtype.E4M3).quantize(exact)).sqnr_db == math.inf


def test_counterfactual_formats_of_an_outlier():
    # One outlier of 1e4 among values 1e-3 (shape 32 x 32, outlier at [0, 0]). Current-scaled E4M3 maps
    # 1e-3 to 4.5e-5 < 2^-10: all 1023 small values flush. HiF8 (target 15) maps them to 1.5e-6, above its
    # smallest subnormal 2^-22: none flush. MXFP8 flushes only the 31 neighbours in the outlier's 32-block.
    x = torch.full((32, 32), 1e-3)
    x[0, 0] = 1e4
    recorder = numerics.NumericsRecorder()
    recorder.record(torch.nn.Parameter(torch.empty(1)), "input", x, _fixed_scale(FP8Dtype.E4M3).quantize(x))
    flushed = {r["format"]: r["flushed_pct"] for r in recorder.rows}
    assert flushed["e4m3"] == pytest.approx(100 * 1023 / 1024)
    assert flushed["hif8"] == 0.0
    assert flushed["mxfp8"] == pytest.approx(100 * 31 / 1024)
    # The recipe's own quantizer (scale 1): 1e-3 rounds up to E4M3's 2^-9, and only the outlier saturates.
    recipe = next(r for r in recorder.rows if r["format"] == "recipe:e4m3")
    assert recipe["flushed_pct"] == 0.0 and recipe["saturated_pct"] == pytest.approx(100 / 1024)


def _train_step(model: torch.nn.Module, recipe) -> None:
    x = torch.randn(32, 64, requires_grad=True)
    with fp8_autocast(enabled=True, fp8_recipe=recipe):
        y = model(x)
    y.sum().backward()


def test_report_rows_files_and_counters(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(64, 64), Linear(64, 32))
    report = NumericsReport(str(tmp_path), interval=2, model=model)
    reset_counters()
    try:
        for step in range(1, 4):  # steps 1 and 3 are skipped, step 2 is recorded
            report.begin_step(step)
            _train_step(model, DelayedScaling(fp8_format=Format.HYBRID))
        count("nonfinite_steps", 2)
    finally:
        report.stop()
    keys = {(r["step"], r["layer"], r["tensor"], r["format"]) for r in report.rows}
    assert {k[0] for k in keys} == {2}
    tensors = {"input": "recipe:e4m3", "weight": "recipe:e4m3", "grad_output": "recipe:e5m2"}
    expected = {(2, layer, t, f) for layer in ("0", "1") for t, recipe_fmt in tensors.items()
                for f in (recipe_fmt, "hif8", "e4m3", "mxfp8")}
    assert keys == expected
    paths = report.write()
    assert {p.rsplit("/", 1)[-1] for p in paths} == {
        "numerics.csv", "numerics.json", "numerics_saturated_pct.png", "numerics_flushed_pct.png",
        "numerics_sqnr_db.png"}
    saved = json.loads((tmp_path / "numerics.json").read_text())
    assert saved["counters"] == {"nonfinite_steps": 2} and len(saved["rows"]) == len(expected)
    assert (tmp_path / "numerics_sqnr_db.png").read_bytes()[:4] == b"\x89PNG"


def test_off_computes_nothing(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("numerics computed while the report is off")

    monkeypatch.setattr(numerics, "tensor_stats", fail)
    monkeypatch.setattr(numerics.NumericsRecorder, "record", fail)
    report = NumericsReport("unused", interval=3)
    report.begin_step(1)  # not a reporting step
    assert FP8GlobalStateManager.get_operand_observer() is None
    _train_step(torch.nn.Sequential(Linear(64, 64)), DelayedScaling(fp8_format=Format.HIF8))
    report.stop()


def test_bad_interval_names_the_flag():
    with pytest.raises(ValueError, match="--fp8-numerics-interval"):
        NumericsReport("x", interval=0)
