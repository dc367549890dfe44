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

The frame of a length sweep (checking the lengths, choosing the documents, running and timing each variant)
is shared with the encoders' `hf_attnscale.evaluation.mlm.mlm_sweep`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from hf_attnscale.core.options.validation import as_int, check_int
from hf_attnscale.streaming.spec import check_streaming_model

from .perplexity import segment_nll
from .positions import bucket_sums, position_buckets
from .processes import process_share, summed_across_processes
from .report import PositionTable, SweepResult, SweepRow, rows_from_sums, versions
from .variants import Variant

OnVariant = Callable[[Variant, list[SweepRow], float], None]
"""Called with each variant's rows and seconds as soon as it is done (for live output)."""


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
    on_variant: OnVariant | None = None,
    positions: Sequence[int] | None = None,
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
        positions: edges of position buckets (`hf_attnscale.evaluation.positions`), each below ``max(lengths)``:
            the result also holds perplexity by position within the longest length's segments (each read from
            its start, so position p is predicted from the p tokens before it). None: not computed.

    Raises:
        ValueError: bad lengths or variants, or no document of at least ``max(lengths)`` tokens.
    """
    lengths = check_lengths(lengths)
    check_variants(variants)
    buckets = ()
    if positions is not None:
        if max(positions, default=0) >= lengths[-1]:
            raise ValueError(
                f"Position buckets must lie within the longest length ({lengths[-1]} tokens); got edges "
                f"{list(positions)}."
            )
        buckets = position_buckets([*positions, lengths[-1]])[:-1]  # the last ends with the segments
    chosen = sweep_documents(documents, lengths[-1], names, max_documents, bos_id)
    _check_model_runs(model, variants)
    by_position: dict[str, list[float]] = {}

    def score(variant: Variant) -> list[SweepRow]:
        rows, by_position[variant.name] = _score_variant(
            model, variant, chosen, lengths, chunk_size, bos_id, progress, buckets
        )
        return rows

    result = run_variants(
        model,
        variants,
        score,
        lengths=lengths,
        documents=chosen,
        train_length=train_length,
        info={"chunk_size": chunk_size, "bos_id": bos_id},
        on_variant=on_variant,
    )
    if buckets:
        result.positions = PositionTable([b.label for b in buckets], [b.start for b in buckets], by_position)
    return result


def _score_variant(
    model, variant, chosen, lengths, chunk_size, bos_id, progress, buckets
) -> tuple[list[SweepRow], list[float]]:
    """One variant's rows: the token-weighted NLL of every segment of every document, at each length; and
    the perplexity of each position bucket within the longest length's segments.

    Under a torch.distributed process group (``torchrun``) each process reads every ``world``-th document and
    the sums are added up across processes: every process returns the rows of all the documents.
    """
    longest = lengths[-1]
    nll_sum = dict.fromkeys(lengths, 0.0)
    counts = dict.fromkeys(lengths, 0)
    bucket_nll = [0.0] * len(buckets)
    bucket_counts = [0] * len(buckets)
    first_position = 0 if bos_id is not None else 1  # without BOS a segment's first token is not predicted
    rank, world = process_share()
    share = chosen[rank::world]
    total = len(share) * sum(longest - (0 if bos_id is not None else longest // n) for n in lengths)
    with tqdm(
        total=total, desc=variant.name, unit="tok", disable=None if progress is None else not progress
    ) as bar:
        for _, ids in share:
            for length in lengths:
                for segment in ids.view(-1, length):
                    nll = segment_nll(
                        model, segment, bos_id, cache=variant.new_cache(), chunk_size=chunk_size
                    )
                    nll_sum[length] += nll.double().sum().item()
                    counts[length] += nll.numel()
                    bar.update(nll.numel())
                    if length == longest:
                        for i, (summed, count) in enumerate(bucket_sums(nll, buckets, first_position)):
                            bucket_nll[i] += summed
                            bucket_counts[i] += count
            bar.set_postfix(ppl=f"{math.exp(nll_sum[longest] / counts[longest]):.2f}")
    summed = summed_across_processes([*nll_sum.values(), *counts.values(), *bucket_nll, *bucket_counts])
    n, b = len(lengths), len(buckets)
    nll_sum = dict(zip(lengths, summed[:n]))
    counts = {length: int(c) for length, c in zip(lengths, summed[n : 2 * n])}
    by_position = [
        math.exp(total / count) if count else math.nan
        for total, count in zip(summed[2 * n : 2 * n + b], summed[2 * n + b :])
    ]
    return rows_from_sums(variant.name, nll_sum, counts, len(chosen)), by_position


def check_lengths(lengths: Sequence[int]) -> list[int]:
    """The evaluation lengths, sorted and without repeats; raises ValueError unless each is an int >= 2 that
    divides the longest (so that every length scores the same tokens)."""
    if not lengths:
        raise ValueError("Pass at least one evaluation length.")
    numbers = [as_int(n) for n in lengths]
    bad = [n for n, number in zip(lengths, numbers) if number is None or number < 2]
    if bad:
        raise ValueError(f"Lengths must be ints >= 2 (tokens), got {bad}.")
    lengths = sorted(set(numbers))
    longest = lengths[-1]
    uneven = [n for n in lengths if longest % n]
    if uneven:
        raise ValueError(
            f"Every length must divide the longest ({longest}) so that all lengths score the same tokens; "
            f"{uneven} do not. Powers of two (e.g. 1k,2k,4k,8k) always do."
        )
    return lengths


def check_variants(variants: Sequence[Variant]) -> None:
    """Raise ValueError unless there is at least one variant and their names are unique."""
    if not variants:
        raise ValueError("Pass at least one variant.")
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"Variant names must be unique, got {names}.")


def sweep_documents(
    documents: Sequence[torch.Tensor],
    longest: int,
    names: Sequence[str] | None = None,
    max_documents: int | None = None,
    bos_id: int | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, ids)`` a length sweep scores: each document's own BOS set aside (every segment gets one,
    with ``bos_id``), the documents of at least ``longest`` tokens (`choose_documents`), each cut to that."""
    if bos_id is not None:
        documents = [d[1:] if d.numel() and int(d[0]) == bos_id else d for d in documents]
    return [(name, ids[:longest]) for name, ids in choose_documents(documents, longest, names, max_documents)]


