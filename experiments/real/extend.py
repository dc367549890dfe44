"""Section 11: Self-Extend and Dual Chunk Attention past the trained length, beside section 10's ReRoPE w2048 + logn,
YaRN and dynamic NTK (issue 71).

SmolLM2 (trained at 8,192 tokens) through lm-eval's ``simple_evaluate`` with the ``hf-attnscale`` model type, as
sections 9 and 10: perplexity by position over Genesis' first 32,768 tokens (``hfa_kjv_books``), and the passkeys
``hfa_passkey_16k`` and ``_32k`` on prompts v2 at depths 0, 50% and 100%. Methods, with `compare`'s defaults for
a model trained at L = 8,192 read to 32k: Self-Extend with w = L/4 = 2,048 and the least G that keeps the largest
grouped distance within L at 32k, (32,768 − w)/G + w ≤ L, so G = 5; DCA with ChunkLlama's defaults, s = 3L/4 =
6,144, l = L/16 = 512. Each with and without logn on seed 0; the better of the two on seeds 1 and 2.

One prompt per cell, each in a fresh process that reports its time and peak resident memory, kept as it is
computed. Section 10's methods are not computed again: their cells come from ``rerope.json`` (perplexity, depths 0
and 50%, which prompts v2 left unchanged) and ``depth100.json`` (depth 100% on v2).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from sections.tables import markdown

import hf_attnscale as hfa

from . import rerope
from .context import SHORT_NAME, TRAINED_LENGTH, Context
from .recall import BUCKETS, DEPTHS, DOCUMENT_TOKENS, MODEL, PASSKEY_TASKS

LENGTHS = (16384, 32768)
GENESIS = "hfa_kjv_books"
SELF_EXTEND = {"self_extend_group": 5, "self_extend_window": 2048}
DUAL_CHUNK = {"dual_chunk_size": 6144, "dual_chunk_local": 512}
FAMILIES = {"Self-Extend G5 w2048": SELF_EXTEND, "DCA s6144 l512": DUAL_CHUNK}
SECTION_10 = ("ReRoPE w2048 + logn", "YaRN", "dynamic NTK", "unpatched")

Cell = tuple[str, str, float, int]
"""(method, task, depth, seed); Genesis' cell has depth 0 and seed 0."""


def methods() -> dict[str, dict]:
    """This section's methods by label: each family with logn first, then without."""
    logn = {"scale": "logn", "train_length": TRAINED_LENGTH[MODEL]}
    table = {}
    for family, args in FAMILIES.items():
        table[f"{family} + logn"] = {**args, **logn}
        table[family] = dict(args)
    return table


def better(family: str, results: dict[Cell, dict]) -> str:
    """The family's variant (with or without logn) that found more keys on seed 0, then read Genesis past 8k lower;
    with logn while seed 0 is incomplete (logn is what ReRoPE needed in section 10)."""

    def score(label: str) -> tuple | None:
        keys = [results.get((label, PASSKEY_TASKS[n], d, 0)) for n in LENGTHS for d in DEPTHS]
        genesis = results.get((label, GENESIS, 0.0, 0))
        if genesis is None or None in keys:
            return None
        past = genesis["ppl_8k-16k,none"] + genesis["ppl_16k-32k,none"]
        return (sum(k["acc,none"] for k in keys), -past)

    with_logn, without = score(f"{family} + logn"), score(family)
    if with_logn is None or without is None or with_logn >= without:
        return f"{family} + logn"
    return family


def cells(results: dict[Cell, dict]) -> list[Cell]:
    """The cells still to run, in order: seed 0 of each variant with logn (Genesis, then 16k, then 32k), then
    without, then seeds 1 and 2 of each family's better variant."""
    order: list[Cell] = []
    for with_logn in (True, False):
        for family in FAMILIES:
            label = f"{family} + logn" if with_logn else family
            order.append((label, GENESIS, 0.0, 0))
            order += [(label, PASSKEY_TASKS[n], d, 0) for n in LENGTHS for d in DEPTHS]
    for seed in rerope.SEEDS[1:]:
        for family in FAMILIES:
            order += [(better(family, results), PASSKEY_TASKS[n], d, seed) for n in LENGTHS for d in DEPTHS]
    return [cell for cell in order if cell not in results]


