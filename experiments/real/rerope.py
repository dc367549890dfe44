"""Section 10: ReRoPE with log-n (Su's own recipe) against RoPE rescaling past the trained length (issue 55).

SmolLM2 (trained at 8,192 tokens) runs through lm-eval's ``simple_evaluate`` with the ``hf-attnscale`` model type,
on section 9's tasks: perplexity by position over Genesis' first 32,768 tokens (``hfa_kjv_books``), and the
passkeys ``hfa_passkey_4k`` ... ``_32k`` at depths 0, 50% and 100%, one prompt per depth for each of the seeds
0, 1, 2 (three prompts per cell). Methods: ReRoPE with w = 1024 and 2048, each with and without logn; leaky
ReRoPE (w = 1024, k = 16) with logn, as Su's patch; and section 9's unchanged model, dynamic NTK, YaRN and
YaRN + logn (factor 4), rerun on the same seeds. Every cell runs in a fresh process, which reports its time and
its peak resident memory.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import math
import multiprocessing
import resource
import time
from collections.abc import Callable
from pathlib import Path

import torch
from sections.figures import figure, save
from sections.tables import markdown

import hf_attnscale as hfa
from hf_attnscale.evaluation.positions import position_buckets

from .context import SHORT_NAME, TRAINED_LENGTH, Context
from .dense import rope_settings
from .recall import BUCKETS, DEPTHS, DOCUMENT_TOKENS, MODEL, PASSKEY_TASKS, evaluate

SEEDS = (0, 1, 2)


def methods() -> dict[str, dict]:
    """Each method's model_args beyond the common ones."""
    rope = rope_settings(MODEL)
    logn = {"scale": "logn", "train_length": TRAINED_LENGTH[MODEL]}
    return {
        "unpatched": {},
        "dynamic NTK": {"rope_parameters": rope["dynamic NTK"]},
        "YaRN": {"rope_parameters": rope["YaRN"]},
        "YaRN + logn": {"rope_parameters": rope["YaRN"], **logn},
        "ReRoPE w1024 + logn": {"rerope_window": 1024, **logn},
        "ReRoPE w1024": {"rerope_window": 1024},
        "ReRoPE w2048": {"rerope_window": 2048},
        "ReRoPE w2048 + logn": {"rerope_window": 2048, **logn},
        "leaky ReRoPE w1024 k16 + logn": {"rerope_window": 1024, "rerope_leak": 16.0, **logn},
    }


# The cells that settle the goal run first: the passkeys past 8k of the patch that reads within 1% of the
# unchanged model inside 8k (w2048 + logn) and of YaRN, shortest haystack and lowest seed first. The rest follow:
# perplexity by position, then seed 0's passkeys at every length (one whole grid, as section 9's), then seeds 1
# and 2 by length, the shortest haystack's three seeds first, ReRoPE before the methods section 9 already ran.
GOAL_METHODS = ("ReRoPE w2048 + logn", "YaRN")


def priority(cell: tuple[str, int | None, int, str]) -> tuple:
    task, _, seed, label = cell
    length = next((n for n, name in PASSKEY_TASKS.items() if name == task), 0)
    if length > TRAINED_LENGTH[MODEL] and label in GOAL_METHODS:
        return (0, length, seed, GOAL_METHODS.index(label))
    return (1, seed > 0, length, seed, "ReRoPE" not in label, list(methods()).index(label))


def measured(task: str, model_args: dict, metadata: dict, limit: int | None, threads: int) -> dict:
    """`evaluate` in this (fresh) process, with its wall time and the process's peak resident memory."""
    torch.set_num_threads(threads)
    started = time.perf_counter()
    results = evaluate(task, model_args, metadata, limit)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {**results, "seconds": time.perf_counter() - started, "peak_gib": peak_kib / 2**20}


def in_fresh_process(cell: Callable[..., dict], *args) -> dict:
    """``cell(*args)`` in a fresh (spawned) process: each cell's time and peak memory are its own."""
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        return pool.submit(cell, *args).result()


