"""Sections 1-3: StreamingLLM's Figure 1 / Table 1 (dense, window-only, re-computation, sink+window), its
Table 2 (how many sinks, and four newlines in their place) and its Table 6 (cache size), on real checkpoints.

Every method reads the same stream: the first ``context.stream_tokens`` tokens of a text (20,480 by
default), tokenized as one document (Gemma-3's tokenizer puts its BOS first; SmolLM2's adds none). A cache ``S+W`` keeps the stream's first S tokens and its last W (`hfa.SinkCache(S, W)`);
``0+W`` is window-only. Re-computation predicts a token from the C tokens before it, re-read from scratch (a
model call per token), so it is scored on one token in `RECOMPUTE_EVERY[C]` only; the table gives every
other method on those same tokens beside its full-stream perplexity.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from matplotlib.ticker import LogLocator, NullLocator, ScalarFormatter
from sections.figures import figure, save
from sections.tables import markdown

import hf_attnscale as hfa
from hf_attnscale.evaluation.recompute import recompute_rows

from .context import SHORT_NAME, TRAINED_LENGTH, Context, Lazy

CACHES = (1024, 256)
"""Section 1's cache sizes C (the paper's 1024 and a small one), sinks included."""
RECOMPUTE_EVERY = {1024: 128, 256: 32}
"""Re-computation scores one token in N (160 and 640 tokens of the 20,480): a model call of C tokens each."""
SINK_COUNTS = (0, 1, 2, 4, 8)
"""Section 2's sink counts, at a cache of `SINK_CACHE` tokens in all."""
SINK_CACHE = 1024
"""Section 2's cache: the paper's 1024 tokens in all (Gemma-3's local layers keep their own 512 of it)."""
SIZES = (256, 512, 1024, 2048, 4096)
"""Section 3's cache sizes: 4 sinks plus C - 4 recent tokens."""
CHUNK = 512


def stream_nll(context: Context, model: Lazy, text: str, sinks: int, window: int | None) -> torch.Tensor:
    """Per-token NLL of the stream (``nll[t]`` predicts token t+1): dense (``window=None``) or through
    ``SinkCache(sinks, window)``."""
    label = "dense" if window is None else f"{sinks}+{window}"
    ids = context.stream(model.name, text, context.stream_tokens)

    def compute() -> torch.Tensor:
        cache = None if window is None else hfa.SinkCache(sinks, window)
        return hfa.perplexity(model(), ids, cache, chunk_size=CHUNK, progress=False).nll

    return context.cells.get(f"nll/{model.name}/{text}/{context.stream_tokens}/{label}", compute)


def newline_sinks_nll(context: Context, model: Lazy, text: str) -> torch.Tensor:
    """Table 2's control: the stream's first four tokens replaced by four newline tokens, kept as the sinks of
    ``SinkCache(4, C - 4)``."""
    cache = SINK_CACHE

    def compute() -> torch.Tensor:
        ids = context.stream(model.name, text, context.stream_tokens).clone()
        (newline,) = context.tokenizer(model.name)("\n", add_special_tokens=False).input_ids
        ids[:4] = newline
        return hfa.perplexity(model(), ids, hfa.SinkCache(4, cache - 4), chunk_size=CHUNK, progress=False).nll

    return context.cells.get(
        f"nll/{model.name}/{text}/{context.stream_tokens}/newlines4+{cache - 4}", compute
    )


def recompute_nll(context: Context, model: Lazy, text: str, cache: int) -> dict:
    """Re-computation with ``cache`` tokens of context, on one token in `RECOMPUTE_EVERY` (``mean_nll``,
    ``tokens``, ``seconds``)."""
    every = RECOMPUTE_EVERY[cache]
    ids = context.stream(model.name, text, context.stream_tokens)

    def compute() -> dict:
        start = time.perf_counter()
        (row,) = recompute_rows(
            model(), "recompute", cache, [ids], [ids.numel()], every=every, chunk_size=cache
        )
        return {"mean_nll": row.nll, "tokens": row.tokens, "seconds": time.perf_counter() - start}

    return context.cells.get(
        f"recompute/{model.name}/{text}/{context.stream_tokens}/{cache}/every{every}", compute
    )


def on_recompute_tokens(nll: torch.Tensor, every: int) -> float:
    """Mean NLL over the tokens re-computation scores: tokens p with p % every == every - 1, i.e. nll[p - 1]."""
    return nll[every - 2 :: every].double().mean().item()


def ppl(nll: torch.Tensor) -> float:
    return math.exp(nll.double().mean().item())


