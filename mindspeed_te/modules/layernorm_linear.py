"""`LayerNormLinear`: TransformerEngine's norm-then-linear layer (Megatron's QKV and FC1 projections).

It is a `Linear` with a LayerNorm/RMSNorm in front: the linear part, with its FP8 GEMMs, tensor parallelism
and sequence-parallel gather, is Linear's own code. With sequence parallelism the norm runs on this rank's
slice of the sequence, and Linear then gathers the normalized activations before the GEMM.

Where the backend's norm kernel makes the GEMM's quantized input itself (`fuses_norm_quantize`; on an NPU: RMSNorm
into MXFP8 rowwise, for a linear that needs no columnwise input, i.e. no weight gradient), the norm's output is a
stand-in that only carries its gradient (see ops/prequantized.py): not with sequence parallelism or
`return_layernorm_output`, which need its values.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from mindspeed_te.distributed import ProcessGroup
from mindspeed_te.modules.linear import Linear
from mindspeed_te.modules.norm import NORMALIZATIONS, norm_parameters, normalize, normalize_and_quantize
from mindspeed_te.ops.linear import LinearQuantizers
from mindspeed_te.ops.prequantized import fused_input_quantizer, with_prequantized_input
from mindspeed_te.state import FP8GlobalStateManager

LayerNormLinearOutput = Union[torch.Tensor, tuple[torch.Tensor, ...]]


class LayerNormLinear(Linear):
    """y = norm(x) Wᵀ + b, with TE's parameter names: `layer_norm_weight`, `layer_norm_bias` (LayerNorm only),
    `weight`, `bias` (Megatron's checkpoints and its TELayerNormColumnParallelLinear rely on them).
    parallel_mode None or "column"; a row-parallel input holds only part of the hidden dimension, which the
    norm needs whole. forward returns out, (out, bias) with `return_bias`, and the norm output last with
    `return_layernorm_output` (this rank's sequence slice under sequence parallelism, as in TE).

    Args:
        in_features, out_features: sizes of the whole (unsplit) layer
        eps: added to the variance (or mean square) in the norm
        sequence_parallel: the input is this rank's slice along dim 0; gathered after the norm
        fuse_wgrad_accumulation: add weight gradients into `weight.main_grad` (float32, or bfloat16/float16
            rounded once) instead of `.grad`
        tp_group, tp_size: tensor-parallel process group (None: no TP), or its size when no group is given
        init_method: fills the linear weight in place (None: Kaiming-uniform); the norm starts at gamma 1, beta 0
        bias: whether the linear part has a bias
        normalization: "LayerNorm" or "RMSNorm"
        return_bias: forward returns the bias instead of adding it
        params_dtype: parameter dtype (None: torch's default dtype)
        parallel_mode: None or "column"
        return_layernorm_output: forward also returns the norm output
        zero_centered_gamma: the norm scales by 1 + weight (weight starts at 0)
        device: where the parameters are created (None: torch's default device)
        delay_wgrad_compute: backward leaves the weight-gradient GEMM to a later `backward_dw()` call
        extra_state_format: the `_extra_state` checkpoints get: "mindspeed_te", or "te" for TransformerEngine's
            (None: MINDSPEED_TE_EXTRA_STATE_FORMAT, default "mindspeed_te"; docs/te-checkpoints.md)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group: ProcessGroup = None,
        tp_size: int = 1,
        init_method: Optional[Callable[[torch.Tensor], object]] = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        return_layernorm_output: bool = False,
        zero_centered_gamma: bool = False,
        device: Union[torch.device, str, None] = None,
        delay_wgrad_compute: bool = False,
        extra_state_format: Optional[str] = None,
    ) -> None:
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"LayerNormLinear: normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
        if parallel_mode not in (None, "column"):
            raise ValueError(f"LayerNormLinear: parallel_mode must be None or 'column', got {parallel_mode!r}")
        super().__init__(
            in_features, out_features,
            sequence_parallel=sequence_parallel,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            tp_group=tp_group,
            tp_size=tp_size,
            init_method=init_method,
            bias=bias,
            return_bias=return_bias,
            params_dtype=params_dtype,
            parallel_mode=parallel_mode,
            device=device,
            delay_wgrad_compute=delay_wgrad_compute,
            extra_state_format=extra_state_format,
        )
        self.eps = eps
        self.normalization = normalization
        self.zero_centered_gamma = zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        # `self.sequence_parallel` (set by Linear) is the effective flag: the input is sequence-split only
        # when the layer is column-parallel.
        ln_weight, ln_bias = norm_parameters(
            in_features, bias=normalization == "LayerNorm", zero_centered_gamma=zero_centered_gamma,
            sequence_parallel=self.sequence_parallel, dtype=params_dtype, device=device,
        )
        self.layer_norm_weight = ln_weight
        if ln_bias is not None:
            self.layer_norm_bias = ln_bias
        # Register in TE's order (norm first): optimizer states saved by position follow parameter order.
        for name in ("weight", "bias"):
            self._parameters[name] = self._parameters.pop(name)

    def prepare_forward(self, device: torch.device):
        """The forward's quantizers: those `forward` prepared already for the norm's kernel (taken once), else
        made now (FP8ModuleBase.prepare_forward)."""
        prepared = self.__dict__.pop("_prepared_forward", None)
        return prepared[0] if prepared is not None else super().prepare_forward(device)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> LayerNormLinearOutput:
        gamma, beta = self.layer_norm_weight, getattr(self, "layer_norm_bias", None)
        if self.sequence_parallel or self.return_layernorm_output or not FP8GlobalStateManager.is_fp8_enabled():
            # The norm's output is gathered before the GEMM's quantize, or returned: no fused norm + quantize.
            ln_out = normalize(inp, self.normalization, gamma, beta, self.eps, self.zero_centered_gamma)
        else:
            # The norm's kernel may make the GEMM's quantized input itself (NpuBackend: RMSNorm into MXFP8 rowwise,
            # for a linear that needs no columnwise input: no weight gradient): prepare this call's quantizers
            # first (Linear.forward then takes them, see prepare_forward) and let the backend decide.
            fp8 = super().prepare_forward(inp.device)
            fwd, bwd, first = fp8
            quantizers = LinearQuantizers(fwd[0], fwd[1], bwd[0])
            quantizer = fused_input_quantizer(quantizers, self.weight, FP8GlobalStateManager.get_fp8_recipe()
                                              .fp8_wgrad(), self.save_original_input)
            ln_out, made = normalize_and_quantize(inp, self.normalization, gamma, beta, self.eps,
                                                  self.zero_centered_gamma, quantizer)
            if made is not None:
                fp8 = ([with_prequantized_input(quantizers, made).input, *fwd[1:]], bwd, first)
            self._prepared_forward = (fp8,)
        try:
            out = super().forward(ln_out, is_first_microbatch=is_first_microbatch)
        finally:
            self.__dict__.pop("_prepared_forward", None)
        if not self.return_layernorm_output:
            return out
        return (*out, ln_out) if self.return_bias else (out, ln_out)
