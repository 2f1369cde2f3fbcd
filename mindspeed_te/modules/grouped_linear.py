"""`GroupedLinear`: one linear per expert (MoE), TransformerEngine's parameter names weight{i} / bias{i}."""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

from mindspeed_te.distributed import ProcessGroup, copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from mindspeed_te.modules.base import FP8ModuleBase
from mindspeed_te.modules.linear import check_parallel_mode, create_linear_parameters, record_tensor_parallel
from mindspeed_te.ops.grouped_linear import check_m_splits, grouped_linear
from mindspeed_te.ops.linear import LinearQuantizers, WeightCache
from mindspeed_te.quantized_tensor import QuantizedTensor
from mindspeed_te.state import FP8GlobalStateManager


class GroupedLinear(FP8ModuleBase):
    """`num_gemms` experts; forward(inp, m_splits) applies expert i to the next m_splits[i] rows. Expert
    tensor parallelism: "column" splits out_features, "row" splits in_features and all-reduces the output.

    FP8 metadata in TE's grouped layout ("per_role"): fp8_meta["scaling_fwd"] holds every expert's input
    (slots 0..n-1), then every weight (n..2n-1), then every output; "scaling_bwd" every grad_output, then
    every grad_input. megatron-core converts expert checkpoints between grouped and sequential experts in
    this layout.

    `use_fp8_gemm=False` (MindSpeed's --no-use-gmm-fp8) keeps the expert GEMMs in high precision inside FP8
    regions. `sequence_parallel` is recorded for Megatron: the MoE token dispatcher, not this layer, moves
    expert tokens between sequence-parallel ranks.

    The experts' weights are separate parameters, as in TE, but row blocks of one buffer (weight0 first; TE
    allocates each on its own), so that on an NPU one kernel pass quantizes them all where the quantized form
    is row-local. Anything that moves a weight elsewhere (`param.data = ...`, `.to()` into another dtype or
    device) only loses that batching.

    Args:
        num_gemms: number of experts, each with its own weight{i} (and bias{i})
        in_features, out_features: sizes of one whole (unsplit) expert
        sequence_parallel: recorded for Megatron (see above)
        fuse_wgrad_accumulation: add weight gradients into `weight{i}.main_grad` (float32, or bfloat16/float16
            rounded once) instead of `.grad`
        tp_group, tp_size: expert tensor-parallel group (None: no TP), or its size when no group is given
        init_method: fills each expert weight in place (None: Kaiming-uniform); biases start at 0
        bias: whether the experts have biases
        return_bias: forward returns the biases instead of adding them
        params_dtype: parameter dtype (None: torch's default dtype)
        parallel_mode: None, "column" or "row" (see above)
        device: where the parameters are created (None: torch's default device)
        use_fp8_gemm: quantized expert GEMMs inside FP8 regions (see above)
        delay_wgrad_compute: backward leaves the weight-gradient grouped GEMM to a later `backward_dw()` call
        save_original_input: keep the input itself for backward and quantize it there for the FP8 wgrad
        extra_state_format: the `_extra_state` checkpoints get: "mindspeed_te", or "te" for TransformerEngine's
            (None: MINDSPEED_TE_EXTRA_STATE_FORMAT, default "mindspeed_te"; docs/te-checkpoints.md)
            (TE's option, which Megatron sets with `set_save_original_input`); with delayed scaling too, unlike
            TE: with the forward's scale, so the wgrad reads the codes the forward's GEMM read
    """

    fp8_meta_layout = "per_role"

    def __init__(
        self,
        num_gemms: int,
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
        use_fp8_gemm: bool = True,
        delay_wgrad_compute: bool = False,
        save_original_input: bool = False,
        extra_state_format: Optional[str] = None,
    ) -> None:
        super().__init__(num_gemms=num_gemms, extra_state_format=extra_state_format)
        check_parallel_mode(parallel_mode)
        if num_gemms < 1:
            raise ValueError(f"num_gemms must be >= 1, got {num_gemms}")
        shape = record_tensor_parallel(self, in_features, out_features, tp_group, tp_size, parallel_mode)
        self.sequence_parallel = sequence_parallel
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.return_bias = return_bias
        self.use_fp8_gemm = use_fp8_gemm
        self.use_bias = bias
        buffer: Optional[torch.Tensor] = None
        for i in range(num_gemms):
            weight, bias_param = create_linear_parameters(self, shape, params_dtype, device, init_method, bias, gemm=i)
            if not isinstance(weight, QuantizedTensor):
                # Row block i of one buffer, as Megatron's parameter buffer lays out experts (there in reverse):
                # the NPU path then quantizes all experts' weights in one pass where the form is row-local.
                if buffer is None:
                    buffer = torch.empty(num_gemms * shape[0], shape[1], dtype=weight.dtype, device=weight.device)
                block = buffer[i * shape[0] : (i + 1) * shape[0]]
                weight.data = block.copy_(weight.data)
            weight.allreduce = False  # Megatron reduces expert gradients over the expert-data-parallel group
            self.register_parameter(f"weight{i}", weight)
            if bias_param is not None:
                bias_param.allreduce = False
                self.register_parameter(f"bias{i}", bias_param)
        self._weight_caches = [WeightCache() for _ in range(num_gemms)]
        self.save_original_input = save_original_input
        self.init_wgrad_store(delay_wgrad_compute, [*self.weights, *(self.biases or ())])

    @property
    def weights(self) -> list[torch.nn.Parameter]:
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    @property
    def biases(self) -> Optional[list[torch.nn.Parameter]]:
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else None

    def will_execute_quantized(self, is_context_quantized: bool) -> bool:
        """Whether the expert GEMMs run quantized: in an FP8 region, unless FP8 grouped GEMMs are off."""
        return is_context_quantized and self.use_fp8_gemm

    def forward(self, inp: torch.Tensor, m_splits: Sequence[int], is_first_microbatch: Optional[bool] = None):
        shape = inp.shape
        x = inp.reshape(-1, shape[-1])
        splits = check_m_splits(x, m_splits, self.num_gemms)
        if self.parallel_mode == "column":
            x = copy_to_tensor_parallel_region(x, self.tp_group)
        # With FP8 grouped GEMMs switched off the experts take no part in FP8: no scaling state, and they
        # must not take the first-module flag, which would leave the step's backward amax reduction undone.
        fp8 = self.prepare_forward(inp.device) if self.use_fp8_gemm else None
        quantizers, first = None, False
        if fp8 is not None:
            fwd, bwd, first = fp8
            if FP8GlobalStateManager.is_fp8_enabled():
                index = self.fp8_meta_index
                quantizers = [LinearQuantizers(fwd[index("input", i)], fwd[index("weight", i)],
                                               bwd[index("grad_output", i)]) for i in range(self.num_gemms)]
            else:
                for i, rows in enumerate(torch.split(x, splits)):
                    if rows.shape[0]:
                        self.calibrate([fwd[self.fp8_meta_index("input", i)], fwd[self.fp8_meta_index("weight", i)]],
                                       rows, self.weights[i])
        add_bias = self.use_bias and not self.return_bias and self.parallel_mode != "row"
        out = grouped_linear(
            x, splits, self.weights, self.biases if add_bias else None,
            quantizers=quantizers,
            fp8_wgrad=FP8GlobalStateManager.get_fp8_recipe().fp8_wgrad(),
            weight_caches=self._weight_caches,
            is_first_microbatch=is_first_microbatch,
            fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
            reduce_amax_in_backward=first and quantizers is not None,
            wgrad_store=self.wgrad_store,
            save_original_input=self.save_original_input,
        )
        if self.parallel_mode == "row":
            out = reduce_from_tensor_parallel_region(out, self.tp_group)
            if self.use_bias and not self.return_bias:  # added once, after the partial sums are reduced
                out = out + torch.cat([b.expand(m, -1) for b, m in zip(self.biases, splits)])
        out = out.reshape(*shape[:-1], out.shape[-1])
        if self.return_bias:
            return out, self.biases
        return out
