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
* For models trained with a BOS token at the start of every window (``bos_id``), the documents' own leading
  BOS is set aside, their next ``Lmax`` tokens are cut into segments, and every segment is read behind BOS,
  as in training: all ``Lmax`` tokens are predicted at every length (a segment is then ``L + 1`` positions).

So the scored tokens are the same at every length (up to the ``Lmax / L`` segment starts without BOS), and the curves
differ only by how much context each token gets: within the trained length more context helps, past it a
dense model meets positions it never saw, while a streaming cache bounds what a token sees.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from hf_attnscale.streaming.cache import DEFAULT_SINK_TOKENS
from hf_attnscale.streaming.pos_shift import check_streaming_model
from hf_attnscale.validation import check_int

from .perplexity import perplexity
from .report import SweepResult, SweepRow, versions
from .variants import Variant


def demo_variants(
    train_length: int, sink_tokens: int = DEFAULT_SINK_TOKENS, bos: bool = False
) -> list[Variant]:
    """The variants of ``hf-attnscale demo`` for a model trained at ``train_length`` tokens (L below).

    unpatched; logn (``max(1, log_L(n))``); window-only and sink+window streaming with a cache of L tokens,
    so no token ever sees a position the model was not trained on; and streaming+logn with a cache of 2L,
    next to sink+window with the same 2L cache so the two differ only by logn. (With a cache of at most L,
    the clamped logn factor is 1 everywhere and streaming+logn would equal sink+window exactly.) With ``bos``
    (segments read behind a BOS token, ``L + 1`` positions at 1x) every cache holds one token more, so that
    at the trained length a segment still fits.
    """
    logn = {"scale": "logn", "train_length": train_length}
    capacity = train_length + bos
    window, wide = capacity - sink_tokens, capacity + train_length - sink_tokens
    return [
        Variant("unpatched"),
        Variant("logn", patch=logn),
        Variant(f"window-only ({capacity})", window=capacity),
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
    bos_id: int | None = None,
    progress: bool | None = None,
    on_variant: Callable[[Variant, list[SweepRow], float], None] | None = None,
) -> SweepResult:
    """Perplexity of each variant at each length over tokenized documents (definition: module docstring).

    Args:
        model: a causal LM in eval mode; each variant runs on it in turn, and it is restored exactly after
            (a patch it carried, trained parameters included, stays).
        documents: token ids of each document, 1-D tensors.
        lengths: evaluation lengths in tokens; each must divide ``max(lengths)`` (e.g. powers of two).
        variants: how to run the model; names must be unique.
        names: a name per document (for the JSON); defaults to ``doc0, doc1, ...``.
        max_documents: use at most this many of the documents long enough (in the order given).
        train_length: the model's trained length, only for labels and the plot.
        chunk_size: tokens per model call within a segment (memory, not results).
        bos_id: for models trained with a BOS token opening every window: each document's leading BOS is set
            aside and every segment is read behind it, all its tokens scored (see the module docstring).
        progress: tqdm bars (None: only on a terminal).
        on_variant: called with each variant's rows and seconds as soon as it is done (for live output).

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
    if bos_id is not None:  # set each document's own BOS aside: every segment gets one
        documents = [d[1:] if d.numel() and int(d[0]) == bos_id else d for d in documents]
    chosen = [(n, d[:longest]) for n, d in zip(names, documents) if d.numel() >= longest]
    if not chosen:
        most = max((d.numel() for d in documents), default=0)
        raise ValueError(
            f"No document has at least {longest} tokens (the longest length asked for); the longest of the "
            f"{len(documents)} documents has {most}. Ask for lengths up to {most} tokens, or use longer data."
        )
    if max_documents is not None:
        chosen = chosen[: check_int("max_documents", max_documents, 1)]
    _check_variants(model, variants)

    rows: list[SweepRow] = []
    seconds: dict[str, float] = {}
    for variant in variants:
        start = time.perf_counter()
        with variant.applied(model):
            variant_rows = _score_variant(model, variant, chosen, lengths, chunk_size, bos_id, progress)
        seconds[variant.name] = time.perf_counter() - start
        rows += variant_rows
        if on_variant is not None:
            on_variant(variant, variant_rows, seconds[variant.name])
    return SweepResult(
        rows=rows,
        variants=list(variants),
        lengths=lengths,
        documents=[n for n, _ in chosen],
        train_length=train_length,
        seconds=seconds,
        info={"chunk_size": chunk_size, "bos_id": bos_id, "versions": versions()},
    )


def _score_variant(model, variant, chosen, lengths, chunk_size, bos_id, progress) -> list[SweepRow]:
    """One variant's rows: the token-weighted NLL of every segment of every document, at each length."""
    longest = lengths[-1]
    nll_sum = dict.fromkeys(lengths, 0.0)
    counts = dict.fromkeys(lengths, 0)
    total = len(chosen) * sum(longest - (0 if bos_id is not None else longest // n) for n in lengths)
    with tqdm(
        total=total, desc=variant.name, unit="tok", disable=None if progress is None else not progress
    ) as bar:
        for _, ids in chosen:
            for length in lengths:
                for segment in ids.view(-1, length):
                    if bos_id is not None:
                        segment = torch.cat([segment.new_tensor([bos_id]), segment])
                    nll = perplexity(
                        model, segment, cache=variant.new_cache(), chunk_size=chunk_size, progress=False
                    ).nll
                    nll_sum[length] += nll.double().sum().item()
                    counts[length] += nll.numel()
                    bar.update(nll.numel())
            bar.set_postfix(ppl=f"{math.exp(nll_sum[longest] / counts[longest]):.2f}")
    return [
        SweepRow(
            variant.name, n, math.exp(nll_sum[n] / counts[n]), nll_sum[n] / counts[n], counts[n], len(chosen)
        )
        for n in lengths
    ]


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
    """Raise before any work if the model cannot run one of the variants (it is restored either way)."""
    for variant in variants:
        try:
            with variant.applied(model):
                if variant.streaming:
                    check_streaming_model(model)
        except ValueError as err:
            raise ValueError(f"Variant {variant.name!r}: {err}") from err
