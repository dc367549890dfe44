"""Figures of the diagnostics (matplotlib's object API with the Agg canvas: no global backend is touched)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def plot_attention(stats: Any, path: Path, title: str | None) -> Path:
    """Entropy and gradient size against n, per layer (mean over heads); sink mass per layer and head.

    ``stats``: an `AttentionStatistics` (typed loosely: it imports this module to draw itself).
    """
    fig = Figure(figsize=(13, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    entropy_ax, gradient_ax, sink_ax = fig.subplots(1, 3)
    layers = stats.entropy.shape[0]
    for layer in range(layers):
        n = stats.visible[layer].numpy()
        entropy_ax.plot(n, stats.entropy[layer].mean(0).numpy(), label=f"layer {layer}", linewidth=1.2)
        gradient_ax.plot(n, stats.gradient[layer].mean(0).numpy(), linewidth=1.2)
    n_max = float(stats.visible.max())
    grid = torch.linspace(1, n_max, 200)
    entropy_ax.plot(grid, grid.log(), color="0.5", linestyle=":", label="ln n (uniform)")
    for ax, name in ((entropy_ax, "entropy (nats)"), (gradient_ax, "softmax gradient 2(1 - Σp²)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("visible keys n")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    entropy_ax.legend(frameon=False, fontsize=8)
    entropy_ax.set_title("attention entropy vs n")
    gradient_ax.set_title("gradient size vs n")
    mass = stats.summary(skip=min(16, stats.sink_mass.shape[-1] - 1))["sink_mass"].numpy()
    image = sink_ax.imshow(mass, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    sink_ax.set_xlabel("head")
    sink_ax.set_ylabel("layer")
    sink_ax.set_title(f"mass on the first {stats.sink_tokens} token(s)")
    fig.colorbar(image, ax=sink_ax)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_outliers(stats: Any, path: Path, title: str | None) -> Path:
    """Kurtosis and max |x| per layer, for attention outputs and hidden states (``stats``: `OutlierStatistics`)."""
    fig = Figure(figsize=(9, 3.8), dpi=110)
    FigureCanvasAgg(fig)
    kurt_ax, max_ax = fig.subplots(1, 2)
    layers = range(len(stats.hidden_kurtosis))
    for name, kurt, peak in (
        ("attention output", stats.attention_kurtosis, stats.attention_max_abs),
        ("hidden state", stats.hidden_kurtosis, stats.hidden_max_abs),
    ):
        kurt_ax.plot(layers, kurt.numpy(), marker="o", label=name)
        max_ax.plot(layers, peak.numpy(), marker="o", label=name)
    kurt_ax.axhline(3, color="0.5", linestyle=":", label="Gaussian")
    for ax, name in ((kurt_ax, "kurtosis"), (max_ax, "max |x|")):
        ax.set_xlabel("layer")
        ax.set_ylabel(name)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(frameon=False, fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, path)
