"""Section 10b: the depth-100% passkeys of sections 9 and 10 again, on version 2 of the prompts (issue 70).

Version 1 put the needle at depth 100% directly before the question, where SmolLM2, unchanged at 4k, echoes the
needle's last sentence (" the pass key") instead of writing the key it knows. Version 2 keeps one filler unit
between them and changes no other prompt, so sections 9's and 10's cells at depths 0 and 50% stand. Cells: the
unchanged model at 4k on seeds 0-2 (the task's own check, inside the trained length); every method of section 9
at 4k-32k on seed 0; every method of section 10 at 16k and 32k on seeds 0-2. One prompt per cell (depth 100%
only), each in a fresh process that reports its time and peak resident memory; the loglikelihood requests
compute logits only at the key's positions, so these memory figures are not comparable with sections 9's and 10's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from sections.figures import figure, save
from sections.tables import markdown

import hf_attnscale as hfa

from . import recall, rerope
from .context import SHORT_NAME, TRAINED_LENGTH, Context
from .recall import MODEL, PASSKEY_TASKS

SECTION_10_LENGTHS = (16384, 32768)
GOAL_ORDER = ("ReRoPE w2048 + logn", "YaRN", "leaky ReRoPE w1024 k16 + logn", "dynamic NTK")


def methods() -> dict[str, dict]:
    """Section 9's and section 10's methods by label (the labels they share name the same model_args)."""
    return {**recall.methods(), **rerope.methods()}


def cells() -> list[tuple[str, int, int]]:
    """Every (method, haystack length, seed), in the order they run: the task's check inside the trained length
    first, then section 9's cheap short cells, then section 10's methods past the trained length in tiers (the
    favoured patch and YaRN; leaky ReRoPE and dynamic NTK, the other two that section 12 reads at 8x; the rest),
    each tier seed 0 before the others and 16k before 32k; then section 9's other methods past 8k."""
    first = [("unpatched", 4096, seed) for seed in rerope.SEEDS]
    short = [(label, n, 0) for n in (4096, 8192) for label in recall.methods() if label != "unpatched"]
    short.append(("unpatched", 8192, 0))
    past = [
        (label, n, seed)
        for seed in rerope.SEEDS
        for n in SECTION_10_LENGTHS
        for label in [*GOAL_ORDER, *(m for m in rerope.methods() if m not in GOAL_ORDER)]
    ]
    past.sort(key=lambda cell: (_tier(cell[0]), cell[2] > 0, cell[1] > 16384))
    section_9_past = [
        (label, n, 0)
        for n in SECTION_10_LENGTHS
        for label in recall.methods()
        if label not in rerope.methods()
    ]
    ordered = first + short + past + section_9_past
    return list(dict.fromkeys(ordered))


def _tier(label: str) -> int:
    """0 for the first two of `GOAL_ORDER`, 1 for its other two, 2 for every other method."""
    return GOAL_ORDER.index(label) // 2 if label in GOAL_ORDER else 2


def key(label: str, length: int, seed: int) -> str:
    return f"depth100-v2/{MODEL}/{PASSKEY_TASKS[length]}/{label}/seed{seed}"


def run(context: Context) -> str:
    """Every cell, kept as it is computed (or, with ``--kept-only``, those kept so far); the tables and figure."""
    path = str(hfa.fetch(MODEL))
    common = {"pretrained": path, "dtype": "float32", "max_length": 2 * recall.DOCUMENT_TOKENS}
    results: dict[tuple[str, int, int], dict] = {}
    todo = cells()[:1] if context.quick else cells()
    reported = {} if context.quick else reported_results(context.out)
    for label, length, seed in todo:
        cell = key(label, length, seed) + ("/quick" if context.quick else "")
        earlier = reported.get(f"{label}/{length}/seed{seed}")
        if earlier is not None and not context.cells.path(cell).is_file():
            results[(label, length, seed)] = earlier
            continue
        if context.kept_only and not context.cells.path(cell).is_file():
            continue
        results[(label, length, seed)] = rerope.one_cell(
            context,
            key(label, length, seed),
            PASSKEY_TASKS[length],
            {**common, **methods()[label]},
            seed=seed,
        )
    return report(results, context.out)


def reported_results(out: Path) -> dict[str, dict]:
    """This section's cells as its last report wrote them (``depth100.json``, committed beside the tables), so that
    a machine whose kept cells are gone computes only the cells that report lacks."""
    path = out / "depth100.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def found_mark(result: dict) -> str:
    return "Y" if result["acc,none"] == 1 else "N"


