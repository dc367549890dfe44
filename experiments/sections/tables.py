"""Markdown tables and their cells."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def markdown(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A Markdown table of ``rows`` under ``header``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def mean_and_range(values: Sequence[float]) -> str:
    """A table cell: the mean over seeds and their range, ``mean (min..max)`` (the mean alone for one seed)."""
    mean = f"{statistics.fmean(values):.2f}"
    return mean if len(values) == 1 else f"{mean} ({min(values):.2f}..{max(values):.2f})"
