"""Section 14: Gemma-3-270M inside and past its trained length (issue 85).

A second family: 5 of every 6 layers attend within a window of 512 (RoPE θ 1e4), the others globally (θ 1e6), one
KV head of 256 channels, trained at 32,768 tokens. Through lm-eval's ``simple_evaluate`` with the ``hf-attnscale``
model type, as sections 9-13:

- passkeys (``hfa_passkey_*``, prompts v2, one prompt a cell: its seed's first key at that depth) at 16k and 32k
  (inside), 64k (2x) and 128k (4x), depths 0, 50% and 100%;
- perplexity by position over the KJV's first 131,072 tokens (Gemma's tokenizer), from Genesis, read whole
  (``hfa_kjv_128k``), in buckets to 64k-128k.

Methods (`methods`): the unchanged model; YaRN and dynamic NTK on the global layers' RoPE (factor 2 up to 64k,
4 at 128k and for the 128k read); ReRoPE w8192 + logn and leaky ReRoPE w4096 k16 + logn (``train_length`` 32768);
Self-Extend and DCA at ``hf-attnscale compare``'s defaults for 32k read to 128k (G5 w8192; s24576 l2048); STRING
with S a third of the length read, W 128. Every method's near part is wider than the local layers' window, so
the local layers run as the model has them (`Method.exact_below`): the methods differ on the 3 global layers only.

The cells run in the issue's order (`cells`), one fresh process each, kept as computed; ``--kept-only`` reports
what is there.
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

MODEL = "gemma3-270m"
TRAINED = TRAINED_LENGTH[MODEL]
PASSKEYS = {
    16384: "hfa_passkey_16k",
    32768: "hfa_passkey_32k",
    65536: "hfa_passkey_64k",
    131072: "hfa_passkey_128k",
}
DOCUMENT, DOCUMENT_TOKENS = "hfa_kjv_128k", 131072
EDGES = (2048, 4096, 8192, 16384, 32768, 65536)
BUCKETS = tuple(bucket.label for bucket in position_buckets(EDGES))
DEPTHS = (0.0, 0.5, 1.0)
SEEDS = (0, 1, 2)
METHOD_NAMES = (
    "unpatched",
    "YaRN",
    "dynamic NTK",
    "ReRoPE w8192 + logn",
    "leaky ReRoPE w4096 k16 + logn",
    "Self-Extend G5 w8192",
    "DCA s24576 l2048",
    "STRING S=T/3 W128",
)
BEST_OF = 3
"""How many methods, the best at 32k and 64k, read the longer cells' other seeds and 128k."""

Cell = tuple[str, int, float, int]
"""(method, length read, depth, seed); the document's cell: (method, DOCUMENT_TOKENS, -1.0, 0)."""


def rope_factor(length: int) -> float:
    """YaRN's and dynamic NTK's factor for a read of ``length`` tokens: 2 up to 64k, 4 beyond."""
    return 2.0 if length <= 2 * TRAINED else 4.0