def run_streaming(context: Context) -> str:
    """Section 1: dense, window-only, re-computation and sink+window at C = 1024 and 256."""
    results, tables = {}, []
    for name in context.models:
        model = Lazy(context, name)
        for text in context.texts:
            dense = stream_nll(context, model, text, 0, None)
            curves = {"dense": dense}
            rows = [
                [
                    "dense",
                    f"{ppl(dense):.2f}",
                    *[f"{math.exp(on_recompute_tokens(dense, RECOMPUTE_EVERY[c])):.2f}" for c in CACHES],
                ]
            ]
            numbers = {"dense": ppl(dense)}
            for cache in CACHES:
                every = RECOMPUTE_EVERY[cache]
                methods = {f"window-only (0+{cache})": 0, f"StreamingLLM (4+{cache - 4})": 4}
                for label, sinks in methods.items():
                    nll = stream_nll(context, model, text, sinks, cache - sinks)
                    curves[label] = nll
                    numbers[label] = ppl(nll)
                    sub = math.exp(on_recompute_tokens(nll, every))
                    rows.append(
                        [label, f"{ppl(nll):.2f}", *[f"{sub:.2f}" if c == cache else "" for c in CACHES]]
                    )
                recomputed = recompute_nll(context, model, text, cache)
                numbers[f"re-computation ({cache})"] = math.exp(recomputed["mean_nll"])
                rows.append(
                    [
                        f"re-computation ({cache}; 1 token in {every})",
                        "-",
                        *[f"{math.exp(recomputed['mean_nll']):.2f}" if c == cache else "" for c in CACHES],
                    ]
                )
            key = f"{name}/{text}"
            results[key] = numbers
            plot_nll_by_position(curves, name, text, context.out / f"streaming-{name}-{text}.png")
            header = [
                "method",
                f"perplexity, all {context.stream_tokens - 1} tokens",
                *[f"on re-computation's tokens (C = {c}: 1 in {RECOMPUTE_EVERY[c]})" for c in CACHES],
            ]
            tables.append(
                f"**{SHORT_NAME[name]}, {text}** (trained at {TRAINED_LENGTH[name]} tokens)\n\n"
                + markdown(header, rows)
            )
    (context.out / "streaming.json").write_text(json.dumps(results, indent=1))
    return "\n\n".join(tables)


def plot_nll_by_position(
    curves: dict[str, torch.Tensor], model: str, text: str, path: Path, bin_size: int = 256
) -> None:
    """NLL by position, averaged in bins of ``bin_size`` tokens, one line per method; the trained length marked."""
    fig, (ax,) = figure(1, width=10, height=4.5)
    for label, nll in curves.items():
        bins = nll[: nll.numel() // bin_size * bin_size].view(-1, bin_size).double().mean(1)
        ax.plot((torch.arange(bins.numel()) + 0.5) * bin_size, bins, label=label, lw=1.2)
    trained = TRAINED_LENGTH[model]
    if trained < len(next(iter(curves.values()))):
        ax.axvline(trained, color="grey", ls="--", lw=0.8)
        ax.text(trained, ax.get_ylim()[1], " trained length", va="top", fontsize=8, color="grey")
    ax.set(
        xlabel="position in the stream (tokens)",
        ylabel=f"NLL (mean of {bin_size} tokens)",
        yscale="log",
        title=f"{SHORT_NAME[model]} on {text}: NLL by position",
    )
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_locator(NullLocator())
    # The curves fill the whole width, so the legend goes beside them, not over the stream's first tokens.
    ax.legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save(fig, path)


def run_sinks(context: Context) -> str:
    """Section 2: 0, 1, 2, 4 and 8 sinks at a fixed cache, and four newlines as the sinks."""
    results, rows = {}, []
    for name in context.models:
        model = Lazy(context, name)
        cache = SINK_CACHE
        for text in context.texts:
            numbers = {}
            for sinks in SINK_COUNTS:
                numbers[f"{sinks}+{cache - sinks}"] = ppl(
                    stream_nll(context, model, text, sinks, cache - sinks)[4:]
                )
            numbers[f"4 newlines+{cache - 4}"] = ppl(newline_sinks_nll(context, model, text)[4:])
            results[f"{name}/{text}"] = numbers
            rows.append([SHORT_NAME[name], text, *[f"{v:.2f}" for v in numbers.values()]])
    (context.out / "sinks.json").write_text(json.dumps(results, indent=1))
    header = [
        "model",
        "text",
        *[f"{s} sink{'' if s == 1 else 's'}" for s in SINK_COUNTS],
        "4 newlines as sinks",
    ]
    note = (
        f"Perplexity over the stream's tokens 5..{context.stream_tokens} (the same tokens in every column), cache of "
        f"{SINK_CACHE} tokens in all (Gemma-3's local layers see their own last 512 of it)."
    )
    return markdown(header, rows) + "\n\n" + note


def run_caches(context: Context) -> str:
    """Section 3: 4 sinks and C - 4 recent tokens, C from 256 to 4096."""
    results, rows = {}, []
    for name in context.models:
        model = Lazy(context, name)
        for text in context.texts:
            numbers = {}
            for size in SIZES:
                numbers[f"4+{size - 4}"] = ppl(stream_nll(context, model, text, 4, size - 4))
            results[f"{name}/{text}"] = numbers
            rows.append([SHORT_NAME[name], text, *[f"{v:.2f}" for v in numbers.values()]])
    (context.out / "caches.json").write_text(json.dumps(results, indent=1))
    plot_caches(results, context.out / "caches.png")
    return markdown(["model", "text", *[f"4+{s - 4}" for s in SIZES]], rows)


def plot_caches(results: dict[str, dict[str, float]], path: Path) -> None:
    """Perplexity against cache size, one line per model and text."""
    fig, (ax,) = figure(1, width=6, height=4)
    for key, numbers in results.items():
        sizes = [int(k.split("+")[0]) + int(k.split("+")[1]) for k in numbers]
        ax.plot(sizes, list(numbers.values()), marker="o", label=key)
    ax.set(xscale="log", xlabel="cache (4 sinks + recent tokens)", ylabel="perplexity", title="Cache size")
    ax.set_xticks(SIZES, [str(s) for s in SIZES])
    ax.minorticks_off()
    ax.legend(fontsize=8)
    save(fig, path)