def key(cell: Cell) -> str:
    label, task, depth, seed = cell
    return f"extend/{MODEL}/{task}/{label}/depth{depth:g}/seed{seed}"


def run(context: Context) -> str:
    """Every cell, kept as it is computed (with ``--kept-only``, those kept so far); the tables."""
    path = str(hfa.fetch(MODEL))
    common = {"pretrained": path, "dtype": "float32", "max_length": 2 * DOCUMENT_TOKENS}
    results = reported_results(context.out)
    every = [(label, task, depth, seed) for label in methods() for task, depth, seed in grid()]
    for cell in every:  # cells kept on this machine (a run stopped since its last report)
        if cell not in results and context.cells.path(key(cell)).is_file():
            results[cell] = torch.load(context.cells.path(key(cell)), weights_only=False)
    todo = [] if context.kept_only else cells(results)
    if context.quick:
        todo = todo[:1]
    while todo:
        cell = todo[0]
        label, task, depth, seed = cell
        first_tokens = (1024 if context.quick else DOCUMENT_TOKENS) if task == GENESIS else None
        model_args = {**common, **methods()[label]}
        results[cell] = rerope.one_cell(
            context, key(cell), task, model_args, depth=depth, seed=seed, first_tokens=first_tokens
        )
        if context.quick:
            break
        report(results, context.out)  # the tables as they stand, after each cell
        todo = cells(results)
    return report(results, context.out)


def grid() -> list[tuple[str, float, int]]:
    """Every (task, depth, seed) a method may run."""
    passkeys = [(PASSKEY_TASKS[n], d, s) for n in LENGTHS for d in DEPTHS for s in rerope.SEEDS]
    return [(GENESIS, 0.0, 0), *passkeys]


def reported_results(out: Path) -> dict[Cell, dict]:
    """This section's cells as its last report wrote them (``extend.json``, committed beside the tables), so that
    a machine whose kept cells are gone computes only what that report lacks."""
    path = out / "extend.json"
    if not path.is_file():
        return {}
    return {
        (c["method"], c["task"], c["depth"], c["seed"]): c["result"] for c in json.loads(path.read_text())
    }


def section_10(out: Path) -> dict[Cell, dict]:
    """Section 10's cells of `SECTION_10`, per prompt: Genesis and depths 0 and 50% from its report (one cell held
    the three depths of a seed: their per-depth accuracies are there, their log-likelihood only as a mean), and
    depth 100% on prompts v2 from section 10b."""
    reported = rerope.reported_results(out)
    depth100 = json.loads((out / "depth100.json").read_text()) if (out / "depth100.json").is_file() else {}
    cells: dict[Cell, dict] = {}
    for label in SECTION_10:
        genesis = rerope.reported_cell(reported, label, GENESIS, 0)
        if genesis is not None:
            cells[(label, GENESIS, 0.0, 0)] = genesis
        for n in LENGTHS:
            task = PASSKEY_TASKS[n]
            for seed in rerope.SEEDS:
                prompts = rerope.reported_cell(reported, label, task, seed)
                if prompts is not None:
                    for depth in DEPTHS[:-1]:
                        cells[(label, task, depth, seed)] = {
                            "acc,none": prompts[f"acc_depth_{round(depth * 100)},none"]
                        }
                v2 = depth100.get(f"{label}/{n}/seed{seed}")
                if v2 is not None:
                    cells[(label, task, 1.0, seed)] = v2
    return cells


