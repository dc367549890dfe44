"""Section 13: RULER past the trained length (issue 84), lm-eval's own synthetic tasks on SmolLM2.

Each cell is one run of lm-eval's ``simple_evaluate`` on one RULER task at one length, through the
``hf-attnscale`` model type, in a fresh process that reports its time and peak resident memory, kept as it is
computed. The samples are RULER's own (500 a task and length, drawn once with seed 42 and kept:
`hf_attnscale.integrations.lm_eval_ruler`), so every method reads the same ones; a cell scores the first 20
(``niah_single_1``) or 10 (the others), greedy, with RULER's own generation lengths.

In the order the cells run:
1. the unchanged model at 4k and 8k on all six tasks: its ceiling, inside its trained length (8,192);
2. at 16k, on the tasks it scores above zero at 8k, every method: unchanged, YaRN (factor 4), dynamic NTK,
   ReRoPE w2048 + logn, leaky ReRoPE w1024 k16 + logn, Self-Extend G5 w2048 + logn, DCA s6144 l512 and STRING
   S8320 W128;
3. at 32k, the three methods with the highest mean score at 16k.
"""

from __future__ import annotations

import functools
import json
import math
import random
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from sections.figures import figure, save
from sections.tables import markdown

import hf_attnscale as hfa
from hf_attnscale.integrations.lm_eval_ruler import SYNTHETIC

from . import extend, rerope, shifted
from .context import SHORT_NAME, TRAINED_LENGTH, Context
from .recall import MODEL

CEILING = (4096, 8192)
PAST = (16384, 32768)
SAMPLES = {"niah_single_1": 20}
"""Samples a cell scores: 20 for niah_single_1, 10 for the others (`samples`)."""
BEST_AT_16K = 3


def methods() -> dict[str, dict]:
    """Each method's model_args beyond the common ones, in the order its 16k cells run."""
    section_10 = rerope.methods()
    logn = {"scale": "logn", "train_length": TRAINED_LENGTH[MODEL]}
    return {
        "ReRoPE w2048 + logn": section_10["ReRoPE w2048 + logn"],
        "unpatched": {},
        f"STRING S{shifted.STRING_PAST['string_shift']} W128": shifted.STRING_PAST,
        "Self-Extend G5 w2048 + logn": {**extend.SELF_EXTEND, **logn},
        "leaky ReRoPE w1024 k16 + logn": section_10["leaky ReRoPE w1024 k16 + logn"],
        "YaRN": section_10["YaRN"],
        "dynamic NTK": section_10["dynamic NTK"],
        "DCA s6144 l512": extend.DUAL_CHUNK,
    }


def samples(task: str) -> int:
    return SAMPLES.get(task, 10)


Cell = tuple[str, str, int]
"""(method, task, length)."""


