"""The rest of megatron-core's TE surface: padding for quantized grouped GEMMs, activation checkpointing,
the RNG states tracker, the CPU-offload context, the fused RoPE entry points and the parallel cross entropy."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch

from mindspeed_te.checkpointing import checkpoint
from mindspeed_te.kernels import get_backend
from mindspeed_te.kernels.permutation import constant
from mindspeed_te.megatron.common import quantization_align_size
from mindspeed_te.modules.rope import apply_rotary_pos_emb
from mindspeed_te.ops.cpu_offload import get_cpu_offload_context as _get_cpu_offload_context
from mindspeed_te.ops.grouped_linear import check_m_splits
from mindspeed_te.state import FP8GlobalStateManager


def _alignment(device: torch.device) -> int:
    """Rows per expert must be a multiple of this for the active recipe's quantized grouped GEMM: TE's rule, 1 for
    per-tensor recipes where the backend's grouped GEMMs take any rows per group (the NPU's), the backend's own
    for blockwise and MXFP8 recipes where it has one (the NPU's 1, and 64 for MXFP8 without a grouped MX quantize).
    Padding rows are zeros, which change no amax and no sum, so any alignment gives the same results."""
    recipe = FP8GlobalStateManager.get_fp8_recipe()
    capabilities = get_backend(device).capabilities
    if recipe.float8_per_tensor_scaling() and capabilities.unaligned_per_tensor_groups:
        return 1
    own = (capabilities.blockwise_expert_rows if recipe.float8_block_scaling()
           else capabilities.mx_expert_rows if recipe.mxfp8() else None)
    return own or quantization_align_size(recipe)


def _relaid(x: torch.Tensor, sizes: list[int], new_sizes: list[int], align: int) -> torch.Tensor:
    """The row blocks of `x` (`sizes`) at `new_sizes` rows each: cut to their first rows, or followed by fewer than
    `align` zero rows (views of `align` zero rows kept per shape, `constant`: the same tensor every micro-batch,
    whatever its routing), in one concatenation."""
    pieces, zeros = [], None
    for block, rows in zip(torch.split(x, sizes), new_sizes):
        pieces.append(block[:rows])
        if rows > block.shape[0]:
            if zeros is None:
                zeros = constant(0.0, (align, *x.shape[1:]), x.dtype, x.device)
            pieces.append(zeros[: rows - block.shape[0]])
    return torch.cat(pieces)


class _Relay(torch.autograd.Function):
    """`_relaid` both ways: padding's gradient drops the padding rows', unpadding's adds zeros for them (one
    concatenation each way; per-block pads and slices cost a launch each)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int], new_sizes: list[int], align: int) -> torch.Tensor:
        ctx.sizes, ctx.new_sizes, ctx.align = sizes, new_sizes, align
        return _relaid(x, sizes, new_sizes, align)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _relaid(grad, ctx.new_sizes, ctx.sizes, ctx.align), None, None, None


class _SplitPadding(torch.nn.Module):
    def __init__(self, num_gemms: int, align_size: Optional[int] = None) -> None:
        super().__init__()
        self.num_gemms = num_gemms
        self.align_size = align_size

    def _padded_splits(self, m_splits: list[int], device: torch.device) -> tuple[list[int], int]:
        """(each expert's rows rounded up to the alignment, the alignment: the backend's of `device` when not
        given)."""
        align = self.align_size or _alignment(device)
        return [(int(m) + align - 1) // align * align for m in m_splits], align


class Fp8Padding(_SplitPadding):
    """Pads every expert's rows to the quantized GEMM's alignment: forward(inp, m_splits) -> (padded, splits).

    Args:
        num_gemms: number of experts (length of m_splits)
        align_size: row alignment (None: the active recipe's, `quantization_align_size`)
    """

    def forward(self, inp: torch.Tensor, m_splits: list[int]) -> tuple[torch.Tensor, list[int]]:
        m_splits = check_m_splits(inp, m_splits, self.num_gemms)
        padded, align = self._padded_splits(m_splits, inp.device)
        if padded == m_splits:
            return inp, padded
        return _Relay.apply(inp, m_splits, padded, align), padded


class Fp8Unpadding(_SplitPadding):
    """Drops the padding rows again: forward(inp, m_splits) with the original (unpadded) splits.

    Args:
        num_gemms: number of experts (length of m_splits)
        align_size: row alignment (None: the active recipe's, `quantization_align_size`)
    """

    def forward(self, inp: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        padded, align = self._padded_splits(m_splits, inp.device)
        check_m_splits(inp, padded, self.num_gemms)
        splits = [int(m) for m in m_splits]
        if padded == splits:
            return inp
        return _Relay.apply(inp, padded, splits, align)


class TECudaRNGStatesTracker:
    """Named RNG streams (Megatron's model-parallel RNG) on whatever device torch's default generator
    lives: the accelerator's when there is one, the CPU's otherwise.

    Args:
        is_inference_rng_tracker: Megatron's flag for the inference tracker; recorded
    """

    def __init__(self, is_inference_rng_tracker: bool = False) -> None:
        self.is_inference_rng_tracker = is_inference_rng_tracker
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)
        self._is_initialized = True

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists")
        self.seeds_.add(seed)
        saved = _get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = _get_rng_state()
        _set_rng_state(saved)
        self._is_initialized = True

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not added")
        saved = _get_rng_state()
        _set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state()
            _set_rng_state(saved)


def _accelerator_module():
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return getattr(torch, accelerator.type) if accelerator is not None else None


def _get_rng_state() -> torch.Tensor:
    module = _accelerator_module()
    return module.get_rng_state() if module is not None else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    module = _accelerator_module()
    if module is not None:
        module.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def te_checkpoint(forward_func: Callable, distribute_saved_activations: bool, get_rng_state_tracker: Optional[Callable],
                  tp_group: Optional[Any], *args: Any, **kwargs: Any) -> Any:
    """Megatron's positional form of `mindspeed_te.checkpoint`: the recompute uses the same FP8 scales,
    autocast state and RNG streams as the first pass, and does not record amaxes twice."""
    return checkpoint(forward_func, *args, distribute_saved_activations=distribute_saved_activations,
                      get_rng_state_tracker=get_rng_state_tracker, tp_group=tp_group, **kwargs)


def get_cpu_offload_context(enabled: bool, num_layers: int, model_layers: int, activation_offloading: bool,
                            weight_offloading: bool, double_buffering: bool = False,
                            retain_pinned_cpu_buffers: bool = False) -> tuple[Any, Callable]:
    """Megatron's positional form of TE's `get_cpu_offload_context` (--cpu-offloading): the activations of the
    first `num_layers` layers go to host memory (`retain_pinned_cpu_buffers`: megatron-core 0.17 on)."""
    return _get_cpu_offload_context(enabled, num_layers, model_layers, activation_offloading, weight_offloading,
                                    double_buffering, retain_pinned_cpu_buffers=retain_pinned_cpu_buffers)


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
                               interleaved: bool = False) -> torch.Tensor:
    """RoPE on an sbhd tensor (Megatron's --apply-rope-fusion entry point; the output layout is always t's)."""
    return apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", interleaved=interleaved, fused=True)


