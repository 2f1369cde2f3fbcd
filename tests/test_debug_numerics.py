"""The numerics report (mindspeed_te.debug) against closed-form cases, and its zero cost when off."""
import json
import math

import numpy as np
import pytest
import torch

from mindspeed_te import DelayedScaling, Format, FP8GlobalStateManager, fp8_autocast
from mindspeed_te.debug import NumericsReport, count, numerics, reset_counters, tensor_stats
from mindspeed_te.formats import FP8Dtype
from mindspeed_te.modules import Linear
from mindspeed_te.quantizers import Float8Quantizer, NVFP4Quantizer
from mindspeed_te.recipe import MXFP4BlockScaling, NVFP4BlockScaling
from tests.oracles import (
    e2m1_values,
    hadamard_reference,
    mxfp4_reference,
    nvfp4_dequantize_reference,
    nvfp4_reference,
)


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


def _expected_stats(x: np.ndarray, dq: np.ndarray, largest: np.ndarray) -> dict:
    """The statistics from their definitions: `dq` the dequantized values, `largest` each element's largest
    representable magnitude (6 x its block's float32 scale for E2M1, a float32 product, as elements at a block's
    amax land on it within rounding); the sums in float64."""
    saturated = np.abs(x.astype(np.float32)) > largest.astype(np.float32)
    x, dq = x.astype(np.float64), dq.astype(np.float64)
    signal, noise = np.square(x).sum(), np.square(dq - x).sum()
    return {"saturated_pct": 100 * np.mean(saturated), "flushed_pct": 100 * np.mean((x != 0) & (dq == 0)),
            "sqnr_db": 10 * math.log10(signal / noise), "rel_error": math.sqrt(noise / signal)}


def _mxfp4_expected(x: np.ndarray) -> dict:
    codes, exps = mxfp4_reference(x)
    scale = np.repeat(2.0 ** (exps.astype(np.float64) - 127), 32, axis=1)
    return _expected_stats(x, e2m1_values(codes) * scale, np.float32(6) * scale.astype(np.float32))


def _nvfp4_expected(x: np.ndarray, tile_rows: int) -> dict:
    codes, scales, amax = nvfp4_reference(x, tile_rows=tile_rows)
    unit = nvfp4_dequantize_reference(np.full(codes.shape, 0x2, np.uint8), scales, amax)  # code 0x2 is 1.0
    return _expected_stats(x, nvfp4_dequantize_reference(codes, scales, amax), np.float32(6) * unit)


def _operand(seed: int = 0) -> torch.Tensor:
    """Normal values over five octaves of block amax, a few outliers, some exact zeros: every block scale differs,
    E2M1 both flushes and (under MXFP4's floor rule) saturates."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-2, 2, 96, base=2.0)
    x[torch.rand(64, 96, generator=g) < 0.01] *= 40.0
    x[:, 5] = 0.0
    return x


@pytest.mark.parametrize("tensor,tile_rows", [("input", 1), ("grad_output", 1), ("weight", 16)])
def test_fp4_counterfactuals_against_ml_dtypes(tensor, tile_rows):
    """The NVFP4 and MXFP4 columns equal the statistics of the independent block-by-block quantizers
    (tests/oracles.py: ml_dtypes' E2M1 cast, TE's NVFP4 scale rule, the OCP MX rule); NVFP4 weights take TE's
    16x16 tiles, the other operands 1x16 blocks."""
    x = _operand()
    recorder = numerics.NumericsRecorder()
    recorder.record(torch.nn.Parameter(torch.empty(1)), tensor, x, _fixed_scale(FP8Dtype.E4M3).quantize(x))
    rows = {r["format"]: r for r in recorder.rows}
    for fmt, expected in (("mxfp4", _mxfp4_expected(x.numpy())), ("nvfp4", _nvfp4_expected(x.numpy(), tile_rows))):
        for key, value in expected.items():
            assert rows[fmt][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (fmt, key)
    assert rows["mxfp4"]["saturated_pct"] > 0 and rows["mxfp4"]["flushed_pct"] > 0  # the case exercises both


def test_fp4_counterfactuals_skip_operands_their_blocks_do_not_divide():
    """48 rows: a multiple of NVFP4's 16 but not of MX's 32."""
    x = _operand()[:48]
    recorder = numerics.NumericsRecorder()
    recorder.record(torch.nn.Parameter(torch.empty(1)), "input", x, _fixed_scale(FP8Dtype.E4M3).quantize(x))
    assert {r["format"] for r in recorder.rows} == {"recipe:e4m3", "hif8", "e4m3", "nvfp4"}


def test_hadamard_transformed_wgrad_form_is_compared_where_it_was_cast():
    """A columnwise-only NVFP4 form after the random Hadamard transform (a wgrad operand) is compared with the
    transformed transpose it was cast from: the oracle's transform, then its NVFP4 quantizer."""
    x = _operand()
    q = NVFP4Quantizer(rowwise=False, columnwise=True, with_rht=True).quantize(x)
    stats = tensor_stats(x, q)
    transformed = hadamard_reference(x.numpy().T.copy()).astype(np.float32)
    expected = _nvfp4_expected(transformed, 1)
    for key, value in expected.items():
        assert getattr(stats, key) == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert stats.amax == pytest.approx(float(np.abs(transformed).max()), rel=1e-6)


@pytest.mark.parametrize("recipe", [NVFP4BlockScaling(), MXFP4BlockScaling(random_hadamard_transform=True,
                                                                            stochastic_rounding=True)],
                         ids=["nvfp4", "mxfp4+rht+sr"])
def test_report_of_an_fp4_run_leaves_its_training_unchanged(recipe):
    """An FP4 run with the report on: every operand gets its recipe row (E2M1) and every counterfactual; the
    recipe row of the input is the oracle's rowwise FP4 cast of it; and the report draws no random bits, so
    the stochastically rounded gradients are the same bits as with the report off."""
    def step(report: NumericsReport | None) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        model = Linear(64, 32)
        x = (torch.randn(32, 64) * 3).requires_grad_()
        if report is not None:
            report.watch(model)
            report.begin_step(1)
        try:
            with fp8_autocast(enabled=True, fp8_recipe=recipe):
                y = model(x)
            (y * torch.linspace(-1, 1, 32)).sum().backward()
        finally:
            FP8GlobalStateManager.set_operand_observer(None)
        return x.detach(), model.weight.grad

    report = NumericsReport("unused", interval=1)
    x, grad_on = step(report)
    _, grad_off = step(None)
    assert torch.equal(grad_on, grad_off)
    rows = {(r["tensor"], r["format"]): r for r in report.rows}
    assert set(rows) == {(t, f) for t in ("input", "weight", "grad_output")
                         for f in ("recipe:e2m1", "hif8", "e4m3", "mxfp8", "nvfp4", "mxfp4")}
    expected = (_nvfp4_expected(x.numpy(), 1) if isinstance(recipe, NVFP4BlockScaling)
                else _mxfp4_expected(x.numpy()))
    for key, value in expected.items():
        assert rows["input", "recipe:e2m1"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert all(math.isfinite(r["sqnr_db"]) for r in rows.values())


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
                for f in (recipe_fmt, "hif8", "e4m3", "mxfp8", "nvfp4", "mxfp4")}
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