def one_cell(
    context: Context,
    key: str,
    task: str,
    model_args: dict,
    *,
    depth: float = 1.0,
    seed: int = 0,
    first_tokens: int | None = None,
    metadata: dict | None = None,
) -> dict:
    """One kept cell in a fresh process: the prompt of ``task`` at ``depth`` on ``seed``, or with ``first_tokens``
    the task's first document cut there (sections 10b, 11, 12 and 14); ``metadata``: the task's, beyond those."""
    path = model_args["pretrained"]
    if first_tokens is None:
        given, limit = {"pretrained": path, "per_cell": 1, "seed": seed, "depths": [depth]}, None
    else:
        given, limit = {"pretrained": path, "first_tokens": first_tokens}, 1
    metadata = {**given, **(metadata or {})}
    return context.cells.get(
        key + ("/quick" if context.quick else ""),
        functools.partial(
            in_fresh_process, measured, task, model_args, metadata, limit, torch.get_num_threads()
        ),
    )


def run(context: Context) -> str:
    """Every (method, task, seed) cell, kept as it is computed; the tables and the figure from what is there."""
    path = str(hfa.fetch(MODEL))
    passkeys = dict(list(PASSKEY_TASKS.items())[:1]) if context.quick else PASSKEY_TASKS
    depths = DEPTHS[-1:] if context.quick else DEPTHS
    seeds = SEEDS[:1] if context.quick else SEEDS
    document_tokens = 1024 if context.quick else DOCUMENT_TOKENS
    common = {"pretrained": path, "dtype": "float32", "max_length": 2 * DOCUMENT_TOKENS}
    jobs = [("hfa_kjv_books", 1, 0)] + [(task, None, seed) for task in passkeys.values() for seed in seeds]
    cells = [(task, limit, seed, label) for task, limit, seed in jobs for label in methods()]
    table: dict[str, dict] = {label: {} for label in methods()}
    section_9 = {} if context.quick else section_9_results(context.out)
    reported = {} if context.quick else reported_results(context.out)
    for task, limit, seed, label in sorted(cells, key=priority):
        metadata = {"pretrained": path, "per_cell": 1, "seed": seed, "depths": list(depths)}
        if task == "hfa_kjv_books":
            metadata = {"pretrained": path, "first_tokens": document_tokens}
        args = methods()[label]
        key = f"rerope/{MODEL}/{task}/{label}/seed{seed}/{document_tokens}" + (
            "/quick" if context.quick else ""
        )
        kept = context.cells.path(key).is_file()
        earlier = reported_cell(reported, label, task, seed) or section_9_cell(section_9, label, task, seed)
        if earlier is not None and not kept:
            table[label][(task, seed)] = earlier
        elif context.kept_only:  # a report of what is there, computing nothing
            if kept:
                table[label][(task, seed)] = torch.load(context.cells.path(key), weights_only=False)
        else:
            table[label][(task, seed)] = context.cells.get(
                key,
                functools.partial(
                    in_fresh_process,
                    measured,
                    task,
                    {**common, **args},
                    metadata,
                    limit,
                    torch.get_num_threads(),
                ),
            )
    return report(table, passkeys, depths, seeds, document_tokens, context.out)


def section_9_results(out: Path) -> dict:
    """Section 9's cells by method and task (its ``recall.json``), or none where it has not run."""
    path = out / "recall.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def section_9_cell(section_9: dict, label: str, task: str, seed: int) -> dict | None:
    """Section 9's result for the same method and task, where this section would compute it again: section 9
    ran the same model_args on seed 0's prompts and on the same document. The four cells this section did
    compute again (the unchanged model and dynamic NTK at 4k, YaRN at 16k and 32k) found the same keys, with
    key log-likelihoods within 8e-5 nats. Marked ``"from": "section 9"``; it has no time or memory."""
    cell = section_9.get(label, {}).get(task) if seed == 0 else None
    return {**cell, "from": "section 9"} if cell else None


