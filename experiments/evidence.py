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


def probe_batch(tokenizer, windows_per_doc: int = 2) -> torch.Tensor:
    """Held-out windows as the LMs were trained on them: BOS, then 127 tokens of text."""
    rows = []
    for doc in heldout_streams(tokenizer, STREAM_LENGTH):
        text = doc[1:]
        for i in range(windows_per_doc):
            start = i * 997 % (len(text) - TRAIN_LENGTH)
            rows.append(torch.cat([doc[:1], text[start : start + TRAIN_LENGTH - 1]]))
    return torch.stack(rows)


def figure(columns: int = 1, width: float = 6.0, height: float = 4.0) -> tuple[Figure, list]:
    fig = Figure(figsize=(width * columns, height), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, columns, squeeze=False)[0]
    return fig, list(axes)


def save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path)


def markdown(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- sinks


def sinks(runs: Path, out: Path) -> str:
    """Attention mass on token 0 over training: per layer, the mean over heads and the largest head."""
    found = finished(runs, LM_RUNS)
    batch = probe_batch(
        AutoTokenizer.from_pretrained(next(iter(found.values())))
    )  # one tokenizer for all runs
    curves: dict[str, dict[int, dict[str, list[float]]]] = {}
    for label, path in found.items():
        curves[label] = {}
        for snapshot in sorted((path / "snapshots").glob("step-*")):
            stats = attention_statistics(load(snapshot), batch).summary(skip=SKIP_QUERIES)
            step = int(snapshot.name.split("-")[1])
            curves[label][step] = {
                "heads": stats["sink_mass"].tolist(),
                "mean": stats["sink_mass"].mean(-1).tolist(),
                "max": stats["sink_mass"].amax(-1).tolist(),
                "sink_heads": float((stats["sink_mass"] > SINK_HEAD).float().mean()),
                "exit": float(stats["exit_mass"].mean()),
            }
    (out / "sinks.json").write_text(json.dumps(curves, indent=1))

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
    save(fig, out / "sinks.png")

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


def streaming(runs: Path, out: Path) -> str:
    """Per-position NLL of each LM over held-out streams of 32x its window: dense, and through `STREAM_METHODS`."""
    found = finished(runs, {**LM_RUNS, "E (logn)": E_RUN})
    streams = heldout_streams(AutoTokenizer.from_pretrained(next(iter(found.values()))), STREAM_LENGTH)
    curves: dict[str, dict[str, list[float]]] = {}
    rows = []
    for label, path in found.items():
        model = load(path)
        curves[label] = {}
        # Streaming needs a patched model: the trained patch, or the identity for an unpatched one.
        with hfa.patched(model, hfa.get_config(model) or hfa.AttnScaleConfig()):
            for method, new_cache in STREAM_METHODS.items():
                nll = torch.stack(
                    [hfa.perplexity(model, s, cache=new_cache(), chunk_size=512).nll for s in streams]
                )
                curves[label][method] = [round(x, 5) for x in nll.mean(0).tolist()]
        past = {m: math.exp(statistics.fmean(c[TRAIN_LENGTH:])) for m, c in curves[label].items()}
        rows.append([label, *[f"{past[m]:.2f}" for m in STREAM_METHODS]])
    (out / "streaming.json").write_text(json.dumps(curves))

    plot_streams(curves, out / "streaming.png")
    note = (
        f"\nPerplexity over positions {TRAIN_LENGTH}..{STREAM_LENGTH - 1} of {len(streams)} held-out files, "
        f"each streamed alone from its BOS token ({STREAM_LENGTH} tokens = 32x the training window)."
    )
    return markdown(["model", *STREAM_METHODS], rows) + "\n" + note


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
    gains = {  # (window-only, with sinks): same cache size
        "1 sink (cache 128)": ("window-only (0+128)", "1 sink + 127"),
        "4 sinks (cache 128)": ("window-only (0+128)", "4 sinks + 124"),
        "4 sinks (cache 32)": ("window-only (0+32)", "4 sinks + 28"),
    }
    for column, (label, by_method) in enumerate(curves.items()):
        top, bottom = axes[0][column], axes[1][column]
        for method in ("dense", "window-only (0+128)", "4 sinks + 124", "window-only (0+32)", "4 sinks + 28"):
            x, nll = binned(by_method[method], 64)
            top.plot(x, nll.exp(), label=method)
        top.set(title=label, ylabel="perplexity (bins of 64)", yscale="log")
        for name, (without, with_sinks) in gains.items():
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


def decoder(runs: Path, out: Path) -> str:
    """Su's table for a decoder: O with inference-time fixes, against E (trained with log_L(n))."""
    o_path, e_path = run_dir(runs, LM_RUNS["vanilla"]), run_dir(runs, E_RUN)
    tokenizer = AutoTokenizer.from_pretrained(o_path)
    docs = tokenize_documents(tokenizer, long_documents("heldout", DECODER_LENGTHS[-1] + 1, tokenizer))
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
        results.append(_sweep(model, docs, variants, tokenizer.bos_token_id))
    e_model = load(e_path)
    results.append(
        _sweep(
            e_model,
            docs,
            [hfa.Variant("E (log_L n, trained)", patch=hfa.get_config(e_model).to_dict())],
            tokenizer.bos_token_id,
        )
    )

    table: dict[str, dict[int, float]] = {}
    for row in (row for result in results for row in result.rows):
        table.setdefault(row.variant, {})[row.length] = row.ppl
    (out / "decoder.json").write_text(json.dumps(table, indent=1))
    fig, (ax,) = figure(1, width=7)
    for name, by_length in table.items():
        ax.plot(list(by_length), list(by_length.values()), marker="o", label=name)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="segment length (tokens)",
        ylabel="perplexity",
        title="decoder: O vs E",
    )
    ax.set_xticks(DECODER_LENGTHS, [str(n) for n in DECODER_LENGTHS])
    ax.minorticks_off()
    ax.axvline(TRAIN_LENGTH, color="grey", ls="--", lw=0.8)
    ax.legend(fontsize=7)
    save(fig, out / "decoder.png")
    header = ["variant", *[f"{n} ({n // TRAIN_LENGTH}x)" for n in DECODER_LENGTHS]]
    return markdown(
        header,
        [[name, *[f"{by_length[n]:.2f}" for n in DECODER_LENGTHS]] for name, by_length in table.items()],
    )


def _sweep(model, docs, variants, bos_id):
    return hfa.sweep(
        model, docs, DECODER_LENGTHS, variants, train_length=TRAIN_LENGTH, bos_id=bos_id, chunk_size=4096
    )


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
        means = [statistics.fmean(v) for v in values]
        ax.errorbar(
            [int(n) for n in MLM_LENGTHS],
            means,
            yerr=[[m - min(v) for m, v in zip(means, values)], [max(v) - m for m, v in zip(means, values)]],
            marker="o",
            capsize=3,
            label=f"Attention-{label}",
        )
        rows.append([label, *[f"{m:.2f} ({min(v):.2f}..{max(v):.2f})" for m, v in zip(means, values)]])
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
    "outliers": outliers,
    "mlm": mlm,
}

if __name__ == "__main__":
    main()
