"""Section ``rates``: lm-vanilla's recipe at peak learning rates 2e-3, 4e-3 and 6e-3.

For each rate: its sink heads over training, and the 32x stream of section ``streaming``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .heldout import STREAM_LENGTH, heldout_streams, probe_batch
from .runs import TRAIN_LENGTH, finished, load, shared_tokenizer, training_info
from .sinks import SINK_HEAD_COLUMNS, SKIP_QUERIES, plot_sink_curves, sink_curves, sink_head_cells, sink_stats
from .streaming import (
    FOUR_SINK_GAINS,
    STREAM_METHODS,
    eviction_cost,
    past_perplexity,
    plot_streams,
    stream_curves,
)
from .tables import markdown

RUNS = {  # label -> run: lm-vanilla's recipe at three peak learning rates, the same 8.2M tokens
    "peak lr 2e-3": "lm-vanilla",
    "peak lr 4e-3": "lm-vanilla-lr4e-3",
    "peak lr 6e-3": "lm-vanilla-lr6e-3",
}


def run(runs: Path, out: Path) -> str:
    """Sinks grown by the learning rate: BOS mass over training, and section 2's 32x stream for each rate."""
    found = finished(runs, RUNS)
    tokenizer = shared_tokenizer(found.values())
    batch, streams = probe_batch(tokenizer), heldout_streams(tokenizer, STREAM_LENGTH)
    data, rows = {}, []
    for label, path in found.items():
        model = load(path)
        final = sink_stats(model, batch)
        curves = stream_curves(model, streams, STREAM_METHODS)
        past = past_perplexity(curves)
        data[label] = {"final": final, "over_training": sink_curves(path, batch), "streaming": curves}
        rows.append(
            [
                label,
                f"{training_info(path)[f'heldout_ppl_{TRAIN_LENGTH}']:.2f}",
                *sink_head_cells(torch.tensor(final["heads"])),
                *[f"{past[m]:.2f}" for m in STREAM_METHODS],
                *[eviction_cost(past, *pair) for pair in FOUR_SINK_GAINS],
            ]
        )
    (out / "rates.json").write_text(json.dumps(data))
    plot_streams({label: d["streaming"] for label, d in data.items()}, out / "rates.png")
    with_snapshots = {label: d["over_training"] for label, d in data.items() if d["over_training"]}
    if with_snapshots:
        plot_sink_curves(with_snapshots, out / "rates-sinks.png")
    header = [
        "peak learning rate",
        f"held-out ppl at {TRAIN_LENGTH}",
        *SINK_HEAD_COLUMNS,
        *STREAM_METHODS,
        *[f"{a} against {b}" for a, b in FOUR_SINK_GAINS],
    ]
    note = (
        f"\nSink heads: the final model, {len(batch)} held-out windows of {TRAIN_LENGTH} tokens, queries from "
        f"position {SKIP_QUERIES} on. Streaming: perplexity over positions {TRAIN_LENGTH}..{STREAM_LENGTH - 1} "
        f"of {len(streams)} held-out files, each streamed alone from its BOS token; the last two columns are "
        "what evicting BOS costs (window-only against 4 sinks in a cache of the same size)."
    )
    return markdown(header, rows) + "\n" + note
