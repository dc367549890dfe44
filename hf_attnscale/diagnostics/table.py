"""The per-layer Markdown table of ``hf-attnscale diagnose``: attention statistics beside activation outliers."""

from __future__ import annotations

import torch

from .attention import AttentionStatistics
from .outliers import OutlierStatistics

COLUMNS = (
    "layer",
    "entropy",
    "entropy at n=L",
    "ln L",
    "sink mass",
    "gradient",
    "exit mass",
    "kurtosis (attn / hidden)",
    "max abs (attn / hidden)",
)


def layer_table(attention: AttentionStatistics, outliers: OutlierStatistics, skip: int = 0) -> str:
    """One row per layer: each attention measure averaged over heads and over the queries after the first
    ``skip`` (entropy also at the last query, which sees the most keys, beside ``ln`` of that count), then
    the outliers' kurtosis and largest magnitude."""
    summary = attention.summary(skip=skip)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---:"] * len(COLUMNS)) + "|"]
    for layer in range(attention.entropy.shape[0]):
        cells = [
            str(layer),
            f"{summary['entropy'][layer].mean():.3f}",
            f"{attention.entropy[layer, :, -1].mean():.3f}",
            f"{torch.log(attention.visible[layer, -1]):.3f}",
            f"{summary['sink_mass'][layer].mean():.3f}",
            f"{summary['gradient'][layer].mean():.3f}",
            f"{summary['exit_mass'][layer].mean():.3f}",
            f"{outliers.attention_kurtosis[layer]:.1f} / {outliers.hidden_kurtosis[layer]:.1f}",
            f"{outliers.attention_max_abs[layer]:.1f} / {outliers.hidden_max_abs[layer]:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
