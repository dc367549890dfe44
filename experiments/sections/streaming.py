"""Section ``streaming``: per-position NLL over a 32x stream, through dense, window-only and sink+window caches."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import hf_attnscale as hfa

from .figures import figure, save
from .heldout import STREAM_LENGTH, heldout_streams
from .runs import E_RUN, LM_RUNS, TRAIN_LENGTH, finished, load, shared_tokenizer
from .tables import markdown

STREAM_METHODS: dict[str, Callable[[], hfa.SinkCache | None]] = {
    "dense": lambda: None,
    "window-only (0+128)": lambda: hfa.SinkCache(0, TRAIN_LENGTH),
    "1 sink + 127": lambda: hfa.SinkCache(1, TRAIN_LENGTH - 1),
    "2 sinks + 126": lambda: hfa.SinkCache(2, TRAIN_LENGTH - 2),
    "4 sinks + 124": lambda: hfa.SinkCache(4, TRAIN_LENGTH - 4),
    "window-only (0+32)": lambda: hfa.SinkCache(0, 32),
    "4 sinks + 28": lambda: hfa.SinkCache(4, 28),
}
STREAM_GAINS = {  # what the sinks buy: (window-only, with sinks) of `STREAM_METHODS`, the same cache size
    "1 sink (cache 128)": ("window-only (0+128)", "1 sink + 127"),
    "4 sinks (cache 128)": ("window-only (0+128)", "4 sinks + 124"),
    "4 sinks (cache 32)": ("window-only (0+32)", "4 sinks + 28"),
}
FOUR_SINK_GAINS = (STREAM_GAINS["4 sinks (cache 128)"], STREAM_GAINS["4 sinks (cache 32)"])
"""Window-only against 4 sinks at both cache sizes: the curves of the stream figure, and the rates table's costs."""


def run(runs: Path, out: Path) -> str:
    """Per-position NLL of each LM over held-out streams of 32x its window: dense, and through `STREAM_METHODS`."""
    found = finished(runs, {**LM_RUNS, "E (logn)": E_RUN})
    streams = heldout_streams(shared_tokenizer(found.values()), STREAM_LENGTH)
    curves: dict[str, dict[str, list[float]]] = {}
    rows = []
    for label, path in found.items():
        curves[label] = stream_curves(load(path), streams, STREAM_METHODS)
        past = past_perplexity(curves[label])
        rows.append([label, *[f"{past[m]:.2f}" for m in STREAM_METHODS]])
    (out / "streaming.json").write_text(json.dumps(curves))

    plot_streams(curves, out / "streaming.png")
    note = (
        f"\nPerplexity over positions {TRAIN_LENGTH}..{STREAM_LENGTH - 1} of {len(streams)} held-out files, "
        f"each streamed alone from its BOS token ({STREAM_LENGTH} tokens = 32x the training window)."
    )
    return markdown(["model", *STREAM_METHODS], rows) + "\n" + note


def stream_curves(model, streams: list[torch.Tensor], methods: dict) -> dict[str, list[float]]:
    """Mean NLL by stream position of ``model`` read through each method's cache (``None``: dense)."""
    curves = {}
    # Streaming needs a patched model: the trained patch, or the identity for an unpatched one.
    with hfa.patched(model, hfa.get_config(model) or hfa.AttnScaleConfig()):
        for method, new_cache in methods.items():
            nll = torch.stack(
                [hfa.perplexity(model, s, cache=new_cache(), chunk_size=512).nll for s in streams]
            )
            curves[method] = [round(x, 5) for x in nll.mean(0).tolist()]
    return curves


def past_perplexity(curves: dict[str, list[float]], start: int = TRAIN_LENGTH) -> dict[str, float]:
    """Perplexity past the trained window (positions ``start`` onwards) of each curve."""
    return {method: math.exp(statistics.fmean(nll[start:])) for method, nll in curves.items()}


def eviction_cost(past: dict[str, float], window_only: str, with_sinks: str) -> str:
    """A table cell: how much higher window-only's perplexity is than with sinks in a cache of the same size."""
    return f"{100 * (past[window_only] / past[with_sinks] - 1):+.1f}%"


def binned(nll: Sequence[float], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bin centres, mean NLL per bin) over whole bins of ``size`` positions."""
    usable = len(nll) // size * size
    means = torch.tensor(nll[:usable], dtype=torch.float64).view(-1, size).mean(-1)
    return (torch.arange(len(means)) + 0.5) * size, means


def plot_streams(curves: dict[str, dict[str, list[float]]], path: Path) -> None:
    """Top: perplexity by position per model; bottom: what the sinks buy, NLL(window-only) - NLL(with sinks)."""
    fig, axes = figure(len(curves), width=4.5, height=3.75, rows=2, sharey="row")
    shown = ("dense", *[method for pair in FOUR_SINK_GAINS for method in pair])
    for column, (label, by_method) in enumerate(curves.items()):
        top, bottom = axes[column], axes[len(curves) + column]
        for method in shown:
            x, nll = binned(by_method[method], 64)
            top.plot(x, nll.exp(), label=method)
        top.set(title=label, ylabel="perplexity (bins of 64)", yscale="log")
        for name, (without, with_sinks) in STREAM_GAINS.items():
            x, gain = binned([a - b for a, b in zip(by_method[without], by_method[with_sinks])], 256)
            bottom.plot(x, gain, marker="o", label=name)
        bottom.axhline(0, color="grey", lw=0.8)
        bottom.set(xlabel="position in stream", ylabel="NLL(window-only) - NLL(with sinks), bins of 256")
        for ax in (top, bottom):
            ax.axvline(TRAIN_LENGTH, color="grey", ls="--", lw=0.8)
            ax.legend(fontsize=7)
    save(fig, path)
