"""Section 11b: STRING (An et al. 2024, ``HKUNLP/STRING``) on SmolLM2, inside its trained length and at 2x (issue 83).

Through lm-eval's ``simple_evaluate`` with the ``hf-attnscale`` model type, as sections 9-12. STRING scores a
distance d ≥ S at d − S + W (W = 128, the authors'), cos and sin times 1 + 0.1·ln 2:
- **inside 8k**, where its authors claim its gains: S = 2,730, a third of the 8,192 read (their 0.33); the
  passkeys of ``hfa_passkey_8k`` (prompts v2, depths 0, 50%, 100%, seed 0) beside the unchanged model's, and
  perplexity by position over Genesis' first 8,192 tokens; and the same without the factor (``string_factor=1``),
  which alone changes the pairs nearer than S;
- **at 16k**: S = T − L + W = 8,320 for T = 16,384, so that every far distance stays inside 8k (the near part
  then reaches 8,319: at T = 2L no S keeps both parts inside L with W > 0); the passkeys of ``hfa_passkey_16k``
  and Genesis' first 16,384 tokens, without and with logn.

One prompt per cell, each in a fresh process that reports its time and peak resident memory, kept as it is
computed. The unchanged model's Genesis and the other methods' 16k rows are section 10's and 11's cells.
"""

from __future__ import annotations

import json
from pathlib import Path

from sections.tables import markdown

import hf_attnscale as hfa

from . import extend, rerope
from .context import SHORT_NAME, TRAINED_LENGTH, Context
from .recall import DEPTHS, MODEL, PASSKEY_TASKS