def report(results: dict[tuple[str, int, int], dict], out: Path) -> str:
    """The depth-100% table (v2), the keys found over all depths with sections 9's and 10's v1 cells at depths 0
    and 50%, the cost table, and the figure."""
    flat = {f"{label}/{length}/seed{seed}": value for (label, length, seed), value in results.items()}
    (out / "depth100.json").write_text(json.dumps(flat, indent=1, default=str))
    section_10 = rerope.reported_results(out)
    section_9 = rerope.section_9_results(out)
    lengths = sorted({length for _, length, _ in results}) or list(PASSKEY_TASKS)
    labels = [label for label in methods() if any(r[0] == label for r in results)]
    trained = TRAINED_LENGTH[MODEL]
    header = [f"{n // 1024}k ({n / trained:g}x)" for n in lengths]

    at_100, combined, cost = [], [], []
    for label in labels:
        row, whole, spent = [label], [label], [label]
        for length in lengths:
            runs = [(s, results[(label, length, s)]) for s in rerope.SEEDS if (label, length, s) in results]
            if not runs:
                row.append("not run")
                whole.append("not run")
                spent.append("not run")
                continue
            marks = "".join(found_mark(r) for _, r in runs)
            mean = sum(r["key_loglikelihood,none"] for _, r in runs) / len(runs)
            row.append(f"{marks.count('Y')}/{len(runs)} {marks} ({mean:.2f})")
            earlier = []
            for seed, result in runs:
                task = PASSKEY_TASKS[length]
                v1 = section_10.get(label, {}).get(f"{task}/seed{seed}")
                if v1 is None and seed == 0:
                    v1 = section_9.get(label, {}).get(task)
                if v1 is not None:
                    earlier.append(v1["acc_depth_0,none"] + v1["acc_depth_50,none"] + result["acc,none"])
            whole.append(f"{sum(earlier):.0f}/{3 * len(earlier)}" if earlier else "-")
            timed = [r for _, r in runs if "seconds" in r]
            spent.append(
                f"{sum(r['seconds'] for r in timed) / len(timed):.0f} s, "
                f"{max(r['peak_gib'] for r in timed):.2f} GiB"
            )
        at_100.append(row)
        combined.append(whole)
        cost.append(spent)
    plot(results, labels, lengths, out / "depth100.png")
    return (
        f"**{SHORT_NAME[MODEL]}** (trained at {trained}), passkey prompts v2 at depth 100% (the needle one "
        "filler unit before the question): keys found of the seeds run, each seed's Y/N in seed order, and the "
        "key's mean log-likelihood\n\n"
        + markdown(["method", *header], at_100)
        + "\n\nKeys found over depths 0, 50% (version 1 = version 2 there: sections 9 and 10) and 100% (v2), of "
        "the seeds run at 100%\n\n"
        + markdown(["method", *header], combined)
        + "\n\nTime of one depth-100% prompt (mean over seeds, model load included) and the peak resident memory "
        "of the process that ran it\n\n" + markdown(["method", *header], cost)
    )


def plot(results: dict, labels: list[str], lengths: list[int], path: Path) -> None:
    """One row per method, one column per (length, seed): found (green), missed (red), not run (white)."""
    columns = [(n, s) for n in lengths for s in rerope.SEEDS]
    grid = torch.full((len(labels), len(columns)), math.nan)
    for i, label in enumerate(labels):
        for j, (n, s) in enumerate(columns):
            if (label, n, s) in results:
                grid[i, j] = results[(label, n, s)]["acc,none"]
    fig, (ax,) = figure(1, width=1.0 + 0.45 * len(columns), height=1.0 + 0.4 * len(labels))
    ax.imshow(grid, cmap="RdYlGn", vmin=-0.6, vmax=1.6, aspect="auto")
    for i in range(len(labels)):
        for j in range(len(columns)):
            value = grid[i, j].item()
            word = "" if math.isnan(value) else "found" if value == 1 else "missed"
            ax.text(j, i, word, ha="center", va="center", fontsize=6)
    ax.set_xticks(range(len(columns)), [f"{n // 1024}k s{s}" for n, s in columns], rotation=90, fontsize=7)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    for j, (_, s) in enumerate(columns):
        if s == 0 and j:
            ax.axvline(j - 0.5, color="black", lw=0.8)
    ax.set_title(
        f"{SHORT_NAME[MODEL]}: the key at depth 100%,\nprompts v2 (blank: not run)", fontsize=9, loc="left"
    )
    save(fig, path)
