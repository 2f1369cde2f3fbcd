"""`Linear`: a TransformerEngine-style linear layer, FP8 inside `fp8_autocast`, high precision outside,
with optional column/row tensor parallelism and sequence parallelism."""
from __future__ import annotations

import warnings
from typing import Callable, Optional, Union

import torch

from mindspeed_te.distributed import (
    ProcessGroup,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    group_size,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from mindspeed_te.kernels import get_backend
from mindspeed_te.modules.base import FP8ModuleBase, InitMethod, initialize_
from mindspeed_te.ops.linear import LinearQuantizers, WeightCache, fp8_linear
from mindspeed_te.ops.mc2 import mc2_linear, mc2_mx_linear
from mindspeed_te.quantized_tensor import QuantizedTensor
from mindspeed_te.recipe import MXFP8BlockScaling
from mindspeed_te.state import FP8GlobalStateManager

PARALLEL_MODES = (None, "column", "row")


def check_parallel_mode(parallel_mode: Optional[str]) -> None:
    if parallel_mode not in PARALLEL_MODES:
        raise ValueError(f"parallel_mode must be None, 'column' or 'row', got {parallel_mode!r}")


def resolve_tp_size(tp_group: ProcessGroup, tp_size: int) -> int:
    """The TP size: from the group when one is given, else `tp_size` (which must then be 1 on one process)."""
    size = group_size(tp_group) if tp_group is not None else tp_size
    if tp_group is not None and tp_size not in (1, size):
        raise ValueError(f"tp_size={tp_size} does not match the size of tp_group ({size})")
    return size


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) must be divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


def set_tensor_parallel_attributes(param: torch.Tensor, is_parallel: bool, dim: int) -> None:
    """Mark a parameter the way Megatron's optimizer and checkpointing expect."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = 1


def record_tensor_parallel(module: FP8ModuleBase, in_features: int, out_features: int, tp_group: ProcessGroup,
                           tp_size: int, parallel_mode: Optional[str]) -> tuple[int, int]:
    """Record a linear's whole sizes and tensor parallelism on `module`; returns its local weight shape."""
    module.in_features, module.out_features = in_features, out_features
    module.tp_group = tp_group
    module.tp_size = resolve_tp_size(tp_group, tp_size)
    module.parallel_mode = parallel_mode
    local_out = divide(out_features, module.tp_size, "out_features") if parallel_mode == "column" else out_features
    local_in = divide(in_features, module.tp_size, "in_features") if parallel_mode == "row" else in_features
    return local_out, local_in


def create_linear_parameters(module: FP8ModuleBase, shape: tuple[int, int], params_dtype: Optional[torch.dtype],
                             device: Union[torch.device, str, None], init_method: InitMethod, bias: bool,
                             gemm: int = 0) -> tuple[torch.nn.Parameter, Optional[torch.nn.Parameter]]:
    """GEMM `gemm`'s weight (`module.create_weight`) and bias (zeros, or None without one), marked split
    the way `module.parallel_mode` splits them: column splits both, row only the weight."""
    dtype = params_dtype or torch.get_default_dtype()
    mode = module.parallel_mode
    weight = module.create_weight(shape, dtype, device, init_method, gemm=gemm)
    set_tensor_parallel_attributes(weight, mode is not None, 0 if mode == "column" else 1)
    if not bias:
        return weight, None
    bias_param = torch.nn.Parameter(torch.zeros(shape[0], dtype=dtype, device=device))
    set_tensor_parallel_attributes(bias_param, mode == "column", 0)
    return weight, bias_param