def fused_apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
                                   cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """RoPE on packed sequences (thd) holding this context-parallel rank's share of each sequence."""
    return apply_rotary_pos_emb(t, freqs, tensor_format="thd", fused=True, cu_seqlens=cu_seqlens,
                                cp_size=cp_size, cp_rank=cp_rank)


# TE's parallel_cross_entropy ignores this label (its ignore_idx default): loss 0, no gradient.
IGNORE_INDEX = -100


class _ParallelCrossEntropy(torch.autograd.Function):
    """Vocabulary-parallel cross entropy built from megatron-core's own steps (VocabParallelCrossEntropy), over
    an explicit group, with the gradient in the logits' dtype and TE's ignored label."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, tp_group: Any) -> torch.Tensor:
        from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as steps
        from megatron.core.tensor_parallel.utils import VocabUtility

        world = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
        rank = torch.distributed.get_rank(tp_group) if tp_group is not None else 0
        ignored = labels == IGNORE_INDEX
        values = logits.to(torch.float32, copy=True)  # the steps work in place
        values, logits_max = steps.calculate_logits_max(values)
        if world > 1:
            torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=tp_group)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(logits.shape[-1], rank, world)
        target_mask, target_1d, predicted, sum_exp, exp_logits = steps.calculate_predicted_logits(
            values, labels.masked_fill(ignored, 0), logits_max, start, end)
        if world > 1:
            both = torch.stack((predicted, sum_exp))
            torch.distributed.all_reduce(both, group=tp_group)
            predicted, sum_exp = both.unbind(0)
        softmax, loss = steps.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.save_for_backward(softmax, target_mask, target_1d, ignored)
        ctx.logits_dtype = logits.dtype
        return loss.masked_fill(ignored, 0.0)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as steps

        softmax, target_mask, target_1d, ignored = ctx.saved_tensors
        grad_2d, arange_1d, update, grad_input = steps.prepare_gradient_calculation_operands(softmax, target_mask)
        grad_input = steps.calculate_gradients(grad_2d, arange_1d, target_1d, update, grad_input,
                                               grad_output.float().masked_fill(ignored, 0.0))
        return grad_input.to(ctx.logits_dtype), None, None


def te_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, tp_group: Any,
                              is_cg_capturable: bool = False) -> torch.Tensor:
    """TE's parallel_cross_entropy as Megatron calls it (--cross-entropy-loss-fusion --cross-entropy-fusion-impl
    te): the per-token float32 loss of vocabulary-parallel logits [s, b, vocab / tp] over `tp_group`, label -100
    giving loss and gradient zero; the gradient comes back in the logits' dtype."""
    return _ParallelCrossEntropy.apply(logits, labels, tp_group)


def set_save_original_input(module: torch.nn.Module) -> None:
    """Megatron's request that a linear keep its high-precision input for backward instead of the quantized copy
    (attention's output projection, shared experts, output-discarding recompute)."""
    if hasattr(module, "save_original_input"):
        module.save_original_input = True
