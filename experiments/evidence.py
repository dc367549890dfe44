"""Regenerate every table and figure of ``experiments/RESULTS.md`` from the trained checkpoints.

    python experiments/evidence.py --runs runs --out experiments/out        # all sections
    python experiments/evidence.py --runs runs --out experiments/out --only sinks streaming

The checkpoints are trained by ``experiments/train.sh`` (one directory per run under ``--runs``). Each
section reads the runs it needs, prints its Markdown table and writes ``<out>/<section>.md``, ``.json`` and
``.png``. A section whose runs are missing says which and is skipped. Data: the built-in corpus's held-out
files (Python standard library sources, split by path), never seen in training.

Sections:
  sinks      attention mass on token 0 (the BOS token) over training, per layer, for the three LM runs;
  streaming  per-position NLL over a 32x stream: dense, window-only and sink+window caches (0/1/2/4 sinks);
  decoder    Su's table for a decoder: O, O + inference-time logn / dynamic NTK / YaRN / streaming, and E;
  targets    where the unpatched decoders' heads attend (BOS, own token, previous token, start of line) and
             what evicting BOS costs them, for each recipe tried to grow sinks (weight decay, learning
             rate, depth, length);
  rates      the same recipe at peak learning rates 2e-3, 4e-3 and 6e-3: sink heads over training, and the
             32x stream of `streaming` for each;
  outliers   kurtosis and max |activation| of the three LM runs, and their perplexity under W8A8;
  mlm        Su's table for an encoder: MLM accuracy of O and E at 64..1024 tokens, mean and spread of seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_attnscale as hfa
from hf_attnscale.diagnostics import activation_outliers, attention_statistics, fake_quantized
from hf_attnscale.evaluation.corpus import builtin_documents, long_documents, tokenize_documents
from hf_attnscale.training.lm import windowed_perplexity

TRAIN_LENGTH = 128
"""The LM runs' training window (``--context 128``): 128 positions, BOS then 127 tokens of text."""
STREAM_LENGTH = 32 * TRAIN_LENGTH
LM_RUNS = {"vanilla": "lm-vanilla", "zero_kv": "lm-zerokv", "learnable sink": "lm-sink"}
E_RUN = "lm-logn"
MLM_RUNS = {"O": "mlm-o-s{seed}", "E": "mlm-e-s{seed}"}
MLM_SEEDS = (0, 1, 2)
SKIP_QUERIES = 16
"""Sink mass is averaged over queries at positions >= this (the first few see few keys)."""
SINK_HEAD = 0.3
"""A head whose mean mass on token 0 exceeds this is a sink head (Gu et al. 2024's threshold)."""


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, required=True, help="directory holding the trained runs")
    parser.add_argument("--out", type=Path, required=True, help="where tables, JSON and figures go")
    parser.add_argument("--only", nargs="*", choices=SECTIONS, help="sections to run (default: all)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.only or SECTIONS:
        try:
            table = SECTIONS[name](args.runs, args.out)
        except MissingRuns as err:
            print(f"## {name}: skipped ({err})\n")
            continue
        (args.out / f"{name}.md").write_text(table + "\n")
        print(f"## {name}\n\n{table}\n")


class MissingRuns(Exception):
    """A section's checkpoints are not there."""


def is_finished(path: Path) -> bool:
    """Whether a run directory holds its final model (the trainers save it last)."""
    return (path / "config.json").is_file()


def run_dir(runs: Path, name: str) -> Path:
    path = runs / name
    if not is_finished(path):
        raise MissingRuns(f"no finished run at {path}")
    return path


def finished(runs: Path, names: dict[str, str]) -> dict[str, Path]:
    """The finished runs among ``names`` (label -> directory name); raises MissingRuns if there is none."""
    found = {label: runs / name for label, name in names.items() if is_finished(runs / name)}
    if not found:
        raise MissingRuns(f"none of {list(names.values())} under {runs}")
    for label in names.keys() - found.keys():
        print(f"({label}: no finished run at {runs / names[label]}; left out)")
    return found


def load(path: Path):
    """A trained LM with the patch it was trained under (in eval mode)."""
    return hfa.from_pretrained(AutoModelForCausalLM, str(path), local_files_only=True).eval()


def heldout_streams(tokenizer, length: int) -> list[torch.Tensor]:
    """The held-out files of at least ``length`` tokens, each cut to its first ``length`` (BOS first)."""
    docs = tokenize_documents(tokenizer, long_documents("heldout", length, tokenizer))
    return [doc[:length] for doc in docs]


def probe_batch(tokenizer, length: int = TRAIN_LENGTH, windows_per_doc: int = 2) -> torch.Tensor:
    """Held-out windows as the LMs were trained on them: BOS, then ``length - 1`` tokens of text."""
    rows = []
    for doc in heldout_streams(tokenizer, STREAM_LENGTH):
        text = doc[1:]
        for i in range(windows_per_doc):
            start = i * 997 % (len(text) - length)
            rows.append(torch.cat([doc[:1], text[start : start + length - 1]]))
    return torch.stack(rows)


def figure(columns: int = 1, width: float = 6.0, height: float = 4.0, rows: int = 1) -> tuple[Figure, list]:
    """A figure of ``rows x columns`` panels of ``width x height`` inches; its axes in reading order."""
    fig = Figure(figsize=(width * columns, height * rows), dpi=110)
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(rows, columns, squeeze=False).flat)


