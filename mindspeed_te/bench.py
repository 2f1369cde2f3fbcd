"""Benchmarks, reported as ratios against a baseline measured in the same run.

    python -m mindspeed_te.bench [--size-mib 64] [--repeats 5] [--only quantize]

Quantize throughput: the time of `Tensor.copy_` on the same tensor divided by the time of the quantize,
so 1.0x means "as fast as a memory copy" and higher is better.
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from mindspeed_te.formats import hif8_encode
from mindspeed_te.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling
from mindspeed_te.recipe_state import RecipeState

TARGETS = {
    "quantize current E4M3": 0.5,  # ratio to copy_, higher is better
    "hif8_encode vs en_dtypes": 10.0,  # speed-up, higher is better
}


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of `repeats` calls after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _quantizer(recipe, role: str = "input"):
    """The forward quantizer of a recipe for one tensor role (input or weight)."""
    state = RecipeState.create(recipe, forward=True, num_quantizers=3)
    quantizer = state.make_quantizers()[0 if role == "input" else 1]
    quantizer.set_usage(rowwise=True, columnwise=False)
    return quantizer


def quantize_cases() -> dict[str, Callable]:
    return {
        "quantize delayed E4M3": _quantizer(DelayedScaling(fp8_format=Format.E4M3)),
        "quantize delayed HiF8": _quantizer(DelayedScaling(fp8_format=Format.HIF8)),
        "quantize current E4M3": _quantizer(Float8CurrentScaling(fp8_format=Format.E4M3)),
        "quantize current HiF8": _quantizer(Float8CurrentScaling(fp8_format=Format.HIF8)),
        "quantize blockwise 1x128 E4M3": _quantizer(Float8BlockScaling()),
        "quantize blockwise 128x128 E4M3": _quantizer(Float8BlockScaling(), role="weight"),
        "quantize mxfp8 E4M3": _quantizer(MXFP8BlockScaling()),
    }


def bench_quantize(size_mib: int, repeats: int) -> list[tuple[str, float, str]]:
    numel = size_mib * 2**20 // 4
    x = torch.randn(numel // 4096, 4096)
    dst = torch.empty_like(x)
    copy_t = best_time(lambda: dst.copy_(x), repeats)
    rows = [("copy_ baseline", 1.0, f"{copy_t * 1e3:.2f} ms")]
    for name, quantizer in quantize_cases().items():
        t = best_time(lambda: quantizer(x), repeats)
        rows.append((name, copy_t / t, f"{t * 1e3:.2f} ms"))
    return rows


def bench_hif8(size_mib: int, repeats: int) -> list[tuple[str, float, str]]:
    import numpy as np

    try:
        import en_dtypes
    except ImportError:
        return [("hif8_encode vs en_dtypes", float("nan"), "en_dtypes not installed")]
    numel = size_mib * 2**20 // 4
    x = torch.randn(numel)
    ours = best_time(lambda: hif8_encode(x, saturate=True), repeats)
    # en_dtypes is slow: time it on a sixteenth of the tensor and scale up.
    part = x[: numel // 16].numpy()
    theirs = best_time(lambda: np.clip(part, -32768, 32768).astype(en_dtypes.hifloat8), 1) * 16
    return [("hif8_encode vs en_dtypes", theirs / ours, f"ours {ours * 1e3:.1f} ms, en_dtypes {theirs * 1e3:.0f} ms")]


def report(rows: list[tuple[str, float, str]]) -> str:
    lines = [f"{'case':36s} {'ratio':>8s}  {'target':>8s}  detail"]
    for name, ratio, detail in rows:
        target = TARGETS.get(name)
        mark = "" if target is None else (f">={target:g}x " + ("ok" if ratio >= target else "MISS"))
        lines.append(f"{name:36s} {ratio:7.2f}x  {mark:>8s}  {detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mindspeed_te.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=64, help="tensor size for the quantize cases")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=["quantize", "hif8"], help="run one group of cases")
    args = parser.parse_args(argv)
    if args.size_mib < 1 or args.repeats < 1:
        parser.error("--size-mib and --repeats must be >= 1")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    rows: list[tuple[str, float, str]] = []
    if args.only in (None, "quantize"):
        rows += bench_quantize(args.size_mib, args.repeats)
    if args.only in (None, "hif8"):
        rows += bench_hif8(args.size_mib, args.repeats)
    print(report(rows))


if __name__ == "__main__":
    main()
