"""Section 8 (new): Bondarenko et al.'s Table 2 as a retrofit: each cure fine-tuned into SmolLM2.

Bondarenko et al. pre-train OPT and BERT with each cure. Here each is added to the pretrained SmolLM2 and
fine-tuned with the same LoRA budget (rank `RANK` on the attention projections at section 7's rate, `STEPS` steps
of `BATCH` windows of `LENGTH` tokens of the stdlib training split): LoRA alone, zero_kv, a learnable sink
logit, a learnable clipped softmax and the two gates. The learnable cures start where the pretrained model is
(sink at 0 is zero_kv; γ = 0, ζ = 1 is the softmax; a gate starts at 1): a fixed clip at Bondarenko's
γ = −α/T (α = 8) zeroes every weight under 3% and takes SmolLM2's perplexity to thousands. The scalar
parameters (sinks, clip bounds) train at section 7's `PATCH_LR`; the gates' projections at LoRA's rate (at
`PATCH_LR` two steps saturate them). The clip bounds at `PATCH_LR` move by about that much a step, in units of
probability: the run diverges within four steps, so the clipped softmax is also run with its bounds at LoRA's rate. After training, on the held-out split: perplexity in float32 and in
simulated W8A8 (with and without the first token kept in float), the kurtosis and the largest |value| of each layer's output, the attention
mass on the first token and on the exit, and window-only against sink+window streaming.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import torch
from sections.figures import figure, save
from sections.tables import markdown

import hf_attnscale as hfa
from hf_attnscale.diagnostics import activation_outliers, attention_statistics, fake_quantized
from hf_attnscale.evaluation.perplexity import windowed_perplexity

from .context import SHORT_NAME, Context
from .finetune import BATCH, EVAL_WINDOW, LENGTH, LR, MODEL, PATCH_LR, fine_tune

RUNS = {
    "LoRA alone": None,
    "zero_kv": {"zero_kv": True},
    "learnable sink": {"sink_logit": "learnable"},
    "clipped softmax": {"clipped_softmax": "learnable"},
    "clipped softmax, slow bounds": {"clipped_softmax": "learnable"},
    "gate (head)": {"gate": "head"},
    "gate (element)": {"gate": "element"},
}
SLOW = {"gate (head)", "gate (element)", "clipped softmax, slow bounds"}
"""The runs whose patch parameters train at LoRA's rate `LR`, not at the sinks' `PATCH_LR`."""
STEPS = 40
SEEDS = (0, 1)
EVAL_TOKENS = 4096
CACHES = {"window-only (0+256)": (0, 256), "sink+window (4+252)": (4, 252)}
DIVERGED = 10
"""A run whose fp32 perplexity is this many times LoRA alone's is reported as diverged (not drawn in the bars)."""
MAX_SCALARS = 1000
"""Learned scalars per run written to retrofit.json at most (`_without_large_scalars`)."""
PROBE = 2  # windows of EVAL_WINDOW tokens for the outlier and attention statistics


@torch.no_grad()
def measure(model: torch.nn.Module, heldout: torch.Tensor) -> dict:
    """Everything the table reports, for one trained model (a cell)."""
    model.eval()
    docs = [heldout]
    numbers = {"fp32": windowed_perplexity(model, docs, EVAL_WINDOW)}
    with fake_quantized(model):
        numbers["W8A8"] = windowed_perplexity(model, docs, EVAL_WINDOW)
    with fake_quantized(model, keep_first=1):
        numbers["W8A8, first kept"] = windowed_perplexity(model, docs, EVAL_WINDOW)
    probe = heldout[: PROBE * EVAL_WINDOW].view(PROBE, EVAL_WINDOW)
    outliers = activation_outliers(model, probe)
    summary = attention_statistics(model, probe).summary(skip=16)
    numbers["kurtosis by layer"] = outliers.hidden_kurtosis.tolist()
    numbers["max |activation| by layer"] = outliers.hidden_max_abs.tolist()
    numbers["mass on token 0"] = summary["sink_mass"].mean().item()
    numbers["mass on the exit"] = summary["exit_mass"].mean().item()
    for label, (sinks, window) in CACHES.items():
        numbers[label] = hfa.perplexity(model, heldout, hfa.SinkCache(sinks, window), progress=False).ppl
    return numbers


