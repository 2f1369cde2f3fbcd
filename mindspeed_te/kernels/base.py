"""The kernel-backend contract: everything above `kernels/` (ops, modules, state) talks only to this.

A backend turns quantizers and quantized operands into device work. `ReferenceBackend` implements all of it
with exact torch ops; the NPU and torch backends override what their kernels do better. What a backend can
do beyond the common core is asked through `capabilities`, never through its name.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch

from mindspeed_te.kernels.masks import CausalMask, PackedMask
from mindspeed_te.quantizers import Quantizer
from mindspeed_te.tensor import QuantizedTensorStorage

Operand = Union[torch.Tensor, QuantizedTensorStorage]


@dataclass(frozen=True)
class Capabilities:
    """What a backend offers beyond quantize / GEMM / norm / attention.

    fused_communication_gemm: all-gather + matmul, matmul + reduce-scatter and matmul + all-reduce as single
        kernels (`--use-ascend-mc2`), in high precision and MXFP8.
    fused_communication_k_range: the contraction sizes [low, high) the all-gather + matmul and matmul +
        reduce-scatter kernels take.
    fused_communication_world_sizes: the group sizes those kernels take.
    native_mx_gemm: MXFP8 GEMMs run as device kernels (what makes MXFP8 TE's default recipe on a device).
    unaligned_per_tensor_groups: the grouped GEMMs of per-tensor FP8/HiF8 operands take any rows per group, so
        `Fp8Padding` pads no expert's rows (TE's GEMMs want 16).
    blockwise_expert_rows, mx_expert_rows: the rows per expert `Fp8Padding` pads to under blockwise and MXFP8
        recipes where the backend's kernels want other than TE's (None: TE's 16 and 32; 1: none).
    """

    fused_communication_gemm: bool = False
    fused_communication_k_range: tuple[int, int] = (0, 0)
    fused_communication_world_sizes: tuple[int, ...] = ()
    native_mx_gemm: bool = False
    unaligned_per_tensor_groups: bool = False
    blockwise_expert_rows: Optional[int] = None
    mx_expert_rows: Optional[int] = None


class KernelBackend(ABC):
    """One device's kernels. Methods that a backend lacks raise `NotImplementedError` naming the capability."""

    name: str
    capabilities: Capabilities = Capabilities()

    def available(self) -> tuple[bool, str]:
        """(whether FP8 kernels exist on this device, why not)."""
        return True, ""

    def nvfp4_available(self) -> tuple[bool, str]:
        """(whether NVFP4BlockScaling runs here, why not): its GEMM takes per-16 E4M3 block scales, which a device
        may lack although it has other FP4 GEMMs (TransformerEngine's is_nvfp4_available)."""
        return self.available()

    @abstractmethod
    def quantize(self, quantizer: Quantizer, x: torch.Tensor) -> QuantizedTensorStorage:
        """x quantized the way `quantizer` describes (its usage says which layouts)."""

    def quantize_many(self, quantizers: Sequence[Quantizer], tensors: Sequence[torch.Tensor]
                      ) -> list[QuantizedTensorStorage]:
        """`quantize` of several tensors at once (a linear's input and weight): a backend may batch their
        small per-tensor ops into multi-tensor launches."""
        return [self.quantize(q, x) for q, x in zip(quantizers, tensors)]

    def quantize_row_blocks(self, quantizers: Sequence[Quantizer], tensors: Sequence[torch.Tensor], blocks: int
                            ) -> list[QuantizedTensorStorage]:
        """`quantize_many`, where the first `blocks` tensors are consecutive row blocks of one tensor, in order (a
        grouped linear's experts' inputs or grad_outputs, each quantized on its own): a backend may make a form
        of all of them in one grouped kernel (the same values as one quantize each)."""
        return self.quantize_many(quantizers, tensors)

    def read_twice(self, t: Operand) -> AbstractContextManager:
        """A block in which several GEMMs read operand `t` (a backward's dgrad and wgrad both read grad_output):
        a backend may keep what it derives from `t` for all of them, and drops it when the block ends."""
        return nullcontext()

    def gemm_bias(self, bias: torch.Tensor, weight: Operand) -> torch.Tensor:
        """The bias in the form this backend's quantized `gemm` with `weight` takes, made once so that a caller
        may keep it while the bias does not change (across the micro-batches of a step, as the weight)."""
        return bias

    @abstractmethod
    def gemm(self, a: Operand, b: Operand, *, a_columnwise: bool = False, b_columnwise: bool = False,
             out_dtype: torch.dtype = torch.float32, bias: Optional[torch.Tensor] = None,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """a · bᵀ over the shared last dim (+ bias), or its float32 sum added into `out` (float32, bfloat16 or
        float16: Megatron's main_grad), rounded once to out's dtype."""

    @abstractmethod
    def grouped_gemm(self, a: Sequence[Operand], b: Sequence[Operand], *, a_columnwise: bool = False,
                     b_columnwise: bool = False, out_dtype: torch.dtype = torch.float32,
                     out: Optional[Sequence[torch.Tensor]] = None) -> list[torch.Tensor]:
        """One `gemm` per group (M-split for fprop/dgrad, K-split with columnwise operands for wgrad)."""

    @abstractmethod
    def layer_norm(self, x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor], eps: float
                   ) -> torch.Tensor:
        """LayerNorm over gamma's trailing dims in float32 (gamma and beta in x's dtype or float32), x's dtype out."""

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over gamma's trailing dims, x's dtype out."""

    # A norm or an activation fused with the quantize of its output (the next GEMM's input) -----------------
    def fuses_norm_quantize(self, normalization: str, x: torch.Tensor, gamma: torch.Tensor,
                            quantizer: Quantizer) -> bool:
        """Whether `norm_quantize` runs this norm ("RMSNorm" or "LayerNorm") of x and `quantizer` (its usage as
        set) as one kernel, with the same bits, and so returns no norm output values."""
        return False

    @abstractmethod
    def norm_quantize(self, normalization: str, x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor],
                      eps: float, quantizer: Quantizer) -> tuple[torch.Tensor, QuantizedTensorStorage]:
        """(y, `quantize(quantizer, y)`) for y = `rms_norm(x, gamma, eps)` or `layer_norm(x, gamma, beta, eps)`.
        Where `fuses_norm_quantize` holds, one kernel makes the quantized form and y has the norm output's shape
        and dtype but no defined values: it only carries the norm's gradient to x and gamma in autograd."""

    def fuses_activation_quantize(self, activation: str, x: torch.Tensor, quantizer: Quantizer) -> bool:
        """Whether `activation_quantize` runs `activation` (TE's name: "swiglu", "gelu", ...) of x and
        `quantizer` (its usage as set) as one kernel, with the same bits."""
        return False

    @abstractmethod
    def activation_quantize(self, activation: str, x: torch.Tensor, quantizer: Quantizer,
                            fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedTensorStorage:
        """`quantize(quantizer, fn(x))`, where `fn` computes x's `activation` as the ops layer defines it (in at
        least float32, x's dtype out). Where `fuses_activation_quantize` holds, one kernel computes both and
        fn(x) is never made."""

    @abstractmethod
    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  mask: Optional[Union[torch.Tensor, CausalMask, PackedMask]], scale: float, dropout: float, *,
                  empty_rows: bool = False, softmax_offset: Optional[torch.Tensor] = None) -> torch.Tensor:
        """softmax(Q Kᵀ · scale + mask) V on [s, b, heads, d] inputs; [s, b, heads · d] out. `mask` is a boolean
        "may attend" matrix, an additive float one, or a pattern (`CausalMask`, `PackedMask`). A query whose keys
        are all masked gets zeros; `empty_rows` says that such rows may occur (a kernel may need to know).
        `softmax_offset` [heads]: one more logit per head in every softmax, whose probability multiplies no value
        (TE's off-by-one and learnable softmax; an attention sink)."""

    # MoE token permutation (TE's moe_permute / moe_unpermute with a mask routing map) and RoPE -------------
    @abstractmethod
    def moe_permute(self, tokens: torch.Tensor, routing_map: torch.Tensor,
                    num_out_tokens: Optional[Union[int, torch.Tensor]], probs: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """(the rows of `tokens` [num_tokens, hidden] that the boolean `routing_map` [num_tokens, num_experts]
        routes, grouped by expert with tokens ascending within one, [num_out_tokens, hidden]; each row's prob
        from `probs` [num_tokens, num_experts] when given; a row map that only this backend's `moe_unpermute`
        reads). num_out_tokens None or <= 0 means every routed pair; fewer drops the last rows."""

    @abstractmethod
    def moe_unpermute(self, rows: torch.Tensor, row_map: torch.Tensor, merging_probs: Optional[torch.Tensor],
                      num_tokens: int) -> torch.Tensor:
        """The permuted `rows` summed back per token (each weighted by its `merging_probs` [num_tokens,
        num_experts] entry when given), in float32 for 16-bit rows, rows' dtype out: [num_tokens, hidden]."""

    @abstractmethod
    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str, *,
               unit_tables: bool = False) -> torch.Tensor:
        """RoPE x · cos + rotate(x) · sin over x's last dim, cos and sin of x's dtype broadcasting to x (3 or 4
        dims). mode "half": rotate(x) = (-x2, x1) of the two halves; "interleave": of each adjacent pair;
        "interleave-half": channels (0, 2, ..) then (1, 3, ..) first, then "half" (MLA's layout, output in the
        half-split order). `unit_tables`: the caller knows every cos / sin value lies in [-1, 1] (some kernels
        take nothing else)."""

    # Fused communication GEMMs (capabilities.fused_communication_gemm) -------------------------------------
    def all_gather_matmul(self, x1: torch.Tensor, x2: torch.Tensor, group: Any
                          ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(all_gather(x1) · x2, the gathered x1 when the kernel returns it), in high precision."""
        raise NotImplementedError(f"the {self.name} backend has no fused communication GEMMs "
                                  "(capabilities.fused_communication_gemm)")

    def matmul_reduce_scatter(self, x1: torch.Tensor, x2: torch.Tensor, group: Any) -> torch.Tensor:
        """reduce_scatter(x1 · x2) along the rows, in high precision."""
        raise NotImplementedError(f"the {self.name} backend has no fused communication GEMMs "
                                  "(capabilities.fused_communication_gemm)")

    def all_gather_matmul_mx(self, a: QuantizedTensorStorage, b: QuantizedTensorStorage, group: Any, *,
                             b_columnwise: bool, out_dtype: torch.dtype) -> torch.Tensor:
        """all_gather(a) · bᵀ of MXFP8 operands: a's rowwise form gathered along its rows, b's rowwise form (or
        its columnwise one) as the (n, k) operand."""
        raise NotImplementedError(f"the {self.name} backend has no fused communication GEMMs "
                                  "(capabilities.fused_communication_gemm)")

    def matmul_reduce_scatter_mx(self, a: QuantizedTensorStorage, b: QuantizedTensorStorage, group: Any, *,
                                 b_columnwise: bool, out_dtype: torch.dtype) -> torch.Tensor:
        """reduce_scatter(a · bᵀ) along the rows, of MXFP8 operands (forms as in `all_gather_matmul_mx`)."""
        raise NotImplementedError(f"the {self.name} backend has no fused communication GEMMs "
                                  "(capabilities.fused_communication_gemm)")

    def matmul_all_reduce(self, x1: torch.Tensor, x2: torch.Tensor, group: Any) -> torch.Tensor:
        """all_reduce(x1 · x2)."""
        raise NotImplementedError(f"the {self.name} backend has no fused communication GEMMs "
                                  "(capabilities.fused_communication_gemm)")
