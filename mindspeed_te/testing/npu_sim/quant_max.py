"""npu_quant_max (aclnnQuantMax): the cast with a given scale and the amax of the input, in one launch.

Not a kernel of the default simulator: the NPU backend does not call it, and the default simulator's kernels are
the ones the self-check asks an installed torch_npu for (`selfcheck.missing_kernels`). Its rule is not delayed
scaling's: the kernel MULTIPLIES x by the scale, where the recipe divides x by the 1/scale prepared at the update
(npu_quantize, div_mode=True); the two round differently unless 1/scale is a power of 2 (a tie x / d of the
format, e.g. bfloat16 x = 1.3671875 over d = 1.75, is moved off the tie by the rounded 1 / d). A torch_npu that has
it is `make_simulator_with_quant_max()`; the default simulator lacks it, as torch_npu releases before op-plugin
26.1.0 do (`hasattr(torch_npu, "npu_quant_max")` is False there).

Sources: torch_npu's document (op-plugin codegen/templates/_op_plugin_docs.py, master), its schema
(op_plugin_functions.yaml: "npu_quant_max(Tensor x, Tensor scale, *, str round_mode="rint", int dst_dtype=291,
Tensor? group_list=None) -> (Tensor, Tensor)"), its binding (QuantMaxKernelNpuOpApi.cpp) and meta registration,
and CANN's aclnnQuantMax.md and kernel (ops-nn quant/quant_max: op_api/aclnn_quant_max.cpp,
op_kernel/arch35/quant_max_per_tensor_regbase.h, quant_max_common.h).
"""
from __future__ import annotations

from typing import Optional

import torch

from mindspeed_te.testing.npu_sim.checks import (
    check_dims,
    check_dtype,
    check_same_device,
    check_shape,
    check_tensor,
    dtype_arg,
    dtype_name,
    kernel,
)
from mindspeed_te.testing.npu_sim.codecs import encode
from mindspeed_te.testing.npu_sim.dtypes import FLOAT8_E5M2, FLOATS, FP8_NATIVE, HIFLOAT8, DtypeArg
from mindspeed_te.testing.npu_sim.errors import NpuSimNotImplemented, NpuValueError
from mindspeed_te.testing.npu_sim.simulator import NpuSimulator


class QuantMaxKernels:
    """npu_quant_max (mixed into `NpuSimulatorWithQuantMax`)."""

    @kernel
    def npu_quant_max(self, x: torch.Tensor, /, scale: torch.Tensor, *, round_mode: str = "rint",
                      dst_dtype: DtypeArg = FLOAT8_E5M2, group_list: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, amax): y = cast(float32(x) * scale) (float32 product, saturating cast, nearest-even for FP8 and half
        away from zero for HiF8, whose codes come back as uint8), amax = max |x| of the whole input, shape [1],
        in x's dtype (exact: max |x| is one of x's values). The documents give only "y = cast(x * scale,
        dst_dtype), amax = max(|x|)"; they are silent on overflow and on NaN/Inf input. Saturation is the kernel
        source's (quant_max_common.h: the FP32_TO_FP8E4M3 / FP8E5M2 / HIFP8 CastTraits are "SatMode::SAT"); a NaN
        amax for an input holding NaN is the simulator's assumption (the kernel folds |x| with the vector max,
        whose document asc_max.md says only "dst_i = max(src0_i, src1_i)"), not documented kernel behaviour: a
        caller must not rely on it to see NaN data."""
        # _op_plugin_docs.py, 支持的NPU产品: "Atlas 350加速卡"; aclnnQuantMax.md, 产品支持情况: "Ascend 950PR&950DT
        # 系列产品：支持", "Atlas A3系列产品：不支持", "Atlas A2系列产品：不支持".
        self._require_fp8_soc("npu_quant_max")
        # x: "数据类型支持`float32`、`bfloat16`和`float16`", "输入最大支持8维"; aclnnQuantMax.md x: "1-8" dims.
        check_tensor("x", x, FLOATS)
        check_dims("x", x, 1, 8)
        # group_list (op-plugin master): "表示输入x在0轴上每个group的偏移（cumsum模式）" runs aclnnGroupedQuantMax
        # (the binding: "group_list->sizes()[0] <= 1" keeps aclnnQuantMax); the library never passes one.
        if group_list is not None:
            raise NpuSimNotImplemented("group_list (aclnnGroupedQuantMax) is not simulated")
        # aclnnQuantMax.md x: "支持空Tensor", but aclnn_quant_max.cpp returns before the kernel ("if (x->IsEmpty())
        # { *workspaceSize = 0; ...") and the binding allocates amax uninitialised: no documented amax.
        if x.numel() == 0:
            raise NpuSimNotImplemented("an empty x: aclnnQuantMax launches nothing and leaves amax unwritten")
        # scale: "数据类型支持float32", "仅支持1维Tensor, shape为(num_groups,) ... group_list为None时，num_groups
        # 默认为1"; aclnnQuantMax.md: "不支持空Tensor", "shape固定为[1]".
        check_tensor("scale", scale, (torch.float32,))
        check_shape("scale", scale, (1,))
        # dst_dtype: "支持的取值: torch_npu.hifloat8, torch.float8_e5m2, torch.float8_e4m3fn"; aclnnQuantMax.md dstType:
        # "取值范围为{34, 35, 36}" (34=HIFLOAT8, 35=FLOAT8_E5M2, 36=FLOAT8_E4M3; torch_npu's numbers minus 256).
        out = dtype_arg("dst_dtype", dst_dtype, required=True)
        check_dtype("dst_dtype", out, (*FP8_NATIVE, HIFLOAT8))
        # "round_mode与dst_dtype的搭配需遵循约束: float8_e5m2/float8_e4m3fn仅支持"rint", hifloat8仅支持"round"或
        # "hybrid"。"
        allowed = ("round", "hybrid") if out == HIFLOAT8 else ("rint",)
        if round_mode not in allowed:
            raise NpuValueError(f"round_mode must be one of {list(allowed)} for {dtype_name(out)} output, "
                                f"got {round_mode!r}")
        if round_mode == "hybrid":
            raise NpuSimNotImplemented("round_mode='hybrid' (HiF8's hybrid rounding) is not simulated")
        check_same_device({"x": x, "scale": scale})
        # quant_max_per_tensor_regbase.h: x cast to float32, "Mul(vregFloatY, vregFloatX, vregS)", then the cast;
        # "Abs", "Max" over float32 |x|, and the amax cast back to x's type ("Cast<T, float>(..., CAST_RINT, 1)").
        y = encode(x.float() * scale, out)
        amax = x.abs().amax().reshape(1)  # NaN propagates: the simulator's assumption, see the docstring
        # Meta registration: "hifloat8 等 PyTorch 无原生 dtype 对应，存储用 uint8 承载"; "amax = x.new_empty([1],
        # dtype=x.dtype)".
        return y, amax.to(x.dtype)


class NpuSimulatorWithQuantMax(QuantMaxKernels, NpuSimulator):
    """A simulated torch_npu that has npu_quant_max (op-plugin 26.1.0 and later; CANN's ops-nn with
    aclnnQuantMax)."""


def make_simulator_with_quant_max(soc_name: str = "Ascend950PR") -> NpuSimulatorWithQuantMax:
    """A fresh simulator of a chip named `soc_name` whose torch_npu has npu_quant_max."""
    return NpuSimulatorWithQuantMax(soc_name)