def scored(task: str, model_args: dict, metadata: dict, limit: int, threads: int) -> dict:
    """One lm-eval run of RULER's ``task`` in this (fresh) process: the score, each sample's score, the wall
    time and the process's peak resident memory."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from hf_attnscale.integrations.lm_eval_model import register
    from hf_attnscale.integrations.lm_eval_ruler import offline_and_cached

    register()
    torch.set_num_threads(threads)
    started = time.perf_counter()
    with offline_and_cached():
        results = simple_evaluate(
            model="hf-attnscale",
            model_args=model_args,
            tasks=[task],
            task_manager=TaskManager(metadata=metadata),
            limit=limit,
            batch_size=1,
            device="cpu",
            bootstrap_iters=0,
            log_samples=True,
        )
    length = str(metadata["max_seq_lengths"][0])
    rows = results["samples"][task]
    return {
        "score": results["results"][task][f"{length},none"],
        "per_sample": [row[length] for row in rows],
        "answers": [row["filtered_resps"][0] for row in rows],
        "seconds": time.perf_counter() - started,
        "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def interval(scores: list[float], level: float = 0.95) -> tuple[float, float]:
    """A 95% interval on the mean of ``scores``: Wilson's where every score is 0 or 1, else a percentile bootstrap
    (10,000 resamples, seed 0)."""
    n = len(scores)
    mean = sum(scores) / n
    if set(scores) <= {0.0, 1.0}:
        z = 1.959964
        centre = (mean + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        return max(0.0, centre - half), min(1.0, centre + half)
    draw = random.Random(0)
    means = sorted(sum(draw.choices(scores, k=n)) / n for _ in range(10_000))
    return means[int(0.025 * len(means))], means[int(0.975 * len(means)) - 1]


def cells(results: dict[Cell, dict]) -> list[Cell]:
    """Every cell in the order it runs; the 16k tasks and the 32k methods as far as ``results`` decide them
    (before the 8k ceiling is in, every task at 16k; before 16k is in, the first three methods at 32k)."""
    order: list[Cell] = [("unpatched", task, length) for length in CEILING for task in SYNTHETIC]
    at_8k = {task: results.get(("unpatched", task, 8192)) for task in SYNTHETIC}
    past_tasks = [task for task in SYNTHETIC if at_8k[task] is None or at_8k[task]["score"] > 0]
    order += [(label, task, PAST[0]) for label in methods() for task in past_tasks]
    order += [(label, task, PAST[1]) for label in best_at_16k(results, past_tasks) for task in past_tasks]
    return order


def best_at_16k(results: dict[Cell, dict], tasks: list[str]) -> list[str]:
    """The `BEST_AT_16K` methods of highest mean score over ``tasks`` at 16k (those with every 16k cell in, ties in
    `methods`' order), then the others in that order."""
    done = {
        label: sum(results[(label, task, PAST[0])]["score"] for task in tasks) / len(tasks)
        for label in methods()
        if all((label, task, PAST[0]) in results for task in tasks)
    }
    ranked = sorted(done, key=lambda label: -done[label]) + [
        label for label in methods() if label not in done
    ]
    return ranked[:BEST_AT_16K]


def key(cell: Cell) -> str:
    label, task, length = cell
    return f"ruler/{MODEL}/{task}/{length}/{label}/{samples(task)}"


def run(context: Context) -> str:
    """Every cell, kept as it is computed (with ``--kept-only``, those kept so far); the tables."""
    path = str(hfa.fetch(MODEL))
    results = reported_results(context.out)
    for cell in _schedule(context, results):
        label, task, length = cell
        kept = context.cells.path(key(cell)).is_file()
        if (cell in results and not kept) or (context.kept_only and not kept):
            continue
        model_args = {"pretrained": path, "dtype": "float32", "max_length": length + 512, **methods()[label]}
        metadata = {"tokenizer": path, "max_seq_lengths": [length]}
        limit = 1 if context.quick else samples(task)
        results[cell] = context.cells.get(
            key(cell) + ("/quick" if context.quick else ""),
            functools.partial(
                rerope.in_fresh_process, scored, task, model_args, metadata, limit, torch.get_num_threads()
            ),
        )
        if not context.quick:
            report(results, context.out)
    return report(results, context.out)


def _schedule(context: Context, results: dict[Cell, dict]) -> Iterator[Cell]:
    """The cells to visit: in ``--quick``, one 4k cell; else `cells`, re-decided after each (the 16k tasks
    follow the 8k cells, the 32k methods the 16k ones)."""
    if context.quick:
        yield ("unpatched", "niah_single_1", CEILING[0])
        return
    visited: list[Cell] = []
    while (pending := [cell for cell in cells(results) if cell not in visited]) and not context.kept_only:
        visited.append(pending[0])
        yield pending[0]
    yield from (cell for cell in cells(results) if cell not in visited)


def reported_results(out: Path) -> dict[Cell, dict]:
    """This section's cells as its last report wrote them (``ruler.json``, committed beside the tables)."""
    path = out / "ruler.json"
    if not path.is_file():
        return {}
    return {(c["method"], c["task"], c["length"]): c["result"] for c in json.loads(path.read_text())}


def _score(result: dict | None, ceiling: dict | None = None) -> str:
    if result is None:
        return "not run"
    low, high = interval(result["per_sample"])
    text = f"{result['score']:.2f} [{low:.2f}, {high:.2f}]"
    if ceiling is not None and ceiling["score"] > 0:
        text += f" ({result['score'] / ceiling['score']:.0%})"
    return text


def report(results: dict[Cell, dict], out: Path) -> str:
    """The ceiling table (4k, 8k), the table past it (16k, 32k: each score with its interval and as a fraction
    of the unchanged model's at 8k), each cell's cost; ``ruler.json``."""
    kept = [
        {"method": label, "task": task, "length": length, "result": value}
        for (label, task, length), value in results.items()
    ]
    (out / "ruler.json").write_text(json.dumps(kept, indent=1, default=str))
    name = SHORT_NAME[MODEL]
    ceiling_rows = [
        [f"{length:,}", *[_score(results.get(("unpatched", task, length))) for task in SYNTHETIC]]
        for length in CEILING
    ]
    counts = ", ".join(f"{samples(task)} for {task}" for task in SYNTHETIC[:2]) + " ..."
    tables = [
        f"**{name}** (trained at {TRAINED_LENGTH[MODEL]}), unchanged, inside its trained length: RULER's score "
        f"on each synthetic task ({counts}), its 95% interval in brackets\n\n"
        + markdown(["length", *SYNTHETIC], ceiling_rows)
    ]
    tasks = [t for t in SYNTHETIC if any((label, t, PAST[0]) in results for label in methods())]
    past_rows, cost_rows = [], []
    for length in PAST:
        for label in methods():
            row = [results.get((label, task, length)) for task in tasks]
            if not any(row):
                continue
            past_rows.append(
                [f"{length:,}", label]
                + [_score(r, results.get(("unpatched", t, 8192))) for r, t in zip(row, tasks, strict=True)]
            )
            cost_rows.append(
                [
                    f"{length:,}",
                    label,
                    *[f"{r['seconds']:.0f} s, {r['peak_gib']:.1f} GiB" if r else "-" for r in row],
                ]
            )
    draw(results, out / "ruler.png")
    if past_rows:
        tables.append(
            f"**{name}** past its trained length: RULER's score, its 95% interval, and in brackets the score as a "
            "fraction of the unchanged model's at 8k\n\n" + markdown(["length", "method", *tasks], past_rows)
        )
        tables.append(
            "Time of each cell (model load, lm-eval's task index and every sample included) and the peak "
            "resident memory of its process\n\n" + markdown(["length", "method", *tasks], cost_rows)
        )
    return "\n\n".join(tables)


def draw(results: dict[Cell, dict], path: Path) -> None:
    """One panel a task: each method's score (95% interval as error bars) by length, the unchanged model's joined
    by a line; lengths on a log scale; the trained length marked."""
    fig, axes = figure(3, width=4.0, height=3.2, rows=2, sharey=True)
    lengths = [*CEILING, *PAST]
    for ax, task in zip(axes, SYNTHETIC, strict=True):
        if not any(key[1] == task for key in results):
            ax.text(0.5, 0.5, "not run yet", ha="center", va="center", transform=ax.transAxes, color="grey")
        for index, label in enumerate(methods()):
            points = [(n, results[(label, task, n)]) for n in lengths if (label, task, n) in results]
            if not points:
                continue
            nudge = 2 ** (0.04 * (index - len(methods()) / 2))  # methods side by side at one length
            xs = [n * (1 if label == "unpatched" else nudge) for n, _ in points]
            ys = [r["score"] for _, r in points]
            bounds = [interval(r["per_sample"]) for _, r in points]
            spread = [[y - lo for y, (lo, _) in zip(ys, bounds)], [hi - y for y, (_, hi) in zip(ys, bounds)]]
            style = "-o" if label == "unpatched" else "o"
            ax.errorbar(xs, ys, yerr=spread, fmt=style, capsize=2, markersize=4, label=label)
        ax.axvline(TRAINED_LENGTH[MODEL], color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlim(lengths[0] / 1.25, lengths[-1] * 1.25)
        ax.set_xticks(lengths, [f"{n // 1024}k" for n in lengths])
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(task)
    axes[0].set_ylabel("RULER score")
    axes[3].set_ylabel("RULER score")
    axes[0].legend(fontsize=6, loc="lower left")
    fig.suptitle(f"{SHORT_NAME[MODEL]} on RULER's synthetic tasks (dotted: its trained length)", fontsize=10)
    save(fig, path)
