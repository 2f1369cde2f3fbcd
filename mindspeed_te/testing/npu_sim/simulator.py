"""The simulator object: a module that can stand where `torch_npu` would, made of the kernel groups."""
from __future__ import annotations

import collections
import types
from typing import Any

import torch

from mindspeed_te.testing.npu_sim.attention import AttentionKernels
from mindspeed_te.testing.npu_sim.checks import (
    check_dtype,
    check_tensor,
    dtype_arg,
    dtype_name,
    kernel,
)
from mindspeed_te.testing.npu_sim.codecs import decode, encode
from mindspeed_te.testing.npu_sim.cube import Bf16Matmul, set_bf16_matmul
from mindspeed_te.testing.npu_sim.dtypes import (
    FLOAT4_E1M2FN_X2,
    FLOAT4_E2M1FN_X2,
    FLOAT8_E4M3FN,
    FLOAT8_E5M2,
    FLOAT8_E8M0FNU,
    FP8_NATIVE,
    HIF8_CARRIERS,
    HIFLOAT8,
    INT4,
    NPU_ONLY_NAMES,
    DtypeArg,
)
from mindspeed_te.testing.npu_sim.errors import NpuSimNotImplemented, NpuSocError, NpuTypeError
from mindspeed_te.testing.npu_sim.gemm import QuantMatmulKernels
from mindspeed_te.testing.npu_sim.grouped_gemm import GroupedMatmulKernels
from mindspeed_te.testing.npu_sim.mc2 import Mc2Kernels
from mindspeed_te.testing.npu_sim.moe import MoeKernels
from mindspeed_te.testing.npu_sim.norm import NormKernels
from mindspeed_te.testing.npu_sim.quantize import QuantizeKernels
from mindspeed_te.testing.npu_sim.rope import RopeKernels

FP8_SOC_PREFIX = "Ascend950"
# CANN's product names: Atlas A2 training series = Ascend910B*, Atlas A3 = Ascend910_93*
A2_A3_SOC_PREFIXES = ("Ascend910B", "Ascend910_93")


class NpuSimulator(QuantizeKernels, QuantMatmulKernels, GroupedMatmulKernels, Mc2Kernels, AttentionKernels,
                   NormKernels, MoeKernels, RopeKernels, types.ModuleType):
    """Module object usable in place of `torch_npu`; see the module docstring."""

    hifloat8 = HIFLOAT8
    float8_e5m2 = FLOAT8_E5M2
    float8_e4m3fn = FLOAT8_E4M3FN
    float8_e8m0fnu = FLOAT8_E8M0FNU
    float4_e2m1fn_x2 = FLOAT4_E2M1FN_X2
    float4_e1m2fn_x2 = FLOAT4_E1M2FN_X2
    int4 = INT4
    is_simulator = True

    def __init__(self, soc_name: str = "Ascend950PR") -> None:
        super().__init__("torch_npu", "CPU simulator of torch_npu 2.14 kernels (mindspeed_te.testing.npu_sim)")
        self.__version__ = "2.14.0"
        self.soc_name = soc_name
        self.launch_counts: collections.Counter = collections.Counter()
        npu = types.ModuleType("torch_npu.npu")
        npu.get_device_name = lambda device=None: soc_name
        npu.is_available = lambda: True
        npu.device_count = lambda: 1
        self.npu = npu
        self._groups: dict[str, Any] = {}

    @staticmethod
    def set_bf16_matmul(engine: Bf16Matmul) -> None:
        """Simulator only: the engine the cube sums matmuls of bfloat16 values with (`cube.set_bf16_matmul`)."""
        set_bf16_matmul(engine)

    def hcom_of(self, group: Any) -> str:
        """Simulator stand-in for `group._get_backend(npu).get_hccl_comm_name(rank)`: the communicator name
        the fused matmul+communication kernels take as `hcom`."""
        name = f"sim_hccl_{id(group)}"
        self._groups[name] = group
        return name

    # bookkeeping
    def reset_counts(self) -> None:
        self.launch_counts.clear()

    def total_launches(self) -> int:
        return sum(self.launch_counts.values())

    @property
    def supports_fp8(self) -> bool:
        """FP8, HiF8 and MX kernels exist on the Ascend 950 series only."""
        return self.soc_name.startswith(FP8_SOC_PREFIX)

    @property
    def soc_family(self) -> str:
        """The chip family the documents' tables name: "950" (Ascend 950PR/950DT), "A2/A3" (Atlas A2/A3 training
        series) or "" (another chip)."""
        if self.soc_name.startswith(FP8_SOC_PREFIX):
            return "950"
        return "A2/A3" if self.soc_name.startswith(A2_A3_SOC_PREFIXES) else ""

    def _require_fp8_soc(self, what: str) -> None:
        if not self.supports_fp8:
            raise NpuSocError(f"{what} needs an Ascend 950 series chip; the simulated chip is {self.soc_name}")


    # misc ------------------------------------------------------------------------------------------------
    @kernel(differentiable=True)
    def npu_dtype_cast(self, input: torch.Tensor, /, dtype: DtypeArg, input_dtype: DtypeArg = None) -> torch.Tensor:
        """Element cast. To float8_e4m3fn/e5m2 as torch's own cast (nearest-even, not saturating); to
        torch_npu.hifloat8 (uint8 codes) half away from zero, |x| >= 40960 to +-Inf; from HiF8 with
        input_dtype=torch_npu.hifloat8 on uint8 codes."""
        check_tensor("input", input)
        out = dtype_arg("dtype", dtype, required=True)
        src = dtype_arg("input_dtype", input_dtype)
        for name, d in (("dtype", out), ("input_dtype", src)):
            if d in NPU_ONLY_NAMES and d != HIFLOAT8:
                raise NpuSimNotImplemented(f"{name}={dtype_name(d)} is not simulated")
        if src == HIFLOAT8:
            check_dtype("input.dtype", input.dtype, HIF8_CARRIERS)
        elif src is not None and src != input.dtype:
            raise NpuTypeError(f"input_dtype={dtype_name(src)} does not match input.dtype {input.dtype}")
        if HIFLOAT8 in (out, src) or out in FP8_NATIVE or input.dtype in FP8_NATIVE:
            self._require_fp8_soc("an 8-bit float cast")
        values = decode(input, HIFLOAT8) if src == HIFLOAT8 else input
        if out == HIFLOAT8:
            return encode(values.float(), HIFLOAT8, saturate=False)
        return values.to(out)


def make_simulator(soc_name: str = "Ascend950PR") -> NpuSimulator:
    """A fresh simulator (own launch counters) of a chip named `soc_name`."""
    return NpuSimulator(soc_name)