GENESIS = "hfa_kjv_books"
INSIDE, PAST = 8192, 16384
STRING_INSIDE = {"string_shift": INSIDE // 3, "string_local": 128}
STRING_PAST = {"string_shift": PAST - TRAINED_LENGTH[MODEL] + 128, "string_local": 128}
LOGN = {"scale": "logn", "train_length": TRAINED_LENGTH[MODEL]}
METHODS = {
    f"STRING S{STRING_INSIDE['string_shift']} W128": (INSIDE, STRING_INSIDE),
    "unpatched": (INSIDE, {}),
    f"STRING S{STRING_INSIDE['string_shift']} W128, factor 1": (
        INSIDE,
        {**STRING_INSIDE, "string_factor": 1.0},
    ),
    f"STRING S{STRING_PAST['string_shift']} W128": (PAST, STRING_PAST),
    f"STRING S{STRING_PAST['string_shift']} W128 + logn": (PAST, {**STRING_PAST, **LOGN}),
}
"""Each row's label: the length it reads and its model_args beyond the common ones."""
BUCKETS = {INSIDE: ("0-2k", "2k-4k", "4k-8k"), PAST: ("0-2k", "2k-4k", "4k-8k", "8k-16k")}

Cell = tuple[str, str, float]
"""(method, task, depth); Genesis' cell has depth 0."""


def cells() -> list[Cell]:
    """Every cell in the order it runs: each method's passkeys (the farthest key first), then its Genesis; the
    unchanged model reads no Genesis here (sections 10 and 11 did)."""
    order: list[Cell] = []
    for label, (length, _) in METHODS.items():
        order += [(label, PASSKEY_TASKS[length], depth) for depth in DEPTHS]
        if label != "unpatched":
            order.append((label, GENESIS, 0.0))
    return order


def key(cell: Cell) -> str:
    label, task, depth = cell
    return f"shifted/{MODEL}/{task}/{label}/depth{depth:g}"


def run(context: Context) -> str:
    """Every cell, kept as it is computed (with ``--kept-only``, those kept so far); the tables."""
    path = str(hfa.fetch(MODEL))
    common = {"pretrained": path, "dtype": "float32", "max_length": 2 * PAST}
    results = reported_results(context.out)
    for cell in cells()[:1] if context.quick else cells():
        label, task, depth = cell
        kept = context.cells.path(key(cell)).is_file()
        if (cell in results and not kept) or (context.kept_only and not kept):
            continue
        length, args = METHODS[label]
        first_tokens = (1024 if context.quick else length) if task == GENESIS else None
        results[cell] = rerope.one_cell(
            context, key(cell), task, {**common, **args}, depth=depth, first_tokens=first_tokens
        )
        if not context.quick:
            report(results, context.out)
    return report(results, context.out)


def reported_results(out: Path) -> dict[Cell, dict]:
    """This section's cells as its last report wrote them (``shifted.json``, committed beside the tables)."""
    path = out / "shifted.json"
    if not path.is_file():
        return {}
    return {(c["method"], c["task"], c["depth"]): c["result"] for c in json.loads(path.read_text())}


def _found(prompt: dict | None) -> str:
    if prompt is None:
        return "not run"
    found = "found" if prompt["acc,none"] == 1 else "missed"
    score = prompt.get("key_loglikelihood,none")  # section 10's depths 0 and 50% kept their accuracy alone
    return found if score is None else f"{found} ({score:.2f})"


def report(results: dict[Cell, dict], out: Path) -> str:
    """Perplexity by position and the passkeys at each length, beside the earlier sections' rows; each cell's
    cost; ``shifted.json``."""
    kept = [
        {"method": label, "task": task, "depth": depth, "result": value}
        for (label, task, depth), value in results.items()
    ]
    (out / "shifted.json").write_text(json.dumps(kept, indent=1, default=str))
    earlier = extend.reported_results(out)  # section 11's cells, with section 10's rows beside them
    section_10 = extend.section_10(out)
    tables = []
    for length in (INSIDE, PAST):
        buckets = BUCKETS[length]
        ppl_rows, key_rows, cost_rows = [], [], []
        for label, (read, _) in METHODS.items():
            if read != length:
                continue
            document = results.get((label, GENESIS, 0.0))
            if label == "unpatched":
                document = section_10.get(("unpatched", GENESIS, 0.0, 0))
            ppl_rows.append(
                [label, *[f"{document[f'ppl_{b},none']:,.2f}" if document else "-" for b in buckets]]
            )
            prompts = [results.get((label, PASSKEY_TASKS[length], depth)) for depth in DEPTHS]
            key_rows.append([label, *[_found(prompt) for prompt in prompts]])
            cost_rows.append(
                [
                    label,
                    *[f"{p['seconds']:.0f} s, {p['peak_gib']:.1f} GiB" if p else "-" for p in prompts],
                    f"{document['seconds']:.0f} s, {document['peak_gib']:.1f} GiB"
                    if document and label != "unpatched"
                    else "-",
                ]
            )
        if length == PAST:
            for label in ("ReRoPE w2048 + logn", "Self-Extend G5 w2048 + logn", "unpatched"):
                source = section_10 if label != "Self-Extend G5 w2048 + logn" else earlier
                document = source.get((label, GENESIS, 0.0, 0))
                ppl_rows.append(
                    [
                        f"{label} (§10/§11)",
                        *[f"{document[f'ppl_{b},none']:,.2f}" if document else "-" for b in buckets],
                    ]
                )
                prompts = [source.get((label, PASSKEY_TASKS[length], depth, 0)) for depth in DEPTHS]
                key_rows.append([f"{label} (§10/§11, seed 0)", *[_found(prompt) for prompt in prompts]])
        depths = [f"depth {d:.0%}" for d in DEPTHS]
        title = "inside the trained length" if length == INSIDE else f"at {length // TRAINED_LENGTH[MODEL]}x"
        tables.append(
            f"**{SHORT_NAME[MODEL]}** (trained at {TRAINED_LENGTH[MODEL]}) at {length} tokens, {title}: perplexity "
            f"by position over Genesis' first {length} tokens (`{GENESIS}`)\n\n"
            + markdown(["method", *[f"positions {b}" for b in buckets]], ppl_rows)
            + f"\n\nThe passkey (`{PASSKEY_TASKS[length]}`, prompts v2, seed 0): found (greedy) or missed, the key's "
            "mean log-likelihood in brackets\n\n"
            + markdown(["method", *depths], key_rows)
            + "\n\nTime of each cell (model load included) and the peak resident memory of its process\n\n"
            + markdown(["method", *depths, "Genesis"], cost_rows)
        )
    return "\n\n".join(tables)