def reported_results(out: Path) -> dict:
    """This section's cells as its last report wrote them (``rerope.json``, committed beside the tables), so that
    a run on a machine whose kept cells are gone computes only the cells that report lacks."""
    path = out / "rerope.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def reported_cell(reported: dict, label: str, task: str, seed: int) -> dict | None:
    """The reported result of one cell (its time and memory included), or none where it was not reported."""
    return reported.get(label, {}).get(f"{task}/seed{seed}")


def report(table, passkeys, depths, seeds, document_tokens, out: Path) -> str:
    """The three tables (perplexity by position, passkeys, cost) and the figure, from the cells."""
    flat = {
        label: {f"{task}/seed{seed}": v for (task, seed), v in cells.items()}
        for label, cells in table.items()
    }
    (out / "rerope.json").write_text(json.dumps(flat, indent=1, default=str))
    trained = TRAINED_LENGTH[MODEL]
    ppl_rows, key_rows, cost_rows = [], [], []
    for label, cells in table.items():
        ppl = cells.get(("hfa_kjv_books", 0))
        ppl_rows.append([label, *[f"{ppl[f'ppl_{b},none']:,.2f}" if ppl else "not run" for b in BUCKETS]])
        found = []
        for task in passkeys.values():
            runs = [cells[(task, s)] for s in seeds if (task, s) in cells]
            if not runs:
                found.append("not run")
                continue
            keys = sum(r["acc,none"] * len(depths) for r in runs)
            loglik = sum(r["key_loglikelihood,none"] for r in runs) / len(runs)
            found.append(f"{keys:.0f}/{len(depths) * len(runs)} ({loglik:.2f})")
        key_rows.append([label, *found])
        cost = []
        for task in [*passkeys.values(), "hfa_kjv_books"]:
            runs = [cells[(task, s)] for s in seeds if (task, s) in cells]
            timed = [r for r in runs if "seconds" in r]
            cost.append(
                f"{sum(r['seconds'] for r in timed) / len(timed):.0f} s, {max(r['peak_gib'] for r in timed):.1f} GiB"
                if timed
                else "section 9"
                if runs
                else "not run"
            )
        cost_rows.append([label, *cost])
    plot(table, passkeys, depths, seeds, out / "rerope.png")
    lengths = [f"{n // 1024}k ({n / trained:g}x)" for n in passkeys]
    return (
        f"**{SHORT_NAME[MODEL]}** (trained at {trained}): perplexity by position over Genesis' first "
        f"{document_tokens} tokens (`hfa_kjv_books`, one document)\n\n"
        + markdown(["method", *[f"positions {b}" for b in BUCKETS]], ppl_rows)
        + f"\n\nPasskeys found (greedy: every key token the argmax) of the prompts run: {len(depths)} depths "
        f"({', '.join(f'{d:.0%}' for d in depths)}) x seeds {', '.join(map(str, seeds))}; the key's mean "
        "log-likelihood in brackets (`hfa_passkey_*`)\n\n"
        + markdown(["method", *lengths], key_rows)
        + "\n\nTime per prompt set (mean over seeds) and peak resident memory of the process that ran it\n\n"
        + markdown(["method", *lengths, "Genesis 32k"], cost_rows)
        + "\n\nSection 9's cells stand for the unchanged model, dynamic NTK, YaRN and YaRN + logn on seed 0 and on "
        "Genesis, where this section did not compute them again (the same model_args, prompts and document; "
        '"section 9" in the cost table: their time was not measured alone).'
    )


PPL_CEILING = 25.0
"""The left panel's top: the methods that read past 8k stay below it; a value above is written there."""


BUCKET_CENTRES = {b.label: (b.start + (b.end or 2 * b.start)) / 2048 for b in position_buckets()}
"""Each default bucket's middle in k tokens ("2k-4k": 3); the open last one ("32k+") as if it ended at twice its
start, as each bucket before it does."""


