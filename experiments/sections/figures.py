"""What every figure shares: the canvas, saving it, and seeds drawn as a mean with its range."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def figure(
    columns: int = 1, width: float = 6.0, height: float = 4.0, rows: int = 1, sharey: bool | str = False
) -> tuple[Figure, list]:
    """A figure of ``rows x columns`` panels of ``width x height`` inches; its axes in reading order."""
    fig = Figure(figsize=(width * columns, height * rows), dpi=110)
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(rows, columns, squeeze=False, sharey=sharey).flat)


def save(fig: Figure, path: Path) -> None:
    """Lay the figure out and write it to ``path``."""
    fig.tight_layout()
    fig.savefig(path)


def plot_seeds(ax, x: Sequence[float], per_x: Sequence[Sequence[float]], label: str) -> None:
    """The mean over seeds at each x, with the seeds' range as error bars."""
    means = [statistics.fmean(v) for v in per_x]
    spread = [[m - min(v) for m, v in zip(means, per_x)], [max(v) - m for m, v in zip(means, per_x)]]
    ax.errorbar(list(x), means, yerr=spread, marker="o", capsize=3, label=label)
