"""`WeightGradStore`: delayed weight-gradient GEMMs (TransformerEngine's `delay_wgrad_compute`).

Megatron's 1F1B schedule with expert-parallel overlap splits a layer's backward in two: the backward pass
computes only the input gradients (what the previous layer waits for), and `module.backward_dw()` runs the
weight-gradient GEMMs later, overlapped with communication. With the store enabled, the linear autograd
functions put each wgrad computation here (its operands and a function of them) instead of running it; the
module's `backward_dw` pops and runs them, in the order the backward produced them.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Optional

import torch

__all__ = ["WeightGradStore", "WgradResult"]

# What a delayed wgrad computation returns: each parameter with its gradient (None: already accumulated
# into the parameter's main_grad).
WgradResult = list[tuple[torch.nn.Parameter, Optional[torch.Tensor]]]


class WeightGradStore:
    """FIFO of delayed wgrad computations of one module. Disabled, nothing is ever put."""

    def __init__(self, delay_wgrad_compute: bool = False) -> None:
        self.enabled = bool(delay_wgrad_compute)
        self._queue: deque[tuple[Callable[..., WgradResult], tuple]] = deque()

    def delay_wgrad_compute(self) -> bool:
        return self.enabled

    def put(self, operands: tuple, compute: Callable[..., WgradResult]) -> None:
        if not self.enabled:
            raise RuntimeError("WeightGradStore.put: delay_wgrad_compute is not enabled on this module")
        self._queue.append((compute, operands))

    def pop(self) -> WgradResult:
        """Run the oldest delayed computation and return its gradients."""
        if not self._queue:
            raise RuntimeError("backward_dw() found no delayed weight gradient: call it once after each backward "
                               "of a module built with delay_wgrad_compute=True")
        compute, operands = self._queue.popleft()
        return compute(*operands)

    def __len__(self) -> int:
        return len(self._queue)
