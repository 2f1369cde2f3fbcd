"""Benchmarks, reported as ratios against a baseline measured in the same run.

    python -m mindspeed_te.bench [--size-mib 64] [--repeats 5] [--only quantize]

Groups: linear (mindspeed_te.bench.linear, host), npu (launches, layer), params, memory, gpt, quantize and hif8
(quantize).
"""
from __future__ import annotations

import argparse

import torch

from mindspeed_te import fused_cast
from mindspeed_te.bench.launches import bench_fp4_launches, bench_npu_launches
from mindspeed_te.bench.linear import bench_linear
from mindspeed_te.bench.quantize import bench_hif8, bench_quantize
from mindspeed_te.bench.report import report


def _megatron_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mindspeed_te.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=64, help="tensor size for the quantize cases")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=["quantize", "hif8", "linear", "npu", "params", "gpt", "memory"],
                        help="run one group of cases")
    args = parser.parse_args(argv)
    if args.size_mib < 1 or args.repeats < 1:
        parser.error("--size-mib and --repeats must be >= 1")
    kernels = fused_cast.simd_level() if fused_cast.available() else "off"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fused kernels: {kernels}")
    rows: list[tuple[str, float, str]] = []
    if args.only in (None, "linear"):
        rows += bench_linear(args.repeats)
        from mindspeed_te.bench.host import bench_host_noop

        rows += bench_host_noop(args.repeats)
    if args.only in (None, "npu"):
        rows += bench_npu_launches()
        rows += bench_fp4_launches()
        if _megatron_available():
            from mindspeed_te.bench.layer import bench_layer_launches

            rows += bench_layer_launches()
    if args.only in (None, "params"):
        from mindspeed_te.bench.params import bench_params

        rows += bench_params()
    if args.only in (None, "memory"):
        from mindspeed_te.bench.memory import bench_activations, bench_memory

        rows += bench_memory()
        if _megatron_available():
            rows += bench_activations()
    if args.only in (None, "gpt"):
        from mindspeed_te.bench.gpt import RECIPES, bench_gpt

        missing = [(f"GPT step {label} / bf16", float("nan"), "megatron-core not installed")
                   for label in RECIPES if label != "bf16"]
        rows += bench_gpt(args.repeats) if _megatron_available() else missing
    # Last: they allocate tensors of --size-mib, and the quantize group raises glibc's trim threshold for the
    # rest of the process, which would change what the groups above measure.
    if args.only in (None, "quantize"):
        rows += bench_quantize(args.size_mib, args.repeats)
    if args.only in (None, "hif8"):
        rows += bench_hif8(args.size_mib, args.repeats)
    print(report(rows))


main()