def save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path)


def plot_seeds(ax, x: Sequence[float], per_x: Sequence[Sequence[float]], label: str) -> None:
    """The mean over seeds at each x, with the seeds' range as error bars."""
    means = [statistics.fmean(v) for v in per_x]
    spread = [[m - min(v) for m, v in zip(means, per_x)], [max(v) - m for m, v in zip(means, per_x)]]
    ax.errorbar(list(x), means, yerr=spread, marker="o", capsize=3, label=label)


def mean_and_range(values: Sequence[float]) -> str:
    """A table cell: the mean over seeds and their range, ``mean (min..max)`` (the mean alone for one seed)."""
    mean = f"{statistics.fmean(values):.2f}"
    return mean if len(values) == 1 else f"{mean} ({min(values):.2f}..{max(values):.2f})"


def markdown(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- sinks


def sinks(runs: Path, out: Path) -> str:
    """Attention mass on token 0 over training: per layer, the mean over heads and the largest head."""
    found = finished(runs, LM_RUNS)
    # Every run shares the shipped tokenizer: one probe batch for all.
    batch = probe_batch(AutoTokenizer.from_pretrained(next(iter(found.values()))))
    curves = {label: sink_curves(path, batch) for label, path in found.items()}
    (out / "sinks.json").write_text(json.dumps(curves, indent=1))
    plot_sink_curves(curves, out / "sinks.png")

    steps = sorted(next(iter(curves.values())))
    layers = len(next(iter(curves.values()))[steps[0]]["mean"])
    header = [
        "model",
        "step",
        *[f"layer {i}: mean / top head" for i in range(layers)],
        f"sink heads (mass > {SINK_HEAD})",
        "mass on the exit",
    ]
    rows = []
    for label, by_step in curves.items():
        for step, c in sorted(by_step.items()):
            cells = [f"{m:.3f} / {x:.3f}" for m, x in zip(c["mean"], c["max"])]
            rows.append([label, step, *cells, f"{c['sink_heads']:.0%}", f"{c['exit']:.3f}"])
    note = (
        f"\nMass on token 0 (BOS), averaged over the queries at positions {SKIP_QUERIES}..{TRAIN_LENGTH - 1} of "
        f"{len(batch)} held-out windows (BOS + {TRAIN_LENGTH - 1} tokens). A sink head (Gu et al. 2024's "
        f"Sink metric, epsilon {SINK_HEAD}) puts more than {SINK_HEAD} of its attention there."
    )
    return markdown(header, rows) + "\n" + note


def sink_stats(model, batch: torch.Tensor) -> dict:
    """BOS mass per head, its per-layer mean and top head, the share of sink heads and the exit's mass."""
    stats = attention_statistics(model, batch).summary(skip=SKIP_QUERIES)
    return {
        "heads": stats["sink_mass"].tolist(),
        "mean": stats["sink_mass"].mean(-1).tolist(),
        "max": stats["sink_mass"].amax(-1).tolist(),
        "sink_heads": float((stats["sink_mass"] > SINK_HEAD).float().mean()),
        "exit": float(stats["exit_mass"].mean()),
    }


def sink_curves(path: Path, batch: torch.Tensor) -> dict[int, dict]:
    """`sink_stats` of every snapshot of a run (``--snapshot-every``), by training step."""
    snapshots = sorted((path / "snapshots").glob("step-*"))
    return {int(s.name.split("-")[1]): sink_stats(load(s), batch) for s in snapshots}


def plot_sink_curves(curves: dict[str, dict[int, dict]], path: Path) -> None:
    """One panel per run: each layer's mean BOS mass (solid) and top head (dotted) against the step."""
    fig, axes = figure(len(curves), width=4.5)
    for ax, (label, by_step) in zip(axes, curves.items()):
        steps = sorted(by_step)
        for layer in range(len(by_step[steps[0]]["mean"])):
            line = ax.plot(
                steps, [by_step[s]["mean"][layer] for s in steps], marker="o", label=f"layer {layer}"
            )
            ax.plot(steps, [by_step[s]["max"][layer] for s in steps], ls=":", color=line[0].get_color())
        ax.set(
            title=f"{label}: attention on BOS", xlabel="training step", ylabel="mass on token 0", ylim=(0, 1)
        )
        ax.legend(fontsize=7, title="solid: mean of heads, dotted: top head", title_fontsize=7)
    save(fig, path)


# ------------------------------------------------------------------------------------------ streaming

STREAM_METHODS: dict[str, Callable[[], hfa.SinkCache | None]] = {
    "dense": lambda: None,
    "window-only (0+128)": lambda: hfa.SinkCache(0, TRAIN_LENGTH),
    "1 sink + 127": lambda: hfa.SinkCache(1, TRAIN_LENGTH - 1),
    "2 sinks + 126": lambda: hfa.SinkCache(2, TRAIN_LENGTH - 2),
    "4 sinks + 124": lambda: hfa.SinkCache(4, TRAIN_LENGTH - 4),
    "window-only (0+32)": lambda: hfa.SinkCache(0, 32),
    "4 sinks + 28": lambda: hfa.SinkCache(4, 28),
}
STREAM_GAINS = {  # what the sinks buy: (window-only, with sinks) of `STREAM_METHODS`, the same cache size
    "1 sink (cache 128)": ("window-only (0+128)", "1 sink + 127"),
    "4 sinks (cache 128)": ("window-only (0+128)", "4 sinks + 124"),
    "4 sinks (cache 32)": ("window-only (0+32)", "4 sinks + 28"),
}


def streaming(runs: Path, out: Path) -> str:
    """Per-position NLL of each LM over held-out streams of 32x its window: dense, and through `STREAM_METHODS`."""
    found = finished(runs, {**LM_RUNS, "E (logn)": E_RUN})
    streams = heldout_streams(AutoTokenizer.from_pretrained(next(iter(found.values()))), STREAM_LENGTH)
    curves: dict[str, dict[str, list[float]]] = {}
    rows = []
    for label, path in found.items():
        curves[label] = stream_curves(load(path), streams, STREAM_METHODS)
        past = past_perplexity(curves[label])
        rows.append([label, *[f"{past[m]:.2f}" for m in STREAM_METHODS]])
    (out / "streaming.json").write_text(json.dumps(curves))

    plot_streams(curves, out / "streaming.png")
    note = (
        f"\nPerplexity over positions {TRAIN_LENGTH}..{STREAM_LENGTH - 1} of {len(streams)} held-out files, "
        f"each streamed alone from its BOS token ({STREAM_LENGTH} tokens = 32x the training window)."
    )
    return markdown(["model", *STREAM_METHODS], rows) + "\n" + note


def stream_curves(model, streams: list[torch.Tensor], methods: dict) -> dict[str, list[float]]:
    """Mean NLL by stream position of ``model`` read through each method's cache (``None``: dense)."""
    curves = {}
    # Streaming needs a patched model: the trained patch, or the identity for an unpatched one.
    with hfa.patched(model, hfa.get_config(model) or hfa.AttnScaleConfig()):
        for method, new_cache in methods.items():
            nll = torch.stack(
                [hfa.perplexity(model, s, cache=new_cache(), chunk_size=512).nll for s in streams]
            )
            curves[method] = [round(x, 5) for x in nll.mean(0).tolist()]
    return curves


def past_perplexity(curves: dict[str, list[float]], start: int = TRAIN_LENGTH) -> dict[str, float]:
    """Perplexity past the trained window (positions ``start`` onwards) of each curve."""
    return {method: math.exp(statistics.fmean(nll[start:])) for method, nll in curves.items()}


def binned(nll: Sequence[float], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bin centres, mean NLL per bin) over whole bins of ``size`` positions."""
    usable = len(nll) // size * size
    means = torch.tensor(nll[:usable], dtype=torch.float64).view(-1, size).mean(-1)
    return (torch.arange(len(means)) + 0.5) * size, means


def plot_streams(curves: dict[str, dict[str, list[float]]], path: Path) -> None:
    """Top: perplexity by position per model; bottom: what the sinks buy, NLL(window-only) - NLL(with sinks)."""
    fig = Figure(figsize=(4.5 * len(curves), 7.5), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(curves), squeeze=False, sharey="row")
    for column, (label, by_method) in enumerate(curves.items()):
        top, bottom = axes[0][column], axes[1][column]
        for method in ("dense", "window-only (0+128)", "4 sinks + 124", "window-only (0+32)", "4 sinks + 28"):
            x, nll = binned(by_method[method], 64)
            top.plot(x, nll.exp(), label=method)
        top.set(title=label, ylabel="perplexity (bins of 64)", yscale="log")
        for name, (without, with_sinks) in STREAM_GAINS.items():
            x, gain = binned([a - b for a, b in zip(by_method[without], by_method[with_sinks])], 256)
            bottom.plot(x, gain, marker="o", label=name)
        bottom.axhline(0, color="grey", lw=0.8)
        bottom.set(xlabel="position in stream", ylabel="NLL(window-only) - NLL(with sinks), bins of 256")
        for ax in (top, bottom):
            ax.axvline(TRAIN_LENGTH, color="grey", ls="--", lw=0.8)
            ax.legend(fontsize=7)
    save(fig, path)


# -------------------------------------------------------------------------------------------- decoder

DECODER_LENGTHS = [TRAIN_LENGTH * m for m in (1, 2, 4, 8, 16)]
DECODER_SEEDS = (0, 1, 2)


def seed_run(name: str, seed: int) -> str:
    """A decoder run's directory for a seed: seed 0 is the plain name the other sections use, others add -s<seed>."""
    return name if seed == 0 else f"{name}-s{seed}"


def decoder(runs: Path, out: Path) -> str:
    """Su's table for a decoder: O with inference-time fixes, against E (trained with log_L(n)), over the seeds."""
    pairs = {}
    for seed in DECODER_SEEDS:
        o_path, e_path = (runs / seed_run(name, seed) for name in (LM_RUNS["vanilla"], E_RUN))
        if is_finished(o_path) and is_finished(e_path):
            pairs[seed] = (o_path, e_path)
        else:
            print(f"(seed {seed}: needs finished runs at {o_path} and {e_path}; left out)")
    if not pairs:
        raise MissingRuns(f"no seed of {DECODER_SEEDS} has both an O and an E run under {runs}")
    tokenizer = AutoTokenizer.from_pretrained(next(iter(pairs.values()))[0])
    docs = tokenize_documents(tokenizer, long_documents("heldout", DECODER_LENGTHS[-1] + 1, tokenizer))
    table: dict[str, dict[int, list[float]]] = {}  # variant -> length -> perplexity per seed
    for o_path, e_path in pairs.values():
        for variant, by_length in decoder_seed(o_path, e_path, docs, tokenizer.bos_token_id).items():
            for length, ppl in by_length.items():
                table.setdefault(variant, {}).setdefault(length, []).append(ppl)
    (out / "decoder.json").write_text(json.dumps({"seeds": list(pairs), "perplexity": table}, indent=1))

    fig, (ax,) = figure(1, width=7)
    for name, by_length in table.items():
        plot_seeds(ax, list(by_length), list(by_length.values()), name)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="segment length (tokens)",
        ylabel=f"perplexity (mean and range of {len(pairs)} seeds)",
        title="decoder: O vs E",
    )
    ax.set_xticks(DECODER_LENGTHS, [str(n) for n in DECODER_LENGTHS])
    ax.minorticks_off()
    ax.axvline(TRAIN_LENGTH, color="grey", ls="--", lw=0.8)
    ax.legend(fontsize=7)
    save(fig, out / "decoder.png")
    header = ["variant", *[f"{n} ({n // TRAIN_LENGTH}x)" for n in DECODER_LENGTHS]]
    rows = [
        [name, *[mean_and_range(by_length[n]) for n in DECODER_LENGTHS]] for name, by_length in table.items()
    ]
    note = f"\nCells: perplexity, mean (min..max) over seeds {', '.join(map(str, pairs))}."
    return markdown(header, rows) + "\n" + note


