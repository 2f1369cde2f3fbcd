"""`LayerNormMLP`: TransformerEngine's norm + FC1 + activation + FC2 block (one FP8 module of two GEMMs).

Built from the project's pieces: the norm of `modules/norm.py`, the FP8 linear autograd function of
`ops/linear.py` for both GEMMs, the activations of `ops/activation.py`, and the tensor/sequence-parallel
collectives of `distributed.py`. Its FP8 state follows TE's layout for two GEMMs: forward quantizers
(input, weight, output) of FC1 then FC2, backward (grad_output, grad_input) of FC1 then FC2.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from mindspeed_te.distributed import (
    ProcessGroup,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from mindspeed_te.modules.base import FP8ModuleBase
from mindspeed_te.modules.linear import divide, resolve_tp_size, set_tensor_parallel_attributes
from mindspeed_te.modules.norm import NORMALIZATIONS, norm_parameters, normalize_and_quantize
from mindspeed_te.ops.activation import GATED_ACTIVATIONS, activation_function, fused_activation_input
from mindspeed_te.ops.linear import LinearQuantizers, WeightCache, fp8_linear
from mindspeed_te.ops.prequantized import fused_input_quantizer, with_prequantized_input
from mindspeed_te.state import FP8GlobalStateManager

__all__ = ["LayerNormMLP"]

InitMethod = Optional[Callable[[torch.Tensor], object]]
LayerNormMLPOutput = Union[torch.Tensor, tuple[Optional[torch.Tensor], ...]]


class LayerNormMLP(FP8ModuleBase):
    """y = FC2(act(FC1(norm(x)))), with TE's parameter names `layer_norm_weight`, `layer_norm_bias` (LayerNorm
    only), `fc1_weight`, `fc1_bias`, `fc2_weight`, `fc2_bias`. Gated activations (geglu, swiglu, ...) make FC1
    twice as wide and gate its first half with the activation.

    As in TE, FC1 and FC2 hold 1/tp_size of the FFN dimension each; `set_parallel_mode=True` makes FC1
    column- and FC2 row-parallel over `tp_group` (output all-reduced, or with `sequence_parallel` the input
    all-gathered after the norm and the output reduce-scattered; FC2's bias is added after the reduction).
    forward returns out, then the bias with `return_bias`, then the norm output with `return_layernorm_output`
    (this rank's sequence slice, or the gathered one with `return_layernorm_output_gathered`).

    Args:
        hidden_size, ffn_hidden_size: model width and the whole (unsplit) FFN width
        eps: added to the variance (or mean square) in the norm
        sequence_parallel: the input is this rank's slice along dim 0 (with tp_size > 1)
        return_bias: FC2's bias is returned instead of added
        tp_group, tp_size: tensor-parallel process group (None: no TP), or its size when no group is given
        init_method, output_layer_init_method: fill FC1's / FC2's weight in place (None: Kaiming-uniform, as
            this project's Linear); biases start at 0, the norm at gamma 1 (0 with zero_centered_gamma), beta 0
        bias: whether FC1 and FC2 have biases
        normalization: "LayerNorm" or "RMSNorm"
        activation: one of mindspeed_te.ops.activation.ACTIVATIONS (TE's names: gelu, geglu, glu, qgelu,
            qgeglu, relu, reglu, srelu, sreglu, silu, swiglu, clamped_swiglu)
        activation_params: for "clamped_swiglu": limit, alpha, glu_linear_offset
        fuse_wgrad_accumulation: add weight gradients into `main_grad` (float32, or bfloat16/float16
            rounded once) instead of `.grad`
        params_dtype: parameter dtype (None: torch's default dtype)
        return_layernorm_output, return_layernorm_output_gathered: see above
        set_parallel_mode: FC1 column-parallel, FC2 row-parallel (see above)
        zero_centered_gamma: the norm scales by 1 + weight
        device: where the parameters are created (None: torch's default device)
        name: label used in NaN/Inf reports
        delay_wgrad_compute: backward leaves both weight-gradient GEMMs to a later `backward_dw()` call
        extra_state_format: the `_extra_state` checkpoints get: "mindspeed_te", or "te" for TransformerEngine's
            (None: MINDSPEED_TE_EXTRA_STATE_FORMAT, default "mindspeed_te"; docs/te-checkpoints.md)
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        return_bias: bool = False,
        tp_group: ProcessGroup = None,
        tp_size: int = 1,
        init_method: InitMethod = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        activation_params: Optional[dict] = None,
        output_layer_init_method: InitMethod = None,
        fuse_wgrad_accumulation: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        set_parallel_mode: bool = False,
        zero_centered_gamma: bool = False,
        device: Union[torch.device, str, None] = None,
        name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        extra_state_format: Optional[str] = None,
    ) -> None:
        super().__init__(num_gemms=2, extra_state_format=extra_state_format)
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"LayerNormMLP: normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
        self.activation, self.activation_params = activation, activation_params
        self._activation = activation_function(activation, activation_params)
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        self.tp_group = tp_group
        self.tp_size = resolve_tp_size(tp_group, tp_size)
        self.set_parallel_mode = set_parallel_mode
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.use_bias, self.return_bias = bias, return_bias
        self.return_layernorm_output = return_layernorm_output
        self.return_layernorm_output_gathered = return_layernorm_output_gathered
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.name = name
        dtype = params_dtype or torch.get_default_dtype()
        self.size_per_partition = divide(ffn_hidden_size, self.tp_size, "ffn_hidden_size")
        fc1_out = 2 * self.size_per_partition if activation in GATED_ACTIVATIONS else self.size_per_partition

        ln_weight, ln_bias = norm_parameters(
            hidden_size, bias=normalization == "LayerNorm", zero_centered_gamma=zero_centered_gamma,
            sequence_parallel=self.sequence_parallel, dtype=dtype, device=device)
        self.layer_norm_weight = ln_weight
        if ln_bias is not None:
            self.layer_norm_bias = ln_bias
        else:
            self.register_parameter("layer_norm_bias", None)
        self.fc1_weight = self.create_weight((fc1_out, hidden_size), dtype, device, init_method, gemm=0)
        set_tensor_parallel_attributes(self.fc1_weight, True, 0)
        self.fc1_bias = self._bias(fc1_out, dtype, device)
        if self.fc1_bias is not None:
            set_tensor_parallel_attributes(self.fc1_bias, True, 0)
        self.fc2_weight = self.create_weight((hidden_size, self.size_per_partition), dtype, device,
                                             output_layer_init_method, gemm=1)
        set_tensor_parallel_attributes(self.fc2_weight, True, 1)
        self.fc2_bias = self._bias(hidden_size, dtype, device)
        if self.fc2_bias is not None and set_parallel_mode:
            self.fc2_bias.sequence_parallel = self.sequence_parallel
        self._weight_caches = (WeightCache(), WeightCache())
        self.init_wgrad_store(delay_wgrad_compute, (self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias),
                              computations_per_backward=2)

    def _bias(self, size: int, dtype: torch.dtype, device) -> Optional[torch.nn.Parameter]:
        return torch.nn.Parameter(torch.zeros(size, dtype=dtype, device=device)) if self.use_bias else None

    def will_execute_quantized(self, is_context_quantized: bool) -> bool:
        """Whether the GEMMs run quantized in a context that is (or is not) an FP8 autocast region."""
        return is_context_quantized

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> LayerNormMLPOutput:
        fp8 = self.prepare_forward(inp.device)
        fc1_q = fc2_q = None
        first = calibrating = False
        if fp8 is not None:
            fwd, bwd, first = fp8
            if FP8GlobalStateManager.is_fp8_enabled():  # TE's layout: 3 forward, 2 backward quantizers per GEMM
                fc1_q, fc2_q = LinearQuantizers(fwd[0], fwd[1], bwd[0]), LinearQuantizers(fwd[3], fwd[4], bwd[2])
            else:
                calibrating = True
        fp8_wgrad = FP8GlobalStateManager.get_fp8_recipe().fp8_wgrad()
        # The norm's kernel may make FC1's quantized input itself (as in LayerNormLinear), unless the norm's output
        # is gathered before the GEMM or returned.
        fused_norm = not (self.sequence_parallel or self.return_layernorm_output)
        ln_out, made = normalize_and_quantize(
            inp, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.zero_centered_gamma,
            fused_input_quantizer(fc1_q, self.fc1_weight, fp8_wgrad) if fused_norm else None)
        if made is not None:
            fc1_q = with_prequantized_input(fc1_q, made)
        x = ln_out
        if self.set_parallel_mode:
            x = (gather_from_sequence_parallel_region(x, self.tp_group) if self.sequence_parallel
                 else copy_to_tensor_parallel_region(x, self.tp_group))
        if calibrating:
            self.calibrate(fwd[0:2], x, self.fc1_weight)
        common = dict(fp8_wgrad=fp8_wgrad, is_first_microbatch=is_first_microbatch,
                      fuse_wgrad_accumulation=self.fuse_wgrad_accumulation, wgrad_store=self.wgrad_store)
        # FC1's backward runs last in this module, so it reduces the step's backward amaxes when first.
        hidden = fp8_linear(x, self.fc1_weight, self.fc1_bias, quantizers=fc1_q, weight_cache=self._weight_caches[0],
                            reduce_amax_in_backward=first and fc1_q is not None, **common)
        # The activation's kernel may make FC2's quantized input itself (NpuBackend: SwiGLU into MXFP8).
        fused = fused_activation_input(self.activation, self._activation, hidden, fc2_q, self.fc2_weight, fp8_wgrad)
        if fused is None:
            act = self._activation(hidden)
        else:
            act, fc2_q = fused
        if calibrating:
            self.calibrate(fwd[3:5], act, self.fc2_weight)
        add_bias = self.fc2_bias is not None and not self.return_bias
        out = fp8_linear(act, self.fc2_weight, self.fc2_bias if add_bias and not self.set_parallel_mode else None,
                         quantizers=fc2_q, weight_cache=self._weight_caches[1], **common)
        if self.set_parallel_mode:
            out = (reduce_scatter_to_sequence_parallel_region(out, self.tp_group) if self.sequence_parallel
                   else reduce_from_tensor_parallel_region(out, self.tp_group))
            if add_bias:  # after the reduction, so it is added once
                out = out + self.fc2_bias
        outputs: list[Optional[torch.Tensor]] = [out]
        if self.return_bias:
            outputs.append(self.fc2_bias)
        if self.return_layernorm_output:
            outputs.append(x if self.return_layernorm_output_gathered else ln_out)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)
