"""Encoders by length: MLM accuracy (the measure of Su's Attention-E table) and pseudo-perplexity.

Both read each document in non-overlapping windows of ``length`` tokens, each window on its own, so that
longer windows give each masked token more context. The masked positions are drawn once per document, from
``seed``, and are the same at every length: the lengths differ only in how much context a token gets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hf_attnscale.core.install.offload import run_device
from hf_attnscale.core.options.validation import check_int

from .report import SweepResult, SweepRow
from .sweep import OnVariant, check_lengths, check_variants, choose_documents, run_variants, whole_windows
from .variants import Variant


@dataclass(frozen=True)
class MaskedLMResult:
    """One length: accuracy of the top-1 prediction at masked positions, and their mean NLL."""

    length: int
    accuracy: float
    nll: float
    tokens: int

    @property
    def perplexity(self) -> float:
        """``exp`` of the mean NLL of the masked tokens (a pseudo-perplexity when masked one at a time)."""
        return math.exp(self.nll)


def _windows(
    documents: Sequence[torch.Tensor], lengths: Sequence[int]
) -> tuple[list[int], list[torch.Tensor]]:
    """The checked lengths, and the documents long enough cut to whole windows of the longest."""
    lengths = check_lengths(lengths)
    return lengths, whole_windows(documents, lengths[-1])


@torch.no_grad()
def masked_lm_accuracy(
    model: nn.Module,
    documents: Sequence[torch.Tensor],
    lengths: Sequence[int],
    mask_token_id: int,
    *,
    fraction: float = 0.15,
    seed: int = 0,
    batch_size: int = 8,
) -> list[MaskedLMResult]:
    """MLM accuracy by window length, with ``fraction`` of the tokens masked at once (BERT's setting).

    Args:
        model: a masked LM (``...ForMaskedLM``) in eval mode.
        documents: token ids of each document; those shorter than ``max(lengths)`` are skipped, the rest cut
            to a multiple of it.
        lengths: window lengths; each must divide the longest.
        mask_token_id: the tokenizer's ``mask_token_id``.
        fraction: share of tokens masked in every window (all replaced by the mask token).
        seed: draws the masked positions, the same at every length.
    """
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}.")
    lengths, docs = _windows(documents, lengths)
    generator = torch.Generator().manual_seed(seed)
    masks = [torch.rand(doc.shape, generator=generator) < fraction for doc in docs]
    results = []
    for length in lengths:
        ids = torch.cat([d.view(-1, length) for d in docs])
        masked = torch.cat([m.view(-1, length) for m in masks])
        correct = nll = 0.0
        for start in range(0, ids.shape[0], batch_size):
            rows, where = ids[start : start + batch_size], masked[start : start + batch_size]
            inputs = rows.masked_fill(where, mask_token_id).to(run_device(model))
            logits = model(input_ids=inputs).logits.float().cpu()[where]
            targets = rows[where]
            correct += (logits.argmax(-1) == targets).sum().item()
            nll += nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        count = int(masked.sum())
        results.append(MaskedLMResult(length, correct / count, nll / count, count))
    return results


@torch.no_grad()
def pseudo_perplexity(
    model: nn.Module,
    documents: Sequence[torch.Tensor],
    lengths: Sequence[int],
    mask_token_id: int,
    *,
    positions_per_window: int = 16,
    seed: int = 0,
    batch_size: int = 16,
) -> list[MaskedLMResult]:
    """Pseudo-perplexity by window length (Salazar et al.): each scored token masked alone, the rest visible.

    Scoring every token costs one forward pass per token, so each window scores ``positions_per_window``
    positions drawn from ``seed``; the positions are those of the longest windows, so every length scores
    the same tokens. Accuracy is reported for the same predictions.
    """
    lengths, docs = _windows(documents, lengths)
    longest = lengths[-1]
    count = check_int("positions_per_window", positions_per_window, 1)
    generator = torch.Generator().manual_seed(seed)
    chosen = [
        torch.cat(
            [
                w * longest + torch.randperm(longest, generator=generator)[:count].sort().values
                for w in range(d.numel() // longest)
            ]
        )
        for d in docs
    ]
    results = []
    for length in lengths:
        windows, where = [], []
        for doc, positions in zip(docs, chosen):
            for p in positions.tolist():
                start = p // length * length
                windows.append(doc[start : start + length])
                where.append(p - start)
        nll, correct = masked_one_at_a_time(model, windows, where, mask_token_id, batch_size=batch_size)
        results.append(MaskedLMResult(length, correct.float().mean().item(), nll.mean().item(), len(where)))
    return results


@torch.no_grad()
def masked_one_at_a_time(
    model: nn.Module,
    windows: Sequence[torch.Tensor],
    positions: Sequence[int],
    mask_token_id: int,
    *,
    batch_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each (window, position): the NLL of the token there with only it masked, and whether the top-1
    prediction is right. Both ``(len(positions),)``; windows in one batch must have the same length."""
    nll, correct = [], []
    for first in range(0, len(positions), batch_size):
        rows = torch.stack(list(windows[first : first + batch_size])).clone()
        index = torch.tensor(positions[first : first + batch_size])
        arange = torch.arange(rows.shape[0])
        targets = rows[arange, index].clone()
        rows[arange, index] = mask_token_id
        logits = model(input_ids=rows.to(run_device(model))).logits.float().cpu()[arange, index]
        nll.append(nn.functional.cross_entropy(logits, targets, reduction="none"))
        correct.append(logits.argmax(-1) == targets)
    return torch.cat(nll), torch.cat(correct)


def pseudo_log_likelihood(
    model: nn.Module, ids: torch.Tensor, mask_token_id: int, window: int, *, batch_size: int = 16
) -> float:
    """The pseudo-log-likelihood of a whole token sequence: every token masked alone, read in non-overlapping
    windows of ``window`` tokens (the last one shorter). The sum of ``log p``, in nats."""
    total = 0.0
    for start in range(0, ids.numel(), window):
        piece = ids[start : start + window]
        nll, _ = masked_one_at_a_time(
            model, [piece] * piece.numel(), list(range(piece.numel())), mask_token_id, batch_size=batch_size
        )
        total -= nll.double().sum().item()
    return total


def mlm_sweep(
    model: nn.Module,
    documents: Sequence[torch.Tensor],
    lengths: Sequence[int],
    variants: Sequence[Variant],
    mask_token_id: int,
    *,
    names: Sequence[str] | None = None,
    max_documents: int | None = None,
    train_length: int | None = None,
    positions_per_window: int = 16,
    on_variant: OnVariant | None = None,
) -> SweepResult:
    """For masked LMs what `hf_attnscale.sweep` is for causal ones: each variant's pseudo-perplexity and MLM
    accuracy at each length (see `masked_lm_accuracy` and `pseudo_perplexity`).

    Variants must be dense (no streaming cache: an encoder reads its whole window at once).
    """
    streaming = [v.name for v in variants if v.streaming]
    if streaming:
        raise ValueError(f"Variants {streaming} stream through a SinkCache, which an encoder cannot use.")
    lengths = check_lengths(lengths)
    check_variants(variants)
    chosen = choose_documents(documents, lengths[-1], names, max_documents)
    docs = [d for _, d in chosen]

    def score(variant: Variant) -> list[SweepRow]:
        accuracy = masked_lm_accuracy(model, docs, lengths, mask_token_id)
        pseudo = pseudo_perplexity(
            model, docs, lengths, mask_token_id, positions_per_window=positions_per_window
        )
        return [
            SweepRow(variant.name, p.length, p.perplexity, p.nll, p.tokens, len(docs), accuracy=a.accuracy)
            for a, p in zip(accuracy, pseudo)
        ]

    return run_variants(
        model,
        variants,
        score,
        lengths=lengths,
        documents=chosen,
        train_length=train_length,
        info={"positions_per_window": positions_per_window},
        measure="pseudo-perplexity",
        on_variant=on_variant,
    )