def decoder_seed(o_path: Path, e_path: Path, docs, bos_id: int) -> dict[str, dict[int, float]]:
    """One seed's row per variant: perplexity by segment length."""
    logn = {"scale": "logn", "train_length": TRAIN_LENGTH}
    factor = DECODER_LENGTHS[-1] // TRAIN_LENGTH
    rope = {
        "": None,
        "dynamic NTK": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        "YaRN": {
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": TRAIN_LENGTH,
            "rope_theta": 10000.0,
        },
    }
    results = []
    for rope_name, parameters in rope.items():
        kwargs = {} if parameters is None else {"rope_parameters": parameters}
        model = hfa.from_pretrained(AutoModelForCausalLM, str(o_path), local_files_only=True, **kwargs).eval()
        prefix = f"O + {rope_name}" if rope_name else "O"
        variants = [hfa.Variant(prefix), hfa.Variant(f"{prefix} + logn", patch=logn)]
        if not rope_name:
            variants.append(hfa.Variant("O + streaming (4+125)", sink_tokens=4, window=TRAIN_LENGTH - 3))
        results.append(_sweep(model, docs, variants, bos_id))
    e_model = load(e_path)
    results.append(
        _sweep(
            e_model,
            docs,
            [hfa.Variant("E (log_L n, trained)", patch=hfa.get_config(e_model).to_dict())],
            bos_id,
        )
    )
    table: dict[str, dict[int, float]] = {}
    for row in (row for result in results for row in result.rows):
        table.setdefault(row.variant, {})[row.length] = row.ppl
    return table


