"""Held-out data: the built-in corpus's held-out files (Python standard library sources), never trained on."""

from __future__ import annotations

import torch

from hf_attnscale.evaluation.corpus import long_documents, tokenize_documents

from .runs import TRAIN_LENGTH

STREAM_LENGTH = 32 * TRAIN_LENGTH
"""The streams of the streaming sections: 32x the LM runs' training window."""


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
