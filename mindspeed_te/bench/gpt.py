"""Bench group "gpt": the CPU emulation's cost in a Megatron training step.

A megatron-core GPTModel built from Megatron's TransformerEngine layer spec (patched by this plugin to our
modules), 4 layers, hidden 256, sequence 256, micro-batch 2, bf16 (Megatron's Float16Module), in a
one-process gloo world. One step is forward + backward + optimizer step; each FP8 recipe's best step time
is reported as a ratio to the same step without FP8, the recipes timed in turn in the same run.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import time
import warnings
from typing import Callable, Iterator, Optional

import torch

from mindspeed_te.state import FP8GlobalStateManager

__all__ = ["bench_gpt", "gpt_step"]


# label -> (Megatron's --fp8 format, --fp8-recipe); None: the bf16 baseline


RECIPES: dict[str, Optional[tuple[str, str]]] = {
    "bf16": None,
    "delayed HiF8": ("hif8", "delayed"),
    "delayed E4M3": ("e4m3", "delayed"),
    "delayed HYBRID": ("hybrid", "delayed"),
    "tensorwise E4M3": ("e4m3", "tensorwise"),
    "blockwise E4M3": ("e4m3", "blockwise"),
    "mxfp8 E4M3": ("e4m3", "mxfp8"),
}


def gpt_step(fp8: Optional[tuple[str, str]], layers: int = 4, hidden: int = 256, seq: int = 256,
             batch: int = 2, vocab: int = 1024, device: str = "cpu") -> Callable[[], float]:
    """A closure running one training step of a fresh GPTModel (same seed for every recipe) on `device`;
    returns the loss. Needs the Megatron TE patches applied and model parallelism initialized."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    # ("e2m1", recipe): Megatron's --fp4-format / --fp4-recipe (megatron-core 0.15 on)
    fp8_args = ({} if fp8 is None else dict(fp4=fp8[0], fp4_recipe=fp8[1]) if fp8[0] == "e2m1"
                else dict(fp8=fp8[0], fp8_recipe=fp8[1]))
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=hidden // 64, use_cpu_initialization=True,
        params_dtype=torch.bfloat16, bf16=True, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, **fp8_args)
    torch.manual_seed(0)
    model = Float16Module(config, GPTModel(config, get_gpt_layer_with_transformer_engine_spec(), vocab_size=vocab,
                                           max_sequence_length=seq)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    positions = torch.arange(seq, device=device).expand(batch, -1)
    mask = torch.ones(batch, 1, seq, seq, dtype=torch.bool, device=device).tril().logical_not()

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        # As Megatron's schedule does at a step's first micro-batch: the FP8 modules quantize their (updated)
        # weights again; without it they would keep the first step's quantized weights.
        model.set_is_first_microbatch()
        loss = model(tokens, positions, mask, labels=tokens).float().mean()
        loss.backward()
        optimizer.step()
        value = loss.item()
        FP8GlobalStateManager.harvest_nonfinite()  # the step's NaN/Inf report: the host has just waited
        return value

    return step


def _interleaved_best(steps: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best wall time of each step over `repeats` rounds that run every step once in turn, so that a load
    change on a shared machine hits all of them alike."""
    for step in steps.values():  # warm-up: FP8 metadata and delayed scales, oneDNN kernels for new shapes
        step()
        step()
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(repeats):
        for label, step in steps.items():
            start = time.perf_counter()
            step()
            best[label] = min(best[label], time.perf_counter() - start)
    return best


@contextlib.contextmanager
def megatron_world(cpu_adaptor: bool = False) -> Iterator[None]:
    """Megatron's TE patches (and with `cpu_adaptor` the CPU device adaptor) applied, model parallelism
    initialized in a one-process gloo world (started here unless one is), all undone on the way out."""
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mindspeed_te.patches.device_cpu import register_device_cpu
    from mindspeed_te.patches.megatron_te import register_megatron_te
    from mindspeed_te.patches.registry import PatchRegistry

    registry = PatchRegistry()
    register_megatron_te(registry)
    if cpu_adaptor:
        register_device_cpu(registry)
    registry.apply()
    started = not dist.is_initialized()
    if started:
        init = f"file://{os.path.join(tempfile.mkdtemp(), 'init')}"
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if started:
            dist.destroy_process_group()
        registry.revert()
        FP8GlobalStateManager.reset()


def bench_gpt(repeats: int = 5) -> list[tuple[str, float, str]]:
    """Per recipe: best FP8 step time / best bf16 step time, over 6 * `repeats` rounds: a step takes tens of
    milliseconds, and on a shared machine the best of 5 rounds moved the ratios by +-0.05 between runs, the best
    of 15 by +-0.02 on a quiet day and +-0.05 on a busy one, the best of 30 by +-0.04 on that busy day."""
    with megatron_world():
        FP8GlobalStateManager.reset()
        times = _interleaved_best({label: gpt_step(fp8) for label, fp8 in RECIPES.items()}, 6 * repeats)
    base = times.pop("bf16")
    return [(f"GPT step {label} / bf16", t / base,
             f"{t * 1e3:.0f} ms vs {base * 1e3:.0f} ms (4 layers, hidden 256, seq 256, batch 2)")
            for label, t in times.items()]
