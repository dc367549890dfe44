"""Passkey retrieval, generated offline: a haystack of filler text with a 5-digit key stated at a chosen depth, then
the question. A model that reads the whole context recalls the key; one that only keeps its perplexity low (a
window that evicted the key) does not.

The filler is the classic passkey test's repeated sentences; each prompt is sized in the evaluated model's
own tokens, and the keys come from a seeded generator, so a prompt set is the same on every machine.

The needle is never directly before the question: at least one filler unit separates them, so depth 1 (the
last place) still measures reading, not an echo of the needle's last sentence ("... 15306 is the pass key. What
is the pass key? The pass key is" makes SmolLM2, unchanged at 4k, write " the pass key" where it knows the key).
That is version 2 of these prompts; version 1 put depth 1's needle right before the question, and differs from
version 2 at depth 1 only.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from hf_attnscale.evaluation.perplexity import perplexity
from hf_attnscale.streaming.cache import SinkCache

FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"


@dataclass(frozen=True)
class Passkey:
    """One prompt: ``context`` (haystack and question, about ``length`` tokens), and ``key``, whose tokens
    (read as ``" " + key``) should follow it. ``depth``: where the key is stated, 0 (first) to 1 (last)."""

    context: str
    key: str
    length: int
    depth: float


def passkey_prompts(
    tokenizer: PreTrainedTokenizerBase,
    lengths: Sequence[int],
    depths: Sequence[float],
    per_cell: int = 1,
    seed: int = 0,
) -> list[Passkey]:
    """``per_cell`` prompts for each length (in ``tokenizer``'s tokens, its special tokens included) and depth.

    The haystack holds as many filler units as fit beside the key and the question; the key's sentence goes
    after ``round(depth * units)`` of them, but never after the last: at least one unit stays between it and
    the question (`needle_units_before`). ``seed`` draws the keys (the filler is fixed), so a prompt set is the
    same on every machine. Raises ValueError for a length too short for the key and question.
    """
    rng = random.Random(seed)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    special = len(tokenizer("")["input_ids"])
    unit, fixed = count(FILLER), count(NEEDLE.format(key="12345")) + count(QUESTION) + special
    prompts = []
    for length in lengths:
        units = (length - fixed) // unit
        if units < 1:
            raise ValueError(
                f"A passkey prompt needs more than {fixed + unit} tokens of this tokenizer; got {length}."
            )
        for depth in depths:
            if not 0 <= depth <= 1:
                raise ValueError(f"Depths are fractions of the haystack, from 0 to 1; got {depth}.")
            for _ in range(per_cell):
                key = str(rng.randint(10000, 99999))
                before = needle_units_before(depth, units)
                context = FILLER * before + NEEDLE.format(key=key) + FILLER * (units - before) + QUESTION
                prompts.append(Passkey(context, key, length, depth))
    return prompts


def needle_units_before(depth: float, units: int) -> int:
    """How many of a haystack's ``units`` filler units precede the needle at ``depth``: ``round(depth * units)``,
    at most ``units - 1``, so that the needle is never directly before the question."""
    return min(round(depth * units), units - 1)


@dataclass(frozen=True)
class Recall:
    """How a model did on one `Passkey` prompt: ``found`` when every key token was its top choice (what greedy
    decoding would write), and the key's log-likelihood (summed over its tokens; a guess of 5 digits is about
    ``5·ln(1/10) = −11.5``). ``length`` and ``depth``: the prompt's, as `passkey_prompts` made it."""

    length: int
    depth: float
    found: bool
    loglikelihood: float


def passkey_recall(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompt: Passkey,
    cache: SinkCache | None = None,
    chunk_size: int = 512,
) -> Recall:
    """Score ``prompt`` under ``model`` (read densely, or streamed through ``cache``, as `perplexity` reads, in
    chunks of ``chunk_size`` tokens): the key's tokens after the context, each predicted from everything before
    it. ``tokenizer``: the one the prompt was made with. Only the key's positions reach the output layer: a long
    haystack costs no logits over the vocabulary at each of its tokens."""
    context = tokenizer(prompt.context)["input_ids"]
    key = tokenizer(" " + prompt.key, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([context + key])
    scored = perplexity(model, ids, cache, chunk_size=chunk_size, score_last=len(key), progress=False)
    return Recall(prompt.length, prompt.depth, bool(scored.greedy.all()), -scored.nll.double().sum().item())
