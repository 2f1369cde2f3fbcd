"""The demo's figures (matplotlib, Agg): loss curves side by side, and the numerics heatmaps in one picture."""
from __future__ import annotations

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


def plot_losses(results: list[RunResult], entropy: float, path: str) -> None:
    plt = _pyplot()

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for r in results:
        style = dict(color="black", linewidth=2.2, zorder=3) if r.name == "bf16" else dict(linewidth=1.2)
        left.plot(range(1, len(r.train_losses) + 1), _running_mean(r.train_losses), label=r.name, **style)
        right.plot(*zip(*r.val_losses), marker="o", markersize=3, label=r.name, **style)
    for ax, title in ((left, "training loss (mean of the last 10 steps)"), (right, "validation loss (held-out files)")):
        ax.axhline(entropy, color="grey", linestyle="--", linewidth=1)
        ax.text(0.01, entropy, "unigram entropy", va="bottom", fontsize=8, color="grey",
                transform=ax.get_yaxis_transform())
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    left.set_ylabel("cross-entropy (nats per byte)")
    right.legend(fontsize=8)
    fig.suptitle("GPT (megatron-core, TE layer spec via mindspeed_te) on the Python standard library's bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
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
