"""Test helper: `python -m mindspeed_te.launch` with one fault injected, for tests/test_launch_megatron.py.
MINDSPEED_TE_TEST_FAULT="rank,iteration" puts a NaN into the output of the first TELayerNormColumnParallelLinear
on that rank at that (0-based) iteration, in its first attempt only."""
from __future__ import annotations

import os
import sys

import torch

from mindspeed_te import launch


def _install_fault(rank: int, iteration: int) -> None:
    done: list[bool] = []

    def poison(module: torch.nn.Module, inputs: tuple, output: object) -> object:
        from megatron.training import get_args

        from mindspeed_te.megatron import TELayerNormColumnParallelLinear

        if done or not module.training or not isinstance(module, TELayerNormColumnParallelLinear) \
                or torch.distributed.get_rank() != rank or get_args().curr_iteration != iteration:
            return output
        done.append(True)
        out, *rest = output
        out = out.clone()
        out.view(-1)[0] = float("nan")
        return (out, *rest)

    torch.nn.modules.module.register_module_forward_hook(poison)


if __name__ == "__main__":
    _install_fault(*map(int, os.environ["MINDSPEED_TE_TEST_FAULT"].split(",")))
    launch.main(sys.argv[1:])
