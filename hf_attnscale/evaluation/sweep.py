"""Perplexity against context length: the sweep behind ``hf-attnscale demo`` and ``hf-attnscale eval``.

What "perplexity at length L" means here, for every variant alike:

* The documents are those with at least ``Lmax = max(lengths)`` tokens, each cut to its first ``Lmax`` tokens,
  so every length and every variant reads the same text.
* At length L each document is cut into ``Lmax / L`` non-overlapping segments of L tokens, and each segment
  is read on its own, from scratch: the model never sees anything before the segment.
* Within a segment, token ``t`` is predicted from what the variant lets it see of tokens ``0..t-1``:
  everything for a dense variant (unpatched, logn: one causal pass, dense attention over the segment), or
  the first ``sink_tokens`` tokens of the segment plus its last ``window`` tokens for a streaming variant
  (the segment is streamed through a fresh `SinkCache`).
* The result is ``exp`` of the token-weighted mean NLL over every predicted token of every segment of every
  document (the first token of a segment has no context and is not predicted).

So the scored tokens are the same at every length, up to the ``Lmax / L`` segment starts, and the curves
differ only by how much context each token gets: within the trained length more context helps, past it a
dense model meets positions it never saw, while a streaming cache bounds what a token sees.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from hf_attnscale.core.patching import unpatch
from hf_attnscale.streaming.cache import DEFAULT_SINK_TOKENS
from hf_attnscale.streaming.pos_shift import check_streaming_model

from .perplexity import perplexity
from .report import SweepResult, SweepRow, versions
from .variants import Variant


def demo_variants(train_length: int, sink_tokens: int = DEFAULT_SINK_TOKENS) -> list[Variant]:
    """The variants of ``hf-attnscale demo`` for a model trained at ``train_length`` tokens (L below).

    unpatched; logn (``max(1, log_L(n))``); window-only and sink+window streaming with a cache of L tokens,
    so no token ever sees a position the model was not trained on; and streaming+logn with a cache of 2L,
    next to sink+window with the same 2L cache so the two differ only by logn. (With a cache of at most L,
    the clamped logn factor is 1 everywhere and streaming+logn would equal sink+window exactly.)
    """
    logn = {"scale": "logn", "train_length": train_length}
    window, wide = train_length - sink_tokens, 2 * train_length - sink_tokens
    return [
        Variant("unpatched"),
        Variant("logn", patch=logn),
        Variant(f"window-only ({train_length})", window=train_length),
        Variant(f"sink+window ({sink_tokens}+{window})", sink_tokens=sink_tokens, window=window),
        Variant(f"sink+window ({sink_tokens}+{wide})", sink_tokens=sink_tokens, window=wide),
        Variant(f"streaming+logn ({sink_tokens}+{wide})", patch=logn, sink_tokens=sink_tokens, window=wide),
    ]


def sweep(
    model: nn.Module,
    documents: Sequence[torch.Tensor],
    lengths: Sequence[int],
    variants: Sequence[Variant],
    *,
    names: Sequence[str] | None = None,
    max_documents: int | None = None,
    train_length: int | None = None,
    chunk_size: int = 512,
    progress: bool | None = None,
) -> SweepResult:
    """Perplexity of each variant at each length over tokenized documents (definition: module docstring).

    Args:
        model: a causal LM in eval mode; it is patched per variant and left unpatched on return.
        documents: token ids of each document, 1-D tensors.
        lengths: evaluation lengths in tokens; each must divide ``max(lengths)`` (e.g. powers of two).
        variants: how to run the model; names must be unique.
        names: a name per document (for the JSON); defaults to ``doc0, doc1, ...``.
        max_documents: use at most this many of the documents long enough (in the order given).
        train_length: the model's trained length, only for labels and the plot.
        chunk_size: tokens per model call within a segment (memory, not results).
        progress: tqdm bars (None: only on a terminal).

    Raises:
        ValueError: bad lengths or variants, or no document of at least ``max(lengths)`` tokens.
    """
    lengths = _check_lengths(lengths)
    longest = lengths[-1]
    if not variants:
        raise ValueError("Pass at least one variant.")
    seen_names = [v.name for v in variants]
    if len(set(seen_names)) != len(seen_names):
        raise ValueError(f"Variant names must be unique, got {seen_names}.")
    names = list(names) if names is not None else [f"doc{i}" for i in range(len(documents))]
    if len(names) != len(documents):
        raise ValueError(f"Got {len(names)} names for {len(documents)} documents.")
    chosen = [(n, d[:longest]) for n, d in zip(names, documents) if d.numel() >= longest]
    if not chosen:
        most = max((d.numel() for d in documents), default=0)
        raise ValueError(
            f"No document has at least {longest} tokens (the longest length asked for); the longest of the "
            f"{len(documents)} documents has {most}. Ask for lengths up to {most} tokens, or use longer data."
        )
    if max_documents is not None:
        if max_documents < 1:
            raise ValueError(f"max_documents must be at least 1, got {max_documents}.")
        chosen = chosen[:max_documents]
    _check_variants(model, variants)

    rows: list[SweepRow] = []
    seconds: dict[str, float] = {}
    try:
        for variant in variants:
            variant.apply(model)
            start = time.perf_counter()
            nll_sum = dict.fromkeys(lengths, 0.0)
            counts = dict.fromkeys(lengths, 0)
            total = len(chosen) * sum(longest - longest // n for n in lengths)
            disable = None if progress is None else not progress
            with tqdm(total=total, desc=variant.name, unit="tok", disable=disable) as bar:
                for _, ids in chosen:
                    for length in lengths:
                        for segment in ids.view(-1, length):
                            result = perplexity(
                                model,
                                segment,
                                cache=variant.new_cache(),
                                chunk_size=chunk_size,
                                progress=False,
                            )
                            nll_sum[length] += result.nll.double().sum().item()
                            counts[length] += result.nll.numel()
                            bar.update(result.nll.numel())
                    bar.set_postfix(ppl=f"{math.exp(nll_sum[longest] / counts[longest]):.2f}")
            seconds[variant.name] = time.perf_counter() - start
            for length in lengths:
                mean = nll_sum[length] / counts[length]
                rows.append(SweepRow(variant.name, length, math.exp(mean), mean, counts[length], len(chosen)))
    finally:
        unpatch(model)
    return SweepResult(
        rows=rows,
        variants=list(variants),
        lengths=lengths,
        documents=[n for n, _ in chosen],
        train_length=train_length,
        seconds=seconds,
        info={"chunk_size": chunk_size, "versions": versions()},
    )


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    if not lengths:
        raise ValueError("Pass at least one evaluation length.")
    bad = [n for n in lengths if isinstance(n, bool) or not isinstance(n, int) or n < 2]
    if bad:
        raise ValueError(f"Lengths must be ints >= 2 (tokens), got {bad}.")
    lengths = sorted(set(lengths))
    longest = lengths[-1]
    uneven = [n for n in lengths if longest % n]
    if uneven:
        raise ValueError(
            f"Every length must divide the longest ({longest}) so that all lengths score the same tokens; "
            f"{uneven} do not. Powers of two (e.g. 1k,2k,4k,8k) always do."
        )
    return lengths


def _check_variants(model: nn.Module, variants: Sequence[Variant]) -> None:
    """Raise before any work if the model cannot run one of the variants (it is left unpatched)."""
    try:
        for variant in variants:
            variant.apply(model)
            if variant.streaming:
                check_streaming_model(model)
    except ValueError as err:
        raise ValueError(f"Variant {variant.name!r}: {err}") from err
    finally:
        unpatch(model)
