"""What the library finds out about the device before it runs: whether FP8 can run there (asked of the current
accelerator's kernel backend), whether there is an accelerator at all (the CPU device adaptor), that the
torch_npu simulator never replaces a real NPU, and that the NPU backend emulates only what it declares.

A host without torch_npu stands in for an Ascend one through a fake torch_npu that the import system finds
as an installed distribution would be found, and that registers `torch.npu` when imported, as torch_npu does."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import types
from typing import Any, Callable, Iterator, Optional

import pytest
import torch

from mindspeed_te import DelayedScaling, FP8GlobalStateManager, MXFP8BlockScaling, fp8_autocast


class _Device:
    """What torch.accelerator.current_accelerator() returns, as far as the library reads it ("npu" is a device
    type torch knows only once torch_npu is imported)."""

    def __init__(self, kind: str) -> None:
        self.type = kind


class _FakeTorchNpu(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An installed but not yet imported torch_npu: found by importlib.util.find_spec, and its import either
    registers a `torch.npu` that sees the chip `device_name` or fails with `error` (a missing CANN library)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, device_name: str, error: Optional[Exception]) -> None:
        self.monkeypatch, self.device_name, self.error = monkeypatch, device_name, error
        self.imports = 0

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(fullname, self) if fullname == "torch_npu" else None

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        self.imports += 1
        if self.error is not None:
            raise self.error
        npu = types.ModuleType("torch_npu.npu")
        npu.is_available = lambda: True
        npu.get_device_name = lambda device=None: self.device_name
        module.npu = npu
        self.monkeypatch.setattr(torch, "npu", npu, raising=False)  # torch_npu registers torch.npu on import


@pytest.fixture
def fake_torch_npu(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., _FakeTorchNpu]]:
    """fake_torch_npu(device_name="Ascend910B3", error=None) installs a fake torch_npu for the test."""
    assert getattr(torch, "npu", None) is None and importlib.util.find_spec("torch_npu") is None, \
        "these tests stand in for torch_npu on a host that has none"

    def install(device_name: str = "Ascend910B3", error: Optional[Exception] = None) -> _FakeTorchNpu:
        finder = _FakeTorchNpu(monkeypatch, device_name, error)
        monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
        return finder

    yield install
    sys.modules.pop("torch_npu", None)


# 1. fp8_autocast asks the backend of the current accelerator ------------------------------------------------


def test_autocast_refuses_an_npu_without_fp8_under_the_auto_backend(monkeypatch):
    """MINDSPEED_TE_BACKEND=auto on an Ascend 910B (no FP8 matmuls): the check asks the NPU backend, not the
    CPU's reference emulation, and refuses at the region's entry with the chip named."""
    monkeypatch.setenv("MINDSPEED_TE_BACKEND", "auto")
    monkeypatch.setenv("MINDSPEED_TE_NPU_SIMULATOR", "Ascend910B3")
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: _Device("npu"))
    FP8GlobalStateManager.reset()
    ok, reason = FP8GlobalStateManager.is_fp8_available()
    assert not ok and "Ascend910B3" in reason
    assert not FP8GlobalStateManager.is_mxfp8_available()[0]
    assert not FP8GlobalStateManager.is_fp8_block_scaling_available()[0]
    for recipe in (None, DelayedScaling(), MXFP8BlockScaling()):
        with pytest.raises(RuntimeError, match="FP8 is not available: the NPU is Ascend910B3"):
            with fp8_autocast(enabled=True, fp8_recipe=recipe):
                pass
    assert not FP8GlobalStateManager.is_fp8_enabled()
    with fp8_autocast(enabled=False):  # a disabled region asks nothing
        pass


def test_autocast_accepts_an_npu_with_fp8_under_the_auto_backend(monkeypatch):
    monkeypatch.setenv("MINDSPEED_TE_BACKEND", "auto")
    monkeypatch.setenv("MINDSPEED_TE_NPU_SIMULATOR", "Ascend950DT")
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: _Device("npu"))
    FP8GlobalStateManager.reset()
    with fp8_autocast(enabled=True):
        assert type(FP8GlobalStateManager.get_fp8_recipe()) is MXFP8BlockScaling  # the NPU's default, via its backend


@pytest.mark.parametrize("capability,ok", [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True),
                                           ((10, 0), True)])
def test_autocast_on_cuda_follows_te_fp8_gemm_rule(monkeypatch, capability, ok):
    """TransformerEngine's rule: FP8 GEMMs need compute capability >= 8.9 (torch._scaled_mm refuses FP8 operands
    below it). Under the auto backend a CUDA device gets the torch backend, which must say so."""
    monkeypatch.setenv("MINDSPEED_TE_BACKEND", "auto")
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: _Device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA TEST GPU")
    FP8GlobalStateManager.reset()
    available, reason = FP8GlobalStateManager.is_fp8_available()
    assert available is ok
    if ok:
        with fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
            pass
    else:
        assert "NVIDIA TEST GPU" in reason and f"{capability[0]}.{capability[1]}" in reason and "8.9" in reason
        with pytest.raises(RuntimeError, match="FP8 is not available: the CUDA device NVIDIA TEST GPU"):
            with fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
                pass


# 2. the CPU device adaptor sees an NPU whose torch_npu is not imported yet --------------------------------


def test_adaptor_imports_an_installed_torch_npu_and_keeps_the_npu(fake_torch_npu):
    from mindspeed_te.patches import build_registry
    from mindspeed_te.patches.device_cpu import accelerator_present

    finder = fake_torch_npu()
    assert accelerator_present()
    assert finder.imports == 1
    targets = [patch.target for patch in build_registry().patches]
    assert not [t for t in targets if t.startswith("torch.cuda.") or t == "torch.distributed.init_process_group"]


def test_adaptor_names_torch_npu_when_it_cannot_be_imported(fake_torch_npu):
    from mindspeed_te.patches.device_cpu import accelerator_present

    fake_torch_npu(error=ImportError("libascendcl.so: cannot open shared object file"))
    with pytest.raises(RuntimeError, match=r"torch_npu is installed but cannot be imported \(ImportError: "
                                           r"libascendcl.so: cannot open shared object file\)"):
        accelerator_present()


def test_adaptor_without_torch_npu_is_the_cpu():
    from mindspeed_te.patches.device_cpu import accelerator_present

    assert importlib.util.find_spec("torch_npu") is None and not accelerator_present()


# 3. the simulator is refused where torch_npu sees an NPU ---------------------------------------------------


def test_simulator_is_refused_on_a_real_npu(monkeypatch, fake_torch_npu):
    from mindspeed_te.kernels.npu import get_npu_backend

    fake_torch_npu(device_name="Ascend950PR")
    for value in ("1", "Ascend950DT"):
        monkeypatch.setenv("MINDSPEED_TE_NPU_SIMULATOR", value)
        FP8GlobalStateManager.reset()
        with pytest.raises(RuntimeError, match=f"MINDSPEED_TE_NPU_SIMULATOR={value} asks for the torch_npu "
                                               r"simulator, .*\(Ascend950PR\): unset MINDSPEED_TE_NPU_SIMULATOR"):
            get_npu_backend()


def test_simulator_stands_in_for_a_torch_npu_that_cannot_load(monkeypatch, fake_torch_npu):
    """A torch_npu installed without its CANN libraries drives no NPU: the simulator may replace it."""
    from mindspeed_te.kernels.npu import get_npu_backend

    fake_torch_npu(error=ImportError("libascendcl.so: cannot open shared object file"))
    monkeypatch.setenv("MINDSPEED_TE_NPU_SIMULATOR", "1")
    FP8GlobalStateManager.reset()
    assert getattr(get_npu_backend().npu, "is_simulator", False)


# 4. NpuBackend emulates only what it declares ------------------------------------------------------------


def test_npu_backend_declares_each_emulated_contract_method():
    from mindspeed_te.kernels.base import KernelBackend
    from mindspeed_te.kernels.npu import NpuBackend, check_emulations
    from mindspeed_te.kernels.reference import ReferenceBackend

    check_emulations(NpuBackend)
    contract = [name for name, value in vars(KernelBackend).items() if callable(value) and not name.startswith("_")]
    for name in contract:
        taken_from_reference = getattr(NpuBackend, name) is getattr(ReferenceBackend, name)
        assert taken_from_reference == (name in NpuBackend.reference_emulations), name
    assert all(isinstance(reason, str) and reason for reason in NpuBackend.reference_emulations.values())


def test_a_backend_missing_a_kernel_fails_at_class_creation():
    from mindspeed_te.kernels.npu import (
        DeclaredEmulations,
        MoeRopeKernels,
        NpuAttention,
        NpuBackend,
        NpuFP4,
        NpuGemm,
        NpuGroupedGemm,
        NpuMc2,
        NpuQuantize,
    )
    from mindspeed_te.kernels.reference import ReferenceBackend

    with pytest.raises(TypeError, match="without a declaration: available, layer_norm, rms_norm "):
        class NoNorm(DeclaredEmulations, NpuMc2, NpuQuantize, NpuAttention, NpuFP4, NpuGemm,  # noqa: F841
                     NpuGroupedGemm, MoeRopeKernels, ReferenceBackend):
            reference_emulations = dict(NpuBackend.reference_emulations)
    with pytest.raises(TypeError, match="without a declaration: read_twice"):
        class Undeclared(NpuBackend):  # noqa: F841
            reference_emulations = {}
    with pytest.raises(TypeError, match="declared but not taken from the reference: gemm"):
        class Stale(NpuBackend):  # noqa: F841
            reference_emulations = {**NpuBackend.reference_emulations, "gemm": "no kernel"}
