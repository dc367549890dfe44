"""Section 4: StreamingLLM's Figure 5, a stream of over a million tokens through one ``SinkCache(4, 1020)``.

SmolLM2 (trained at 8,192 tokens) reads the whole King James Bible (1,163,228 of its tokens; no text repeats)
in chunks of `CHUNK` tokens through one cache, as a server would. Every `BLOCK` tokens the section records the
block's perplexity, the running perplexity, the tokens per second and the process's resident memory.

The control reads every `CONTROL_EVERY`-th block again through a fresh ``SinkCache(4, 1020)`` that starts at
the block: if the long stream had drifted, its perplexity on a block would exceed the fresh cache's there.

After every block the stream's state (the cache's `SinkCache.state_dict`, the records, the summed NLL) is written
to ``<work>/million/``, and a stopped run continues from there exactly.
"""

from __future__ import annotations

import functools
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from sections.figures import figure, save
from sections.tables import markdown
from tqdm.auto import tqdm

import hf_attnscale as hfa
from hf_attnscale.core.install.routing import cache_argument

from .context import SHORT_NAME, Context, Lazy

MODEL, TEXT = "smollm2-135m", "kjv"
"""The model and the text (the only one long enough for a million tokens; another text if kjv is not asked for)."""
SINKS, WINDOW = 4, 1020
CHUNK = 512
BLOCK = 16_384
QUICK_TOKENS = 2 * CHUNK
CONTROL_EVERY = 8


def resident_mb() -> float:
    """This process's resident memory (VmRSS), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


@torch.no_grad()
def stream(context: Context, text: str, tokens: int | None = None) -> list[dict]:
    """Stream the text's first ``tokens`` tokens (None: all) through one cache; a record per `BLOCK` tokens. A
    stopped stream continues from its last block."""
    ids = context.stream(MODEL, text)
    total = ids.numel() - 1 if tokens is None else min(tokens, ids.numel() - 1)
    model = hfa.patch(context.load(MODEL))
    cache = hfa.SinkCache(SINKS, WINDOW)
    saved = context.work / "million" / f"{MODEL}-{text}-{total}.pt"
    saved.parent.mkdir(parents=True, exist_ok=True)
    records, nll_sum = [], 0.0
    if saved.exists():
        state = torch.load(saved, weights_only=True)
        cache.load_state_dict(state["cache"])
        records, nll_sum = json.loads(state["records"]), float(state["nll_sum"])
    done = records[-1]["tokens"] if records else 0
    with_cache = {cache_argument(model): cache}
    with tqdm(total=total, initial=done, desc="1M stream", unit="tok", mininterval=30) as bar:
        for block_start in range(done, total, BLOCK):
            started, block_sum = time.perf_counter(), 0.0
            block_end = min(block_start + BLOCK, total)
            for start in range(block_start, block_end, CHUNK):
                stop = min(start + CHUNK, block_end)
                logits = model(input_ids=ids[None, start:stop], use_cache=True, **with_cache).logits
                block_sum += F.cross_entropy(
                    logits[0].float(), ids[start + 1 : stop + 1], reduction="sum"
                ).item()
                bar.update(stop - start)
            nll_sum += block_sum
            records.append(
                {
                    "tokens": block_end,
                    "block_ppl": math.exp(block_sum / (block_end - block_start)),
                    "running_ppl": math.exp(nll_sum / block_end),
                    "tokens_per_second": (block_end - block_start) / (time.perf_counter() - started),
                    "resident_mb": resident_mb(),
                }
            )
            state = {"cache": cache.state_dict(), "records": json.dumps(records), "nll_sum": nll_sum}
            torch.save(state, saved.with_suffix(".tmp"))
            saved.with_suffix(".tmp").replace(saved)  # never a half-written state
    return records


def fresh_block_ppl(model: Lazy, ids: torch.Tensor, block: int, tokens: int) -> float:
    """Perplexity of block ``block`` (the stream's targets in it) read through a fresh cache that starts there."""
    start = block * BLOCK
    stop = min(start + BLOCK, tokens)
    cache = hfa.SinkCache(SINKS, WINDOW)
    nll = hfa.perplexity(model(), ids[start : stop + 1], cache, chunk_size=CHUNK, progress=False).nll
    return math.exp(nll.mean().item())


def run(context: Context) -> str:
    """The million-token stream, with its control on every `CONTROL_EVERY`-th block: table and figure."""
    if MODEL not in context.models:
        return f"(needs --models {MODEL})"
    text = TEXT if TEXT in context.texts else context.texts[0]
    records = context.cells.get(
        f"million/{MODEL}/{text}/{SINKS}+{WINDOW}" + ("/quick" if context.quick else ""),
        lambda: stream(context, text, QUICK_TOKENS if context.quick else None),
    )
    tokens, model, ids = records[-1]["tokens"], Lazy(context, MODEL), context.stream(MODEL, text)
    control = {
        block: context.cells.get(
            f"million-control/{MODEL}/{text}/{SINKS}+{WINDOW}/{tokens}/block{block}",
            functools.partial(fresh_block_ppl, model, ids, block, tokens),
        )
        for block in sorted({*range(0, len(records), CONTROL_EVERY), len(records) - 1})
    }
    for block, ppl in control.items():
        records[block]["fresh_cache_ppl"] = ppl
    (context.out / "million.json").write_text(json.dumps(records, indent=1))
    plot_million(records, context.out / "million.png")
    rows = [
        [
            f"{r['tokens']:,}",
            f"{r['block_ppl']:.2f}",
            f"{r['fresh_cache_ppl']:.2f}",
            f"{r['running_ppl']:.2f}",
            f"{r['tokens_per_second']:.0f}",
            f"{r['resident_mb']:.0f}",
        ]
        for r in (records[block] for block in control)
    ]
    header = [
        "tokens read",
        f"ppl of the last {BLOCK:,}",
        "same tokens, a fresh cache",
        "running ppl",
        "tokens/s",
        "resident MB",
    ]
    return f"**{SHORT_NAME[MODEL]}, {text}, SinkCache({SINKS}, {WINDOW})**\n\n" + markdown(header, rows)


def plot_million(records: list[dict], path: Path) -> None:
    """Perplexity (per block and running), tokens per second and resident memory against tokens read."""
    fig, axes = figure(3, width=4.6, height=3.6)
    x = [r["tokens"] / 1e6 for r in records]
    style = {"marker": "o", "ms": 2}
    axes[0].plot(x, [r["block_ppl"] for r in records], lw=0.8, label=f"per {BLOCK:,} tokens", **style)
    axes[0].plot(x, [r["running_ppl"] for r in records], lw=1.6, label="running", **style)
    fresh = [(x, r["fresh_cache_ppl"]) for x, r in zip(x, records, strict=True) if "fresh_cache_ppl" in r]
    axes[0].plot(*zip(*fresh, strict=True), "kx", ms=7, label="same block, a fresh cache")
    axes[0].set(ylabel="perplexity", title=f"{SHORT_NAME[MODEL]}, {SINKS}+{WINDOW}")
    axes[0].legend(fontsize=8)
    axes[1].plot(x, [r["tokens_per_second"] for r in records], **style)
    axes[1].set(ylabel="tokens / s", title="speed", ylim=(0, None))
    axes[2].plot(x, [r["resident_mb"] for r in records], **style)
    axes[2].set(ylabel="resident memory (MB)", title="memory", ylim=(0, None))
    for ax in axes:
        ax.set_xlabel("tokens read (millions)")
    save(fig, path)