def _sweep(model, docs, variants, bos_id):
    return hfa.sweep(
        model, docs, DECODER_LENGTHS, variants, train_length=TRAIN_LENGTH, bos_id=bos_id, chunk_size=4096
    )


# ------------------------------------------------------------------------------------------- targets

TARGET_RUNS = {  # label -> run: the recipes tried to grow sinks, all on the same 8.2M tokens
    "4 x 256, weight decay 0.1": "lm-vanilla",
    "4 x 256, weight decay 0.5": "lm-vanilla-wd0.5",
    "4 x 256, weight decay 1.0": "lm-vanilla-wd1.0",
    "4 x 256, peak lr 4e-3": "lm-vanilla-lr4e-3",
    "4 x 256, peak lr 6e-3": "lm-vanilla-lr6e-3",
    "12 x 128": "lm-deep12",
    "16 x 96": "lm-deep16",
    "4 x 256, trained at 512": "lm-ctx512",
    "4 x 256, trained at 1024": "lm-ctx1024",
}
TARGETS = ("BOS", "own token", "previous token", "start of its line", "elsewhere")
SMALL_CACHE = 32
"""The second cache size of the eviction test, the same for every model (section 2's smaller cache)."""
QUARTERS = 4


def eviction_caches(length: int) -> dict[str, Callable[[], hfa.SinkCache]]:
    """Window-only against 4 sinks, at a cache of the model's trained ``length`` and at `SMALL_CACHE`."""
    return {
        "window-only, cache = trained length": lambda: hfa.SinkCache(0, length),
        "4 sinks + rest, same cache": lambda: hfa.SinkCache(4, length - 4),
        f"window-only (0+{SMALL_CACHE})": lambda: hfa.SinkCache(0, SMALL_CACHE),
        f"4 sinks + {SMALL_CACHE - 4}": lambda: hfa.SinkCache(4, SMALL_CACHE - 4),
    }