def choose_documents(
    documents: Sequence[torch.Tensor],
    longest: int,
    names: Sequence[str] | None = None,
    max_documents: int | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """``(name, ids)`` of the documents of at least ``longest`` tokens, in order, at most ``max_documents``.

    Names default to ``doc0, doc1, ...``. Raises ValueError when none is long enough.
    """
    names = list(names) if names is not None else [f"doc{i}" for i in range(len(documents))]
    if len(names) != len(documents):
        raise ValueError(f"Got {len(names)} names for {len(documents)} documents.")
    chosen = [(n, d) for n, d in zip(names, documents) if d.numel() >= longest]
    if not chosen:
        most = max((d.numel() for d in documents), default=0)
        raise ValueError(
            f"No document has at least {longest} tokens (the longest length asked for); the longest of the "
            f"{len(documents)} documents has {most}. Ask for lengths up to {most} tokens, or use longer data."
        )
    if max_documents is not None:
        chosen = chosen[: check_int("max_documents", max_documents, 1)]
    return chosen


def whole_windows(documents: Sequence[torch.Tensor], length: int) -> list[torch.Tensor]:
    """The documents of at least ``length`` tokens, each cut to a whole number of ``length``-token windows."""
    return [d[: d.numel() // length * length] for _, d in choose_documents(documents, length)]


def run_variants(
    model: nn.Module,
    variants: Sequence[Variant],
    score: Callable[[Variant], list[SweepRow]],
    *,
    lengths: list[int],
    documents: Sequence[tuple[str, torch.Tensor]],
    train_length: int | None,
    info: dict[str, Any],
    measure: str = "perplexity",
    on_variant: OnVariant | None = None,
) -> SweepResult:
    """Each variant applied to ``model`` in turn (restored after) and scored, timed: a `SweepResult`.

    ``score`` gives a variant's rows, one per length; ``documents`` are the ``(name, ids)`` pairs it scores;
    ``info`` (with the versions of the software) goes into the result's JSON.
    """
    rows: list[SweepRow] = []
    seconds: dict[str, float] = {}
    for variant in variants:
        start = time.perf_counter()
        with variant.applied(model):
            variant_rows = score(variant)
        seconds[variant.name] = time.perf_counter() - start
        rows += variant_rows
        if on_variant is not None:
            on_variant(variant, variant_rows, seconds[variant.name])
    return SweepResult(
        rows=rows,
        variants=list(variants),
        lengths=lengths,
        documents=[name for name, _ in documents],
        train_length=train_length,
        seconds=seconds,
        info={**info, "versions": versions()},
        measure=measure,
    )


def _check_model_runs(model: nn.Module, variants: Sequence[Variant]) -> None:
    """Raise before any work if the model cannot run one of the variants (it is restored either way)."""
    for variant in variants:
        try:
            with variant.applied(model):
                if variant.streaming:
                    check_streaming_model(model)
        except ValueError as err:
            raise ValueError(f"Variant {variant.name!r}: {err}") from err
