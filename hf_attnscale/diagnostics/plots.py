"""Figures of the diagnostics (matplotlib's object API with the Agg canvas: no global backend is touched).

Real models have tens of layers, so a per-layer curve is coloured by its depth (one colour bar, not a legend
line per layer), and the figures use matplotlib's constrained layout, which makes room for colour bars and
titles without leaving empty space.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import BoundaryNorm
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

DEPTH_COLORMAP = "viridis"
"""Colours of the layers, from the first (dark) to the last (light)."""
BINS_PER_OCTAVE = 8
"""Curves against n are averaged over this many bins per doubling of n (as they are drawn on a log2 axis)."""


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def layer_colours(layers: int) -> tuple[list[tuple[float, ...]], ScalarMappable]:
    """A colour per layer by depth, and the mappable of a colour bar that labels them (integer layer ticks)."""
    cmap = colormaps[DEPTH_COLORMAP].resampled(max(layers, 2))
    norm = BoundaryNorm(np.arange(-0.5, layers + 0.5), cmap.N)
    mappable = ScalarMappable(norm=norm, cmap=cmap)
    return [cmap(norm(layer)) for layer in range(layers)], mappable


def binned_by_octave(n: np.ndarray, values: np.ndarray, per_octave: int = BINS_PER_OCTAVE):
    """``values`` averaged over bins of ``n`` equally spaced in log2 n (every n of its own below ``per_octave``),
    so that curves over hundreds of query positions read as curves. Returns (mean n, mean value) per bin.

    The bins are counted down from the largest n, so that the last one is as wide as the others (a bin that
    started at a power of two would end the curve on a single query)."""
    octaves_below_top = np.log2(n.max()) - np.log2(np.maximum(n, 1))
    bins = np.where(n <= per_octave, n, 1e6 - np.floor(octaves_below_top * per_octave))
    keys, inverse = np.unique(bins, return_inverse=True)
    counts = np.bincount(inverse, minlength=len(keys))
    return (
        np.bincount(inverse, weights=n, minlength=len(keys)) / counts,
        np.bincount(inverse, weights=values, minlength=len(keys)) / counts,
    )


def _layer_colour_bar(fig: Figure, mappable: ScalarMappable, ax: Any, layers: int) -> None:
    bar = fig.colorbar(mappable, ax=ax, label="layer", pad=0.02)
    bar.locator = MaxNLocator(nbins=min(layers, 8), integer=True)
    bar.update_ticks()


def plot_attention(stats: Any, path: Path, title: str | None) -> Path:
    """Entropy and gradient size against n, a curve per layer (mean over heads, binned by `binned_by_octave`)
    coloured by depth; sink mass per layer and head.

    ``stats``: an `AttentionStatistics` (typed loosely: it imports this module to draw itself).
    """
    fig = _figure(14, 4.4)
    entropy_ax, gradient_ax, sink_ax = fig.subplots(1, 3, width_ratios=[1, 1.15, 0.9])
    layers = stats.entropy.shape[0]
    colours, mappable = layer_colours(layers)
    width = 1.2 if layers <= 8 else 0.8
    for layer in range(layers):
        n = stats.visible[layer].double().numpy()
        style = {"color": colours[layer], "linewidth": width, "alpha": 0.9}
        entropy_ax.plot(*binned_by_octave(n, stats.entropy[layer].mean(0).double().numpy()), **style)
        gradient_ax.plot(*binned_by_octave(n, stats.gradient[layer].mean(0).double().numpy()), **style)
    n_max = float(stats.visible.max())
    grid = torch.linspace(1, n_max, 200)
    entropy_ax.plot(grid, grid.log(), color="0.35", linestyle=":", linewidth=1.5, label="ln n (uniform)")
    entropy_ax.legend(frameon=False, fontsize=8, loc="upper left")
    for ax, name in ((entropy_ax, "entropy (nats)"), (gradient_ax, "softmax gradient 2(1 - Σp²)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("visible keys n")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    entropy_ax.set_title("attention entropy vs n")
    gradient_ax.set_title("gradient size vs n")
    _layer_colour_bar(fig, mappable, gradient_ax, layers)
    mass = stats.summary(skip=min(16, stats.sink_mass.shape[-1] - 1))["sink_mass"].numpy()
    image = sink_ax.imshow(mass, vmin=0, vmax=1, cmap="magma", aspect="auto", interpolation="nearest")
    sink_ax.set_xlabel("head")
    sink_ax.set_ylabel("layer")
    sink_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    sink_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    sink_ax.set_title(f"mass on the first {stats.sink_tokens} token(s)")
    fig.colorbar(image, ax=sink_ax, pad=0.02, label="attention mass")
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_outliers(stats: Any, path: Path, title: str | None) -> Path:
    """Kurtosis and max |x| per layer, for attention outputs and hidden states (``stats``: `OutlierStatistics`)."""
    fig = _figure(10, 3.9)
    kurt_ax, max_ax = fig.subplots(1, 2)
    layers = range(len(stats.hidden_kurtosis))
    marker = {"marker": "o", "markersize": 4 if len(layers) > 12 else 6}
    for name, kurt, peak in (
        ("attention output", stats.attention_kurtosis, stats.attention_max_abs),
        ("hidden state", stats.hidden_kurtosis, stats.hidden_max_abs),
    ):
        kurt_ax.plot(layers, kurt.numpy(), label=name, **marker)
        max_ax.plot(layers, peak.numpy(), label=name, **marker)
    kurt_ax.axhline(3, color="0.5", linestyle=":", label="Gaussian")
    for ax, name in ((kurt_ax, "kurtosis"), (max_ax, "max |x|")):
        ax.set_xlabel("layer")
        ax.set_ylabel(name)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        ax.legend(frameon=False, fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_losses(losses: list[tuple[int, float]], path: Path, title: str) -> Path:
    """A training run's loss by step (``(step, loss)`` pairs, nats a token), raw and smoothed over 10 steps."""
    fig = _figure(6.0, 3.6)
    ax = fig.add_subplot()
    steps = np.array([step for step, _ in losses], dtype=float)
    values = np.array([loss for _, loss in losses], dtype=float)
    ax.plot(steps, values, linewidth=0.8, alpha=0.4, label="each step")
    if len(values) >= 10:
        smooth = np.convolve(values, np.ones(10) / 10, mode="valid")
        ax.plot(steps[9:], smooth, linewidth=1.5, label="mean of the last 10")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("training loss (nats / token)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)