def targets(runs: Path, out: Path) -> str:
    """Where the unpatched decoders' heads attend, and what evicting BOS costs them, for each training recipe."""
    found = finished(runs, TARGET_RUNS)
    tokenizer = AutoTokenizer.from_pretrained(next(iter(found.values())))
    newline = torch.tensor(["\n" in tokenizer.decode([i]) for i in range(len(tokenizer))])
    streams = heldout_streams(tokenizer, STREAM_LENGTH)
    data, summary_rows, target_rows = {}, [], []
    for label, path in found.items():
        model = load(path)
        if hfa.get_config(model) is not None:
            raise ValueError(f"{path} was trained under a patch; this section reads unpatched models")
        length = model.config.max_position_embeddings
        batch = probe_batch(tokenizer, length)
        mass = attention_targets(model, batch, newline)
        caches = eviction_caches(length)
        past = past_perplexity(stream_curves(model, streams, caches), start=length)
        info = json.loads((path / "training_info.json").read_text())
        bos = mass["BOS"]
        data[label] = row = {
            "trained_length": length,
            "layers": model.config.num_hidden_layers,
            "hidden": model.config.hidden_size,
            "parameters": info["parameters"],
            "heldout_ppl": info[f"heldout_ppl_{length}"],
            "targets": {name: m.tolist() for name, m in mass.items()},
            "streaming": past,
        }
        # eviction_caches alternates window-only and its with-sinks twin
        without_sinks, with_sinks = list(past.values())[0::2], list(past.values())[1::2]
        summary_rows.append(
            [
                label,
                length,
                f"{row['parameters'] / 1e6:.1f}M",
                f"{row['heldout_ppl']:.2f}",
                f"{int((bos > SINK_HEAD).sum())} of {bos.numel()}",
                f"{float(bos.max()):.2f}",
                *[f"{v:.2f}" for v in past.values()],
                *[f"{100 * (a / b - 1):+.1f}%" for a, b in zip(without_sinks, with_sinks)],
            ]
        )
        for name, m in mass.items():
            target_rows.append([label, name, *depth_quarters(m)])
    (out / "targets.json").write_text(json.dumps(data, indent=1))
    plot_targets(data, out / "targets.png")

    summary = markdown(
        [
            "model (layers x hidden)",
            "trained at",
            "parameters",
            "held-out ppl at its length",
            f"sink heads (BOS mass > {SINK_HEAD})",
            "top head on BOS",
            *caches,
            "window-only cost, cache = trained length",
            f"cache {SMALL_CACHE}",
        ],
        summary_rows,
    )
    where = markdown(
        [
            "model",
            "attends to",
            *[f"layers, quarter {i + 1} of {QUARTERS}: mean / top head" for i in range(QUARTERS)],
        ],
        target_rows,
    )
    note = (
        f"\nAttention mass of each head on each target, averaged over the queries from position {SKIP_QUERIES} on "
        f"of {len(batch)} held-out windows of each model's trained length (BOS first); the start of a line is the last "
        "newline token before the previous token; each quarter of the layers is one layer for the 4-layer "
        "models. Streaming: perplexity past each model's trained length, up to position "
        f"{STREAM_LENGTH - 1}, of {len(streams)} held-out files streamed alone from BOS."
    )
    return summary + "\n\n" + where + "\n" + note


