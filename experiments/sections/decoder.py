"""Section ``decoder``: Su's table for a decoder, O with inference-time fixes against E, over the seeds.

O is the unpatched decoder, read as trained and with logn, dynamic NTK, YaRN or streaming added at inference;
E is the one trained with ``log_128(n)/sqrt(d)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import hf_attnscale as hfa
from hf_attnscale.evaluation.corpus import long_documents, tokenize_documents

from .figures import figure, plot_seeds, save
from .runs import E_RUN, LM_RUNS, TRAIN_LENGTH, MissingRuns, is_finished, load, shared_tokenizer
from .tables import markdown, mean_and_range

LENGTHS = [TRAIN_LENGTH * m for m in (1, 2, 4, 8, 16)]
SEEDS = (0, 1, 2)


def seed_run(name: str, seed: int) -> str:
    """A decoder run's directory for a seed: seed 0 is the plain name the other sections use, others add -s<seed>."""
    return name if seed == 0 else f"{name}-s{seed}"


def run(runs: Path, out: Path) -> str:
    """Su's table for a decoder: O with inference-time fixes, against E (trained with log_L(n)), over the seeds."""
    pairs = {}
    for seed in SEEDS:
        o_path, e_path = (runs / seed_run(name, seed) for name in (LM_RUNS["vanilla"], E_RUN))
        if is_finished(o_path) and is_finished(e_path):
            pairs[seed] = (o_path, e_path)
        else:
            print(f"(seed {seed}: needs finished runs at {o_path} and {e_path}; left out)")
    if not pairs:
        raise MissingRuns(f"no seed of {SEEDS} has both an O and an E run under {runs}")
    tokenizer = shared_tokenizer(o_path for o_path, _ in pairs.values())
    docs = tokenize_documents(tokenizer, long_documents("heldout", LENGTHS[-1] + 1, tokenizer))
    table: dict[str, dict[int, list[float]]] = {}  # variant -> length -> perplexity per seed
    for o_path, e_path in pairs.values():
        for variant, by_length in seed_perplexity(o_path, e_path, docs, tokenizer.bos_token_id).items():
            for length, ppl in by_length.items():
                table.setdefault(variant, {}).setdefault(length, []).append(ppl)
    (out / "decoder.json").write_text(json.dumps({"seeds": list(pairs), "perplexity": table}, indent=1))
    plot_decoder(table, len(pairs), out / "decoder.png")

    header = ["variant", *[f"{n} ({n // TRAIN_LENGTH}x)" for n in LENGTHS]]
    rows = [[name, *[mean_and_range(by_length[n]) for n in LENGTHS]] for name, by_length in table.items()]
    note = f"\nCells: perplexity, mean (min..max) over seeds {', '.join(map(str, pairs))}."
    return markdown(header, rows) + "\n" + note


def seed_perplexity(o_path: Path, e_path: Path, docs, bos_id: int) -> dict[str, dict[int, float]]:
    """One seed's row per variant: perplexity by segment length."""
    logn = {"scale": "logn", "train_length": TRAIN_LENGTH}
    rope = {
        "": None,
        "dynamic NTK": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        "YaRN": {
            "rope_type": "yarn",
            "factor": float(LENGTHS[-1] // TRAIN_LENGTH),
            "original_max_position_embeddings": TRAIN_LENGTH,
            "rope_theta": 10000.0,
        },
    }
    results = []
    for rope_name, parameters in rope.items():
        model = load(o_path) if parameters is None else load(o_path, rope_parameters=parameters)
        prefix = f"O + {rope_name}" if rope_name else "O"
        variants = [hfa.Variant(prefix), hfa.Variant(f"{prefix} + logn", patch=logn)]
        if not rope_name:
            variants.append(hfa.Variant("O + streaming (4+125)", sink_tokens=4, window=TRAIN_LENGTH - 3))
        results.append(sweep(model, docs, variants, bos_id))
    e_model = load(e_path)
    trained = hfa.Variant("E (log_L n, trained)", patch=hfa.get_config(e_model).to_dict())
    results.append(sweep(e_model, docs, [trained], bos_id))
    table: dict[str, dict[int, float]] = {}
    for row in (row for result in results for row in result.rows):
        table.setdefault(row.variant, {})[row.length] = row.ppl
    return table


def sweep(model, docs, variants: list[hfa.Variant], bos_id: int) -> hfa.SweepResult:
    """`hf_attnscale.sweep` of ``variants`` over `LENGTHS`."""
    return hfa.sweep(
        model, docs, LENGTHS, variants, train_length=TRAIN_LENGTH, bos_id=bos_id, chunk_size=4096
    )


def plot_decoder(table: dict[str, dict[int, list[float]]], seeds: int, path: Path) -> None:
    """Perplexity against segment length per variant: the mean of ``seeds`` seeds and their range."""
    fig, (ax,) = figure(1, width=7)
    for name, by_length in table.items():
        plot_seeds(ax, list(by_length), list(by_length.values()), name)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="segment length (tokens)",
        ylabel=f"perplexity (mean and range of {seeds} seeds)",
        title="decoder: O vs E",
    )
    ax.set_xticks(LENGTHS, [str(n) for n in LENGTHS])
    ax.minorticks_off()
    ax.axvline(TRAIN_LENGTH, color="grey", ls="--", lw=0.8)
    ax.legend(fontsize=7)
    save(fig, path)
