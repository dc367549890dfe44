"""Re-computation, StreamingLLM's baseline: each token predicted from its last C tokens, re-read from scratch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from .perplexity import segment_nll
from .report import SweepRow, rows_from_sums


def recompute_rows(
    model: nn.Module,
    name: str,
    cache: int,
    docs: Sequence[torch.Tensor],
    lengths: Sequence[int],
    *,
    every: int = 1,
    bos_id: int | None = None,
    chunk_size: int = 512,
    progress: bool | None = None,
) -> list[SweepRow]:
    """Re-computation's rows, a `SweepRow` per length, read as the sweep reads a length (in segments, from
    scratch, behind ``bos_id`` if given).

    Token ``p`` of its L-token segment is predicted from the last ``cache`` tokens before it in the segment (BOS
    first, then ``cache - 1`` of them, behind BOS), re-read from scratch. Only the tokens ``p`` with
    ``p % every == every - 1`` in the document are scored, the same at every length. The tokens whose context
    starts at the same token (a segment's first ``cache`` tokens; a token at several lengths) share one read.
    """
    context = cache - (bos_id is not None)  # tokens of the segment a re-read holds before the predicted one
    first = 0 if bos_id is not None else 1  # read without BOS, a segment's first token is not predicted
    reads: dict[
        tuple[int, int], dict[int, list[int]]
    ] = {}  # (document, first token read) -> {token: lengths}
    for d, doc in enumerate(docs):
        for length in lengths:
            for p in range(every - 1, doc.numel(), every):
                start = p - p % length
                if p - start >= first:
                    reads.setdefault((d, max(start, p - context)), {}).setdefault(p, []).append(length)
    nll_sum, counts = dict.fromkeys(lengths, 0.0), dict.fromkeys(lengths, 0)
    for (d, start), targets in tqdm(
        reads.items(), desc=name, unit="read", disable=None if progress is None else not progress
    ):
        # Causal: a read up to the last target gives each earlier target what a read up to it would.
        nll = segment_nll(model, docs[d][start : max(targets) + 1], bos_id, chunk_size=chunk_size)
        for p, scored_at in targets.items():
            for length in scored_at:
                nll_sum[length] += nll[p - start - first].item()
                counts[length] += 1
    if not all(counts.values()):
        raise ValueError(f"Re-computation on 1 token in {every} scores none at some length; score more.")
    return rows_from_sums(name, nll_sum, counts, len(docs))
