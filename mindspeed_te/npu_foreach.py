"""How many kernels torch_npu launches for one aten multi-tensor ("foreach") op on an Ascend 950.

A foreach op is one launch only where torch_npu has a fused kernel and the tensors take its fast route;
otherwise it runs one op per tensor, and long lists are split into several kernel calls. The rules below
follow op-plugin's sources (op_plugin/ops/opapi/Foreach*.cpp, op_plugin_functions.yaml) for the 950, where
every fused kernel is enabled ("is_support_nd_out") and CANN has the V2 kernels the bindings prefer
(DO_COMPATIBILITY(aclnnForeachMulScalarV2, ...): the v1 fallback refuses bfloat16), and PyTorch's
`can_use_fast_route` (ForeachUtils.h). `LaunchCounter` counts foreach ops with `foreach_launches`.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

# Tensors per kernel call of the fused foreach kernels the library and torch's foreach Adam/AdamW use:
# ForeachNormKernelOpApi.cpp (FOREACH_NORM_MAX_TENSOR_COUNT = 24), ForeachAddKernelNpuOpApi.cpp and
# ForeachMaximumKernelNpuOpApi.cpp ("max_tensor_count = is_inplace ? 24 : 16"), ForeachCopyKernelOpApi.cpp and
# ForeachZeroInplaceKernelNpuOpApi.cpp (SINGLE_FOREACH_OP_TENSOR_COUNT = 48); ForeachMulScalarKernelOpApi.cpp,
# ForeachAddScalarKernelNpuOpApi.cpp and ForeachSqrtKernelNpuOpApi.cpp ("is_inplace ? 48 : 24"),
# ForeachLerpScalarKernelNpuOpApi.cpp ("is_inplace ? 24 : 16"), ForeachAddcmulScalarKernelNpuOpApi.cpp
# ("is_inplace ? 16 : 12"), ForeachDivKernelNpuOpApi.cpp (scalar list: "is_inplace ? 50 : 24"). Not listed, so one
# launch per tensor: _foreach_addcdiv(_).ScalarList, which ForeachAddcdivScalarListKernelNpuOpApi.cpp always
# sends to PyTorch's slow path (torch's non-capturable Adam divides by its per-tensor step sizes so).
_CHUNK = {
    "_foreach_norm.Scalar": 24,
    "_foreach_add.List": 16,
    "_foreach_add_.List": 24,
    "_foreach_maximum.List": 16,
    "_foreach_maximum_.List": 24,
    "_foreach_copy_.default": 48,
    "_foreach_zero_.default": 48,
    "_foreach_mul.Scalar": 24,
    "_foreach_mul_.Scalar": 48,
    "_foreach_add.Scalar": 24,
    "_foreach_add_.Scalar": 48,
    "_foreach_sqrt.default": 24,
    "_foreach_sqrt_.default": 48,
    "_foreach_lerp.Scalar": 16,
    "_foreach_lerp_.Scalar": 24,
    "_foreach_addcmul.Scalar": 12,
    "_foreach_addcmul_.Scalar": 16,
    "_foreach_div.ScalarList": 24,
    "_foreach_div_.ScalarList": 50,
}
# ForeachMaximumKernelNpuOpApi.cpp: check_dtype_foreach(..., TO_INT32, ...); other dtypes take the slow path.
_MAXIMUM_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32)
# Ops whose binding sends integer tensors to the slow path: `has_integral_tensor(input, true)` (sqrt, addcmul) or
# `can_use_fast_route(..., does_op_promote_integer_inputs_to_float=true)` (div).
_FLOAT_ONLY = ("_foreach_sqrt", "_foreach_addcmul", "_foreach_div")


def _dense(t: torch.Tensor) -> bool:
    """`is_non_overlapping_and_dense`: the dims of size > 1, ordered by stride, tile memory without gaps."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _fast_route(lists: Sequence[Sequence[torch.Tensor]], scalars: Sequence[Any] = ()) -> bool:
    """PyTorch's `can_use_fast_route`: one device and one dtype across all lists, strided, non-overlapping
    and dense tensors, matching sizes and strides (dims of size 1 aside) position by position, and scalars
    that do not change the tensors' dtype."""
    first = lists[0][0]
    for tensors in lists:
        for t in tensors:
            if t.device != first.device or t.dtype != first.dtype or t.layout != torch.strided or not _dense(t):
                return False
    for tensors in lists[1:]:
        for a, b in zip(lists[0], tensors):
            if a.shape != b.shape or any(n != 1 and s != r for n, s, r in zip(a.shape, a.stride(), b.stride())):
                return False
    return all(torch.result_type(t, s) == t.dtype for s in scalars for t in lists[0])


