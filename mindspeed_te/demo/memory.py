"""The demo's memory table: what training keeps, measured from the tensors that exist (the bench's memory group:
bytes per parameter of each optimizer setup, and the activation bytes a GPT layer keeps per micro-batch)."""
from __future__ import annotations

import csv

from mindspeed_te.bench.memory import ACTIVATION_CASES, COMBINATIONS, activation_bytes, bytes_per_parameter

__all__ = ["memory_rows", "write_memory"]


def memory_rows() -> list[tuple[str, str]]:
    """(what, figure) rows; needs Megatron's model parallelism initialized (the demo's set-up)."""
    rows = [(f"bytes per parameter, {combo.label}", f"{bytes_per_parameter(combo)['total']:.2f}")
            for combo in COMBINATIONS]
    held = {label: activation_bytes(fp8, offload, fp8_attention=attention)
            for label, fp8, offload, attention in ACTIVATION_CASES}
    base = held["bf16"]
    rows += [(f"activation MiB per GPT layer, {label}", f"{n / 2**20:.2f} ({n / base:.2f}x bf16)")
             for label, n in held.items()]
    return rows


def write_memory(rows: list[tuple[str, str]], path: str) -> None:
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([("what", "figure"), *rows])