def report(results: dict[Cell, dict], out: Path) -> str:
    """Perplexity by position, keys found by length and depth, and each cell's cost; ``extend.json``."""
    kept = [
        {"method": label, "task": task, "depth": depth, "seed": seed, "result": value}
        for (label, task, depth, seed), value in results.items()
    ]
    (out / "extend.json").write_text(json.dumps(kept, indent=1, default=str))
    both = {**section_10(out), **results}
    labels = [*methods(), *SECTION_10]
    trained = TRAINED_LENGTH[MODEL]

    ppl_rows = []
    for label in labels:
        genesis = both.get((label, GENESIS, 0.0, 0))
        ppl_rows.append(
            [label, *[f"{genesis[f'ppl_{b},none']:,.2f}" if genesis else "not run" for b in BUCKETS]]
        )

    key_rows, cost_rows = [], []
    for label in labels:
        row, cost = [label], [label]
        for n in LENGTHS:
            for depth in DEPTHS:
                runs = [
                    both[(label, PASSKEY_TASKS[n], depth, s)]
                    for s in rerope.SEEDS
                    if (label, PASSKEY_TASKS[n], depth, s) in both
                ]
                row.append(f"{sum(r['acc,none'] for r in runs):.0f}/{len(runs)}" if runs else "-")
            timed = [
                both[(label, PASSKEY_TASKS[n], d, s)]
                for d in DEPTHS
                for s in rerope.SEEDS
                if "seconds" in both.get((label, PASSKEY_TASKS[n], d, s), {})
            ]
            cost.append(
                f"{sum(r['seconds'] for r in timed) / len(timed):.0f} s, {max(r['peak_gib'] for r in timed):.1f} GiB"
                if timed
                else "-"
            )
        genesis = results.get((label, GENESIS, 0.0, 0))
        cost.append(f"{genesis['seconds']:.0f} s, {genesis['peak_gib']:.1f} GiB" if genesis else "-")
        key_rows.append(row)
        if label in methods():
            cost_rows.append(cost)
    plot(both, labels, out / "extend.png")
    key_header = [f"{n // 1024}k @{d:.0%}" for n in LENGTHS for d in DEPTHS]
    return (
        f"**{SHORT_NAME[MODEL]}** (trained at {trained}): perplexity by position over Genesis' first "
        f"{DOCUMENT_TOKENS} tokens (`{GENESIS}`, one document)\n\n"
        + markdown(["method", *[f"positions {b}" for b in BUCKETS]], ppl_rows)
        + "\n\nPasskeys found (greedy: every key token the argmax) on prompts v2, of the seeds run (0-2), by "
        "haystack length and depth (`hfa_passkey_*`; -: not run)\n\n"
        + markdown(["method", *key_header], key_rows)
        + "\n\nTime of one prompt (mean over the prompts run, model load included) and the peak resident memory "
        "of the process that ran it; Genesis' one read\n\n"
        + markdown(
            ["method", *[f"{n // 1024}k ({n / trained:g}x)" for n in LENGTHS], "Genesis 32k"], cost_rows
        )
        + "\n\nSection 10's rows are its own cells (depths 0 and 50% of its prompt sets, depth 100% from "
        "section 10b on prompts v2), not computed again."
    )


def plot(both: dict[Cell, dict], labels: list[str], path: Path) -> None:
    """Section 10's figure for these methods: perplexity by position, and the share of keys found at each length
    over the seeds whose three depths have all run (a method with none there is not drawn)."""
    table: dict[str, dict] = {}
    for label in labels:
        table[label] = {}
        if (label, GENESIS, 0.0, 0) in both:
            table[label][(GENESIS, 0)] = both[(label, GENESIS, 0.0, 0)]
        for n in LENGTHS:
            seeds = [s for s in rerope.SEEDS if all((label, PASSKEY_TASKS[n], d, s) in both for d in DEPTHS)]
            runs = [both[(label, PASSKEY_TASKS[n], d, s)] for d in DEPTHS for s in seeds]
            if runs:
                table[label][(PASSKEY_TASKS[n], 0)] = {
                    "acc,none": sum(r["acc,none"] for r in runs) / len(runs)
                }
    passkeys = {n: PASSKEY_TASKS[n] for n in LENGTHS}
    title = (
        f"{SHORT_NAME[MODEL]}: Self-Extend and DCA beside ReRoPE and RoPE rescaling\n"
        "(right: keys found over the seeds whose three depths have run)"
    )
    rerope.plot(table, passkeys, DEPTHS, (0,), path, title=title)
