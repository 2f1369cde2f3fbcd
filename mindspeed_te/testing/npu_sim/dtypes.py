"""torch_npu's dtype arguments: its own dtype numbers (ACL dtype enum + 256) and the groups the contracts use.

dtype arguments take what torch_npu's Python binding takes: a `torch.dtype`, a torch ScalarType number, or one
of torch_npu's own numbers: `hifloat8` 290, `float8_e5m2` 291, `float8_e4m3fn` 292, `float8_e8m0fnu` 293,
`float4_e2m1fn_x2` 296. 291/292 mean the same as the native `torch.float8_e5m2` / `torch.float8_e4m3fn`; HiF8
has no torch dtype, so HiF8 codes travel in `torch.uint8` tensors and the kernel is told what they are through
its dtype argument (`x1_dtype=sim.hifloat8`, ...).
"""
from __future__ import annotations

from typing import Union

import torch

# torch_npu dtype numbers (ACL dtype enum + 256), as in torch_npu 2.14's meta registrations.
INT4 = 285
HIFLOAT8 = 290
FLOAT8_E5M2 = 291
FLOAT8_E4M3FN = 292
FLOAT8_E8M0FNU = 293
FLOAT4_E2M1FN_X2 = 296
FLOAT4_E1M2FN_X2 = 297

DtypeArg = Union[torch.dtype, int, None]
Dtype = Union[torch.dtype, int]  # canonical form: a torch.dtype, or an NPU-only number (285, 290, 293, 296, 297)

# Numbers the binding turns into native dtypes: torch ScalarType values, plus torch_npu's FP8 aliases.
NUMBER_TO_NATIVE = {
    0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.int64, 5: torch.float16,
    6: torch.float32, 7: torch.float64, 11: torch.bool, 12: torch.qint8, 13: torch.quint8, 14: torch.qint32,
    15: torch.bfloat16, 16: torch.quint4x2, 21: torch.bits8, 23: torch.float8_e5m2, 24: torch.float8_e4m3fn,
    FLOAT8_E5M2: torch.float8_e5m2, FLOAT8_E4M3FN: torch.float8_e4m3fn,
}
NPU_ONLY_NAMES = {
    INT4: "torch_npu.int4",
    HIFLOAT8: "torch_npu.hifloat8",
    FLOAT8_E8M0FNU: "torch_npu.float8_e8m0fnu",
    FLOAT4_E2M1FN_X2: "torch_npu.float4_e2m1fn_x2",
    FLOAT4_E1M2FN_X2: "torch_npu.float4_e1m2fn_x2",
}
FP8_NATIVE = (torch.float8_e4m3fn, torch.float8_e5m2)
FP4 = (FLOAT4_E2M1FN_X2, FLOAT4_E1M2FN_X2)
HALF_FLOATS = (torch.float16, torch.bfloat16)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
GEMM_OUT = (torch.float16, torch.bfloat16, torch.float32)
HIF8_CARRIERS = (torch.uint8, torch.bits8)  # HiF8 codes arrive as uint8; npu_quantize returns torch.bits8
E8M0_CARRIERS = (torch.uint8, torch.float8_e8m0fnu)

