"""Section ``sinks``: attention mass on token 0 (the BOS token) over training, per layer, for the three LM runs."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hf_attnscale.diagnostics import attention_statistics

from .figures import figure, save
from .heldout import probe_batch
from .runs import LM_RUNS, TRAIN_LENGTH, finished, load, shared_tokenizer
from .tables import markdown

SKIP_QUERIES = 16
"""Sink mass is averaged over queries at positions >= this (the first few see few keys)."""
SINK_HEAD = 0.3
"""A head whose mean mass on token 0 exceeds this is a sink head (Gu et al. 2024's threshold)."""
SINK_HEAD_COLUMNS = (f"sink heads (BOS mass > {SINK_HEAD})", "top head on BOS")
"""The header of `sink_head_cells`."""


def run(runs: Path, out: Path) -> str:
    """Attention mass on token 0 over training: per layer, the mean over heads and the largest head."""
    found = finished(runs, LM_RUNS)
    batch = probe_batch(shared_tokenizer(found.values()))
    curves = {label: sink_curves(path, batch) for label, path in found.items()}
    (out / "sinks.json").write_text(json.dumps(curves, indent=1))
    plot_sink_curves(curves, out / "sinks.png")

    steps = sorted(next(iter(curves.values())))
    layers = len(next(iter(curves.values()))[steps[0]]["mean"])
    header = [
        "model",
        "step",
        *[f"layer {i}: mean / top head" for i in range(layers)],
        f"sink heads (mass > {SINK_HEAD})",
        "mass on the exit",
    ]
    rows = []
    for label, by_step in curves.items():
        for step, c in sorted(by_step.items()):
            cells = [f"{m:.3f} / {x:.3f}" for m, x in zip(c["mean"], c["max"])]
            rows.append([label, step, *cells, f"{c['sink_heads']:.0%}", f"{c['exit']:.3f}"])
    note = (
        f"\nMass on token 0 (BOS), averaged over the queries at positions {SKIP_QUERIES}..{TRAIN_LENGTH - 1} of "
        f"{len(batch)} held-out windows (BOS + {TRAIN_LENGTH - 1} tokens). A sink head (Gu et al. 2024's "
        f"Sink metric, epsilon {SINK_HEAD}) puts more than {SINK_HEAD} of its attention there."
    )
    return markdown(header, rows) + "\n" + note


def sink_stats(model, batch: torch.Tensor) -> dict:
    """BOS mass per head, its per-layer mean and top head, the share of sink heads and the exit's mass."""
    stats = attention_statistics(model, batch).summary(skip=SKIP_QUERIES)
    return {
        "heads": stats["sink_mass"].tolist(),
        "mean": stats["sink_mass"].mean(-1).tolist(),
        "max": stats["sink_mass"].amax(-1).tolist(),
        "sink_heads": float((stats["sink_mass"] > SINK_HEAD).float().mean()),
        "exit": float(stats["exit_mass"].mean()),
    }


def sink_curves(path: Path, batch: torch.Tensor) -> dict[int, dict]:
    """`sink_stats` of every snapshot of a run (``--snapshot-every``), by training step."""
    snapshots = sorted((path / "snapshots").glob("step-*"))
    return {int(s.name.split("-")[1]): sink_stats(load(s), batch) for s in snapshots}


def sink_head_cells(mass: torch.Tensor) -> list[str]:
    """Table cells under `SINK_HEAD_COLUMNS` for a ``(layers, heads)`` BOS mass."""
    return [f"{int((mass > SINK_HEAD).sum())} of {mass.numel()}", f"{float(mass.max()):.2f}"]


def plot_sink_curves(curves: dict[str, dict[int, dict]], path: Path) -> None:
    """One panel per run: each layer's mean BOS mass (solid) and top head (dotted) against the step."""
    fig, axes = figure(len(curves), width=4.5)
    for ax, (label, by_step) in zip(axes, curves.items()):
        steps = sorted(by_step)
        for layer in range(len(by_step[steps[0]]["mean"])):
            line = ax.plot(
                steps, [by_step[s]["mean"][layer] for s in steps], marker="o", label=f"layer {layer}"
            )
            ax.plot(steps, [by_step[s]["max"][layer] for s in steps], ls=":", color=line[0].get_color())
        ax.set(
            title=f"{label}: attention on BOS", xlabel="training step", ylabel="mass on token 0", ylim=(0, 1)
        )
        ax.legend(fontsize=7, title="solid: mean of heads, dotted: top head", title_fontsize=7)
    save(fig, path)
