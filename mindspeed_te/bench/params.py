"""Bench group "params": what keeping weights in FP8 (fp8_model_init, Megatron's --fp8-param-gather) saves.

- Parameter all-gather bytes: two gloo processes emulate Megatron's distributed optimizer step on the
  weights of GPT transformer layers (fp32 main shards, codes/values gathered through one flat buffer), with
  FP8 weights (our fp8_utils hooks: amax MAX-reduce, shard quantization, uint8 all-gather) and with bf16
  weights. Every collective's payload is counted where it is called.
- Parameter bytes of a GPT's transformer layers, and of the whole model with its bf16 embedding, built with
  and without fp8_model_init.
"""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mindspeed_te.megatron.fp8_params import modify_underlying_storage, quantize_param_shard
from mindspeed_te.modules import LayerNormLinear, Linear
from mindspeed_te.quantized_tensor import QuantizedTensor
from mindspeed_te.recipe import Float8CurrentScaling
from mindspeed_te.state import fp8_model_init

__all__ = ["bench_params"]


def gpt_layers(hidden: int, layers: int, fp8: bool) -> torch.nn.ModuleList:
    """The linear layers of `layers` GPT transformer layers (QKV with its norm, projection, MLP), bf16."""
    with fp8_model_init(enabled=fp8, recipe=Float8CurrentScaling()):
        return torch.nn.ModuleList(torch.nn.ModuleList([
            LayerNormLinear(hidden, 3 * hidden, params_dtype=torch.bfloat16),
            Linear(hidden, hidden, params_dtype=torch.bfloat16),
            LayerNormLinear(hidden, 4 * hidden, params_dtype=torch.bfloat16),
            Linear(4 * hidden, hidden, params_dtype=torch.bfloat16)]) for _ in range(layers))


def parameter_bytes(module: torch.nn.Module) -> int:
    return sum(p._storage.nbytes() if isinstance(p, QuantizedTensor) else p.numel() * p.element_size()
               for p in module.parameters())


class _CollectiveBytes:
    """Counts the bytes each rank puts into all-gathers and all-reduces while active."""

    def __init__(self) -> None:
        self.bytes = 0
        self._originals = {}

    def __enter__(self) -> _CollectiveBytes:
        for name in ("all_gather_into_tensor", "all_reduce"):
            original = getattr(dist, name)
            self._originals[name] = original

            def counted(*args, _original=original, _name=name, **kwargs):
                payload = args[1] if _name == "all_gather_into_tensor" else args[0]
                self.bytes += payload.numel() * payload.element_size()
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)


def _param_gather_step(params: list[torch.nn.Parameter], rank: int, world: int) -> int:
    """Bytes moved by one optimizer step's parameter update + all-gather for `params` (one flat buffer per
    dtype, each rank owning a contiguous 1/world of it, as Megatron's distributed optimizer does)."""
    fp8 = [p for p in params if isinstance(p, QuantizedTensor)]
    high = [p for p in params if not isinstance(p, QuantizedTensor)]
    counter = _CollectiveBytes()
    for group, dtype in ((fp8, torch.uint8), (high, torch.bfloat16)):
        if not group:
            continue
        total = sum(p.numel() for p in group)
        total += -total % world
        buffer = torch.zeros(total, dtype=dtype)
        offset, starts = 0, []
        for p in group:
            view = buffer[offset:offset + p.numel()].view(p.shape)
            if dtype is torch.uint8:
                modify_underlying_storage(p, view)
            starts.append(offset)
            offset += p.numel()
        shard = total // world
        lo, hi = rank * shard, (rank + 1) * shard
        mains, offsets = [], []
        for p, start in zip(group, starts):  # this rank's part of each parameter, as fp32 main values
            a, b = max(lo, start), min(hi, start + p.numel())
            mains.append(torch.randn(b - a) * 0.02 if b > a else None)
            offsets.append(a - start if b > a else None)
        with counter:
            if dtype is torch.uint8:
                quantize_param_shard(group, mains, offsets, None)
            else:
                for main, start, off in zip(mains, starts, offsets):
                    if main is not None:
                        buffer[start + off:start + off + main.numel()] = main.to(dtype)
            dist.all_gather_into_tensor(buffer, buffer[lo:hi].clone())
    return counter.bytes


def _gather_worker(rank: int, world: int, init_file: str, out: str, hidden: int, layers: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = {}
        for fp8 in (False, True):
            model = gpt_layers(hidden, layers, fp8)
            weights = [m.weight for m in model.modules() if isinstance(m, Linear)]
            result[fp8] = _param_gather_step(weights, rank, world)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def bench_params(hidden: int = 256, layers: int = 2, vocab: int = 50304) -> list[tuple[str, float, str]]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_gather_worker, args=(2, os.path.join(tmp, "init"), tmp, hidden, layers), nprocs=2, join=True)
        moved = torch.load(os.path.join(tmp, "rank0.pt"))
    rows = [("param all-gather bytes, fp8 / bf16 weights", moved[True] / moved[False],
             f"DP=2 gloo, {layers} GPT layers hidden {hidden}, {moved[True]} / {moved[False]} bytes per rank")]
    hidden, layers = 768, 12  # GPT-2 small proportions for the memory rows
    bf16, fp8 = (parameter_bytes(gpt_layers(hidden, layers, f)) for f in (False, True))
    rows.append(("param bytes, GPT layers, fp8_model_init / bf16", fp8 / bf16, f"{layers} layers hidden {hidden}"))
    embedding = (vocab + 1024) * hidden * 2  # word + position embeddings stay bf16
    rows.append(("param bytes, whole GPT incl. bf16 embeddings", (fp8 + embedding) / (bf16 + embedding),
                 f"vocab {vocab}"))
    return rows
