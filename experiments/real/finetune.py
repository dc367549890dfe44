"""Section 7 (new): fine-tune an exit into a pretrained model, and ask whether it removes the need for sinks.

StreamingLLM's Table 3 pre-trains with a learnable sink token or a zero sink. Here SmolLM2 is fine-tuned three
ways with PEFT, the same steps, data and seed: LoRA plus a learnable per-head sink logit, LoRA plus zero_kv,
and LoRA alone (the control). Before and after: held-out perplexity, window-only streaming (0+256) and
sink+window streaming (4+252), and the attention mass on the exit and on the first token.

Data: random windows of `LENGTH` tokens from the built-in corpus's training split (stdlib sources); held-out
numbers on its held-out split. LoRA (rank `RANK`, attention projections, ``hfa.lora_config``) at `LR`; the sink
logits at `PATCH_LR` (they start at 0 and are few).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from peft import get_peft_model
from sections.figures import figure, save
from sections.tables import markdown
from tqdm.auto import tqdm

import hf_attnscale as hfa
from hf_attnscale.diagnostics import attention_statistics
from hf_attnscale.evaluation.corpus import builtin_documents
from hf_attnscale.evaluation.perplexity import windowed_perplexity

from .context import SHORT_NAME, Context

MODEL = "smollm2-135m"
RUNS = {
    "LoRA + learnable sink": {"sink_logit": "learnable"},
    "LoRA + zero_kv": {"zero_kv": True},
    "LoRA alone (control)": None,
}
STEPS, BATCH, LENGTH = 80, 4, 256
RANK, LR, PATCH_LR = 8, 5e-4, 5e-2
SEED = 0
EVAL_TOKENS = 8192
"""Held-out tokens: perplexity in windows of `EVAL_WINDOW`, and the stream the caches read."""
EVAL_WINDOW = 1024
CACHES = {"window-only (0+256)": (0, 256), "sink+window (4+252)": (4, 252)}


def training_docs(context: Context) -> list[torch.Tensor]:
    """The training split's documents of more than `LENGTH` tokens, tokenized."""
    tokenizer = context.tokenizer(MODEL)
    docs = [torch.tensor(tokenizer(d.text).input_ids) for d in builtin_documents("train")]
    return [d for d in docs if d.numel() > LENGTH]


def batch(docs: list[torch.Tensor], generator: torch.Generator) -> torch.Tensor:
    """`BATCH` random windows of `LENGTH` tokens, documents weighted by length."""
    weights = torch.tensor([float(d.numel() - LENGTH) for d in docs])
    rows = []
    for i in torch.multinomial(weights, BATCH, replacement=True, generator=generator).tolist():
        start = int(torch.randint(0, docs[i].numel() - LENGTH, (1,), generator=generator))
        rows.append(docs[i][start : start + LENGTH])
    return torch.stack(rows)


@torch.no_grad()
def measure(model: torch.nn.Module, heldout: torch.Tensor) -> dict:
    """Held-out perplexity, the two caches' streaming perplexity, and the mass on the exit and on token 0."""
    model.eval()
    numbers = {"held-out ppl": windowed_perplexity(model, [heldout], EVAL_WINDOW)}
    for label, (sinks, window) in CACHES.items():
        numbers[label] = hfa.perplexity(model, heldout, hfa.SinkCache(sinks, window), progress=False).ppl
    probe = heldout[: 2 * EVAL_WINDOW].view(2, EVAL_WINDOW)
    summary = attention_statistics(model, probe).summary(skip=16)
    numbers["mass on token 0"] = summary["sink_mass"].mean().item()
    numbers["mass on the exit"] = summary["exit_mass"].mean().item()
    return numbers