def depth_quarters(mass: torch.Tensor) -> list[str]:
    """Table cells for a ``(layers, heads)`` mass: per quarter of the layers, the mean and the top head."""
    cells = []
    for layers in torch.arange(len(mass)).tensor_split(QUARTERS):
        if not len(layers):  # fewer layers than quarters
            cells.append("–")
            continue
        part = mass[layers]
        top = int(part.argmax())
        layer, head = int(layers[top // part.shape[1]]), top % part.shape[1]
        cells.append(f"{float(part.mean()):.2f} / {float(part.max()):.2f} (L{layer} h{head})")
    return cells


def plot_targets(data: dict, path: Path) -> None:
    """One panel per model: a bar per head, by layer, stacked by what it attends to."""
    columns = min(len(data), 2)
    fig, axes = figure(columns, width=6.5, rows=math.ceil(len(data) / columns))
    for ax, (label, values) in zip(axes, data.items()):
        # (targets, layers * heads): one bar per head, stacked by target
        stacked = torch.tensor([values["targets"][name] for name in TARGETS]).flatten(1)
        bottom = torch.zeros(stacked.shape[1])
        for name, share in zip(TARGETS, stacked):
            ax.bar(range(len(share)), share, bottom=bottom, label=name, width=0.85)
            bottom += share
        heads = len(values["targets"]["BOS"][0])
        layers = len(bottom) // heads
        every = max(1, layers // 8)
        ax.set_xticks(
            [i * heads + (heads - 1) / 2 for i in range(0, layers, every)],
            [f"L{i}" for i in range(0, layers, every)],
        )
        ax.set(
            title=label,
            ylabel="attention mass (mean over queries)",
            xlabel="heads, by layer",
            ylim=(0, 1),
        )
        ax.legend(fontsize=7, loc="upper right")
    for ax in axes[len(data) :]:
        ax.set_visible(False)
    save(fig, path)


@torch.no_grad()
def attention_targets(model, batch: torch.Tensor, newline: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean attention mass per ``(layer, head)`` on each of `TARGETS`, over the queries from `SKIP_QUERIES` on.

    The targets are disjoint: BOS, the query's own token, the token before it, the last newline token before
    that (the start of its line, when it is not BOS), and everything else.
    """
    eager = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager").eval()
    eager.load_state_dict(model.state_dict())
    # One window at a time (the (H, T, T) weights of long windows are large); each has as many queries.
    per_window = [window_targets(eager, window[None], newline) for window in batch]
    return {name: torch.stack([w[name] for w in per_window]).mean(0) for name in TARGETS}


def window_targets(eager, batch: torch.Tensor, newline: torch.Tensor) -> dict[str, torch.Tensor]:
    """`attention_targets` of an eager model on one batch."""
    attentions = eager(input_ids=batch, output_attentions=True).attentions  # each (B, H, T, T)
    queries = torch.arange(SKIP_QUERIES, batch.shape[1])
    rows = torch.arange(len(queries))
    positions = torch.arange(batch.shape[1]).expand_as(batch)
    last_newline = torch.where(newline[batch], positions, 0).cummax(-1).values  # (B, T), 0 where none yet
    # (B, Q): the last newline before the previous token, so that the targets are disjoint
    line_start = last_newline[:, queries - 2]
    mass: dict[str, list[torch.Tensor]] = {name: [] for name in TARGETS}
    for probs in attentions:
        probs = probs[:, :, queries].float()  # (B, H, Q, T)
        at_line_start = probs.gather(-1, line_start[:, None, :, None].expand(-1, probs.shape[1], -1, 1))
        parts = {
            "BOS": probs[..., 0],
            "own token": probs[:, :, rows, queries],
            "previous token": probs[:, :, rows, queries - 1],
            "start of its line": at_line_start.squeeze(-1).masked_fill(line_start[:, None] == 0, 0.0),
        }
        parts["elsewhere"] = 1 - sum(parts.values())
        for name, part in parts.items():
            mass[name].append(part.mean((0, 2)))
    return {name: torch.stack(per_layer) for name, per_layer in mass.items()}


# ---------------------------------------------------------------------------------------------- rates

RATE_RUNS = {  # label -> run: lm-vanilla's recipe at three peak learning rates, the same 8.2M tokens
    "peak lr 2e-3": "lm-vanilla",
    "peak lr 4e-3": "lm-vanilla-lr4e-3",
    "peak lr 6e-3": "lm-vanilla-lr6e-3",
}
RATE_GAINS = (STREAM_GAINS["4 sinks (cache 128)"], STREAM_GAINS["4 sinks (cache 32)"])
"""What evicting BOS costs, in the rates table: window-only against 4 sinks at both cache sizes."""


def rates(runs: Path, out: Path) -> str:
    """Sinks grown by the learning rate: BOS mass over training, and section 2's 32x stream for each rate."""
    found = finished(runs, RATE_RUNS)
    tokenizer = AutoTokenizer.from_pretrained(next(iter(found.values())))
    batch, streams = probe_batch(tokenizer), heldout_streams(tokenizer, STREAM_LENGTH)
    data, rows = {}, []
    for label, path in found.items():
        model = load(path)
        info = json.loads((path / "training_info.json").read_text())
        final = sink_stats(model, batch)
        curves = stream_curves(model, streams, STREAM_METHODS)
        past = past_perplexity(curves)
        data[label] = {"final": final, "over_training": sink_curves(path, batch), "streaming": curves}
        heads = torch.tensor(final["heads"])
        rows.append(
            [
                label,
                f"{info[f'heldout_ppl_{TRAIN_LENGTH}']:.2f}",
                f"{int((heads > SINK_HEAD).sum())} of {heads.numel()}",
                f"{float(heads.max()):.2f}",
                *[f"{past[m]:.2f}" for m in STREAM_METHODS],
                *[f"{100 * (past[a] / past[b] - 1):+.1f}%" for a, b in RATE_GAINS],
            ]
        )
    (out / "rates.json").write_text(json.dumps(data))
    plot_streams({label: d["streaming"] for label, d in data.items()}, out / "rates.png")
    with_snapshots = {label: d["over_training"] for label, d in data.items() if d["over_training"]}
    if with_snapshots:
        plot_sink_curves(with_snapshots, out / "rates-sinks.png")
    header = [
        "peak learning rate",
        f"held-out ppl at {TRAIN_LENGTH}",
        f"sink heads (BOS mass > {SINK_HEAD})",
        "top head on BOS",
        *STREAM_METHODS,
        *[f"{a} against {b}" for a, b in RATE_GAINS],
    ]
    note = (
        f"\nSink heads: the final model, {len(batch)} held-out windows of {TRAIN_LENGTH} tokens, queries from "
        f"position {SKIP_QUERIES} on. Streaming: perplexity over positions {TRAIN_LENGTH}..{STREAM_LENGTH - 1} "
        f"of {len(streams)} held-out files, each streamed alone from its BOS token; the last two columns are "
        "what evicting BOS costs (window-only against 4 sinks in a cache of the same size)."
    )
    return markdown(header, rows) + "\n" + note


# ------------------------------------------------------------------------------------------- outliers


def outliers(runs: Path, out: Path) -> str:
    """Kurtosis and max |x| of each LM's activations, and the perplexity it loses under W8A8."""
    found = finished(runs, LM_RUNS)
    tokenizer = AutoTokenizer.from_pretrained(next(iter(found.values())))
    batch = probe_batch(tokenizer)
    docs = tokenize_documents(tokenizer, builtin_documents("heldout"))
    # Windows of BOS + 127 tokens: the positions the models were trained on.
    rows, data = [], {}
    for label, path in found.items():
        model = load(path)
        stats = activation_outliers(model, batch)
        exact = windowed_perplexity(model, docs, TRAIN_LENGTH - 1, tokenizer.bos_token_id)
        with fake_quantized(model):
            quantized = windowed_perplexity(model, docs, TRAIN_LENGTH - 1, tokenizer.bos_token_id)
        data[label] = {
            "hidden_kurtosis": stats.hidden_kurtosis.tolist(),
            "hidden_max_abs": stats.hidden_max_abs.tolist(),
            "attention_kurtosis": stats.attention_kurtosis.tolist(),
            "attention_max_abs": stats.attention_max_abs.tolist(),
            "ppl_fp32": exact,
            "ppl_w8a8": quantized,
        }
        rows.append(
            [
                label,
                f"{float(stats.hidden_kurtosis.max()):.1f}",
                f"{float(stats.hidden_max_abs.max()):.1f}",
                f"{float(stats.attention_kurtosis.max()):.1f}",
                f"{float(stats.attention_max_abs.max()):.2f}",
                f"{exact:.2f}",
                f"{quantized:.2f}",
                f"{100 * (quantized / exact - 1):+.1f}%",
            ]
        )
    (out / "outliers.json").write_text(json.dumps(data, indent=1))
    fig, axes = figure(2, width=4.5)
    for label, d in data.items():
        axes[0].plot(d["hidden_kurtosis"], marker="o", label=label)
        axes[1].plot(d["hidden_max_abs"], marker="o", label=label)
    for ax in axes:
        ax.set_xticks(range(len(d["hidden_kurtosis"])))
    axes[0].set(xlabel="layer", ylabel="kurtosis of hidden state", yscale="log")
    axes[1].set(xlabel="layer", ylabel="max |hidden state|", yscale="log")
    axes[0].legend(fontsize=7)
    save(fig, out / "outliers.png")
    header = [
        "model",
        "hidden kurtosis (max over layers)",
        "hidden max abs",
        "attn-out kurtosis",
        "attn-out max abs",
        f"ppl @{TRAIN_LENGTH} fp32",
        "ppl W8A8",
        "lost",
    ]
    return markdown(header, rows)


# ------------------------------------------------------------------------------------------------ mlm

MLM_LENGTHS = ("64", "128", "256", "512", "1024")


def mlm(runs: Path, out: Path) -> str:
    """MLM accuracy of O and E at 64..1024 tokens: mean and spread (min..max) over the seeds."""
    accuracy: dict[str, list[dict[str, float]]] = {}
    for label, pattern in MLM_RUNS.items():
        for seed in MLM_SEEDS:
            info = run_dir(runs, pattern.format(seed=seed)) / "training_info.json"
            accuracy.setdefault(label, []).append(json.loads(info.read_text())["mlm_accuracy"])
    (out / "mlm.json").write_text(json.dumps(accuracy, indent=1))
    fig, (ax,) = figure(1, width=6)
    rows = []
    for label, seeds in accuracy.items():
        values = [[100 * s[n] for s in seeds] for n in MLM_LENGTHS]
        plot_seeds(ax, [int(n) for n in MLM_LENGTHS], values, f"Attention-{label}")
        rows.append([label, *[mean_and_range(v) for v in values]])
    ax.set(
        xscale="log",
        xlabel="tokens",
        ylabel="MLM accuracy (%)",
        title=f"RoFormer MLM trained at 64, {len(MLM_SEEDS)} seeds",
    )
    ax.set_xticks([int(n) for n in MLM_LENGTHS], list(MLM_LENGTHS))
    ax.minorticks_off()
    ax.legend()
    save(fig, out / "mlm.png")
    return markdown(["", *MLM_LENGTHS], rows)


SECTIONS: dict[str, Callable[[Path, Path], str]] = {
    "sinks": sinks,
    "streaming": streaming,
    "decoder": decoder,
    "targets": targets,
    "rates": rates,
    "outliers": outliers,
    "mlm": mlm,
}

if __name__ == "__main__":
    main()
