"""Run a function on N real gloo processes and collect what each rank returns."""
from __future__ import annotations

import multiprocessing.util
import os
import sys
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, init_file: str, out_dir: str, fn: Callable, args: tuple) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(1234)
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # Leave without interpreter finalization: there, gloo worker threads that still hold tensors can abort the
    # process (pytorch/pytorch#179291; the likeliest cause of one CI abort, "terminate called without an active
    # exception" with no Python exception). A failing rank raised above and is reported by mp.spawn as usual.
    # os._exit skips multiprocessing's exit finalizers too, so run them first: Megatron's checkpoint writer starts
    # a multiprocessing Manager whose server process would otherwise outlive the test (330 MB each, forever).
    multiprocessing.util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """Spawn `world_size` processes running fn(rank, world_size, *args) inside a gloo process group.
    `fn` must be a module-level function. Returns the per-rank results in rank order."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_entry, args=(world_size, init_file, tmp, fn, args), nprocs=world_size, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
