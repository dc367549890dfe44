"""Section 6: sinks and outliers in the real models (Bondarenko et al. 2023), with the package's diagnostics.

For each model: the attention mass on the first token per layer and head, and which heads sink; the
kurtosis and the largest |hidden state| per layer, and on which token it sits; and what W8A8 fake
quantisation costs in perplexity, with and without the first tokens kept out of the quantisation range.
Probes: `PROBE_WINDOWS` windows of `PROBE_LENGTH` tokens, evenly spaced over the text; perplexity: the text's
first `PPL_TOKENS` tokens in windows of `PROBE_LENGTH`, each read from scratch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from matplotlib.ticker import MaxNLocator
from sections.figures import figure, save
from sections.tables import markdown

from hf_attnscale.diagnostics import activation_outliers, attention_statistics, fake_quantized
from hf_attnscale.evaluation.perplexity import windowed_perplexity

from .context import SHORT_NAME, Context

PROBE_LENGTH = 1024
PROBE_WINDOWS = 4
PPL_TOKENS = 16_384
SINK_HEAD = 0.3
"""A head sinks when more than this share of its attention goes to the first token."""
SKIP = 16
"""Queries left out of the attention means: the first ones see only a few keys, and the sink is all of them."""
KEEP_FIRST = (1, 4)


def probe_batch(ids: torch.Tensor, bos_id: int | None) -> torch.Tensor:
    """`PROBE_WINDOWS` windows of `PROBE_LENGTH` tokens evenly spaced over ``ids`` (behind BOS if the model
    reads documents behind one)."""
    body = PROBE_LENGTH - (bos_id is not None)
    starts = np.linspace(0, ids.numel() - body, PROBE_WINDOWS).astype(int)
    rows = [ids[s : s + body] for s in starts]
    if bos_id is not None:
        rows = [torch.cat([ids.new_tensor([bos_id]), row]) for row in rows]
    return torch.stack(rows)


def measure(context: Context, name: str, text: str) -> dict:
    """Everything the section reports for one model and text (a cell)."""
    tokenizer = context.tokenizer(name)
    bos_id = tokenizer.bos_token_id if tokenizer("a").input_ids[0] == tokenizer.bos_token_id else None
    ids = context.stream(name, text)
    body = ids[1:] if bos_id is not None else ids
    batch = probe_batch(body, bos_id)
    model = context.load(name)
    attention = attention_statistics(model, batch).summary(skip=SKIP)
    outliers = activation_outliers(model, batch)
    with torch.no_grad():
        hidden = model.model(input_ids=batch, output_hidden_states=True).hidden_states[1:]
    # On which token each layer's largest |hidden state| sits (per window, then the most common).
    at = [int(torch.mode(h.abs().amax(-1).argmax(-1)).values) for h in hidden]
    docs = [ids[: 2 * PROBE_LENGTH if context.quick else PPL_TOKENS]]
    ppl = {"fp32": windowed_perplexity(model, docs, PROBE_LENGTH, bos_id)}
    with fake_quantized(model):
        ppl["W8A8"] = windowed_perplexity(model, docs, PROBE_LENGTH, bos_id)
    for keep in KEEP_FIRST:
        with fake_quantized(model, keep_first=keep):
            ppl[f"W8A8, first {keep} kept"] = windowed_perplexity(model, docs, PROBE_LENGTH, bos_id)
    return {
        "sink_mass": attention["sink_mass"].tolist(),
        "hidden_kurtosis": outliers.hidden_kurtosis.tolist(),
        "hidden_max_abs": outliers.hidden_max_abs.tolist(),
        "attention_kurtosis": outliers.attention_kurtosis.tolist(),
        "max_at_token": at,
        "perplexity": ppl,
    }


def run(context: Context) -> str:
    """Sink heads, outliers and their cost under W8A8, per model and text."""
    results, rows = {}, []
    for name in context.models:
        for text in context.texts:
            m = context.cells.get(
                f"outliers/{name}/{text}" + ("/quick" if context.quick else ""),
                lambda name=name, text=text: measure(context, name, text),
            )
            results[f"{name}/{text}"] = m
            mass = torch.tensor(m["sink_mass"])
            ppl = m["perplexity"]
            top_layer = max(range(len(m["hidden_max_abs"])), key=m["hidden_max_abs"].__getitem__)
            rows.append(
                [
                    SHORT_NAME[name],
                    text,
                    f"{(mass > SINK_HEAD).float().mean().item():.0%}",
                    f"{max(m['hidden_kurtosis']):.0f}",
                    f"{max(m['hidden_max_abs']):.0f} (layer {top_layer})",
                    f"{sum(t == 0 for t in m['max_at_token'])} of {len(m['max_at_token'])}",
                    *[f"{v:.2f}" for v in ppl.values()],
                ]
            )
        plot_outliers(
            {k: v for k, v in results.items() if k.startswith(name)},
            name,
            context.out / f"outliers-{name}.png",
        )
    (context.out / "outliers.json").write_text(json.dumps(results, indent=1))
    header = [
        "model",
        "text",
        f"sink heads (mass on token 0 > {SINK_HEAD})",
        "hidden kurtosis (max over layers)",
        "largest hidden activation",
        "layers whose largest activation is on token 0",
        *next(iter(results.values()))["perplexity"],
    ]
    return markdown(header, rows)


def plot_outliers(results: dict[str, dict], model: str, path: Path) -> None:
    """Left: attention mass on the first token per layer and head (the first text); right: kurtosis and max
    |hidden| per layer."""
    first = next(iter(results.values()))
    fig, axes = figure(3, width=4.6, height=4)
    mass = np.array(first["sink_mass"])
    image = axes[0].imshow(mass.T, aspect="auto", vmin=0, vmax=1, cmap="viridis", origin="lower")
    fig.colorbar(image, ax=axes[0], label="attention mass on token 0")
    axes[0].set(
        xlabel="layer",
        ylabel="head",
        title=f"{SHORT_NAME[model]}: sink mass ({next(iter(results)).split('/')[1]})",
    )
    for key, m in results.items():
        text = key.split("/")[1]
        axes[1].plot(m["hidden_kurtosis"], marker="o", ms=3, label=text)
        axes[2].plot(m["hidden_max_abs"], marker="o", ms=3, label=text)
    axes[1].set(xlabel="layer", ylabel="kurtosis of hidden state", yscale="log", title="kurtosis")
    axes[2].set(xlabel="layer", ylabel="max |hidden state|", yscale="log", title="largest activation")
    axes[1].legend(fontsize=8)
    for ax in axes:  # layers and heads are whole numbers
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].yaxis.set_major_locator(MaxNLocator(integer=True))
    save(fig, path)
