"""Tile helpers shared by the block quantizer and the blockwise GEMM."""
from __future__ import annotations

import torch

from mindspeed_te.testing.npu_sim.checks import ceil_div


def block_amax(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """max |x| over (rows x cols) tiles of the last two dims (edge tiles partial) -> (..., ceil(m/r), ceil(n/c))."""
    *batch, m, n = x.shape
    mp, np_ = ceil_div(m, rows) * rows, ceil_div(n, cols) * cols
    padded = torch.nn.functional.pad(x.abs(), (0, np_ - n, 0, mp - m))
    tiles = padded.reshape(*batch, mp // rows, rows, np_ // cols, cols)
    return tiles.amax(dim=(-3, -1))


def expand_blocks(s: torch.Tensor, rows: int, cols: int, m: int, n: int) -> torch.Tensor:
    """Per-tile values (..., ceil(m/r), ceil(n/c)) broadcast back to (..., m, n)."""
    return s.repeat_interleave(rows, dim=-2)[..., :m, :].repeat_interleave(cols, dim=-1)[..., :n]