def fine_tune(
    context: Context,
    label: str,
    options: dict | None,
    heldout: torch.Tensor,
    steps: int,
    seed: int = SEED,
    measure: Callable[[torch.nn.Module, torch.Tensor], dict] = measure,
    measure_before: bool = True,
    patch_lr: float = PATCH_LR,
) -> dict:
    """One run: the numbers (``measure``) before (if ``measure_before``) and after ``steps`` steps from ``seed``,
    the losses, the seconds."""
    model = hfa.patch(context.load(MODEL), **(options or {}))
    before = measure(model, heldout) if measure_before else None
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, hfa.lora_config(model, r=RANK, lora_alpha=2 * RANK))
    patch_params = [p for _, p in hfa.trainable_parameters(peft_model)]
    patch_ids = {id(p) for p in patch_params}
    lora_params = [p for p in peft_model.parameters() if p.requires_grad and id(p) not in patch_ids]
    groups = [{"params": lora_params, "lr": LR}] + (
        [{"params": patch_params, "lr": patch_lr}] if patch_params else []
    )
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    docs, generator = training_docs(context), torch.Generator().manual_seed(seed)
    peft_model.train()
    losses, started = [], time.perf_counter()
    for _ in tqdm(range(steps), desc=label, mininterval=30):
        ids = batch(docs, generator)
        loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    seconds = time.perf_counter() - started
    merged = peft_model.merge_and_unload()
    after = measure(merged, heldout)
    sinks = [
        p.detach().flatten().tolist() for p in patch_params if p.numel() < 1000
    ]  # not the gates' weights
    return {"before": before, "after": after, "losses": losses, "seconds": seconds, "sink_logits": sinks}


def run(context: Context) -> str:
    """The three fine-tuning runs, before and after."""
    if MODEL not in context.models:
        return f"(needs --models {MODEL})"
    steps, eval_tokens = (2, 2 * EVAL_WINDOW) if context.quick else (STEPS, EVAL_TOKENS)
    heldout = context.stream(MODEL, "stdlib", eval_tokens)  # the held-out split, as sections 1-3 read it
    results = {
        label: context.cells.get(
            f"finetune/{MODEL}/{label}/{steps}x{BATCH}x{LENGTH}/seed{SEED}/{eval_tokens}",
            lambda label=label, options=options: fine_tune(context, label, options, heldout, steps),
        )
        for label, options in RUNS.items()
    }
    (context.out / "finetune.json").write_text(json.dumps(results, indent=1))
    plot_finetune(results, context.out / "finetune.png")
    measures = list(next(iter(results.values()))["before"])
    rows = []
    for label, r in results.items():
        for when in ("before", "after"):
            rows.append(
                [
                    label,
                    when,
                    *[f"{r[when][m]:.3f}" if "mass" in m else f"{r[when][m]:.2f}" for m in measures],
                ]
            )
    minutes = ", ".join(f"{label}: {r['seconds'] / 60:.0f} min" for label, r in results.items())
    note = (
        f"{SHORT_NAME[MODEL]}; {steps} steps x {BATCH} windows of {LENGTH} tokens (seed {SEED}); held-out: the first "
        f"{eval_tokens} tokens of the held-out split, perplexity in windows of {EVAL_WINDOW}, the caches streaming "
        f"all of them; masses averaged over layers, heads and queries after the 16th. Training time: {minutes}."
    )
    return markdown(["run", "", *measures], rows) + "\n\n" + note


def plot_finetune(results: dict[str, dict], path: Path) -> None:
    """Training loss (left) and window-only against sink+window perplexity before and after (right)."""
    fig, axes = figure(2, width=5, height=3.8)
    for label, r in results.items():
        losses = torch.tensor(r["losses"])
        smooth = losses.unfold(0, 10, 1).mean(1) if losses.numel() >= 10 else losses
        axes[0].plot(range(len(smooth)), smooth, label=label)
    axes[0].set(xlabel="step", ylabel="training loss (mean of 10 steps)", title="fine-tuning")
    axes[0].legend(fontsize=7)
    labels = list(results)
    width = 0.2
    for i, (measure, colour) in enumerate(zip(CACHES, ("tab:red", "tab:green"))):
        for j, when in enumerate(("before", "after")):
            values = [results[label][when][measure] for label in labels]
            offset = (2 * i + j - 1.5) * width
            axes[1].bar(
                [k + offset for k in range(len(labels))],
                values,
                width,
                color=colour,
                alpha=0.45 if when == "before" else 1.0,
                label=f"{measure}, {when}",
            )
    axes[1].set_xticks(range(len(labels)), [label.replace(" + ", "\n+ ") for label in labels], fontsize=7)
    axes[1].set(ylabel="streaming perplexity (held-out)", title="does a learned exit replace the sinks?")
    axes[1].legend(fontsize=7)
    save(fig, path)