def run(context: Context) -> str:
    """Every cure, every seed: trained, then measured."""
    if MODEL not in context.models:
        return f"(needs --models {MODEL})"
    steps, eval_tokens = (2, 2 * EVAL_WINDOW) if context.quick else (STEPS, EVAL_TOKENS)
    heldout = context.stream(MODEL, "stdlib", eval_tokens)
    results: dict[str, list[dict]] = {label: [] for label in RUNS}
    for seed in SEEDS:  # seed by seed: a stopped run has whole seeds done
        for label, options in RUNS.items():
            patch_lr = LR if label in SLOW else PATCH_LR
            results[label].append(
                context.cells.get(
                    f"retrofit/{MODEL}/{label}/{steps}x{BATCH}x{LENGTH}/seed{seed}/{eval_tokens}",
                    lambda label=label, options=options, seed=seed, lr=patch_lr: _after(
                        fine_tune(context, label, options, heldout, steps, seed, measure, False, patch_lr=lr)
                    ),
                )
            )
    kept = {label: [_without_large_scalars(r) for r in runs] for label, runs in results.items()}
    (context.out / "retrofit.json").write_text(json.dumps(kept, indent=1))
    plot_retrofit(results, context.out / "retrofit.png")
    columns = ["fp32", "W8A8", "W8A8, first kept", *CACHES, "mass on token 0", "mass on the exit"]
    rows = []
    for label, runs in results.items():
        cells = [_cell([r[c] for r in runs], "mass" in c) for c in columns]
        kurtosis = _cell([max(r["kurtosis by layer"]) for r in runs], False, digits=0)
        largest = _cell([max(r["max |activation| by layer"]) for r in runs], False, digits=0)
        rows.append([label, *cells, kurtosis, largest])
    note = (
        f"{SHORT_NAME[MODEL]}; each run {steps} steps x {BATCH} windows of {LENGTH} tokens; mean ± half the spread "
        f"of seeds {', '.join(map(str, SEEDS))} (data order and LoRA initialisation). Held-out: the first "
        f"{eval_tokens} tokens of the held-out split, perplexity in windows of {EVAL_WINDOW}, the caches streaming "
        f"all of them; outliers and masses on {PROBE} windows of {EVAL_WINDOW} (masses over queries after the "
        "16th; for the clipped softmax they are the softmax's, before the clip)."
    )
    return (
        markdown(["run", *columns, "kurtosis (max over layers)", "largest activation"], rows) + "\n\n" + note
    )


def _after(trained: dict) -> dict:
    learned = {"losses": trained["losses"], "seconds": trained["seconds"], "scalars": trained["sink_logits"]}
    return {**trained["after"], **learned}


def _without_large_scalars(run: dict) -> dict:
    """``run`` for the JSON file: the learned scalars kept where they are per head (sinks, clip bounds, head
    gates), left out where they are per channel (the element gate's 17k biases; they stay in the cells)."""
    size = sum(len(row) for row in run["scalars"])
    return run if size <= MAX_SCALARS else {k: v for k, v in run.items() if k != "scalars"}


def _cell(values: list[float], mass: bool, digits: int | None = None) -> str:
    digits = (3 if mass else 2) if digits is None else digits
    mean, spread = float(np.mean(values)), (max(values) - min(values)) / 2
    return f"{mean:,.{digits}f} ± {spread:,.{digits}f}" if len(values) > 1 else f"{mean:,.{digits}f}"


def plot_retrofit(results: dict[str, list[dict]], path: Path) -> None:
    """Kurtosis by layer (left, log scale) and perplexity in fp32, W8A8 and window-only streaming (right; a run
    that diverged, fp32 perplexity over `DIVERGED` x LoRA alone's, is named on the panel instead of drawn)."""
    fig, axes = figure(2, width=5.5, height=3.8)
    baseline = np.mean([r["fp32"] for r in results["LoRA alone"]])
    diverged = {
        label for label, runs in results.items() if np.mean([r["fp32"] for r in runs]) > DIVERGED * baseline
    }
    for label, runs in results.items():
        kurtosis = np.mean([r["kurtosis by layer"] for r in runs], axis=0)
        name = f"{label} (diverged)" if label in diverged else label
        axes[0].semilogy(range(len(kurtosis)), kurtosis, marker=".", label=name)
    axes[0].set(xlabel="layer", ylabel="kurtosis of the layer's output", title="outliers after the retrofit")
    axes[0].legend(fontsize=6, loc="upper left")
    measures = ["fp32", "W8A8", "window-only (0+256)"]
    labels = [label for label in results if label not in diverged]
    width = 0.8 / len(measures)
    for i, m in enumerate(measures):
        values = [np.mean([r[m] for r in results[label]]) for label in labels]
        axes[1].bar([k + (i - 1) * width for k in range(len(labels))], values, width, label=m)
    axes[1].set_xticks(range(len(labels)), [textwrap.fill(label, 10) for label in labels], fontsize=7)
    top = max(np.mean([r[m] for r in results[label]]) for label in labels for m in measures)
    axes[1].set(ylabel="held-out perplexity", title="what each cure costs and buys", ylim=(0, 1.3 * top))
    for label in diverged:
        fp32 = np.mean([r["fp32"] for r in results[label]])
        axes[1].text(
            0.02,
            0.97,
            f"not drawn: {label} diverged\n(fp32 perplexity {fp32:,.0f})",
            fontsize=7,
            transform=axes[1].transAxes,
            va="top",
        )
    axes[1].legend(fontsize=7, loc="upper right")
    save(fig, path)
