"""Helpers of more than one job of the NPU backend: `_HALF` (the 16-bit float dtypes: quantize, norm),
`_MAX_LAST_DIM` (npu_quant_matmul's limit on a last dim: GEMM, grouped GEMM), `chip_family` (which
documents' rows a chip takes: MoE permutation, RoPE, the high-precision grouped GEMM), and the operand forms of
tiled and MX storages the quant matmul kernels take (`_tiled_pair`, `_mx_pair`: GEMM, fused communication GEMMs)."""
from __future__ import annotations

import torch

from mindspeed_te.tensor import MXFP8TensorStorage, _TiledTensor

_HALF = (torch.float16, torch.bfloat16)
# CANN's product names: Atlas A2 training series = Ascend910B*, Atlas A3 = Ascend910_93*
_A2_A3 = ("Ascend910B", "Ascend910_93")


# torch_npu, npu_quant_matmul 约束说明: "其他情况, x1与x2最后一维的shape大小不能超过65535"; a longer k is summed in
# parts of whole 128-tiles (and E8M0 pairs of 32-blocks).
_MAX_LAST_DIM = 65535


def chip_family(device_name: str) -> str:
    """"950" (Ascend 950PR/950DT), "A2/A3" (Atlas A2/A3 training series) or "" (a chip without these kernels)."""
    name = str(device_name)
    if name.startswith("Ascend950"):
        return "950"
    return "A2/A3" if name.startswith(_A2_A3) else ""


def _tiled_pair(t: _TiledTensor, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(data (rows, k), scale_inv) of the requested form of a tiled tensor."""
    if columnwise:
        return t.columnwise_pair()
    t._require(False)
    return t.rowwise_data.reshape(-1, t.shape[-1]), t.rowwise_scale_inv


def _mx_pair(t: MXFP8TensorStorage, columnwise: bool, as_x2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(data (rows, k), E8M0 scales in the layout npu_quant_matmul wants) of an MXFP8 operand form: pairs of
    32-block bytes along k, as x1 (rows, ceil(k/64), 2); as x2, which the GEMM takes transposed,
    (ceil(k/64), rows, 2). An odd number of blocks (k an odd multiple of 32: a grouped linear's expert or a
    micro-batch of 32 * odd tokens in the wgrad) pads its last pair with a 0 byte, as the quantize kernels pad
    theirs (aclnnDynamicMxQuant mxscaleOut: "并对其进行偶数pad，pad填充值为0"). A columnwise form the kernels
    made (`_quantize_mx`: along the rows) is a transposed view whose scales are already the kernel's
    (ceil(M/64), K, 2) pairs: the layout the GEMM wants for that view as x2 (its (M, K) self, contiguous),
    permuted as x1."""
    pairs = t.columnwise_scale_pairs if columnwise else None
    if pairs is not None:
        t._require(True)
        return t.columnwise_data, pairs if as_x2 else pairs.permute(1, 0, 2)
    data, scale_inv = _tiled_pair(t, columnwise)
    if scale_inv.shape[1] % 2:
        scale_inv = torch.nn.functional.pad(scale_inv, (0, 1))
    pairs = scale_inv.reshape(scale_inv.shape[0], scale_inv.shape[1] // 2, 2)
    return data, pairs.transpose(0, 1) if as_x2 else pairs
