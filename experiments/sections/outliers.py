"""Section ``outliers``: kurtosis and max |activation| of the three LM runs, and their perplexity under W8A8."""

from __future__ import annotations

import json
from pathlib import Path

from hf_attnscale.diagnostics import activation_outliers, fake_quantized
from hf_attnscale.evaluation.corpus import builtin_documents, tokenize_documents
from hf_attnscale.evaluation.perplexity import windowed_perplexity

from .figures import figure, save
from .heldout import probe_batch
from .runs import LM_RUNS, TRAIN_LENGTH, finished, load, shared_tokenizer
from .tables import markdown


def run(runs: Path, out: Path) -> str:
    """Kurtosis and max |x| of each LM's activations, and the perplexity it loses under W8A8."""
    found = finished(runs, LM_RUNS)
    tokenizer = shared_tokenizer(found.values())
    batch = probe_batch(tokenizer)
    docs = tokenize_documents(tokenizer, builtin_documents("heldout"))
    # Windows of BOS + 127 tokens: the positions the models were trained on.
    rows, data = [], {}
    for label, path in found.items():
        model = load(path)
        stats = activation_outliers(model, batch)
        exact = windowed_perplexity(model, docs, TRAIN_LENGTH - 1, tokenizer.bos_token_id)
        with fake_quantized(model):
            quantized = windowed_perplexity(model, docs, TRAIN_LENGTH - 1, tokenizer.bos_token_id)
        data[label] = {
            "hidden_kurtosis": stats.hidden_kurtosis.tolist(),
            "hidden_max_abs": stats.hidden_max_abs.tolist(),
            "attention_kurtosis": stats.attention_kurtosis.tolist(),
            "attention_max_abs": stats.attention_max_abs.tolist(),
            "ppl_fp32": exact,
            "ppl_w8a8": quantized,
        }
        rows.append(
            [
                label,
                f"{float(stats.hidden_kurtosis.max()):.1f}",
                f"{float(stats.hidden_max_abs.max()):.1f}",
                f"{float(stats.attention_kurtosis.max()):.1f}",
                f"{float(stats.attention_max_abs.max()):.2f}",
                f"{exact:.2f}",
                f"{quantized:.2f}",
                f"{100 * (quantized / exact - 1):+.1f}%",
            ]
        )
    (out / "outliers.json").write_text(json.dumps(data, indent=1))
    plot_outliers(data, out / "outliers.png")
    header = [
        "model",
        "hidden kurtosis (max over layers)",
        "hidden max abs",
        "attn-out kurtosis",
        "attn-out max abs",
        f"ppl @{TRAIN_LENGTH} fp32",
        "ppl W8A8",
        "lost",
    ]
    return markdown(header, rows)


def plot_outliers(data: dict[str, dict], path: Path) -> None:
    """The hidden state's kurtosis (left) and max |x| (right) by layer, one line per model."""
    fig, axes = figure(2, width=4.5)
    for label, d in data.items():
        axes[0].plot(d["hidden_kurtosis"], marker="o", label=label)
        axes[1].plot(d["hidden_max_abs"], marker="o", label=label)
    layers = len(next(iter(data.values()))["hidden_kurtosis"])
    for ax in axes:
        ax.set_xticks(range(layers))
    axes[0].set(xlabel="layer", ylabel="kurtosis of hidden state", yscale="log")
    axes[1].set(xlabel="layer", ylabel="max |hidden state|", yscale="log")
    axes[0].legend(fontsize=7)
    save(fig, path)