def _fused(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """Launches of an overload listed in `_CHUNK`: its kernel calls on the fast route, else one per tensor."""
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    n = len(lists[0])
    calls = math.ceil(n / _CHUNK[name])
    if name == "_foreach_norm.Scalar":
        # "checkDataWithInfinit": the fused kernel takes ord 1, 2 and (on the 950) inf, no integer tensors;
        # a `dtype` other than the input's is reached by casting every input first (_npu_dtype_cast).
        order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        dtype = kwargs.get("dtype", args[2] if len(args) > 2 else None)
        tensors = lists[0]
        if not _fast_route(lists) or order not in (1, 2, math.inf) or not tensors[0].is_floating_point():
            return n
        return calls + (n if dtype is not None and dtype != tensors[0].dtype else 0)
    if name.startswith("_foreach_copy_"):
        # Lists of several dtypes are copied one dtype group at a time ("should_group"); a group off the fast
        # route is copied tensor by tensor (foreach_tensor_copy_list_kernel_slow_).
        dst, src = lists[0], lists[1]
        groups: dict[torch.dtype, tuple[list, list]] = {}
        for d, s in zip(dst, src):
            group = groups.setdefault(s.dtype, ([], []))
            group[0].append(d)
            group[1].append(s)
        return sum(math.ceil(len(d) / _CHUNK[name]) if _fast_route([d, s]) else len(d) for d, s in groups.values())
    if name.startswith("_foreach_zero_"):
        return calls if _fast_route(lists) and all(t.is_floating_point() for t in lists[0]) else n
    if name.startswith("_foreach_maximum") and lists[0][0].dtype not in _MAXIMUM_DTYPES:
        return n
    if name.startswith(_FLOAT_ONLY) and not lists[0][0].is_floating_point():
        return n
    scalars: list[Any] = []
    for a in (*args, *kwargs.values()):  # alpha, a Scalar (mul's, add's, lerp's weight, addcmul's value), a Scalar[]
        if isinstance(a, (int, float, bool)):
            scalars.append(a)
        elif isinstance(a, (list, tuple)) and a and not isinstance(a[0], torch.Tensor):
            scalars.extend(a)
    return calls if _fast_route(lists, scalars) else n


def foreach_launches(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """Kernel launches of one aten foreach op on the NPU. An out= overload is PyTorch's generated composite
    (torch_npu registers none): the functional op, then one copy per output. An overload outside `_CHUNK`
    counts one launch per tensor: exact for ops without a torch_npu kernel (such as `_foreach_max`, which the
    library's code avoids for that reason, and Adam's `_foreach_addcdiv_.ScalarList`), an upper bound for the
    many others torch_npu fuses (such as `_foreach_abs`), whose rules this model does not cover."""
    packet = func.overloadpacket.__name__
    overload = func._overloadname
    if overload.endswith("out"):
        functional = getattr(func.overloadpacket, overload[: -len("_out")] if overload != "out" else "default")
        n = len(kwargs["out"])
        return foreach_launches(functional, args, {k: v for k, v in kwargs.items() if k != "out"}) + n
    name = f"{packet}.{overload}"
    if name in _CHUNK:
        return _fused(name, args, kwargs)
    return len(next(a for a in args if isinstance(a, (list, tuple))))