def draw_perplexity(ax, ppl: dict, buckets, label: str, style: dict, ceiling: float = PPL_CEILING) -> None:
    """One method's perplexity by position (the ``ppl_<bucket>,none`` entries of ``ppl``), values above
    ``ceiling`` written at the top, not drawn there."""
    centres = [BUCKET_CENTRES[b] for b in buckets]
    values = [ppl.get(f"ppl_{b},none", math.nan) for b in buckets]
    ax.plot(centres, [min(v, ceiling) for v in values], **style, marker="o", label=label)
    for centre, value in zip(centres, values):
        if value > ceiling:  # the unchanged model past 8k
            ax.annotate(
                f"\u2191 {value:,.0f}",
                (centre, ceiling),
                xytext=(0, -10),
                textcoords="offset points",
                ha="center",
                fontsize=7,
                color=style["color"],
            )


def perplexity_axis(ax, document: str, ceiling: float = PPL_CEILING) -> None:
    """The perplexity panel's scale, ticks and labels (up to ``ceiling``), the trained length dotted."""
    ax.axvline(TRAINED_LENGTH[MODEL] / 1024, color="black", lw=1, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position (k tokens; dotted: trained 8k)")
    ax.set_yscale("log")
    ax.set_ylim(top=ceiling * 1.08)
    ticks = [t for t in (4, 6, 10, 15, 25, 40) if t < ceiling] + [ceiling]
    ax.set_yticks(ticks, labels=[f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_ylabel(f"perplexity ({document}, by position)")


def plot(table, passkeys, depths, seeds, path: Path, title: str | None = None) -> None:
    """Left: perplexity by position (log scale, values above `PPL_CEILING` written at the top); right:
    passkeys found of those run, by haystack length."""
    fig, (left, right) = figure(2, width=5.6, height=3.6)
    centres = [BUCKET_CENTRES[b] for b in BUCKETS]
    for index, (label, cells) in enumerate(table.items()):
        ppl = cells.get(("hfa_kjv_books", 0))
        style = {"linestyle": "-" if "ReRoPE" in label else "--", "color": f"C{index}"}  # one colour a method
        if ppl:
            draw_perplexity(left, ppl, BUCKETS, label, style)
        rates = []
        for task in passkeys.values():
            runs = [cells[(task, s)] for s in seeds if (task, s) in cells]
            rates.append(sum(r["acc,none"] for r in runs) / len(runs) if runs else math.nan)
        if not all(
            math.isnan(r) for r in rates
        ):  # a method with no passkey run yet is left out, not drawn at 0
            nudge = 2 ** (0.04 * (index - len(table) / 2))  # methods that found as many keys stay apart
            right.plot([n / 1024 * nudge for n in passkeys], rates, **style, marker="o", label=label)
    perplexity_axis(left, "Genesis")
    right.axvline(TRAINED_LENGTH[MODEL] / 1024, color="black", lw=1, ls=":")
    right.set_xscale("log", base=2)
    for ax in (left, right):
        ax.set_xlabel("position / haystack (k tokens; dotted: trained 8k)")
    right.set_ylabel("share of passkeys found")
    right.set_ylim(-0.05, 1.05)
    # One span for both panels, wide enough for the longest haystack.
    span = (0.8, max([*centres, *(n / 1024 for n in passkeys)]) * 1.3)
    handles = {}  # one legend for both panels, beside them: a method drawn in either panel, once
    for ax in (left, right):
        ax.set_xlim(span)
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if handles:
        labels = [label for label in table if label in handles]
        right.legend(
            [handles[label] for label in labels],
            labels,
            loc="upper left",
            bbox_to_anchor=(1.02, 1),
            fontsize=7,
            title="cells not run are not drawn",
            title_fontsize=7,
        )
    title = title or f"{SHORT_NAME[MODEL]}: ReRoPE (+ logn) against RoPE rescaling past the trained length"
    fig.suptitle(title, fontsize=10)
    save(fig, path)
