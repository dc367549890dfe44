"""Section 12: SmolLM2 at 65,536 tokens, 8x its trained length (issue 70, item 4).

Through lm-eval's ``simple_evaluate`` with the ``hf-attnscale`` model type, as sections 9-11: perplexity by
position over the KJV's books joined from Genesis, cut to their first 65,536 tokens (``hfa_kjv_64k``), and the
passkeys of ``hfa_passkey_64k`` (prompts v2) at depths 0, 50% and 100%, seed 0. Methods: the unchanged model,
YaRN and dynamic NTK with factor 8, ReRoPE w2048 + logn, and leaky ReRoPE w1024 k16 + logn (section 10's patches,
unchanged). One prompt per cell, each in a fresh process that reports its time and peak resident memory, kept as
it is computed. The passkeys of the patch that met the recall goal at 16k and 32k come first, then every
method's document (the comparison at 8x that one cell per method gives), then the other methods' passkeys.
"""

from __future__ import annotations

import json
from pathlib import Path

from sections.figures import figure, save
from sections.tables import markdown

import hf_attnscale as hfa
from hf_attnscale.evaluation.positions import position_buckets

from . import rerope
from .context import SHORT_NAME, TRAINED_LENGTH, Context
from .dense import rope_settings
from .recall import DEPTHS, MODEL

LENGTH = 65536
DOCUMENT = "hfa_kjv_64k"
PASSKEYS = "hfa_passkey_64k"
BUCKETS = tuple(bucket.label for bucket in position_buckets())
"""The document's buckets: the task's, the defaults (0-2k ... 16k-32k, and 32k+: 32k-64k here)."""

CEILING = 60.0
"""The plot's top: every patch's perplexity at 64k is drawn (dynamic NTK's reaches 48.5); the unchanged
model's past 8k is written there."""

Cell = tuple[str, str, float]
"""(method, task, depth); the document's cell has depth 0."""


def methods() -> dict[str, dict]:
    """Each method's model_args beyond the common ones (RoPE rescaling at factor 8: 64k over the trained 8k)."""
    factor = LENGTH / TRAINED_LENGTH[MODEL]
    rope = {
        name: {**settings, "factor": factor} for name, settings in rope_settings(MODEL).items() if settings
    }
    patches = rerope.methods()
    return {
        "ReRoPE w2048 + logn": patches["ReRoPE w2048 + logn"],
        "YaRN (factor 8)": {"rope_parameters": rope["YaRN"]},
        "leaky ReRoPE w1024 k16 + logn": patches["leaky ReRoPE w1024 k16 + logn"],
        "dynamic NTK (factor 8)": {"rope_parameters": rope["dynamic NTK"]},
        "unpatched": {},
    }


def cells() -> list[Cell]:
    """Every cell in the order it runs: the first method's passkeys (depth 100% first), every method's document,
    then the other methods' passkeys."""
    first, *others = methods()
    keys = {label: [(label, PASSKEYS, depth) for depth in reversed(DEPTHS)] for label in methods()}
    documents = [(label, DOCUMENT, 0.0) for label in methods()]
    return keys[first] + documents + [cell for label in others for cell in keys[label]]


def key(cell: Cell) -> str:
    label, task, depth = cell
    return f"eightx/{MODEL}/{task}/{label}/depth{depth:g}"


def run(context: Context) -> str:
    """Every cell, kept as it is computed (with ``--kept-only``, those kept so far); the tables."""
    path = str(hfa.fetch(MODEL))
    common = {"pretrained": path, "dtype": "float32", "max_length": 2 * LENGTH}
    results = reported_results(context.out)
    for cell in cells()[:1] if context.quick else cells():
        label, task, depth = cell
        kept = context.cells.path(key(cell)).is_file()
        if cell in results and not kept:
            continue
        if context.kept_only and not kept:
            continue
        first_tokens = (1024 if context.quick else LENGTH) if task == DOCUMENT else None
        model_args = {**common, **methods()[label]}
        results[cell] = rerope.one_cell(
            context, key(cell), task, model_args, depth=depth, first_tokens=first_tokens
        )
        if not context.quick:
            report(results, context.out)  # the tables as they stand, after each cell
    return report(results, context.out)


