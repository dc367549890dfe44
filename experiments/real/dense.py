"""Section 5: dense attention past the trained length, with the inference-time fixes, as in Qwen's table.

SmolLM2 (trained at 8,192 tokens) reads the first `LENGTHS[-1]` tokens of a text in segments of 4k, 8k, 16k
and 32k tokens, each from scratch (`hfa.sweep`'s definition), under: no change; ``logn`` (``max(1,
log_8192 n)``); dynamic NTK and YaRN set through the config's ``rope_parameters`` (factor 4, the longest
length over the trained one); and logn on top of each. Dynamic NTK sets its frequencies from the segment's
length, so its segments are read in one call each, as Qwen's evaluation reads them (`hfa.perplexity`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from matplotlib.ticker import LogLocator, ScalarFormatter
from sections.figures import figure, save
from sections.tables import markdown

import hf_attnscale as hfa

from .context import SHORT_NAME, TRAINED_LENGTH, Context

LENGTHS = (4096, 8192, 16384, 32768)
MODELS = ("smollm2-135m",)
"""Gemma-3-270M's trained context is 32k: its test past it (64k-256k dense) does not fit this CPU budget."""


def lengths(context: Context) -> tuple[int, ...]:
    """`LENGTHS`, or two short ones for ``--quick``."""
    return (256, 512) if context.quick else LENGTHS


def rope_settings(model: str) -> dict[str, dict | None]:
    """The RoPE variants: the checkpoint's own, dynamic NTK and YaRN (factor: longest length / trained)."""
    trained = TRAINED_LENGTH[model]
    factor = float(LENGTHS[-1] // trained)
    theta = {"smollm2-135m": 100000.0}[model]
    return {
        "": None,
        "dynamic NTK": {"rope_type": "dynamic", "factor": factor, "rope_theta": theta},
        "YaRN": {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": trained,
            "rope_theta": theta,
        },
    }


def run(context: Context) -> str:
    """Perplexity at each length for every (RoPE, logn) pair, per model and text."""
    results, tables = {}, []
    for name in (m for m in context.models if m in MODELS):
        trained = TRAINED_LENGTH[name]
        logn = {"scale": "logn", "train_length": trained}
        for text in context.texts:
            sizes = lengths(context)
            ids = context.stream(name, text, sizes[-1])
            table = {}
            for rope_name, parameters in rope_settings(name).items():
                for with_logn in (False, True):
                    label = " + ".join(filter(None, [rope_name or "unchanged", "logn" if with_logn else ""]))
                    variant = hfa.Variant(label, patch=logn if with_logn else None)

                    table[label] = context.cells.get(
                        f"dense/{name}/{text}/{label}/{sizes}",
                        functools.partial(perplexities, context, name, ids, sizes, parameters, variant),
                    )
            results[f"{name}/{text}"] = table
            plot_dense(table, name, text, sizes, context.out / f"dense-{name}-{text}.png")
            header = ["variant", *[f"{n} ({n / trained:g}x)" for n in sizes]]
            rows = [[label, *[f"{by_length[n]:.2f}" for n in sizes]] for label, by_length in table.items()]
            tables.append(
                f"**{SHORT_NAME[name]}, {text}** (trained at {trained})\n\n" + markdown(header, rows)
            )
    (context.out / "dense.json").write_text(json.dumps(results, indent=1))
    return "\n\n".join(tables)


def perplexities(
    context: Context, name: str, ids, sizes: tuple[int, ...], parameters: dict | None, variant: hfa.Variant
) -> dict[int, float]:
    """One variant's perplexity at each length of ``sizes``, on the checkpoint loaded with ``rope_parameters``."""
    overrides = {} if parameters is None else {"rope_parameters": parameters}
    model = context.load(name, **overrides)
    result = hfa.sweep(
        model, [ids], list(sizes), [variant], train_length=TRAINED_LENGTH[name], chunk_size=4096
    )
    return {row.length: row.ppl for row in result.rows}


def plot_dense(
    table: dict[str, dict[int, float]], model: str, text: str, sizes: tuple[int, ...], path: Path
) -> None:
    """Perplexity against segment length, a colour per RoPE and a dashed line for logn on it; the trained length
    marked. The right panel zooms in on the variants that hold."""
    fig, axes = figure(2, width=5.2, height=4.2)
    colours = {}
    for label, by_length in table.items():
        rope = label.removesuffix(" + logn")
        colour = colours.setdefault(rope, f"C{len(colours)}")
        for ax in axes:
            ax.plot(
                list(by_length),
                list(by_length.values()),
                marker="o",
                color=colour,
                label=label,
                ls="--" if label.endswith("logn") else "-",
            )
    held = [
        v
        for by_length in table.values()
        if max(by_length.values()) < 3 * min(by_length.values())
        for v in by_length.values()
    ]
    for ax in axes:
        if sizes[0] <= TRAINED_LENGTH[model] <= sizes[-1]:
            ax.axvline(TRAINED_LENGTH[model], color="grey", ls=":", lw=0.8)
        ax.set(xscale="log", xlabel="segment length (tokens)", ylabel="perplexity")
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.minorticks_off()
    axes[0].set(yscale="log", title=f"{SHORT_NAME[model]} on {text}: dense past the trained length")
    axes[0].yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
    axes[0].yaxis.set_major_formatter(ScalarFormatter())
    axes[0].legend(fontsize=8)
    if held:
        axes[1].set(ylim=(min(held) * 0.97, max(held) * 1.03), title="zoomed: the variants that hold")
    save(fig, path)
