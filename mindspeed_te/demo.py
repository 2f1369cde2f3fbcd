"""Demo: train the same small model in fp32 and in FP8/HiF8 with every recipe, and compare the losses.

    python -m mindspeed_te.demo [--steps 150]

A plain torch MLP is converted in one line (`convert_linears`) and trained inside `fp8_autocast`; the
FP8 runs should track the fp32 run closely.
"""
from __future__ import annotations

import argparse
import time

import torch

from mindspeed_te import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    FP8GlobalStateManager,
    MXFP8BlockScaling,
    fp8_autocast,
)
from mindspeed_te.modules import convert_linears

CASES = [
    ("fp32 baseline", None),
    ("delayed / hybrid", DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16)),
    ("delayed / hif8", DelayedScaling(fp8_format=Format.HIF8, amax_history_len=16)),
    ("tensorwise / e4m3", Float8CurrentScaling(fp8_format=Format.E4M3)),
    ("tensorwise / hif8", Float8CurrentScaling(fp8_format=Format.HIF8)),
    ("blockwise / e4m3", Float8BlockScaling()),
    ("mxfp8 / e4m3", MXFP8BlockScaling()),
]


def make_model(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width),
        torch.nn.GELU(), torch.nn.Linear(width, width),
    )


def train(recipe, steps: int, width: int, batch: int) -> list[float]:
    """Fit a fixed random teacher network; returns the loss of every step."""
    FP8GlobalStateManager.reset()
    torch.manual_seed(0)
    teacher = make_model(width)
    torch.manual_seed(1)
    model = convert_linears(make_model(width))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(steps):
        x = torch.randn(batch, width, generator=gen)
        with torch.no_grad():
            target = teacher(x)
        with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mindspeed_te.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--width", type=int, default=128, help="model width (a multiple of 32 for mxfp8)")
    parser.add_argument("--batch", type=int, default=128, help="batch size (a multiple of 32 for mxfp8)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.width % 32 or args.batch % 32:
        parser.error("--steps must be >= 1; --width and --batch must be multiples of 32")
    print(f"Training a {args.width}-wide MLP for {args.steps} steps on CPU, fp32 vs FP8/HiF8 recipes\n")
    print(f"{'recipe / format':22s} {'first loss':>11s} {'final loss':>11s} {'vs fp32':>8s} {'time':>7s}")
    baseline = None
    for name, recipe in CASES:
        start = time.perf_counter()
        losses = train(recipe, args.steps, args.width, args.batch)
        final = sum(losses[-10:]) / len(losses[-10:])
        baseline = baseline or final
        print(f"{name:22s} {losses[0]:11.5f} {final:11.5f} {final / baseline:7.3f}x "
              f"{time.perf_counter() - start:6.1f}s")


if __name__ == "__main__":
    main()
