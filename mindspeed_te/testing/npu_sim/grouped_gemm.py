"""npu_grouped_matmul: high-precision grouped GEMMs and the single-tensor FP8/HiF8 forms MoE layers use."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union

import torch

from mindspeed_te.testing.npu_sim.checks import (
    ceil_div,
    check_choice,
    check_dims,
    check_dtype,
    check_int,
    check_layout,
    check_list,
    check_none,
    check_same_device,
    check_shape,
    check_tensor,
    dtype_arg,
    dtype_name,
    kernel,
    layouts,
)
from mindspeed_te.testing.npu_sim.codecs import decode
from mindspeed_te.testing.npu_sim.cube import cube_matmul, cube_matmul_rounded
from mindspeed_te.testing.npu_sim.dtypes import (
    E8M0_CARRIERS,
    FLOAT8_E8M0FNU,
    FLOATS,
    FP4,
    FP8_NATIVE,
    GEMM_OUT,
    HALF_FLOATS,
    HIF8_CARRIERS,
    HIFLOAT8,
    DtypeArg,
)
from mindspeed_te.testing.npu_sim.errors import NpuSimNotImplemented, NpuSocError, NpuTypeError, NpuValueError

MAX_GROUPS = 128  # tensors in a list: "weight长度最大支持128" / "长度最大128"
MAX_GROUP_LIST = 1024  # single-tensor forms: "groupListOptional第1维最大支持1024，即最多支持1024个group"


class GroupedMatmulKernels:
    """npu_grouped_matmul (mixed into NpuSimulator)."""

    @kernel(differentiable=True)
    def npu_grouped_matmul(self, x: Sequence[torch.Tensor], weight: Sequence[torch.Tensor], *,
                           bias: Optional[Sequence[torch.Tensor]] = None,
                           scale: Optional[Sequence[torch.Tensor]] = None,
                           offset: Optional[Sequence[torch.Tensor]] = None,
                           antiquant_scale: Optional[Sequence[torch.Tensor]] = None,
                           antiquant_offset: Optional[Sequence[torch.Tensor]] = None,
                           per_token_scale: Optional[Sequence[torch.Tensor]] = None,
                           group_list: Union[torch.Tensor, Sequence[int], None] = None,
                           activation_input: Optional[Sequence[torch.Tensor]] = None,
                           activation_quant_scale: Optional[Sequence[torch.Tensor]] = None,
                           activation_quant_offset: Optional[Sequence[torch.Tensor]] = None,
                           split_item: int = 0, group_type: Optional[int] = None, group_list_type: int = 0,
                           act_type: int = 0, tuning_config: Optional[Sequence[int]] = None,
                           output_dtype: DtypeArg = None, x_dtype: DtypeArg = None, weight_dtype: DtypeArg = None,
                           scale_dtype: DtypeArg = None, per_token_scale_dtype: DtypeArg = None
                           ) -> list[torch.Tensor]:
        """Grouped GEMM. group_type 0 splits m: x [(m, k)], weight [(g, k, n)] (or g tensors (k, n)), rows of
        group i multiply weight i. group_type 2 splits k: x [(m, k)] the transposed view of a contiguous (k, m),
        weight [(k, n)] contiguous, output (g, m, n). group_list: int64 tensor, cumulative ends
        (group_list_type 0) or sizes (1); rows/columns past its total are not computed (zero rows out).
        split_item 0/1 return one tensor per group, 2/3 a single tensor.

        FP8/HiF8 (x and weight float8_e4m3fn/e5m2, or uint8 with x_dtype = weight_dtype = torch_npu.hifloat8):
        single tensors, split_item 2 or 3, group_type 0 or 2 passed explicitly, a group_list tensor, output_dtype
        (float16/bfloat16/float32) required, no bias. scale = [float32 (g,) or (g, 1) per group, or (g, n) per
        channel] dequantizes the weight; per_token_scale = [float32 (m,) per row, or (g,) / (g, 1) per group]
        (group_type 0), or [(g, m) per row of each group, or (g,) / (g, 1) per group] (group_type 2). Results
        are (x_g @ w_g) * scale_g * per_token_scale. MX (scale_dtype = per_token_scale_dtype =
        torch_npu.float8_e8m0fnu) and G-B (3-D float32 scale) modes: group_type 0 (`_gmm_blocks`), and for MX
        group_type 2 too (`_mx_k_split`). The rules quoted below are aclnnGroupedMatmulV4.md's Ascend 950PR/950DT
        sections unless another source is named."""
        xs = check_list("x", x)
        ws = check_list("weight", weight)
        if not 0 < len(xs) <= MAX_GROUPS or not 0 < len(ws) <= MAX_GROUPS:
            raise NpuValueError(f"x and weight must hold 1 to {MAX_GROUPS} tensors, got {len(xs)}, {len(ws)}")
        check_choice("split_item", check_int("split_item", split_item), (0, 1, 2, 3))
        check_choice("group_list_type", check_int("group_list_type", group_list_type), (0, 1))
        # torch_npu doc, group_type: "`group_list`输入类型为`List[int]`时仅支持传入`None`。" and "`group_list`输入类型为
        # `Tensor`时，... `group_type`支持的枚举值为：-1代表不分组；0代表m轴分组；2代表k轴分组。" (the simulator also
        # wants it explicit without a group_list: torch_npu's default None means the list form)
        if group_type is None:
            if not isinstance(group_list, (list, tuple)):
                raise NpuValueError("group_type must be passed explicitly (-1, 0 or 2) unless group_list is a "
                                    "Python list")
        else:
            if isinstance(group_list, (list, tuple)):
                raise NpuTypeError(f"group_list must be an int64 tensor when group_type is given ({group_type}); a "
                                   "Python list needs group_type None")
            check_choice("group_type", check_int("group_type", group_type), (-1, 0, 2))
        check_choice("act_type", check_int("act_type", act_type), (0, 1, 2, 4, 5))
        if act_type != 0:
            if self.supports_fp8:
                # Ascend 950 parameter notes: "actType只支持传入0"
                raise NpuValueError(f"act_type must be 0 on {self.soc_name} (no fused activation), got {act_type}")
            raise NpuSimNotImplemented(f"act_type={act_type}: fused activations are not simulated")
        # "不支持offsetOptional"; activation_* are reserved inputs (torch_npu doc: "预留参数，当前版本不支持").
        for name, value in (("offset", offset), ("activation_input", activation_input),
                            ("activation_quant_scale", activation_quant_scale),
                            ("activation_quant_offset", activation_quant_offset)):
            check_none(name, value, "(reserved; only None is supported)")
        if antiquant_scale is not None or antiquant_offset is not None:
            raise NpuSimNotImplemented("antiquant_scale/antiquant_offset (weight-only quantization) are not simulated")
        if tuning_config is not None and not all(isinstance(v, int) for v in tuning_config):
            raise NpuTypeError(f"tuning_config must be a list of ints, got {tuning_config!r}")
        xd = dtype_arg("x_dtype", x_dtype)
        wd = dtype_arg("weight_dtype", weight_dtype)
        for name, d in (("x_dtype", xd), ("weight_dtype", wd)):
            if d is not None:
                check_dtype(name, d, (HIFLOAT8, *FP4))
                if d in FP4:
                    raise NpuSimNotImplemented(f"{name}={dtype_name(d)}: FP4 is not simulated")
        e8m0 = []
        for name, d in (("scale_dtype", dtype_arg("scale_dtype", scale_dtype)),
                        ("per_token_scale_dtype", dtype_arg("per_token_scale_dtype", per_token_scale_dtype))):
            if d is not None:
                # scaleOptional / perTokenScaleOptional: "FLOAT8_E8M0" is their only dtype named by an argument.
                check_dtype(name, d, (FLOAT8_E8M0FNU,))
                e8m0.append(name)
        # 动态量化（mx量化）场景: scaleOptional "FLOAT8_E8M0" with perTokenScaleOptional "FLOAT8_E8M0"
        # (no other pairing)
        if len(e8m0) == 1:
            raise NpuTypeError("the MX grouped GEMM needs both scale_dtype and per_token_scale_dtype = "
                               "torch_npu.float8_e8m0fnu")
        out_dtype = dtype_arg("output_dtype", output_dtype)
        if out_dtype is not None:
            check_dtype("output_dtype", out_dtype, (*GEMM_OUT, torch.int32))
        eight_bit = (*FP8_NATIVE, *HIF8_CARRIERS)
        quantized = xd is not None or wd is not None or xs[0].dtype in eight_bit or ws[0].dtype in eight_bit
        if quantized:
            return self._gmm_quantized(xs, ws, xd, wd, bias, scale, per_token_scale, group_list, split_item,
                                       group_type, group_list_type, out_dtype, mx=bool(e8m0))
        if e8m0:
            raise NpuTypeError("scale_dtype/per_token_scale_dtype (E8M0) need FP8 x and weight (the MX grouped GEMM)")
        for name, value in (("scale", scale), ("per_token_scale", per_token_scale)):
            if value is not None:
                raise NpuSimNotImplemented(f"{name} with {xs[0].dtype} inputs (integer GEMMs) is not simulated")
        return self._gmm_float(xs, ws, bias, group_list, split_item, group_type, group_list_type, out_dtype)

    @kernel
    def npu_grouped_matmul_add_(self, y: torch.Tensor, /, x: torch.Tensor, weight: torch.Tensor,
                                group_list: torch.Tensor, *, transpose_x: bool = True, transpose_weight: bool = False,
                                group_type: int = 2) -> torch.Tensor:
        """y_i += x_iᵀ @ weight_i in place for each group i of the token dim K: x (K, m) and weight (K, n), y float32.
        torch_npu 2.14's binding (op-plugin 7.3.0, op_plugin_functions.yaml: "exec: aclnnGroupedMatmulAdd") calls
        the first kernel, which the 950 does not take. Returns y."""
        return self._grouped_matmul_add(y, x, weight, group_list, transpose_x, transpose_weight, group_type, 0,
                                        v2=False)

    @torch.no_grad()
    def _grouped_matmul_add(self, y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor,
                            transpose_x: bool, transpose_weight: bool, group_type: int, group_list_type: int, *,
                            v2: bool) -> torch.Tensor:
        """aclnnGroupedMatmulAdd (v2 False) or aclnnGroupedMatmulAddV2: each group's float32 product of exact
        products (the cube's), added into y's slice with one rounding (op-plugin's test: "torch.stack(result)
        .reshape(y.shape) + y"). V1 writes y (g * m, n), V2 y (g, m, n)."""
        if v2:
            # aclnnGroupedMatmulAddV2 产品支持情况: "Ascend 950PR/Ascend 950DT AI处理器 √", A2/A3 "×".
            self._require_fp8_soc("aclnnGroupedMatmulAddV2")
        elif self.soc_family != "A2/A3":
            # aclnnGroupedMatmulAdd 产品支持情况: "Ascend 950PR/Ascend 950DT AI处理器 ×", A2/A3 "√".
            raise NpuSocError(f"aclnnGroupedMatmulAdd (torch_npu 2.14's binding of npu_grouped_matmul_add_) runs on "
                              f"Atlas A2/A3 only; the simulated chip is {self.soc_name}")
        for name, t in (("self", y), ("x", x), ("weight", weight), ("group_list", group_list)):
            check_tensor(name, t)
        check_same_device({"self": y, "x": x, "weight": weight, "group_list": group_list})
        # transposeX "仅支持True"; transposeWeight "仅支持False"; groupType "仅支持2（K轴分组）"; groupListType: V1
        # "仅支持0（cumsum模式）", V2 "0：...cumsum结果" / "1：...每组大小".
        check_choice("transpose_x", transpose_x, (True,))
        check_choice("transpose_weight", transpose_weight, (False,))
        check_choice("group_type", check_int("group_type", group_type), (2,))
        list_type = check_int("group_list_type", group_list_type)
        check_choice("group_list_type", list_type, (0, 1) if v2 else (0,))
        # "支持的输入类型为：x为FLOAT16、weight为FLOAT16、y为FLOAT32。x为BFLOAT16、weight为BFLOAT16、y为FLOAT32。"
        check_tensor("x", x, HALF_FLOATS)
        check_tensor("weight", weight, (x.dtype,))
        check_tensor("self", y, (torch.float32,))
        # x and weight "维度 2" ("非连续 √": any strides); y "ND", V1 "2", V2 "3", "非连续 ×"; groupList "INT64".
        check_dims("x", x, 2, 2)
        check_dims("weight", weight, 2, 2)
        check_dims("self", y, 3 if v2 else 2, 3 if v2 else 2)
        check_layout("self", y, ("row",))
        check_tensor("group_list", group_list, (torch.int64,))
        # x "不支持空Tensor", weight likewise.
        if x.numel() == 0 or weight.numel() == 0:
            raise NpuValueError("x and weight must not be empty")
        if x.shape[0] != weight.shape[0]:
            raise NpuValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must share their first dim K")
        # GroupedMatmulInplaceAddOperation: "最后一个元素大小等于k"
        sizes = self._group_sizes_from_list(group_list, list_type, x.shape[0], "rows of K")
        if sum(sizes) != x.shape[0]:
            raise NpuValueError(f"group_list must cover all {x.shape[0]} rows of K, got {sum(sizes)}")
        g, m, n = len(sizes), x.shape[1], weight.shape[1]
        check_shape("self", y, (g, m, n) if v2 else (g * m, n))
        bounds = [sum(sizes[:i]) for i in range(g + 1)]
        products = torch.stack([cube_matmul(x[bounds[i]:bounds[i + 1]].t(), weight[bounds[i]:bounds[i + 1]])
                                for i in range(g)])
        return y.add_(products.reshape(y.shape))

    @staticmethod
    def _group_sizes_from_list(group_list: Any, list_type: int, total: int, what: str,
                               groups: Optional[int] = None) -> list[int]:
        """Per-group sizes along the split dim from group_list (a tensor, or a Python list of ends)."""
        # torch_npu doc, group_list (`List[int]`/`Tensor`): "数据类型支持`int64`。"
        if isinstance(group_list, torch.Tensor):
            check_dtype("group_list.dtype", group_list.dtype, (torch.int64,))
            check_dims("group_list", group_list, 1, 1)
            values = group_list.tolist()
        elif isinstance(group_list, (list, tuple)) and all(isinstance(v, int) for v in group_list):
            values, list_type = list(group_list), 0
        else:
            raise NpuTypeError(f"group_list must be an int64 tensor or a list of ints, got {group_list!r}")
        if groups is not None and len(values) != groups:
            raise NpuValueError(f"group_list must have {groups} entries (one per weight), got {len(values)}")
        # 单单单 forms (group_type 0 and 2): "groupListOptional第1维最大支持1024，即最多支持1024个group"
        if len(values) > MAX_GROUP_LIST:
            raise NpuValueError(f"group_list may hold at most {MAX_GROUP_LIST} groups, got {len(values)}")
        if not values or any(v < 0 for v in values):
            raise NpuValueError(f"group_list must be a non-empty list of non-negative values, got {values}")
        if list_type == 0:
            if any(b < a for a, b in zip(values, values[1:])):
                raise NpuValueError(f"group_list (cumulative, group_list_type 0) must be non-decreasing: {values}")
            sizes = [b - a for a, b in zip([0] + values, values)]
        else:
            sizes = values
        if sum(sizes) > total:
            raise NpuValueError(f"group_list covers {sum(sizes)} {what}, more than the {total} there are")
        return sizes

    @torch.no_grad()
    def _gmm_quantized(self, xs, ws, xd, wd, bias, scale, per_token_scale, group_list, split_item, group_type,
                       group_list_type, out_dtype, mx: bool = False) -> list[torch.Tensor]:
        if len(xs) != 1 or len(ws) != 1:
            raise NpuValueError(f"FP8/HiF8 grouped GEMMs take a single x and weight tensor, got {len(xs)} and "
                                f"{len(ws)}")
        x, w = xs[0], ws[0]
        fx = self._operand_dtype("x[0]", x, xd, "x_dtype")
        fw = self._operand_dtype("weight[0]", w, wd, "weight_dtype")
        # Quantized tables: x "HIFLOAT8" with weight "HIFLOAT8", x "FLOAT8_E5M2/FLOAT8_E4M3FN" with weight
        # "FLOAT8_E5M2/FLOAT8_E4M3FN" (no mixed row).
        if (fx == HIFLOAT8) != (fw == HIFLOAT8):
            raise NpuTypeError("x and weight must both be HiF8 (x_dtype and weight_dtype torch_npu.hifloat8) or "
                               "both float8_e4m3fn/float8_e5m2")
        # "不同groupType约束": group_type 0 and 2 with single x/weight/y ("单单单"): "仅支持splitItem为2/3"; the
        # quantized rows list groupType "0" or "0/2" ("仅非量化和伪量化支持不分组").
        check_choice("split_item", split_item, (2, 3), "for FP8/HiF8 grouped GEMMs (single output tensor)")
        check_choice("group_type", group_type, (0, 2), "for FP8/HiF8 grouped GEMMs")
        # out column of the FP8/HiF8 rows: "BFLOAT16/FLOAT16/FLOAT32".
        if out_dtype is None:
            raise NpuTypeError("output_dtype is required for FP8/HiF8 grouped GEMMs")
        check_dtype("output_dtype", out_dtype, GEMM_OUT)
        # biasOptional: "在输入x为INT8、FLOAT16、BFLOAT16时支持...，在输入x为FLOAT4_E1M2、FLOAT4_E2M1时仅支持
        # FLOAT32，其它类型输入需传空指针"
        check_none("bias", bias, "for FP8/HiF8 grouped GEMMs")
        # "必须传groupListOptional" (单单单 forms); torch_npu takes it as an int64 tensor when group_type is given.
        if not isinstance(group_list, torch.Tensor):
            raise NpuTypeError("group_list must be an int64 tensor for FP8/HiF8 grouped GEMMs")
        if scale is None:
            raise NpuValueError("scale is required for FP8/HiF8 grouped GEMMs")
        s = check_list("scale", scale, 1)[0]
        p = check_list("per_token_scale", per_token_scale, 1)[0] if per_token_scale is not None else None
        # The MX and G-B modes: scales per 32-block (E8M0) or per 1x128 / 128x128 tile (FLOAT32), 3-D or 4-D
        # weight scales (the per-tensor/per-channel ones are 1-D or 2-D).
        if mx or s.dim() == 3:
            return self._gmm_blocks(x, w, fx, fw, s, p, group_list, group_type, group_list_type, out_dtype, mx)
        # Dynamic T-T/T-C/K-T/K-C rows: scaleOptional "FLOAT32", perTokenScaleOptional "FLOAT32" (UINT64/INT64
        # scales are the static form, not simulated).
        check_tensor("scale[0]", s, (torch.float32,))
        if p is not None:
            check_tensor("per_token_scale[0]", p, (torch.float32,))
        check_same_device({"x": x, "weight": w, "scale": s, "per_token_scale": p, "group_list": group_list})
        check_dims("x[0]", x, 2, 2)
        m, k = x.shape
        a = decode(x, fx)
        if group_type == 0:
            check_dims("weight[0]", w, 3, 3)
            g, kw, n = w.shape
            if kw != k:
                raise NpuValueError(f"k of x[0] {tuple(x.shape)} and weight[0] {tuple(w.shape)} differ")
            # group_type 0 单单单: "支持x不转置，weight转置、不转置均支持"
            check_layout("x[0]", x, ("row",))
            check_layout("weight[0]", w)
            sizes = self._group_sizes_from_list(group_list, group_list_type, m, "rows", groups=g)
            self._check_weight_scale(s, g, n)
            # perTokenScaleOptional, groupType 0: "pertoken场景：每个tensor 1维，shape为（M,）；pertensor场景：每个
            # tensor 2维或1维，shape为（g, 1）或（g,）"; "当g = M且perTokenScaleOptional的shape为（g,）时，x选择
            # pertoken量化模式".
            if p is not None:
                check_shape("per_token_scale[0]", p, (m,), (g,), (g, 1))
            per_row = p is not None and tuple(p.shape) == (m,)
            b = decode(w, fw)
            out = torch.zeros(m, n, dtype=torch.float32)
            start = 0
            for i, size in enumerate(sizes):
                rows = slice(start, start + size)
                part = cube_matmul(a[rows], b[i]) * self._weight_scale(s, i)
                if p is not None:
                    part = part * (p[rows].float().reshape(-1, 1) if per_row else p.reshape(-1)[i].float())
                out[rows] = part
                start += size
        else:
            check_dims("weight[0]", w, 2, 2)
            kw, n = w.shape
            if kw != k:
                raise NpuValueError(f"k of x[0] {tuple(x.shape)} and weight[0] {tuple(w.shape)} differ")
            # group_type 2 单单单: "仅支持x转置且weight不转置"
            check_layout("x[0]", x, ("col",))
            check_layout("weight[0]", w, ("row",))
            sizes = self._group_sizes_from_list(group_list, group_list_type, k, "columns of k")
            g = len(sizes)
            # aclnnGroupedMatmulV4, Ascend 950, 动态量化特殊场景处理: "在动态量化场景K分组情况下，K小于128，
            # N小于等于128且scaleOptional的shape为（g, 1）时，...此种场景现一律按照G-B量化处理"; "K小于128, M不等于1时，
            # 如果N小于等于128，x则选择pergroup量化；如果N大于128，...weight如果是perchannel或者pertensor量化，x选择
            # pertoken量化".
            # Below 128 the kernel reads the scales in modes the simulator does not model.
            if k < 128:
                raise NpuSimNotImplemented(f"a K-split grouped GEMM over k = {k} < 128: the kernel picks the scales' "
                                           "quantization modes by M, N and k there (not simulated)")
            self._check_weight_scale(s, g, n)
            # perTokenScaleOptional, groupType 2: "pertoken场景：每个tensor 2维，shape为（g, M）；pertensor场景：每个
            # tensor 2维或1维，shape为（g, 1）或（g,）"
            if p is not None:
                check_shape("per_token_scale[0]", p, (g, m), (g,), (g, 1))
            per_row = p is not None and tuple(p.shape) == (g, m) and m != 1
            b = decode(w, fw)
            out = torch.zeros(g, m, n, dtype=torch.float32)
            start = 0
            for i, size in enumerate(sizes):
                cols = slice(start, start + size)
                part = cube_matmul(a[:, cols], b[cols]) * self._weight_scale(s, i)
                if p is not None:
                    part = part * (p[i].float().reshape(-1, 1) if per_row else p.reshape(-1)[i].float())
                out[i] = part
                start += size
        return [out.to(out_dtype)]

    def _gmm_blocks(self, x, w, fx, fw, s, p, group_list, group_type, group_list_type, out_dtype, mx: bool
                    ) -> list[torch.Tensor]:
        """The M-split MX and G-B grouped GEMMs: group i's rows of x times weight i, each group's product the
        single npu_quant_matmul's in the same mode ([1, 1, 32] / [1, 128, 128]), rounded once to out_dtype.
        aclnnGroupedMatmulV4, Ascend 950, 动态量化（mx量化）/（G-B量化）场景约束."""
        mode = "MX" if mx else "G-B"
        # MX: "计算公式中量化block size为：gsM = gsN = 1，gsK = 32"; G-B: "当前仅支持gsM = 1， gsN = gsK = 128".
        if group_type != 0 and not mx:
            # The library never asks for the K-split G-B form (it wants 128x128 tiles on the tokens).
            raise NpuSimNotImplemented(f"the K-split (group_type 2) {mode} grouped GEMM is not simulated")
        # MX table: x/weight "FLOAT8_E5M2/FLOAT8_E4M3FN" (or FP4) only; G-B table: HIFLOAT8 or FLOAT8 pairs.
        if mx and fx == HIFLOAT8:
            raise NpuTypeError("the MX grouped GEMM needs float8_e4m3fn/float8_e5m2 x and weight, not HiF8")
        if p is None:  # both tables give perTokenScaleOptional a dtype, never null
            raise NpuValueError(f"per_token_scale is required in the {mode} grouped GEMM")
        check_same_device({"x": x, "weight": w, "scale": s, "per_token_scale": p, "group_list": group_list})
        if group_type == 2:
            # MX table: groupType "0/2" for FLOAT8_E5M2/FLOAT8_E4M3FN x and weight.
            return [self._mx_k_split(x, w, fx, fw, s, p, group_list, group_list_type, out_dtype, accumulate=None)]
        check_dims("x[0]", x, 2, 2)
        # groupType 0 单单单: "weight中tensor需为3维，shape为（g, N, K）或（g, K, N）";
        # "支持x不转置，weight转置、不转置均支持"
        check_dims("weight[0]", w, 3, 3)
        lay_x = check_layout("x[0]", x, ("row",))
        lay_w = check_layout("weight[0]", w)
        (m, k), (g, kw, n) = x.shape, w.shape
        if kw != k:
            raise NpuValueError(f"k of x[0] {tuple(x.shape)} and weight[0] {tuple(w.shape)} differ")
        sizes = self._group_sizes_from_list(group_list, group_list_type, m, "rows", groups=g)
        # MX table: scaleOptional / perTokenScaleOptional "FLOAT8_E8M0"; G-B table: "FLOAT32" both.
        check_tensor("scale[0]", s, E8M0_CARRIERS if mx else (torch.float32,))
        check_tensor("per_token_scale[0]", p, E8M0_CARRIERS if mx else (torch.float32,))
        if mx:
            # scaleOptional, groupType 0: "每个tensor 4维，当weight转置时，shape为(g, N, ceil(K / 64), 2)；
            # 当weight不转置时，shape为(g, ceil(K / 64), N, 2)" (here the (g, ceil(K/64), N, 2) view, transposed
            # with the weight);
            # perTokenScaleOptional, groupType 0: "每个tensor 3维，shape为（M, ceil(K / 64), 2）".
            check_shape("scale[0]", s, (g, ceil_div(k, 64), n, 2))
            check_shape("per_token_scale[0]", p, (m, ceil_div(k, 64), 2))
        else:
            # scaleOptional, groupType 0: "每个tensor 3维，weight转置时shape为（g, ceil(N / gsN), ceil (K / gsK)），
            # weight非转置时shape为（g, ceil(K / gsK), ceil(N / gsN)）"; perTokenScaleOptional: "每个tensor 2维，
            # shape为（M, ceil(K / gsK)）".
            check_shape("scale[0]", s, (g, ceil_div(k, 128), ceil_div(n, 128)))
            check_shape("per_token_scale[0]", p, (m, ceil_div(k, 128)))
        out = torch.zeros(m, n, dtype=out_dtype)
        start = 0
        for i, size in enumerate(sizes):
            rows = slice(start, start + size)
            start += size
            if size == 0:
                continue
            if mx:
                a, b = self._mx_operands(x[rows], w[i], fx, fw, s[i], p[rows], lay_x, lay_w)
            else:
                a, b = self._block_operands(x[rows], w[i], fx, fw, s[i], p[rows], lay_x, lay_w, (1, 128, 128))
            out[rows] = cube_matmul_rounded(a, b, out_dtype)
        return [out]

    def _mx_k_split(self, x: torch.Tensor, w: torch.Tensor, fx, fw, s: torch.Tensor, p: torch.Tensor,
                    group_list: Any, group_list_type: int, out_dtype, accumulate: Optional[torch.Tensor]
                    ) -> torch.Tensor:
        """The K-split MX grouped GEMM (aclnnGroupedMatmulV4 groupType 2; also aclnnQuantGroupedMatmulInplaceAdd's
        mx mode, which adds the float32 products into `accumulate` (g, m, n) in place): group i multiplies the
        columns K_i of x (m, K), a transposed view, by the same rows of weight (K, n), its scales the rows of
        the grouped scale tensors that the documents place it at, each group's product that of a single
        npu_quant_matmul in the MX mode over its tokens (`_mx_operands`). Returns (g, m, n) in out_dtype, or
        `accumulate`.

        Scale rows, aclnnGroupedMatmulV4 (Ascend 950, 动态量化（mx量化）场景约束), scaleOptional groupType 2: "每个
        tensor 3维，shape为((K / 64) + g, N, 2)，scale_i起始地址偏移为((K_0 + K_1 + ...+ K_{i-1})/ 64 + g_i)*N* 2" (g_i:
        "第i个分组（下标从0开始）"), perTokenScaleOptional groupType 2: "shape为((K / 64) + g, M, 2), 起始地址偏移与
        scale 同理". The division is an integer one: torch_npu's npu_grouped_dynamic_mx_quant, which writes this layout,
        sizes it "mxscale_shape[0] / blocksize / NUM_TWO + group_index.sizes()[0]" (int64), and the kernels place
        a group at "(groupStart / 64 + groupIdx + blockColIdx)" (ops-nn grouped_dynamic_mx_quant_combine.h) and
        "(params_.bGroupAddrOffset / params_.n / QuantUtils::MXFP_DIVISOR_SIZE + groupIdx)" (ops-transformer
        quant_block_sch.h), int64 divisions. Group i reads ceil(K_i / 64) pairs there ("kLoops=ceil(K_i / gsK)，支持
        最后的切片长度不足gsK"); the rows between groups are read by no group."""
        check_dims("x[0]", x, 2, 2)
        check_dims("weight[0]", w, 2, 2)
        (m, k), (kw, n) = x.shape, w.shape
        if kw != k:
            raise NpuValueError(f"k of x[0] {tuple(x.shape)} and weight[0] {tuple(w.shape)} differ")
        # groupType 2 单单单: "仅支持x转置且weight不转置"
        check_layout("x[0]", x, ("col",))
        check_layout("weight[0]", w, ("row",))
        sizes = self._group_sizes_from_list(group_list, group_list_type, k, "columns of k")
        g = len(sizes)
        # MX table: scaleOptional / perTokenScaleOptional "FLOAT8_E8M0".
        check_tensor("scale[0]", s, E8M0_CARRIERS)
        check_tensor("per_token_scale[0]", p, E8M0_CARRIERS)
        rows = k // 64 + g
        check_shape("scale[0]", s, (rows, n, 2))
        check_shape("per_token_scale[0]", p, (rows, m, 2))
        # The documents give these scales no transposed form: contiguous, as the grouped quantize writes them.
        for name, t in (("scale[0]", s), ("per_token_scale[0]", p)):
            if not t.is_contiguous():
                raise NpuValueError(f"{name} must be contiguous (strides {t.stride()})")
        out = accumulate if accumulate is not None else torch.zeros(g, m, n, dtype=out_dtype)
        start = 0
        for i, size in enumerate(sizes):
            first, pairs = start // 64 + i, ceil_div(size, 64)
            if size:
                x1, x2 = x[:, start:start + size], w[start:start + size]
                x1_scale = p[first:first + pairs].permute(1, 0, 2)
                a, b = self._mx_operands(x1, x2, fx, fw, s[first:first + pairs], x1_scale, layouts(x1), layouts(x2))
                if accumulate is None:
                    out[i] = cube_matmul_rounded(a, b, out_dtype)
                else:  # the float32 products added into y in one rounding
                    out[i].add_(cube_matmul(a, b))
            start += size
        return out

    @staticmethod
    def _check_weight_scale(s: torch.Tensor, g: int, n: int) -> None:
        """scaleOptional, groupType 0/2, weight单tensor: "perchannel场景：每个tensor 2维，shape为（g, N）；
        pertensor场景：每个tensor 2维或1维，shape为（g, 1）或（g,）"."""
        check_shape("scale[0]", s, (g,), (g, 1), (g, n))

    @staticmethod
    def _weight_scale(s: torch.Tensor, i: int) -> torch.Tensor:
        """Group i's weight scale: a scalar (per tensor) or a row of n (per channel). For n = 1 the (g, 1) shape is
        both; the document picks per tensor ("优先选择pertensor量化模式"), which is the same number."""
        return s[i].float().reshape(-1)

    def _gmm_float(self, xs, ws, bias, group_list, split_item, group_type, group_list_type, out_dtype
                   ) -> list[torch.Tensor]:
        """The non-quantized grouped GEMM, y_i = x_i @ weight_i + bias_i ("非量化场景"): float16/bfloat16 x and
        weight of one dtype (float32 too off the 950), each group's product with exact products and float32 sums
        (the cube's), plus its bias, rounded once to x's dtype. Forms: group_type -1, g x and g weights; 0, the rows
        of one x split over g weights (one (g, k, n) tensor, or g (k, n) ones); 2, the columns of one x (the
        transposed view of a contiguous (k, m)) split with the rows of one contiguous (k, n) weight, out
        (g, m, n). The rules quoted are aclnnGroupedMatmulV4.md's Ascend 950 sections ("非量化场景约束", "不同groupType
        约束") unless another source is named."""
        dtype = xs[0].dtype
        # Ascend 950: "x支持FLOAT8_E4M3FN、FLOAT8_E5M2、INT8、HIFLOAT8、FLOAT16、BFLOAT16、FLOAT4_E1M2、FLOAT4_E2M1"
        # (no FLOAT32); the A2/A3 list has "FLOAT16、BFLOAT16、FLOAT32".
        check_dtype("x[0].dtype", dtype, HALF_FLOATS if self.supports_fp8 else FLOATS)
        # 非量化场景约束: "|-1/0/2 |BFLOAT16 |BFLOAT16 |BFLOAT16/FLOAT32/null | BFLOAT16|" (and the FLOAT16 row): x and
        # weight of one dtype, out of x's.
        for i, t in enumerate(xs):
            check_tensor(f"x[{i}]", t, (dtype,))
            # -1 多多多: "非量化x，out中tensor需为2维"; 0 and 2: x 2-D ("x，out中tensor需为2维")
            check_dims(f"x[{i}]", t, 2, 2)
        for i, t in enumerate(ws):
            check_tensor(f"weight[{i}]", t, (dtype,))
            check_dims(f"weight[{i}]", t, 2, 3 if len(ws) == 1 else 2)
        if out_dtype is not None and out_dtype != dtype:
            raise NpuTypeError(f"output_dtype must be None or {dtype} for {dtype} inputs, got {out_dtype}")
        if self.soc_family == "A2/A3":
            # A2/A3: "x和weight中每一组tensor的最后一维大小都应小于65536。x_i的最后一维指当x不转置时x_i的K轴或当x转置
            # 时x_i的M轴" (the last dim as laid out; likewise the weight's N, or its K where it is transposed)
            named = [*((f"x[{i}]", t) for i, t in enumerate(xs)), *((f"weight[{i}]", t) for i, t in enumerate(ws))]
            for name, t in named:
                inner = t.shape[-1] if "row" in layouts(t) else t.shape[-2]
                if inner >= 65536:
                    raise NpuValueError(f"{name}'s last dim as laid out must be below 65536, got {inner}")
        if self.supports_fp8:
            # 非量化场景 table: x BFLOAT16 -> bias "BFLOAT16/FLOAT32/null"; x FLOAT16 -> bias "FLOAT16/FLOAT32/null".
            bias_dtypes: tuple = (dtype, torch.float32)
        else:
            # Off the 950 the simulator keeps its earlier rule (bfloat16 x: float32 bias, float16 x: float16 bias);
            # the A2/A3 section only lists "biasOptional支持FLOAT16、FLOAT32、INT32" without the pairing.
            bias_dtypes = (torch.float32,) if dtype == torch.bfloat16 else (dtype,)
        bs = check_list("bias", bias, len(ws)) if bias is not None else None
        for i, t in enumerate(bs or []):
            check_tensor(f"bias[{i}]", t, bias_dtypes)
        # "不同groupType约束": -1 (多多多) "仅支持splitItem为0/1"; 0 (单单单, 单多单, 多多单) "仅支持splitItem为2/3";
        # 2 (单单单) "仅支持splitItem为2/3".
        if group_type == -1:
            check_choice("split_item", split_item, (0, 1), "with group_type -1")
        elif group_type in (0, 2):
            check_choice("split_item", split_item, (2, 3), f"with group_type {group_type}")
        single_w = len(ws) == 1 and ws[0].dim() == 3
        weights = list(ws[0].unbind(0)) if single_w else ws
        if single_w:
            # 0 单单单: "weight中tensor需为3维，shape为（g, N, K）或（g, K, N）...；bias中tensor需为2维，shape为
            # （g, N）"; "支持x不转置，weight转置、不转置均支持"
            check_layout("weight[0]", ws[0])
            if bs is not None:
                check_shape("bias[0]", bs[0], (ws[0].shape[0], ws[0].shape[2]))
        else:
            # -1, 0 单多单 / 多多单: "weight中tensor需为2维，shape为（n_i, k_i）或（k_i, n_i）；bias中tensor需为1维，
            # shape为（n_i）"; "支持weight转置，但weight的tensorList中每个tensor是否转置需保持统一"
            found = [check_layout(f"weight[{i}]", t) for i, t in enumerate(weights)]
            if not set.intersection(*found):
                raise NpuValueError("the weights must all be contiguous or all be transposed views")
            for i, (t, w) in enumerate(zip(bs or [], weights)):
                check_shape(f"bias[{i}]", t, (w.shape[1],))
        biases = (list(bs[0].unbind(0)) if single_w else bs) if bs is not None else [None] * len(weights)

        def mm(a: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], name: str) -> torch.Tensor:
            if a.shape[-1] != w.shape[0]:
                raise NpuValueError(f"k of {name} {tuple(a.shape)} and its weight {tuple(w.shape)} differ")
            if b is None:
                return cube_matmul_rounded(a, w, dtype)
            return (cube_matmul(a, w) + b.float()).to(dtype)

        if group_list is None:
            if len(xs) != len(weights):
                raise NpuValueError(f"without group_list, x and weight need as many tensors, got {len(xs)} and "
                                    f"{len(weights)}")
            check_choice("group_type", group_type, (-1, 0), "without group_list")
            for i, t in enumerate(xs):
                check_layout(f"x[{i}]", t, ("row",))  # "x不支持转置"
            outs = [mm(a, w, b, f"x[{i}]") for i, (a, w, b) in enumerate(zip(xs, weights, biases))]
            return [torch.cat(outs)] if split_item in (2, 3) else outs
        if len(xs) != 1:
            raise NpuValueError(f"with group_list, x must be a single tensor, got {len(xs)}")
        x = xs[0]
        if group_type == 2:
            # 2 单单单: "x，weight中tensor需为2维，shape分别为（K, M）和（K, N）；out中tensor需为3维, shape为
            # （g, M, N）"; "仅支持x转置且weight不转置"; "最后一个值不大于x中tensor的第一维" (of the (K, M) x); A2/A3:
            # "bias必须传空".
            if len(ws) != 1 or ws[0].dim() != 2:
                raise NpuValueError("the k-split form (group_type 2) takes a single 2-D weight")
            check_none("bias", bias, "in the k-split form (group_type 2)")
            check_layout("x[0]", x, ("col",))
            check_layout("weight[0]", ws[0], ("row",))
            sizes = self._group_sizes_from_list(group_list, group_list_type, x.shape[1], "columns of k")
            bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
            outs = [mm(x[:, bounds[i]:bounds[i + 1]], ws[0][bounds[i]:bounds[i + 1]], None, "x[0]")
                    for i in range(len(sizes))]
            return [torch.stack(outs)] if split_item in (2, 3) else outs
        check_layout("x[0]", x, ("row",))  # "x不支持转置"
        sizes = self._group_sizes_from_list(group_list, group_list_type, x.shape[0], "rows", groups=len(weights))
        if not single_w and sum(sizes) != x.shape[0]:
            # 0 单多单: "必须传groupListOptional，且当groupListType为0时，最后一个值与x中tensor的第一维相等，当
            # groupListType为1时，数值的总与x中tensor的第一维相等" (单单单 takes fewer: "不大于")
            raise NpuValueError(f"group_list must cover all {x.shape[0]} rows of x with a list of weights, got "
                                f"{sum(sizes)}")
        parts = list(torch.split(x[: sum(sizes)], sizes))
        outs = [mm(a, w, b, "x[0]") for a, w, b in zip(parts, weights, biases)]
        if split_item not in (2, 3):
            return outs
        # 单单单: the rows past group_list's total are not computed (zeros here)
        y = torch.zeros(x.shape[0], weights[0].shape[1], dtype=dtype)
        y[: sum(sizes)] = torch.cat(outs)
        return [y]
