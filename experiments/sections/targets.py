"""Section ``targets``: where the unpatched decoders' heads attend, and what evicting BOS costs them.

One row per recipe tried to grow sinks (weight decay, learning rate, depth, length); the targets are BOS, the
query's own token, the previous token and the start of its line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import hf_attnscale as hfa

from .figures import figure, save
from .heldout import STREAM_LENGTH, heldout_streams, probe_batch
from .runs import finished, load, shared_tokenizer, training_info
from .sinks import SINK_HEAD_COLUMNS, SKIP_QUERIES, sink_head_cells
from .streaming import eviction_cost, past_perplexity, stream_curves
from .tables import markdown

RUNS = {  # label -> run: the recipes tried to grow sinks, all on the same 8.2M tokens
    "4 x 256, weight decay 0.1": "lm-vanilla",
    "4 x 256, weight decay 0.5": "lm-vanilla-wd0.5",
    "4 x 256, weight decay 1.0": "lm-vanilla-wd1.0",
    "4 x 256, peak lr 4e-3": "lm-vanilla-lr4e-3",
    "4 x 256, peak lr 6e-3": "lm-vanilla-lr6e-3",
    "12 x 128": "lm-deep12",
    "16 x 96": "lm-deep16",
    "4 x 256, trained at 512": "lm-ctx512",
    "4 x 256, trained at 1024": "lm-ctx1024",
}
TARGETS = ("BOS", "own token", "previous token", "start of its line", "elsewhere")
SMALL_CACHE = 32
"""The second cache size of the eviction test, the same for every model (section 2's smaller cache)."""
QUARTERS = 4


@dataclass(frozen=True)
class Eviction:
    """Window-only against 4 sinks + the rest in a cache of the same size: what evicting BOS costs."""

    window_only: str
    with_sinks: str
    size: int | None
    """The cache size; None: the model's trained length."""

    @property
    def columns(self) -> tuple[str, str]:
        """(window-only, with sinks): its two columns of the table."""
        return self.window_only, self.with_sinks

    def caches(self, length: int) -> dict[str, partial[hfa.SinkCache]]:
        """The two caches, by column, for a model trained at ``length``."""
        size = self.size or length
        return {
            self.window_only: partial(hfa.SinkCache, 0, size),
            self.with_sinks: partial(hfa.SinkCache, 4, size - 4),
        }


EVICTIONS = (
    Eviction("window-only, cache = trained length", "4 sinks + rest, same cache", None),
    Eviction(f"window-only (0+{SMALL_CACHE})", f"4 sinks + {SMALL_CACHE - 4}", SMALL_CACHE),
)


def run(runs: Path, out: Path) -> str:
    """Where the unpatched decoders' heads attend, and what evicting BOS costs them, for each training recipe."""
    found = finished(runs, RUNS)
    tokenizer = shared_tokenizer(found.values())
    newline = torch.tensor(["\n" in tokenizer.decode([i]) for i in range(len(tokenizer))])
    streams = heldout_streams(tokenizer, STREAM_LENGTH)
    data, summary_rows, target_rows = {}, [], []
    for label, path in found.items():
        model = load(path)
        if hfa.get_config(model) is not None:
            raise ValueError(f"{path} was trained under a patch; this section reads unpatched models")
        length = model.config.max_position_embeddings
        batch = probe_batch(tokenizer, length)
        mass = attention_targets(model, batch, newline)
        caches = {
            column: cache for eviction in EVICTIONS for column, cache in eviction.caches(length).items()
        }
        past = past_perplexity(stream_curves(model, streams, caches), start=length)
        info = training_info(path)
        data[label] = row = {
            "trained_length": length,
            "layers": model.config.num_hidden_layers,
            "hidden": model.config.hidden_size,
            "parameters": info["parameters"],
            "heldout_ppl": info[f"heldout_ppl_{length}"],
            "targets": {name: m.tolist() for name, m in mass.items()},
            "streaming": past,
        }
        summary_rows.append(
            [
                label,
                length,
                f"{row['parameters'] / 1e6:.1f}M",
                f"{row['heldout_ppl']:.2f}",
                *sink_head_cells(mass["BOS"]),
                *[f"{v:.2f}" for v in past.values()],
                *[eviction_cost(past, *eviction.columns) for eviction in EVICTIONS],
            ]
        )
        for name, m in mass.items():
            target_rows.append([label, name, *depth_quarters(m)])
    (out / "targets.json").write_text(json.dumps(data, indent=1))
    plot_targets(data, out / "targets.png")

    summary = markdown(
        [
            "model (layers x hidden)",
            "trained at",
            "parameters",
            "held-out ppl at its length",
            *SINK_HEAD_COLUMNS,
            *[column for eviction in EVICTIONS for column in eviction.columns],
            "window-only cost, cache = trained length",
            f"cache {SMALL_CACHE}",
        ],
        summary_rows,
    )
    where = markdown(
        [
            "model",
            "attends to",
            *[f"layers, quarter {i + 1} of {QUARTERS}: mean / top head" for i in range(QUARTERS)],
        ],
        target_rows,
    )
    note = (
        f"\nAttention mass of each head on each target, averaged over the queries from position {SKIP_QUERIES} on "
        f"of {len(batch)} held-out windows of each model's trained length (BOS first); the start of a line is the last "
        "newline token before the previous token; each quarter of the layers is one layer for the 4-layer "
        "models. Streaming: perplexity past each model's trained length, up to position "
        f"{STREAM_LENGTH - 1}, of {len(streams)} held-out files streamed alone from BOS."
    )
    return summary + "\n\n" + where + "\n" + note


@torch.no_grad()
def attention_targets(model, batch: torch.Tensor, newline: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean attention mass per ``(layer, head)`` on each of `TARGETS`, over the queries from `SKIP_QUERIES` on.

    The targets are disjoint: BOS, the query's own token, the token before it, the last newline token before
    that (the start of its line, when it is not BOS), and everything else.
    """
    eager = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager").eval()
    eager.load_state_dict(model.state_dict())
    # One window at a time (the (H, T, T) weights of long windows are large); each has as many queries.
    per_window = [window_targets(eager, window[None], newline) for window in batch]
    return {name: torch.stack([w[name] for w in per_window]).mean(0) for name in TARGETS}


def window_targets(eager, batch: torch.Tensor, newline: torch.Tensor) -> dict[str, torch.Tensor]:
    """`attention_targets` of an eager model on one batch."""
    attentions = eager(input_ids=batch, output_attentions=True).attentions  # each (B, H, T, T)
    queries = torch.arange(SKIP_QUERIES, batch.shape[1])
    rows = torch.arange(len(queries))
    positions = torch.arange(batch.shape[1]).expand_as(batch)
    last_newline = torch.where(newline[batch], positions, 0).cummax(-1).values  # (B, T), 0 where none yet
    # (B, Q): the last newline before the previous token, so that the targets are disjoint
    line_start = last_newline[:, queries - 2]
    mass: dict[str, list[torch.Tensor]] = {name: [] for name in TARGETS}
    for probs in attentions:
        probs = probs[:, :, queries].float()  # (B, H, Q, T)
        at_line_start = probs.gather(-1, line_start[:, None, :, None].expand(-1, probs.shape[1], -1, 1))
        parts = {
            "BOS": probs[..., 0],
            "own token": probs[:, :, rows, queries],
            "previous token": probs[:, :, rows, queries - 1],
            "start of its line": at_line_start.squeeze(-1).masked_fill(line_start[:, None] == 0, 0.0),
        }
        parts["elsewhere"] = 1 - sum(parts.values())
        for name, part in parts.items():
            mass[name].append(part.mean((0, 2)))
    return {name: torch.stack(per_layer) for name, per_layer in mass.items()}


def depth_quarters(mass: torch.Tensor) -> list[str]:
    """Table cells for a ``(layers, heads)`` mass: per quarter of the layers, the mean and the top head."""
    cells = []
    for layers in torch.arange(len(mass)).tensor_split(QUARTERS):
        if not len(layers):  # fewer layers than quarters
            cells.append("–")
            continue
        part = mass[layers]
        top = int(part.argmax())
        layer, head = int(layers[top // part.shape[1]]), top % part.shape[1]
        cells.append(f"{float(part.mean()):.2f} / {float(part.max()):.2f} (L{layer} h{head})")
    return cells


def plot_targets(data: dict, path: Path) -> None:
    """One panel per model: a bar per head, by layer, stacked by what it attends to."""
    columns = min(len(data), 2)
    fig, axes = figure(columns, width=6.5, rows=math.ceil(len(data) / columns))
    for ax, (label, values) in zip(axes, data.items()):
        # (targets, layers * heads): one bar per head, stacked by target
        stacked = torch.tensor([values["targets"][name] for name in TARGETS]).flatten(1)
        bottom = torch.zeros(stacked.shape[1])
        for name, share in zip(TARGETS, stacked):
            ax.bar(range(len(share)), share, bottom=bottom, label=name, width=0.85)
            bottom += share
        heads = len(values["targets"]["BOS"][0])
        layers = len(bottom) // heads
        every = max(1, layers // 8)
        ax.set_xticks(
            [i * heads + (heads - 1) / 2 for i in range(0, layers, every)],
            [f"L{i}" for i in range(0, layers, every)],
        )
        ax.set(
            title=label,
            ylabel="attention mass (mean over queries)",
            xlabel="heads, by layer",
            ylim=(0, 1),
        )
        ax.legend(fontsize=7, loc="upper right")
    for ax in axes[len(data) :]:
        ax.set_visible(False)
    save(fig, path)