class Linear(FP8ModuleBase):
    """y = x Wᵀ + b. `parallel_mode="column"` splits W's rows over `tp_group` (output stays split unless
    `gather_output`), `"row"` splits W's columns (input already split, output reduced). With
    `sequence_parallel` the un-split activations are split along dim 0 and gathered/reduce-scattered.

    Args:
        in_features, out_features: sizes of the whole (unsplit) layer
        sequence_parallel: activations split along dim 0 over the TP group (with `parallel_mode` set)
        fuse_wgrad_accumulation: add weight gradients into `weight.main_grad` (float32, or bfloat16/float16
            rounded once) instead of `.grad`
        tp_group, tp_size: tensor-parallel process group (None: no TP), or its size when no group is given
        init_method: fills the weight in place (None: Kaiming-uniform); bias starts at 0
        bias: whether the layer has a bias
        return_bias: forward returns (output, bias) without adding it, for a later fused add
        params_dtype: parameter dtype (None: torch's default dtype)
        parallel_mode: None, "column" or "row" (see above)
        device: where the parameters are created (None: torch's default device)
        gather_output: all-gather the column-parallel output (parallel_mode="column" only)
        name: label used in NaN/Inf reports (None: the class name and id)
        use_ascend_mc2: fused matmul + communication kernels on the NPU under TP (--use-ascend-mc2); elsewhere, or
            where they do not apply, separate collectives with one warning
        delay_wgrad_compute: backward leaves the weight-gradient GEMM to a later `backward_dw()` call
        save_original_input: keep the input itself for backward and quantize it there for the FP8 wgrad
        extra_state_format: the `_extra_state` checkpoints get: "mindspeed_te", or "te" for TransformerEngine's
            (None: MINDSPEED_TE_EXTRA_STATE_FORMAT, default "mindspeed_te"; docs/te-checkpoints.md)
            (TE's option, which Megatron sets with `set_save_original_input`); with delayed scaling too, unlike
            TE: with the forward's scale, so the wgrad reads the codes the forward's GEMM read
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group: ProcessGroup = None,
        tp_size: int = 1,
        init_method: Optional[Callable[[torch.Tensor], object]] = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        device: Union[torch.device, str, None] = None,
        gather_output: bool = False,
        name: Optional[str] = None,
        use_ascend_mc2: bool = False,
        delay_wgrad_compute: bool = False,
        save_original_input: bool = False,
        extra_state_format: Optional[str] = None,
    ) -> None:
        super().__init__(num_gemms=1, extra_state_format=extra_state_format)
        if delay_wgrad_compute and use_ascend_mc2:
            raise ValueError("delay_wgrad_compute=True cannot be combined with use_ascend_mc2 (--use-ascend-mc2)")
        check_parallel_mode(parallel_mode)
        if gather_output and parallel_mode != "column":
            raise ValueError("gather_output=True needs parallel_mode='column'")
        shape = record_tensor_parallel(self, in_features, out_features, tp_group, tp_size, parallel_mode)
        self.sequence_parallel = sequence_parallel and parallel_mode is not None
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.return_bias = return_bias
        self.gather_output = gather_output
        self.name = name
        self.use_ascend_mc2 = use_ascend_mc2
        self._mc2_warned = False
        self.weight, bias_param = create_linear_parameters(self, shape, params_dtype, device, init_method, bias)
        self.register_parameter("bias", bias_param)
        if bias_param is not None and parallel_mode == "row":
            bias_param.sequence_parallel = self.sequence_parallel
        self._weight_cache = WeightCache()
        self.save_original_input = save_original_input
        self.init_wgrad_store(delay_wgrad_compute, (self.weight, self.bias))

    def reset_parameters(self, init_method: Optional[Callable[[torch.Tensor], object]] = None) -> None:
        """Re-initialize: the weight by `init_method` (Kaiming-uniform when None), the bias to zero."""
        initialize_(self.weight, init_method)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def _mc2_applies(self, inp: torch.Tensor, quantized: bool) -> bool:
        """--use-ascend-mc2: fused communication for TP linears on an NPU, in high precision and (with
        sequence parallelism) MXFP8; otherwise separate collectives (warned once, with the reason)."""
        capabilities = get_backend(inp.device).capabilities
        if (not self.use_ascend_mc2 or self.tp_size == 1 or not capabilities.fused_communication_gemm
                or isinstance(self.weight, QuantizedTensor)):
            return False
        if self.parallel_mode == "column" and not self.sequence_parallel:
            return False
        shape, (low, high) = tuple(self.weight.shape), capabilities.fused_communication_k_range
        if self.tp_size not in capabilities.fused_communication_world_sizes:
            sizes = ", ".join(map(str, capabilities.fused_communication_world_sizes))
            reason = f"takes tensor-parallel sizes {sizes} (got {self.tp_size}); this layer"
        elif quantized and not (isinstance(FP8GlobalStateManager.get_fp8_recipe(), MXFP8BlockScaling)
                                and self.sequence_parallel):
            reason = "runs in high precision and, with sequence parallelism, MXFP8; other FP8 recipes"
        elif self.sequence_parallel and not all(low <= dim < high for dim in shape):
            # the forward and the backward fused GEMM each contract over one weight dim
            reason = f"needs both weight dims per rank in [{low}, {high}) (got {shape}); this layer"
        elif not quantized:
            return True
        elif self.weight.shape[0] % 64 or self.weight.shape[1] % 64:
            # the fused kernels take E8M0 scales in pairs along each GEMM's contraction dim
            reason = f"with MXFP8 needs both weight dims per rank divisible by 64 (got {shape}); this layer"
        elif (local_tokens := self._tokens_per_rank(inp)) % 32:
            # the wgrad's columnwise form is gathered from the ranks' blocks of 32 tokens (ops/mc2.py)
            reason = f"with MXFP8 needs a multiple of 32 tokens per rank (got {local_tokens}); calls like this one"
        else:
            return True
        if not self._mc2_warned:
            warnings.warn(f"--use-ascend-mc2: fused communication {reason} in {type(self).__name__} use "
                          "separate collectives", stacklevel=2)
            self._mc2_warned = True
        return False

    def _tokens_per_rank(self, inp: torch.Tensor) -> int:
        """The rows of this rank's part of the sequence-parallel activation: a column-parallel input is that part,
        a row-parallel one is reduce-scattered into it."""
        tokens = inp.numel() // max(inp.shape[-1], 1)
        return tokens if self.parallel_mode == "column" else tokens // self.tp_size

    def will_execute_quantized(self, is_context_quantized: bool) -> bool:
        """Whether the GEMMs run quantized in a context that is (or is not) an FP8 autocast region."""
        return is_context_quantized

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        fp8 = self.prepare_forward(inp.device)
        quantized = fp8 is not None and FP8GlobalStateManager.is_fp8_enabled()
        if self._mc2_applies(inp, quantized):
            backend = get_backend(inp.device)
            if quantized:
                fwd, bwd, _ = fp8
                out = mc2_mx_linear(inp, self.weight, LinearQuantizers(fwd[0], fwd[1], bwd[0]), backend,
                                    self.tp_group, self.parallel_mode, self.fuse_wgrad_accumulation)
            else:
                out = mc2_linear(inp, self.weight, backend, self.tp_group, self.parallel_mode,
                                 self.sequence_parallel, self.fuse_wgrad_accumulation)
            if self.bias is not None and not self.return_bias:
                out = out + self.bias
            return (out, self.bias) if self.return_bias else out
        x = inp
        if self.parallel_mode == "column":
            x = (gather_from_sequence_parallel_region(x, self.tp_group) if self.sequence_parallel
                 else copy_to_tensor_parallel_region(x, self.tp_group))
        quantizers, first = None, False
        if fp8 is not None:
            fwd, bwd, first = fp8
            if FP8GlobalStateManager.is_fp8_enabled():
                quantizers = LinearQuantizers(fwd[0], fwd[1], bwd[0])
            else:
                self.calibrate(fwd[:2], x, self.weight)
        bias_in_gemm = self.bias if (self.parallel_mode != "row" and not self.return_bias) else None
        out = fp8_linear(
            x, self.weight, bias_in_gemm,
            quantizers=quantizers,
            fp8_wgrad=FP8GlobalStateManager.get_fp8_recipe().fp8_wgrad(),
            weight_cache=self._weight_cache,
            is_first_microbatch=is_first_microbatch,
            fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
            reduce_amax_in_backward=first and quantizers is not None,
            wgrad_store=self.wgrad_store,
            save_original_input=self.save_original_input,
        )
        if self.parallel_mode == "row":
            out = (reduce_scatter_to_sequence_parallel_region(out, self.tp_group) if self.sequence_parallel
                   else reduce_from_tensor_parallel_region(out, self.tp_group))
            if self.bias is not None and not self.return_bias:
                out = out + self.bias
        elif self.gather_output:
            out = gather_from_tensor_parallel_region(out, self.tp_group)
        if self.return_bias:
            return out, self.bias
        return out
