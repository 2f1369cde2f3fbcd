"""The simulated torch_npu of a release. "2.14" (op-plugin 7.3.0): the default simulator's kernels. "26.1"
(op-plugin 26.1.0 and later): those, and the kernels of fused_quant.py (npu_rms_norm_dynamic_mx_quant, from 26.0.0;
npu_swiglu_mx_quant_with_dual_axis), fused_wgrad.py (npu_grouped_dynamic_mx_quant, npu_add_quant_matmul_,
npu_add_quant_gmm_, from 26.0.0) and quant_max.py (npu_quant_max), which the backend takes where torch_npu has
them (`hasattr`)."""
from __future__ import annotations

from mindspeed_te.testing.npu_sim.fused_quant import FusedQuantKernels
from mindspeed_te.testing.npu_sim.fused_wgrad import FusedWgradKernels
from mindspeed_te.testing.npu_sim.quant_max import QuantMaxKernels
from mindspeed_te.testing.npu_sim.simulator import NpuSimulator

RELEASES = ("2.14", "26.1")


class NpuSimulator26(FusedQuantKernels, FusedWgradKernels, QuantMaxKernels, NpuSimulator):
    """A simulated torch_npu 26.1: every kernel this simulator knows."""

    def __init__(self, soc_name: str = "Ascend950PR") -> None:
        super().__init__(soc_name)
        self.__version__ = "26.1.0"


def make_release_simulator(soc_name: str = "Ascend950PR", release: str = RELEASES[0]) -> NpuSimulator:
    """A fresh simulator of a chip named `soc_name` with the kernels of torch_npu `release` (one of RELEASES)."""
    if release not in RELEASES:
        raise ValueError(f"torch_npu release {release!r} is not simulated; choose one of {', '.join(RELEASES)}")
    return NpuSimulator26(soc_name) if release == "26.1" else NpuSimulator(soc_name)
