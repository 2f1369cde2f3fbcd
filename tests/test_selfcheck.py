"""`python -m mindspeed_te.selfcheck` (issue 30): on the simulator every kernel agrees with the reference backend;
a kernel that computes something else, a kernel the installed torch_npu lacks, or a failing GPT step makes it
fail, naming the kernel."""
from __future__ import annotations

import types
from contextlib import contextmanager

import pytest
import torch

from mindspeed_te import selfcheck


def test_relative_error_is_the_largest_difference_over_the_largest_reference_value():
    want = [torch.tensor([2.0, -4.0]), torch.tensor([1.0])]
    got = [torch.tensor([2.0, -3.0]), torch.tensor([1.5])]
    assert selfcheck.relative_error(got, want) == pytest.approx(max(1 / 4, 0.5 / 1))
    assert selfcheck.relative_error([torch.tensor([float("nan")])], [torch.tensor([1.0])]) == float("inf")


def test_every_kernel_agrees_on_the_simulator(capsys):
    assert selfcheck.main(["--no-gpt"]) == 0
    lines = capsys.readouterr().out.splitlines()
    kernels = {line.split()[0]: line.split()[1] for line in lines[1:-1]}
    # the kernels of the quantize, GEMM, grouped GEMM, norm and attention paths all ran and agreed
    assert {"npu_quant_matmul", "npu_grouped_matmul", "npu_dynamic_mx_quant", "npu_rms_norm",
            "npu_fusion_attention"} <= set(kernels)
    assert set(kernels.values()) == {"ok"} and lines[-1] == "self-check passed"


@pytest.mark.parametrize("recipe", ["mxfp4", "mxfp4, MXFP8 activations"])
def test_mxfp4_cases_run_the_mx_kernels_and_agree(recipe):
    """MXFP4 (FP4 x FP4) and MXFP4 weights with MXFP8 activations (E4M3 x FP4): the MX quantize and the quant
    matmul kernels run, and every case agrees with the reference backend."""
    errors, failed = selfcheck.check_kernels("Ascend950PR", (recipe,))
    assert not failed
    assert {"npu_quant_matmul", "npu_dynamic_mx_quant"} <= set(errors) or \
        {"npu_quant_matmul", "npu_dynamic_mx_quant_with_dual_axis"} <= set(errors)
    assert max(errors.values()) <= selfcheck.TOLERANCE


def test_the_newer_release_s_kernels_are_checked_too():
    """With torch_npu 26.1's kernels (`--release 26.1`), the wgrads added into main_grads run on the GEMM +
    accumulate kernels: a Linear's in MXFP8 (npu_add_quant_matmul_), experts' in expert order in bf16
    (npu_grouped_matmul_add_) and MXFP8 (npu_add_quant_gmm_, with npu_grouped_dynamic_mx_quant); they agree with
    the reference backend."""
    errors, failed = selfcheck.check_kernels("Ascend950PR@26.1", ("mxfp8 E4M3",))
    assert not failed
    assert {"npu_add_quant_matmul_", "npu_grouped_matmul_add_", "npu_add_quant_gmm_",
            "npu_grouped_dynamic_mx_quant"} <= set(errors)
    assert max(errors.values()) <= selfcheck.TOLERANCE


def test_a_kernel_that_computes_something_else_is_a_mismatch(monkeypatch, capsys):
    from mindspeed_te.testing import npu_sim

    simulator = type(npu_sim.make_simulator())
    original = simulator.npu_rms_norm

    def skewed(self, *args, **kwargs):
        out, rstd = original(self, *args, **kwargs)
        return out * 1.0625, rstd

    monkeypatch.setattr(simulator, "npu_rms_norm", skewed)
    monkeypatch.setattr(selfcheck, "RECIPES", ("tensorwise E4M3",))
    monkeypatch.setattr(selfcheck, "CASES", {"LayerNormLinear RMSNorm": selfcheck.CASES["LayerNormLinear RMSNorm"]})
    assert selfcheck.main(["--no-gpt"]) == 1
    out = capsys.readouterr().out
    assert "npu_rms_norm" in out and "MISMATCH" in out and out.rstrip().endswith("self-check FAILED")


def test_a_kernel_missing_from_torch_npu_is_reported(monkeypatch):
    fake = types.SimpleNamespace(npu_quantize=lambda *a, **k: None)

    @contextmanager
    def fake_backend(name, chip):
        yield fake

    monkeypatch.setattr(selfcheck, "real_npu", lambda: True)
    monkeypatch.setattr(selfcheck, "backend", fake_backend)
    missing = selfcheck.missing_kernels("Ascend950PR")
    assert "npu_quant_matmul" in missing and "npu_quantize" not in missing


@pytest.mark.slow
def test_the_gpt_steps_agree_on_the_simulator():
    losses = selfcheck.gpt_steps("Ascend950DT")
    assert set(losses) == set(selfcheck.GPT_RECIPES)
    for npu_loss, reference_loss in losses.values():
        assert abs(npu_loss - reference_loss) <= selfcheck.TOLERANCE * abs(reference_loss)