def reported_results(out: Path) -> dict[Cell, dict]:
    """This section's cells as its last report wrote them (``eightx.json``, committed beside the tables)."""
    path = out / "eightx.json"
    if not path.is_file():
        return {}
    return {(c["method"], c["task"], c["depth"]): c["result"] for c in json.loads(path.read_text())}


def report(results: dict[Cell, dict], out: Path) -> str:
    """Perplexity by position, the keys found by depth, and each cell's cost; ``eightx.json``."""
    kept = [
        {"method": label, "task": task, "depth": depth, "result": value}
        for (label, task, depth), value in results.items()
    ]
    (out / "eightx.json").write_text(json.dumps(kept, indent=1, default=str))
    documents = {label: results.get((label, DOCUMENT, 0.0)) for label in methods()}
    ppl_rows, key_rows, cost_rows = [], [], []
    for label in methods():
        document = documents[label]
        ppl_rows.append(
            [label, *[f"{document[f'ppl_{b},none']:,.2f}" if document else "not run" for b in BUCKETS]]
        )
        row, cost = [label], [label]
        for depth in DEPTHS:
            prompt = results.get((label, PASSKEYS, depth))
            row.append(
                f"{'found' if prompt['acc,none'] == 1 else 'missed'} ({prompt['key_loglikelihood,none']:.2f})"
                if prompt
                else "not run"
            )
            cost.append(f"{prompt['seconds']:.0f} s, {prompt['peak_gib']:.1f} GiB" if prompt else "-")
        cost.append(f"{document['seconds']:.0f} s, {document['peak_gib']:.1f} GiB" if document else "-")
        key_rows.append(row)
        cost_rows.append(cost)
    if any(documents.values()):
        plot(documents, out / "eightx.png")
    trained = TRAINED_LENGTH[MODEL]
    depths = [f"depth {d:.0%}" for d in DEPTHS]
    return (
        f"**{SHORT_NAME[MODEL]}** (trained at {trained}) at {LENGTH} tokens ({LENGTH // trained}x): perplexity by "
        f"position over the KJV's first {LENGTH} tokens from Genesis (`{DOCUMENT}`, one document)\n\n"
        + (
            markdown(["method", *[f"positions {b}" for b in BUCKETS]], ppl_rows)
            if any(documents.values())
            else "(no document read yet)"
        )
        + f"\n\nThe passkey (`{PASSKEYS}`, prompts v2, seed 0): found (greedy: every key token the argmax) or "
        "missed, the key's mean log-likelihood in brackets\n\n"
        + markdown(["method", *depths], key_rows)
        + "\n\nTime of each cell (model load included) and the peak resident memory of the process that ran it\n\n"
        + markdown(["method", *depths, "document"], cost_rows)
    )


def plot(documents: dict[str, dict | None], path: Path) -> None:
    """Perplexity by position over the 64k document, one line a method read so far (section 10's panel)."""
    fig, (ax,) = figure(1, width=8.0, height=3.8)
    for index, (label, document) in enumerate(documents.items()):
        if document:
            style = {"linestyle": "-" if "ReRoPE" in label else "--", "color": f"C{index}"}
            rerope.draw_perplexity(ax, document, BUCKETS, label, style, CEILING)
    rerope.perplexity_axis(ax, "KJV", CEILING)
    ax.set_xlim(0.8, rerope.BUCKET_CENTRES[BUCKETS[-1]] * 1.3)
    ax.legend(
        loc="upper left",
        bbox_to_anchor=(1.02, 1),
        fontsize=7,
        title="documents not read are not drawn",
        title_fontsize=7,
    )
    fig.suptitle(
        f"{SHORT_NAME[MODEL]} at {LENGTH:,} tokens ({LENGTH // TRAINED_LENGTH[MODEL]}x its trained length)",
        fontsize=10,
    )
    save(fig, path)
