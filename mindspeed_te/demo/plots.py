"""The demo's figures (matplotlib, Agg): loss curves side by side, and the numerics heatmaps in one picture."""
from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mindspeed_te.demo.train import RunResult


def _pyplot():
    """pyplot on the Agg backend: files only, no display needed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _running_mean(values: list[float], window: int = 10) -> list[float]:
    return [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def _styles(names: list[str], base_run: Callable[[str], str]) -> dict[str, dict]:
    """bf16 in thick black; every other run in a colour of its own, except that a run repeating another with
    one change (8-bit moments, or FP4 without its stabilisers) takes that run's colour, dashed, so the pair
    reads as one."""
    plt = _pyplot()
    colours = itertools.cycle(plt.get_cmap("tab10").colors)
    styles = {}
    for name in names:
        base = base_run(name)
        if name == "bf16":
            styles[name] = dict(color="black", linewidth=2.2, zorder=3)
        elif base != name and base in styles:
            styles[name] = dict(styles[base], linestyle="--", linewidth=1.6)
        else:
            styles[name] = dict(color=next(colours), linewidth=1.2)
    return styles


def plot_losses(results: list[RunResult], entropy: float, path: str, base_run: Callable[[str], str]) -> None:
    """Training loss, validation loss, and validation loss minus bf16's (where bf16 ran): the runs lie within a
    few hundredths of each other, which only the third panel's scale shows."""
    plt = _pyplot()

    baseline = dict(next((r.val_losses for r in results if r.name == "bf16"), []))
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.8))
    styles = _styles([r.name for r in results], base_run)
    for r in results:
        style = styles[r.name]
        left.plot(range(1, len(r.train_losses) + 1), _running_mean(r.train_losses), label=r.name, **style)
        middle.plot(*zip(*r.val_losses), marker="o", markersize=3, label=r.name, **style)
        if baseline:
            right.plot([step for step, _ in r.val_losses], [loss - baseline[step] for step, loss in r.val_losses],
                       marker="o", markersize=3, label=r.name, **style)
    for ax in (left, middle):
        ax.axhline(entropy, color="grey", linestyle="--", linewidth=1)
        ax.text(0.01, entropy, "unigram entropy", va="bottom", fontsize=8, color="grey",
                transform=ax.get_yaxis_transform())
        ax.set_ylabel("cross-entropy (nats per byte)")
    for ax, title in ((left, "training loss (mean of the last 10 steps)"), (middle, "validation loss (held-out files)"),
                      (right, "validation loss minus bf16's")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    right.set_ylabel("nats per byte")
    dashed = any(style.get("linestyle") == "--" for style in styles.values())
    (right if baseline else middle).legend(fontsize=8, title="dashed: with 8-bit Adam moments,\nor FP4 without "
                                           "its stabilisers" if dashed else None,
                                           title_fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.suptitle("GPT (megatron-core, TE layer spec via mindspeed_te) on the Python standard library's bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legend, right of the last panel, included
    plt.close(fig)


def combine_heatmaps(paths: list[str], path: str) -> None:
    """Stack the numerics report's per-metric heatmaps into one picture."""
    plt = _pyplot()

    images = [plt.imread(p) for p in paths]
    dpi = 110
    fig, axes = plt.subplots(len(images), 1, figsize=(max(i.shape[1] for i in images) / dpi,
                                                       sum(i.shape[0] for i in images) / dpi),
                             gridspec_kw={"height_ratios": [i.shape[0] for i in images]})
    for ax, image in zip(axes, images):
        ax.imshow(image)
        ax.axis("off")
    fig.subplots_adjust(left=0, right=1, top=1, bottom=0, hspace=0)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
