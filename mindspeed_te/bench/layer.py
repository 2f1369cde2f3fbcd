"""Bench group "npu", layer part: device launches of one Megatron GPT layer's training step on the torch_npu
simulator, per recipe and chip, beside a floor worked out from the kernels that exist.

The model is a megatron-core `TransformerBlock` built from Megatron's TransformerEngine layer spec (patched by
this plugin to our modules): dense (LayerNorm, biases, GeLU) or MoE (4 experts, top-2, grouped GEMM, the
alltoall dispatcher with the fused permutation, no linear biases), hidden 256, 4 heads, sequence 128, micro-batch
2, bf16 parameters, in a one-process gloo world. A training step is what Megatron's schedule runs: the gradients
zeroed (Megatron zeroes its gradient buffer), `set_is_first_microbatch()`, forward + backward of two micro-batches
(each accumulating into the parameters' .grad), a torch AdamW step (foreach, as torch picks on an NPU) and the
step's non-finite report (`harvest_nonfinite`). Launches are counted by `LaunchCounter` in the second step (the
first makes the optimizer's state and what is made once), less the host's own work on an NPU: torch keeps
AdamW's `step` counters on the host (not capturable), so the ops on them and their `.item()` launch nothing
there, nor does the profiler's record_function.

The step is split into
  micro-batch   a later micro-batch's forward + backward (is_first_microbatch False: the weights' quantized
                forms are the step's first micro-batch's), per layer;
  step          per layer, what the first micro-batch adds to a later one (the weights' quantizes) plus the
                optimizer and the gradients' zeroing;
  constant      what does not grow with the layers: the autocast regions' amax update (delayed scaling: at each
                micro-batch's region exit and backward), the non-finite fold and check (at each micro-batch's
                first region), the optimizer's and the zeroing's multi-tensor chunks.
Per layer and constant come from blocks of 1 and 2 layers: total(L) = L * (2 * micro-batch + step) + constant.
A MoE layer's count depends on its routing (per-expert work follows the token counts), so its "per layer" is the
second layer's, and the constant takes the difference from the first.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from mindspeed_te.bench.gpt import megatron_world
from mindspeed_te.diagnostics import LaunchCounter

MICRO_BATCHES = 2
HIDDEN, HEADS, SEQ, BATCH, EXPERTS = 256, 4, 128, 2, 4

# label -> (Megatron's --fp8-format, --fp8-recipe); None: the bf16 baseline
RECIPES: dict[str, Optional[tuple[str, str]]] = {
    "bf16": None,
    "delayed HiF8": ("hif8", "delayed"),
    "delayed E4M3": ("e4m3", "delayed"),
    "tensorwise E4M3": ("e4m3", "tensorwise"),
    "tensorwise HiF8": ("hif8", "tensorwise"),
    "blockwise E4M3": ("e4m3", "blockwise"),
    "mxfp8 E4M3": ("e4m3", "mxfp8"),
}
CHIPS = ("Ascend950PR", "Ascend950DT")
# The torch_npu releases measured (npu_sim.RELEASES): 2.14 on each chip, 26.1 (its grouped MX quantize and fused
# GEMMs) on the first.
NEWER_RELEASE = "26.1"
KINDS = ("dense", "moe")

# Ops that run on the host on an NPU: the profiler's markers.
_HOST_OPS = ("_record_function_enter_new", "_record_function_exit")


class DeviceLaunchCounter(LaunchCounter):
    """`LaunchCounter` that leaves out what an NPU runs on the host: ops whose every tensor argument is in
    `host` (by storage; torch's AdamW keeps its `step` counters on the CPU beside NPU parameters) and the
    profiler's record_function markers."""

    def __init__(self, npu: Any, host: frozenset[int] = frozenset()) -> None:
        super().__init__(npu)
        self._host = host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        if func.overloadpacket.__name__ in _HOST_OPS or (self._host and _all_host(self._host, args, kwargs)):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _all_host(host: frozenset[int], args: tuple, kwargs: Optional[dict]) -> bool:
    """Whether the op reads a host tensor and nothing else but 0-dim tensors (AdamW adds a CPU scalar tensor
    of 1 to its CPU step counters)."""
    tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
    on_host = [t.untyped_storage().data_ptr() in host for t in tensors]
    return any(on_host) and all(h or t.dim() == 0 for h, t in zip(on_host, tensors))


@dataclasses.dataclass
class StepLaunches:
    """The counters of one training step's parts (`whole` counts the step around all of them)."""
    zero: LaunchCounter
    first: LaunchCounter
    later: LaunchCounter
    optimizer: LaunchCounter
    end: LaunchCounter
    whole: LaunchCounter

    @property
    def parts(self) -> int:
        return sum(c.total for c in (self.zero, self.first, self.later, self.optimizer, self.end))

    @property
    def per_step(self) -> int:
        """What is not a later micro-batch's: the first micro-batch's extra, the optimizer, the zeroing, the end."""
        return self.zero.total + self.first.total - self.later.total + self.optimizer.total + self.end.total


@dataclasses.dataclass
class LayerSplit:
    """Launches per layer (per micro-batch, per step) and per step for the whole block (constant)."""
    micro_batch: int
    step: int
    constant: int
    totals: dict[int, int]  # layers -> measured total of a step
    optimizer: int  # of `step`: the optimizer's launches per layer

    @property
    def per_layer(self) -> int:
        """One layer's launches in a training step of MICRO_BATCHES micro-batches."""
        return MICRO_BATCHES * self.micro_batch + self.step

    def total(self, layers: int) -> int:
        return layers * self.per_layer + self.constant


def build_block(layers: int, fp8: Optional[tuple[str, str]], moe: bool, hidden: int = HIDDEN,
                **config_args: Any) -> torch.nn.Module:
    """A bf16 TransformerBlock of `layers` GPT layers (TE spec), no final norm, `config_args` added to its
    TransformerConfig; needs `megatron_world`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    fp8_args = dict(fp8=fp8[0], fp8_recipe=fp8[1]) if fp8 is not None else {}
    # Any token count per expert (no --moe-router-padding-for-quantization: the padded map takes the permutation
    # off npu_moe_token_permute, whose contract is k experts per token). TE's fused permutation and router
    # (--moe-permute-fusion, --moe-router-fusion from megatron-core 0.14), which the plugin provides.
    moe_args = dict(num_moe_experts=EXPERTS, moe_grouped_gemm=True, moe_router_topk=2, moe_ffn_hidden_size=hidden,
                    moe_token_dispatcher_type="alltoall", moe_permute_fusion=True, moe_aux_loss_coeff=0.0,
                    add_bias_linear=False) if moe else {}
    if moe and "moe_router_fusion" in {f.name for f in dataclasses.fields(TransformerConfig)}:
        moe_args["moe_router_fusion"] = True
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=HEADS, use_cpu_initialization=True,
        params_dtype=torch.bfloat16, bf16=True, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, **fp8_args, **moe_args, **config_args)
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=EXPERTS if moe else None, moe_grouped_gemm=moe)
    torch.manual_seed(0)
    return TransformerBlock(config, spec, pre_process=True, post_process=False)


def step_launches(fp8: Optional[tuple[str, str]], layers: int, moe: bool, steps: int = 2) -> StepLaunches:
    """Launches of the parts of training step `steps` of a `build_block` (on the simulator: needs
    `npu_simulated` and `megatron_world`)."""
    from mindspeed_te.kernels import get_backend
    from mindspeed_te.state import FP8GlobalStateManager

    FP8GlobalStateManager.reset()  # (chooses the backend again: ask for its simulator after)
    npu = get_backend().npu
    block = build_block(layers, fp8, moe)
    optimizer = torch.optim.AdamW(block.parameters(), lr=1e-4, foreach=True)
    gen = torch.Generator().manual_seed(1)
    # The same tokens in each micro-batch: a MoE layer's per-expert work follows its routing, which other tokens
    # would change between the first micro-batch and a later one (moving launches into the step's part).
    tokens = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).bfloat16()
    inputs = [tokens.clone().requires_grad_() for _ in range(MICRO_BATCHES)]
    seed = torch.ones(SEQ, BATCH, HIDDEN, dtype=torch.bfloat16)
    host: frozenset[int] = frozenset()
    for _ in range(steps):
        for x in inputs:
            x.grad = None  # the layer's input gradient goes to the layer before, not into an accumulation
        counters = [DeviceLaunchCounter(npu, host) for _ in range(6)]
        zero, first, later, opt, end, whole = counters
        with whole:
            with zero:
                optimizer.zero_grad(set_to_none=False)  # as Megatron zeroes its gradient buffer (none at step 1)
            block.set_is_first_microbatch()
            for x, counter in zip(inputs, (first, later)):
                with counter:
                    out = block(x, attention_mask=None)
                    out.backward(seed)
            with opt:
                optimizer.step()
            with end:
                FP8GlobalStateManager.harvest_nonfinite()
        host = frozenset(s["step"].untyped_storage().data_ptr() for s in optimizer.state.values())
    return StepLaunches(zero, first, later, opt, end, whole)


def layer_split(fp8: Optional[tuple[str, str]], moe: bool) -> tuple[LayerSplit, dict[int, StepLaunches]]:
    """The per-layer / constant split of a training step, from blocks of 1 and 2 layers (needs `npu_simulated`
    and `megatron_world`)."""
    measured = {layers: step_launches(fp8, layers, moe) for layers in (1, 2)}
    later = {n: m.later.total for n, m in measured.items()}
    per_step = {n: m.per_step for n, m in measured.items()}
    micro_batch, step = later[2] - later[1], per_step[2] - per_step[1]
    constant = MICRO_BATCHES * (later[1] - micro_batch) + per_step[1] - step
    optimizer = measured[2].optimizer.total - measured[1].optimizer.total
    return LayerSplit(micro_batch, step, constant, {n: m.whole.total for n, m in measured.items()}, optimizer), measured


# ------------------------------------------------------------------------------------------------------- floor
#
# The jobs one layer's training step must do, each at one launch where a kernel does it in one (otherwise at the
# fewest launches the kernels that exist allow, said in the reason). Constants (the autocast regions' update, the
# non-finite fold and check) are not in it: they do not grow with the layers.

MB, STEP = "micro-batch", "step"


@dataclasses.dataclass(frozen=True)
class Job:
    name: str
    per: str  # MB or STEP
    count: int  # how many in one layer
    launches: int  # launches each
    reason: str

    @property
    def total(self) -> int:
        return self.count * self.launches


# (name, per, count in a dense layer, count in a MoE layer, launches each, reason): the bf16 step's jobs. The dense
# layer: LayerNorm, QKV / proj / fc1 / fc2 with biases, GeLU; the MoE layer: no linear biases, 4 experts (fc1,
# fc2) behind a top-2 router; Megatron's unfused paths otherwise (no bias-dropout-add or bias-GeLU kernels).
COMMON_JOBS: list[tuple[str, str, int, int, int, str]] = [
    ("LayerNorm forward", MB, 2, 2, 1, "native_layer_norm (aclnnLayerNorm): input_layernorm and pre_mlp_layernorm"),
    ("LayerNorm backward", MB, 2, 2, 1, "native_layer_norm_backward: dx, dgamma and dbeta in one launch"),
    ("q, k, v made dense", MB, 3, 3, 1, "npu_fusion_attention's SBH layout takes each dense; they are strided "
                                        "views of the QKV GEMM's output, interleaved per query group"),
    ("attention forward", MB, 1, 1, 1, "npu_fusion_attention, causal on its fixed 2048x2048 compressed mask"),
    ("attention backward", MB, 1, 1, 1, "npu_fusion_attention_grad"),
    ("dq, dk, dv joined", MB, 1, 1, 1, "the grad kernel returns them apart; the QKV GEMMs take one gradient"),
    ("linear GEMMs (fprop, dgrad, wgrad)", MB, 12, 6, 1, "aclnnMm / npu_quant_matmul per GEMM, a bias in the "
                                                         "fprop's epilogue (aclnnAddmm; the quant GEMM's bias)"),
    ("bias gradients", MB, 4, 0, 1, "a column sum of dy each: no GEMM kernel returns it beside the wgrad"),
    ("residual adds", MB, 2, 2, 1, "aclnnAdd (the biases are in the GEMMs' epilogues)"),
    ("residual gradient sums", MB, 2, 2, 1, "aclnnAdd: the branch's and the skip's gradients"),
    ("GeLU forward", MB, 1, 1, 1, "aclnnGelu"),
    ("GeLU backward", MB, 1, 1, 1, "aclnnGeluBackward"),
    ("gradient accumulation", MB, 12, 15, 1, "each parameter's gradient added into its .grad (aclnnInplaceAdd): the "
                                             "bench runs without Megatron's wgrad-accumulation fusion, bf16 and FP8"),
    ("router GEMMs (fprop, dgrad, wgrad)", MB, 0, 3, 1, "aclnnMm, float32 logits"),
    ("router top-k and softmax", MB, 0, 2, 1, "aclnnTopk, aclnnSoftmax over the top-k logits"),
    ("router softmax in float32", MB, 0, 4, 1, "the top-k logits cast to float32 and the probs back to bfloat16, "
                                               "forward and backward (TE's router and Megatron's compute the scores "
                                               "in float32): op-plugin's softmax(dtype=) and _softmax(half_to_float) "
                                               "cast the input first (_npu_dtype_cast), and its softmax backward "
                                               "writes the output's float32"),
    ("routing probs and map", MB, 0, 2, 1, "one scatter each into [tokens, experts]"),
    ("router backward", MB, 0, 2, 1, "the softmax backward, the top-k's scatter (the probs' gradient comes back "
                                     "from the permuted rows for the router's top-k probs as they are)"),
    ("tokens per expert", MB, 0, 1, 1, "a column sum of the routing map"),
    ("permute forward", MB, 0, 2, 1, "npu_moe_token_permute; the router's top-k probs placed at the permuted rows"),
    ("permute backward", MB, 0, 2, 1, "npu_moe_token_permute_grad_v2; the probs' gradient gathered back from the "
                                      "permuted rows"),
    ("unpermute forward and backward", MB, 0, 2, 1, "npu_moe_token_unpermute, npu_moe_token_unpermute_grad_v2"),
    ("expert GEMMs (fprop, dgrad, wgrad)", MB, 0, 6, 1, "npu_grouped_matmul: all experts in one call per GEMM kind "
                                                        "(fc1, fc2)"),
    ("probs multiply", MB, 0, 4, 1, "the experts' activations times their probs; backward: the activations' "
                                    "gradient (a mul) and the probs' (a mul and a row sum: no kernel sums a row's "
                                    "products rounded to bfloat16, as autograd's mul backward does)"),
    ("router and permute input gradients summed", MB, 0, 1, 1, "aclnnAdd"),
    ("AdamW", STEP, 12, 15, 1, "one launch per parameter: npu_apply_adam_w updates a tensor in one kernel; no "
                               "kernel updates several (torch_npu's _fused_adamw_ loops aclnnApplyAdamWV2 over "
                               "them; torch's foreach AdamW adds to its 7 fused multi-tensor ops one addcdiv per "
                               "tensor, which no torch_npu kernel takes with per-tensor step sizes)"),
]

# The tensors a layer quantizes, per role (dense, MoE): A activations (fprop input: rowwise, and columnwise for the
# wgrad), A_saved (linear_proj's input: Megatron's set_save_original_input under FP8 keeps the attention output
# alone, so the rowwise form is made in forward and the columnwise one in backward), G gradients (rowwise for the
# dgrad, columnwise for the wgrad), W weights (per step: rowwise for the fprop, columnwise for the dgrad); XA /
# XG / XW the experts' (all experts of one GEMM kind together).
ROLES = {"dense": dict(A=3, A_saved=1, G=4, W=4, XA=0, XG=0, XW=0),
         "moe": dict(A=1, A_saved=1, G=2, W=2, XA=2, XG=2, XW=2)}


# A grouped linear's experts' per-tensor quantizes: one scale per expert over row blocks of one tensor. No kernel
# takes a divisor per group (npu_quantize: "size需要为1或和输入x中axis轴的size相等"; npu_group_quant and
# aclnnGroupedQuantMax multiply by the scale, which rounds the format's ties otherwise than the recipe's divide),
# nor makes a per-tensor scale per group (npu_dynamic_quant: "当quantMode取"pertensor"或"perchannel"时，
# groupIndexOptional必须是nullptr"); the grouped GEMM takes x as one tensor ("单单单") with its scales one per group.
EXPERT_DELAYED = ("their amaxes (one multi-tensor norm, a list of 0-d tensors), stacked (1), max-ed into the "
                  "history slots (1); the prepared divisors expanded to one per row (1); one npu_quantize (1)")
EXPERT_CURRENT = (f"the fewer of: one npu_dynamic_quant per expert ({EXPERTS}), their codes and scales joined (2); or "
                  "one multi-tensor amax, a stack, the scales from it (amax / max, 1 where the amax is 0, at least "
                  "1/FLT_MAX: 3), the divisors expanded to one per row, one npu_quantize (7)")


def _quantize_jobs(recipe: str, kind: str) -> list[Job]:
    """The quantize jobs (and the GEMM changes) of `recipe` in one layer (the same kernels on the 950PR and
    950DT)."""
    n = ROLES[kind]
    family = recipe.split()[0]
    jobs: list[tuple[str, str, int, int, str]] = []  # (name, per, count, launches, reason)
    if family == "delayed":
        why = "its amax into the history (one norm) and npu_quantize by the prepared 1/scale: 2 (npu_quant_max " \
              "would cast and take the amax in one but rounds ties apart, and its amax needs one more op)"
        # (Megatron keeps linear_proj's input quantized under delayed scaling: no saved activation)
        jobs += [("activation quantizes", MB, n["A"] + n["A_saved"], 2, why + "; per-tensor codes serve the fprop "
                                                                              "and the transposed wgrad"),
                 ("gradient quantizes", MB, n["G"], 2, why),
                 ("weight quantizes", STEP, n["W"], 2, why),
                 ("expert activation / gradient quantizes", MB, n["XA"] + n["XG"], 5, EXPERT_DELAYED),
                 ("expert weight quantizes", STEP, n["XW"], 2, "the experts' weights (one buffer) quantized with their "
                  "inputs in one pass (their amaxes in the inputs' norm, stack and maximum): their divisors expanded "
                  "to one per row (1), one npu_quantize (1)"),
                 ("NaN marks", MB, n["A"] + n["A_saved"] + n["G"] + n["XA"] + n["XG"], 1,
                  "one per quantize pass (a GEMM's input and weight together): the decode scales + 0 * amax, so "
                  "that an Inf, which npu_quantize may saturate, still makes the GEMM's output non-finite; no "
                  "kernel returns the amax with the decode scale marked")]
    elif family == "tensorwise":
        why = "npu_dynamic_quant (per tensor: amax, scale and cast in one)"
        jobs += [("activation quantizes", MB, n["A"], 1, why + "; one code tensor serves the fprop and the wgrad"),
                 ("saved activation quantizes", MB, n["A_saved"], 2, why + " in forward and again in backward"),
                 ("gradient quantizes", MB, n["G"], 1, why),
                 ("weight quantizes", STEP, n["W"], 1, why),
                 ("expert activation / gradient quantizes", MB, n["XA"] + n["XG"], min(EXPERTS + 2, 7), EXPERT_CURRENT),
                 ("expert weight quantizes", STEP, n["XW"], min(EXPERTS + 2, 7), "the same over the experts' weights")]
    elif family == "blockwise":
        row = "npu_dynamic_mx_quant(scale_alg=1) in 128-blocks, its E8M0 bytes decoded to the float32 scales the " \
              "[1,128,128] GEMM takes"
        col = "npu_dynamic_mx_quant along the tokens as x lies, its bytes repeated per 32-block for the MX-mode " \
              "wgrad (no GEMM mode takes 1x128 x 1x128 otherwise)"
        jobs += [("activation quantizes", MB, n["A"] + n["A_saved"], 4, f"rowwise: {row} (2); columnwise: {col} (2)"
                                                                        "; no kernel makes both 1x128 layouts in one"),
                 ("gradient quantizes", MB, n["G"], 4, "as the activations"),
                 ("weight quantizes", STEP, n["W"], 5, "128x128 power-of-2 tiles, which no kernel makes: "
                                                       "npu_dynamic_mx_quant, a max over each tile's rows, decode, "
                                                       "divide, cast"),
                 ("expert activation / gradient quantizes", MB, n["XA"] + n["XG"], 2 + EXPERTS + 3,
                  "the rowwise form of the joined rows (2); the columnwise one per expert along its tokens (1 each: "
                  "its 1x128 tiles start at the expert's first token, and no grouped quantize takes 128-blocks); "
                  "for the one K-split MX wgrad of all experts, their codes joined (1), their tile bytes joined "
                  "(1) and repeated per 32-block pair in the kernel's grouped layout by one gather (1; its row "
                  "index, from the tokens per expert, is a host-to-device copy, as the GEMMs' group lists are)"),
                 ("expert weight quantizes", STEP, n["XW"], 5, "the experts' weights: whole tiles of one buffer"),
                 ("QKV bias added", MB, 1 if kind == "dense" else 0, 1, "the [1,128,128] GEMM takes no bias")]
    elif family == "mxfp8":
        why = "npu_dynamic_mx_quant_with_dual_axis: both MX layouts in one launch (Ascend 950PR/950DT)"
        jobs += [("activation quantizes", MB, n["A"], 1, why),
                 ("saved activation quantizes", MB, n["A_saved"], 2, "npu_dynamic_mx_quant rowwise in forward, "
                                                                     "columnwise in backward"),
                 ("gradient quantizes", MB, n["G"], 1, why),
                 ("weight quantizes", STEP, n["W"], 1, why),
                 ("expert activation / gradient quantizes", MB, n["XA"] + n["XG"], 2,
                  "the rowwise form of the joined rows in one call, every expert's columnwise form in one "
                  "npu_grouped_dynamic_mx_quant (op-plugin 26.0.0 and later), laid out as the K-split wgrad reads "
                  "them; torch_npu 2.14 has no grouped MX quantize: one call per expert there"),
                 ("expert weight quantizes", STEP, n["XW"], 1, why + ", the experts' weights in one buffer")]
    if family in ("delayed", "tensorwise", "mxfp8") and kind == "dense":
        jobs.append(("QKV bias to float32", STEP, 1, 1, "the FP8 GEMMs take a float32 bias only; cast once per step "
                                                        "(kept for later micro-batches)"))
    return [Job(*job) for job in jobs if job[2] and job[3]]


def floor_jobs(recipe: str, kind: str) -> list[Job]:
    """The floor table of one layer: the bf16 jobs and, for an FP8 recipe, its quantize jobs."""
    jobs = [Job(name, per, dense if kind == "dense" else moe, launches, reason)
            for name, per, dense, moe, launches, reason in COMMON_JOBS if (dense if kind == "dense" else moe)]
    return jobs + (_quantize_jobs(recipe, kind) if RECIPES[recipe] is not None else [])


@dataclasses.dataclass(frozen=True)
class Floor:
    micro_batch: int
    step: int

    @property
    def per_layer(self) -> int:
        return MICRO_BATCHES * self.micro_batch + self.step


def floor(recipe: str, kind: str) -> Floor:
    jobs = floor_jobs(recipe, kind)
    return Floor(sum(j.total for j in jobs if j.per == MB), sum(j.total for j in jobs if j.per == STEP))


# Where the measured counts exceed the floor, per (kind, recipe family): what launches the extra and why.
BLOCKWISE_FOLD = "the non-finite fold concatenates the block scales once per step, a step constant that a 1-layer " \
                 "block skips: +1"
GAPS = {
    ("dense", "all"): "Megatron adds the proj, fc1 and fc2 biases outside their GEMMs (skip_bias_add, for its "
                      "bias-dropout-add and bias-GeLU fusions, which have no kernel here): +3 per micro-batch",
    ("dense", "fp8"): "fc2 keeps no codes of its input but rebuilds it in backward from the GeLU's (ops/rebuild.py, "
                      "for activation memory): the GeLU again and the input's columnwise quantize there, +2 per "
                      "micro-batch (tensorwise, MXFP8; blockwise quantized it there anyway)",
    ("dense", "delayed"): "the rebuilt input's quantize under delayed scaling repeats the forward's: its stored "
                          "scale_inv cast to the input's bfloat16 for npu_quantize, +1 more per micro-batch",
    ("dense", "blockwise"): BLOCKWISE_FOLD,
    ("moe", "blockwise"): BLOCKWISE_FOLD,
    ("moe", "mxfp8"): "where torch_npu has no npu_grouped_dynamic_mx_quant (2.14), Megatron pads each expert's "
                      "tokens to 64 rows (Fp8Padding / Fp8Unpadding: one concatenation each way, 6 per micro-batch), "
                      "so that one quantize call makes every expert's MX forms at whole 64-row pairs; none with it",
}


def gaps(kind: str, recipe: str) -> str:
    family = recipe.split()[0]
    keys = ((kind, "all"), (kind, "fp8" if RECIPES[recipe] is not None else "bf16"), (kind, family))
    return "; ".join(GAPS[key] for key in dict.fromkeys(keys) if key in GAPS)


def _label(chip: str) -> str:
    return chip.removeprefix("Ascend")


def bench_layer_launches(kinds: tuple[str, ...] = KINDS, chips: tuple[str, ...] = CHIPS,
                         recipes: Optional[tuple[str, ...]] = None) -> list[tuple[str, float, str]]:
    """Per kind, chip and recipe: measured / floor launches of one GPT layer's training step (a row), and for an
    FP8 recipe the launches it adds to bf16 per layer (a row). bf16 is measured whether asked for or not."""
    from mindspeed_te.bench.launches import npu_simulated

    names = recipes or tuple(RECIPES)
    rows = []
    with megatron_world(cpu_adaptor=True):
        for kind in kinds:
            for chip, release in [(chip, None) for chip in chips] + [(chips[0], NEWER_RELEASE)]:
                splits = {}
                for name in ("bf16", *[n for n in names if n != "bf16"]):
                    with npu_simulated(chip, release):
                        splits[name] = layer_split(RECIPES[name], kind == "moe")[0]
                label = _label(chip) + (f", torch_npu {release}" if release else "")
                rows += _rows(kind, label, names, splits)
    return rows


def _rows(kind: str, label: str, names: tuple[str, ...], splits: dict[str, LayerSplit]
          ) -> list[tuple[str, float, str]]:
    rows = []
    base, base_floor = splits["bf16"], floor("bf16", kind)
    for name in names:
        split, fl = splits[name], floor(name, kind)
        adamw = sum(j.total for j in floor_jobs(name, kind) if j.name == "AdamW")
        bare = (split.per_layer - split.optimizer) / (fl.per_layer - adamw)
        gap = gaps(kind, name)
        rows.append((f"NPU launches per GPT layer, {kind}, {name}, {label}", split.per_layer / fl.per_layer,
                     f"micro-batch {split.micro_batch} / step {split.step} / constant {split.constant}; per layer "
                     f"{split.per_layer} (AdamW {split.optimizer}), floor {fl.per_layer} ({fl.micro_batch} / "
                     f"{fl.step}, AdamW {adamw}); without AdamW {bare:.2f}" + (f"; {gap}" if gap else "")))
        if name == "bf16":
            continue
        detail = (f"{split.per_layer} vs {base.per_layer} (micro-batch {split.micro_batch - base.micro_batch:+d} x "
                  f"{MICRO_BATCHES}, step {split.step - base.step:+d}); floor "
                  f"{fl.per_layer - base_floor.per_layer:+d}: each activation and gradient quantize is a launch of "
                  "its own")
        rows.append((f"NPU launches per GPT layer FP8 - bf16, {kind}, {name}, {label}",
                     float(split.per_layer - base.per_layer), detail))
    return rows