def methods(length: int) -> dict[str, dict]:
    """Each method's model_args beyond the common ones, for a read of ``length`` tokens."""
    logn = {"scale": "logn", "train_length": TRAINED}
    factor = rope_factor(length)
    yarn = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": TRAINED}
    ntk = {"rope_type": "dynamic", "factor": factor}
    return {
        "unpatched": {},
        "YaRN": {"rope_parameters": {"full_attention": yarn}},  # the local layers keep their own
        "dynamic NTK": {"rope_parameters": {"full_attention": ntk}},
        "ReRoPE w8192 + logn": {"rerope_window": 8192, **logn},
        "leaky ReRoPE w4096 k16 + logn": {"rerope_window": 4096, "rerope_leak": 16.0, **logn},
        "Self-Extend G5 w8192": {"self_extend_group": 5, "self_extend_window": 8192},
        "DCA s24576 l2048": {"dual_chunk_size": 24576, "dual_chunk_local": 2048},
        "STRING S=T/3 W128": {"string_shift": length // 3, "string_local": 128},
    }


def cells(results: dict[Cell, dict]) -> list[Cell]:
    """Every cell in the issue's order: (a) 32k, every method, seed 0 (depths 0 and 50% first: the keys the
    unchanged model misses there), then seeds 1-2, and 16k; (b) the 128k read;
    (c) 64k seed 0, then seeds 1-2 for the three best; (d) 128k seed 0 for the three best. The best: the most
    keys found at 32k (then at 64k), ties by the higher mean key log-likelihood, of the cells run so far."""

    def keys(length: int, seeds: tuple[int, ...], names=METHOD_NAMES, depths=DEPTHS) -> list[Cell]:
        return [(name, length, depth, seed) for seed in seeds for name in names for depth in depths]

    # seed 0 at 32k: the two depths the unchanged model misses first, for every method
    order = keys(32768, SEEDS[:1], depths=DEPTHS[:2]) + keys(32768, SEEDS[:1], depths=DEPTHS[2:])
    order += keys(32768, SEEDS[1:]) + keys(16384, SEEDS[:1])
    order += [(name, DOCUMENT_TOKENS, -1.0, 0) for name in METHOD_NAMES]
    order += keys(65536, SEEDS[:1])
    best = ranked(results, (32768, 65536))[:BEST_OF]
    order += keys(65536, SEEDS[1:], best) + keys(131072, SEEDS[:1], best)
    return [cell for cell in order if not unchanged_inside(cell)]


def unchanged_inside(cell: Cell) -> bool:
    """Whether a passkey cell would read as the unchanged model's, so is not run: dynamic NTK scales nothing
    within the trained length, as one cell (32k, depth 0, seed 0) shows."""
    name, length, depth, seed = cell
    return (
        name == "dynamic NTK"
        and depth >= 0
        and length <= TRAINED
        and (length, depth, seed) != (32768, 0.0, 0)
    )


def ranked(results: dict[Cell, dict], lengths: tuple[int, ...]) -> list[str]:
    """The methods by keys found at ``lengths`` (in turn), then by mean key log-likelihood there."""

    def score(name: str) -> tuple:
        runs = {
            length: [r for (m, n, d, _), r in results.items() if m == name and n == length and d >= 0]
            for length in lengths
        }
        found = [sum(r["acc,none"] for r in runs[n]) for n in lengths]
        loglik = [sum(r["key_loglikelihood,none"] for r in runs[n]) / max(1, len(runs[n])) for n in lengths]
        return tuple(-x for x in found) + tuple(-x for x in loglik)

    return sorted(METHOD_NAMES, key=score)


def key(cell: Cell) -> str:
    name, length, depth, seed = cell
    if depth < 0:
        return f"gemma/{MODEL}/{DOCUMENT}/{name}"
    return f"gemma/{MODEL}/{PASSKEYS[length]}/{name}/seed{seed}/depth{depth:g}"


def run(context: Context) -> str:
    """Every cell, kept as it is computed (with ``--kept-only``, those kept so far); the tables and the figure."""
    path = str(hfa.fetch(MODEL))
    results = reported_results(context.out)
    done: set[Cell] = set()
    while (todo := [c for c in cells(results) if c not in done]) and not context.quick:
        cell = todo[0]
        done.add(cell)
        kept = context.cells.path(key(cell)).is_file()
        if (cell in results and not kept) or (context.kept_only and not kept):
            continue
        results[cell] = compute(context, path, cell)
        report(results, context.out)  # the tables as they stand, after each cell
    if context.quick:
        cell = ("ReRoPE w8192 + logn", 16384, 1.0, 0)
        results[cell] = compute(context, path, cell, quick=True)
    return report(results, context.out)


def compute(context: Context, path: str, cell: Cell, quick: bool = False) -> dict:
    """One cell in a fresh process (`rerope.one_cell`); quick: the task's first 1,024 tokens."""
    name, length, depth, seed = cell
    model_args = {"pretrained": path, "dtype": "float32", "max_length": 2 * DOCUMENT_TOKENS}
    model_args |= methods(length)[name]
    if depth < 0:
        return rerope.one_cell(
            context,
            key(cell),
            DOCUMENT,
            model_args,
            first_tokens=1024 if quick else DOCUMENT_TOKENS,
            metadata={"position_buckets": ";".join(map(str, EDGES))},
        )
    task = "hfa_passkey_4k" if quick else PASSKEYS[length]
    return rerope.one_cell(context, key(cell), task, model_args, depth=depth, seed=seed)


def reported_results(out: Path) -> dict[Cell, dict]:
    """This section's cells as its last report wrote them (``gemma.json``, committed beside the tables)."""
    path = out / "gemma.json"
    if not path.is_file():
        return {}
    return {
        (c["method"], c["length"], c["depth"], c["seed"]): c["result"] for c in json.loads(path.read_text())
    }


def _prompt(result: dict | None) -> str:
    if result is None:
        return "-"
    return f"{'found' if result['acc,none'] == 1 else 'missed'} ({result['key_loglikelihood,none']:.2f})"


def report(results: dict[Cell, dict], out: Path) -> str:
    """The passkeys by length, depth and seed; perplexity by position; each cell's cost; ``gemma.json``."""
    kept = [
        {"method": m, "length": n, "depth": d, "seed": s, "result": value}
        for (m, n, d, s), value in sorted(results.items())
    ]
    (out / "gemma.json").write_text(json.dumps(kept, indent=1, default=str))
    sections = []
    for length, task in PASSKEYS.items():
        seeds = sorted({s for (_, n, d, s) in results if n == length and d >= 0})
        if not seeds:
            continue
        rows, costs = [], []
        for name in METHOD_NAMES:
            prompts = {(d, s): results.get((name, length, d, s)) for d in DEPTHS for s in seeds}
            run = [p for p in prompts.values() if p]
            if not run:
                continue
            found = sum(p["acc,none"] for p in run)
            cells_ = [" / ".join(_prompt(prompts[(d, s)]) for s in seeds) for d in DEPTHS]
            rows.append([name, *cells_, f"{found:.0f} of {len(run)}"])
            seconds = [p["seconds"] for p in run]
            costs.append(
                f"{name}: {min(seconds):.0f}-{max(seconds):.0f} s, {max(p['peak_gib'] for p in run):.1f} GiB"
            )
        if length <= TRAINED:
            rows.append(["dynamic NTK, other cells", *["as unchanged"] * len(DEPTHS), "not run"])
        where = "inside" if length <= TRAINED else f"{length // TRAINED}x"
        sections.append(
            f"Passkeys at {length // 1024}k ({where}; `{task}`, prompts v2), seeds {', '.join(map(str, seeds))} "
            "(separated by /): found or missed, the key's mean log-likelihood in brackets\n\n"
            + markdown(["method", *[f"depth {d:.0%}" for d in DEPTHS], "found"], rows)
            + "\n\nTime of a cell (model load included) and peak resident memory: "
            + "; ".join(costs)
            + "."
        )
    documents = {name: results.get((name, DOCUMENT_TOKENS, -1.0, 0)) for name in METHOD_NAMES}
    if any(documents.values()):
        rows = [
            [name, *[f"{doc[f'ppl_{b},none']:,.2f}" if f"ppl_{b},none" in doc else "-" for b in BUCKETS]]
            for name, doc in documents.items()
            if doc
        ]
        sections.append(
            f"Perplexity by position over the KJV's first {DOCUMENT_TOKENS:,} tokens (`{DOCUMENT}`, read whole; "
            "YaRN and dynamic NTK at factor 4)\n\n" + markdown(["method", *BUCKETS], rows)
        )
    if results:
        plot(results, out / "gemma.png")
    return f"**{SHORT_NAME[MODEL]}** (trained at {TRAINED:,})\n\n" + "\n\n".join(sections)


def plot(results: dict[Cell, dict], path: Path) -> None:
    """Left: the share of keys found by haystack length, of the prompts run (a point's label: how many); right:
    perplexity by position over the 128k read. A method with nothing run in a panel is not drawn there."""
    fig, (left, right) = figure(2, width=5.6, height=3.6)
    for index, name in enumerate(METHOD_NAMES):
        style = {"color": f"C{index}", "linestyle": "-" if "ReRoPE" in name or "STRING" in name else "--"}
        points = []
        for length in PASSKEYS:
            run = [r for (m, n, d, _), r in results.items() if m == name and n == length and d >= 0]
            if run:
                points.append((length / 1024, sum(r["acc,none"] for r in run) / len(run)))
        if points:
            nudge = 2 ** (0.02 * (index - len(METHOD_NAMES) / 2))  # methods with as many keys stay apart
            left.plot([x * nudge for x, _ in points], [y for _, y in points], marker="o", label=name, **style)
        document = results.get((name, DOCUMENT_TOKENS, -1.0, 0))
        if document:
            rerope.draw_perplexity(right, document, BUCKETS, name, style, ceiling=100.0)
    for ax in (left, right):
        ax.axvline(TRAINED / 1024, color="black", lw=1, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("haystack / position (k tokens; dotted: trained 32k)")
    left.set_xlim(12, 180)  # every haystack length, whichever have run
    left.set_xticks([n / 1024 for n in PASSKEYS], labels=[f"{n // 1024}k" for n in PASSKEYS])
    left.set_ylim(-0.05, 1.05)
    left.set_ylabel("share of the prompts run found")
    right.set_yscale("log")
    right.set_ylabel("perplexity (KJV, by position)")
    if not any(d < 0 for (_, _, d, _) in results):
        right.text(0.5, 0.5, "128k read not run yet", transform=right.transAxes, ha="center", fontsize=8)
    handles, labels = left.get_legend_handles_labels()
    right.legend(
        handles, labels, fontsize=6, loc="upper right", title="cells not run are not drawn", title_fontsize=6
    )
    fig.suptitle(f"{SHORT_NAME[MODEL]}: position methods inside and past its trained 32k", fontsize=10)
    save(fig, path)
