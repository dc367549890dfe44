"""Section 9: lm-eval past the trained length, perplexity by position beside passkey retrieval (issue 48).

SmolLM2 (trained at 8,192 tokens) runs through lm-eval's ``simple_evaluate`` with the ``hf-attnscale`` model type,
one cell per (method, task), under: no change; ``logn``; dynamic NTK and YaRN (factor 4, as section 5); YaRN +
logn; a window-only cache of 1,024 and ``SinkCache(4, 1020)`` and ``(4, 4092)`` (``window=``: every request
streamed whole). Tasks: ``hfa_kjv_books``'s first book (Genesis) cut to its first 32,768 tokens, scored by
position (``ppl_0-2k`` ... ``ppl_16k-32k``); ``hfa_passkey_4k`` ... ``_32k``, one prompt per depth (seed 0).
Dense methods read every request whole (``max_length`` above the longest), so nothing is cut.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch
from sections.figures import figure, save
from sections.tables import markdown

import hf_attnscale as hfa

from .context import SHORT_NAME, TRAINED_LENGTH, Context
from .dense import rope_settings

MODEL = "smollm2-135m"
PASSKEY_TASKS = {
    4096: "hfa_passkey_4k",
    8192: "hfa_passkey_8k",
    16384: "hfa_passkey_16k",
    32768: "hfa_passkey_32k",
}
DEPTHS = (0.0, 0.5, 1.0)
DOCUMENT_TOKENS = 32768
BUCKETS = ("0-2k", "2k-4k", "4k-8k", "8k-16k", "16k-32k")


def methods() -> dict[str, dict]:
    """Each method's model_args beyond the common ones."""
    rope = rope_settings(MODEL)
    logn = {"scale": "logn", "train_length": TRAINED_LENGTH[MODEL]}
    return {
        "unpatched": {},
        "logn": logn,
        "dynamic NTK": {"rope_parameters": rope["dynamic NTK"]},
        "YaRN": {"rope_parameters": rope["YaRN"]},
        "YaRN + logn": {"rope_parameters": rope["YaRN"], **logn},
        "window-only (0+1024)": {"sink_tokens": 0, "window": 1024},
        "SinkCache(4, 1020)": {"sink_tokens": 4, "window": 1020},
        "SinkCache(4, 4092)": {"sink_tokens": 4, "window": 4092},
    }


def evaluate(task: str, model_args: dict, metadata: dict, limit: int | None) -> dict:
    """One lm-eval run of ``task`` through the hf-attnscale model type: its results dict."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from hf_attnscale.integrations.lm_eval_tasks_data import TASKS_DIR

    results = simple_evaluate(
        model="hf-attnscale",
        model_args=model_args,
        tasks=[task],
        # Our tasks only: indexing lm-eval's own ~14,000 task files takes 10-15 s a cell and changes no number.
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=metadata),
        limit=limit,
        batch_size=1,
        device="cpu",
        bootstrap_iters=0,
    )
    return results["results"][task]


def run(context: Context) -> str:
    """Every (method, task) cell, shortest work first; the table and the figure."""
    path = str(hfa.fetch(MODEL))
    passkeys = dict(list(PASSKEY_TASKS.items())[:1]) if context.quick else PASSKEY_TASKS
    depths = DEPTHS[-1:] if context.quick else DEPTHS
    document_tokens = 1024 if context.quick else DOCUMENT_TOKENS
    common = {"pretrained": path, "dtype": "float32", "max_length": 2 * DOCUMENT_TOKENS, "chunk_size": 1024}
    metadata = {"pretrained": path, "per_cell": 1, "depths": list(depths), "first_tokens": document_tokens}
    jobs = [(length, task, None) for length, task in list(passkeys.items())[:2]]
    jobs += [(document_tokens, "hfa_kjv_books", 1)]
    jobs += [(length, task, None) for length, task in list(passkeys.items())[2:]]
    table: dict[str, dict] = {label: {} for label in methods()}
    streamed_first = sorted(methods().items(), key=lambda item: "window" not in item[1])  # cheap cells first
    for _, task, limit in jobs:
        for label, args in streamed_first:
            table[label][task] = context.cells.get(
                f"recall/{MODEL}/{task}/{label}/{document_tokens}" + ("/quick" if context.quick else ""),
                functools.partial(evaluate, task, {**common, **args}, metadata, limit),
            )
    (context.out / "recall.json").write_text(json.dumps(table, indent=1, default=str))
    plot_recall(table, passkeys, depths, context.out / "recall.png")
    trained = TRAINED_LENGTH[MODEL]
    ppl_rows, passkey_rows = [], []
    for label, by_task in table.items():
        ppl = [by_task["hfa_kjv_books"].get(f"ppl_{b},none", math.nan) for b in BUCKETS]
        ppl_rows.append([label, *[f"{p:.2f}" for p in ppl]])
        passkey_rows.append(
            [
                label,
                *[
                    f"{by_task[t]['acc,none'] * len(depths):.0f}/{len(depths)} "
                    f"({by_task[t]['key_loglikelihood,none']:.2f})"
                    for t in passkeys.values()
                ],
            ]
        )
    return (
        f"**{SHORT_NAME[MODEL]}** (trained at {trained}): perplexity by position over Genesis' first "
        f"{document_tokens} tokens (`hfa_kjv_books`, one document)\n\n"
        + markdown(["method", *[f"positions {b}" for b in BUCKETS]], ppl_rows)
        + f"\n\nPasskeys found (greedy: every key token the argmax), of {len(depths)} prompts at depths "
        f"{', '.join(f'{d:.0%}' for d in depths)}, and the key's mean log-likelihood (`hfa_passkey_*`)\n\n"
        + markdown(["method", *[f"{n // 1024}k ({n / trained:g}x)" for n in passkeys]], passkey_rows)
    )


def plot_recall(
    table: dict[str, dict], passkeys: dict[int, str], depths: tuple[float, ...], path: Path
) -> None:
    """One panel per method: whether the key was found, by haystack length (x) and depth (y)."""
    labels = list(table)
    fig, axes = figure(4, width=2.6, height=2.4, rows=(len(labels) + 3) // 4)
    for ax, label in zip(axes, labels):
        grid = torch.tensor(
            [
                [
                    table[label][task].get(f"acc_depth_{round(100 * d)},none", math.nan)
                    for task in passkeys.values()
                ]
                for d in depths
            ]
        )
        # Light colours, dark text; a cell not run stays white and says so, never "missed".
        ax.imshow(grid, cmap="RdYlGn", vmin=-0.6, vmax=1.6, origin="upper", aspect="auto")
        for (i, j), value in zip(
            [(i, j) for i in range(len(depths)) for j in range(len(passkeys))], grid.flatten().tolist()
        ):
            word = "not run" if math.isnan(value) else "found" if value == 1 else "missed"
            ax.text(
                j,
                i,
                word,
                ha="center",
                va="center",
                fontsize=7,
                color="0.5" if math.isnan(value) else "black",
            )
        ax.set_xticks(range(len(passkeys)), [f"{n // 1024}k" for n in passkeys])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        within = sum(n <= TRAINED_LENGTH[MODEL] for n in passkeys)  # haystacks inside the trained context
        if within < len(passkeys):
            ax.axvline(within - 0.5, color="black", lw=1, ls="--")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("haystack (tokens)", fontsize=8)
        ax.set_ylabel("key depth", fontsize=8)
    fig.suptitle(
        f"{SHORT_NAME[MODEL]}: passkey found (one prompt per cell), by haystack length and key depth (right of the "
        "dashed line: past the "
        "trained 8k)",
        fontsize=10,
    )
    save(fig, path)
