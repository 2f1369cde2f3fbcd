"""The numerics report: turn recording on every `interval` steps and write CSV, JSON and PNG heatmaps."""
from __future__ import annotations

import csv
import json
import math
import os
from typing import Optional

import torch

from mindspeed_te.debug import numerics
from mindspeed_te.debug.counters import counters
from mindspeed_te.state import FP8GlobalStateManager

__all__ = ["NumericsReport", "plot_heatmaps"]

HEATMAP_METRICS = (("saturated_pct", "% saturated"), ("flushed_pct", "% flushed to zero"), ("sqnr_db", "SQNR (dB)"))


class NumericsReport:
    """`begin_step(i)` before each training step records that step's operands when i % interval == 0;
    `write()` saves numerics.csv, numerics.json (rows and counters) and numerics_<metric>.png under `directory`."""

    def __init__(self, directory: str, interval: int = 1, counterfactuals: bool = True,
                 model: Optional[torch.nn.Module] = None) -> None:
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(f"--fp8-numerics-interval must be a positive integer, got {interval!r}")
        self.directory = directory
        self.interval = interval
        self.recorder = numerics.NumericsRecorder(counterfactuals)
        if model is not None:
            self.recorder.watch(model)

    def watch(self, model: torch.nn.Module) -> None:
        self.recorder.watch(model)

    def begin_step(self, iteration: int) -> None:
        self.recorder.step = iteration
        FP8GlobalStateManager.set_operand_observer(self.recorder.record if iteration % self.interval == 0 else None)

    def stop(self) -> None:
        FP8GlobalStateManager.set_operand_observer(None)

    @property
    def rows(self) -> list[dict]:
        return self.recorder.rows

    def write(self, plots: bool = True) -> list[str]:
        """Write the files; returns their paths."""
        os.makedirs(self.directory, exist_ok=True)
        paths = [os.path.join(self.directory, "numerics.csv"), os.path.join(self.directory, "numerics.json")]
        rows = self.rows
        with open(paths[0], "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["step"])
            writer.writeheader()
            writer.writerows(rows)
        with open(paths[1], "w") as f:
            json.dump({"rows": [{k: _json_number(v) for k, v in r.items()} for r in rows],
                       "counters": counters()}, f, indent=1)
        if plots and rows:
            paths += plot_heatmaps(rows, self.directory)
        return paths


def _json_number(v):
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v


def plot_heatmaps(rows: list[dict], directory: str, step: Optional[int] = None) -> list[str]:
    """One PNG per metric: layers down, (tensor, format) across, for the last recorded step (or `step`)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    step = max(r["step"] for r in rows) if step is None else step
    rows = [r for r in rows if r["step"] == step]
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    columns = list(dict.fromkeys((r["tensor"], "recipe" if r["format"].startswith("recipe") else r["format"])
                                 for r in rows))
    paths = []
    for metric, title in HEATMAP_METRICS:
        grid = torch.full((len(layers), len(columns)), float("nan"))
        for r in rows:
            col = (r["tensor"], "recipe" if r["format"].startswith("recipe") else r["format"])
            value = r[metric]
            grid[layers.index(r["layer"]), columns.index(col)] = min(value, 99.0) if metric == "sqnr_db" else value
        fig, ax = plt.subplots(figsize=(1.0 + 0.75 * len(columns), 1.2 + 0.3 * len(layers)))
        image = ax.imshow(grid.numpy(), aspect="auto", cmap="viridis")
        # "grad_output" is the widest label: break it so neighbouring columns stay readable
        labels = ["\n".join((*tensor.split("_"), fmt)) for tensor, fmt in columns]
        ax.set_xticks(range(len(columns)), labels, fontsize=7)
        ax.set_yticks(range(len(layers)), layers, fontsize=7)
        ax.set_title(f"{title}, step {step}", fontsize=9)
        fig.colorbar(image, ax=ax)
        fig.tight_layout()
        path = os.path.join(directory, f"numerics_{metric}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
