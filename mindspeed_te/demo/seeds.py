"""The run-to-run noise of the demo (`--seeds N`): each run's final validation loss over N seeds, each seed
giving other initial weights and other batches. A run that repeats another with one change (8-bit Adam
moments) is also compared with it seed by seed: the same seed gives both the same weights and batches."""
from __future__ import annotations

import csv
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from mindspeed_te.demo.train import RunResult


@dataclass
class Noise:
    run: str
    val_losses: list[float]  # the final validation loss, one per seed
    base: Optional[str] = None  # the run this one repeats with one change, where it ran too
    differences: Optional[list[float]] = None  # this run's val_losses minus the base's, seed by seed

    @property
    def mean(self) -> float:
        return statistics.fmean(self.val_losses)

    @property
    def std(self) -> float:
        """The sample standard deviation over the seeds: the run-to-run noise."""
        return statistics.stdev(self.val_losses)


def noise(results: dict[int, list[RunResult]], base_run: Callable[[str], str]) -> list[Noise]:
    """One Noise per run, from {seed: that seed's results, in the same run order}."""
    by_run: dict[str, list[float]] = {}
    for seed_results in results.values():
        for r in seed_results:
            by_run.setdefault(r.name, []).append(r.val_losses[-1][1])
    rows = []
    for name, losses in by_run.items():
        base = base_run(name)
        if base == name or base not in by_run:
            rows.append(Noise(name, losses))
        else:
            rows.append(Noise(name, losses, base, [x - y for x, y in zip(losses, by_run[base])]))
    return rows


def write_seeds_csv(results: dict[int, list[RunResult]], path: str) -> None:
    """seeds.csv: the final validation loss of every run and seed."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "seed", "val_loss"])
        writer.writerows([r.name, seed, r.val_losses[-1][1]] for seed, rs in results.items() for r in rs)


def format_noise(rows: list[Noise]) -> str:
    """The noise table: mean, standard deviation and range of each run's validation loss over the seeds and,
    for a run with a base, the mean and the largest magnitude of its seed-by-seed differences to it."""
    width = max(len(r.run) for r in rows)
    lines = [f"{'run':{width}s} {'seeds':>5s} {'val mean':>9s} {'val std':>8s} {'val min':>8s} {'val max':>8s}   "
             "- base: mean, max |.|"]
    for r in rows:
        line = (f"{r.run:{width}s} {len(r.val_losses):5d} {r.mean:9.4f} {r.std:8.4f} {min(r.val_losses):8.4f} "
                f"{max(r.val_losses):8.4f}")
        if r.differences is not None:
            line += (f"   {statistics.fmean(r.differences):+.4f}, {max(map(abs, r.differences)):.4f} "
                     f"(vs {r.base})")
        lines.append(line)
    return "\n".join(lines)
