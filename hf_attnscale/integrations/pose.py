"""PoSE (Zhu et al. 2024, "PoSE: Efficient Context Window Extension of LLMs via Positional Skip-wise Training"):
train inside a short window with the position ids of a long context.

A training window of ``window`` tokens is cut into ``chunks`` runs of consecutive position ids; run i starts at its
offset in the window plus a skip u_i, with u_0 = 0 and u_i drawn uniformly from [u_{i-1}, target_length − window],
so the skips never decrease and the last id stays below ``target_length``. The model then sees, in a window it
can afford, the distances of the target length (every distance up to ``target_length − 1`` can occur). Pair it
with RoPE rescaling (``rope_parameters``: linear, dynamic NTK or YaRN) or logn, as the paper does with
interpolation, or with a method of key parts (ReRoPE, Self-Extend, DCA, STRING), which scores each pair of a
training window at the positions given (while training, or with no cache: jumps onto a cache are refused).

>>> ids = hfa.pose_position_ids(2048, 32768, chunks=2, generator=torch.Generator().manual_seed(0))
>>> trainer = Trainer(model, args, train_dataset=windows, data_collator=hfa.PoSECollator(tokenizer, 32768))
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from transformers import DataCollatorForLanguageModeling

from hf_attnscale.core.options.validation import check_int


def pose_position_ids(
    window: int, target_length: int, chunks: int = 2, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The position ids of one PoSE training window: a LongTensor of ``window`` ids, the first 0, in ``chunks``
    runs of consecutive ids (the cut points drawn uniformly), each run after the first shifted by a skip that
    never decreases, the last id below ``target_length``; drawn from ``generator`` (torch's default one if None).

    Raises:
        ValueError: ``window`` < ``chunks`` or < 1, ``chunks`` < 1, or ``target_length`` < ``window``, in one line.
    """
    window = check_int("window", window, 1)
    chunks = check_int("chunks", chunks, 1)
    target_length = check_int("target_length", target_length, 1)
    if chunks > window:
        raise ValueError(
            f"chunks must be at most window ({window}) so that every run holds a token, got {chunks}."
        )
    if target_length < window:
        raise ValueError(f"target_length must be at least window ({window}), got {target_length}.")
    cuts = (
        torch.randperm(window - 1, generator=generator)[: chunks - 1].sort().values + 1
    )  # run starts after 0
    room = target_length - window  # the largest skip
    skips = [0]
    for _ in range(chunks - 1):  # u_i uniform in [u_{i-1}, room], as the paper draws them
        skips.append(int(torch.randint(skips[-1], room + 1, (1,), generator=generator)))
    ids = torch.arange(window)
    run = torch.zeros(window, dtype=torch.long)
    run[cuts] = 1
    return ids + torch.tensor(skips)[run.cumsum(0)]


class PoSECollator:
    """A `transformers.Trainer` data collator that gives each row of a batch PoSE position ids
    (`pose_position_ids` for the batch's length) toward ``target_length``.

    ``collator`` builds the batch first (default: ``DataCollatorForLanguageModeling(tokenizer, mlm=False)``,
    which pads, masks and sets ``labels``); then ``position_ids`` (B, T) is added. With ``seed``, each row's ids
    are drawn from a generator seeded by ``seed`` and the row's tokens, so a window always gets the same ids,
    whatever the order, the batching or a resumed run (Trainer's data loader collates a batch ahead, so a
    generator's state at a checkpoint would be one batch on); with None, from torch's default generator. Padding
    keeps the ids its row's run gives it: it is masked out.
    """

    def __init__(
        self,
        tokenizer: Any,
        target_length: int,
        *,
        chunks: int = 2,
        seed: int | None = None,
        collator: Callable[[Sequence[Mapping[str, Any]]], dict[str, Any]] | None = None,
    ) -> None:
        self.target_length = check_int("target_length", target_length, 1)
        self.chunks = check_int("chunks", chunks, 1)
        self.seed = None if seed is None else check_int("seed", seed, 0)
        self.collator = collator or DataCollatorForLanguageModeling(tokenizer, mlm=False)

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch = dict(self.collator(features))
        length = batch["input_ids"].shape[1]
        if length > self.target_length:
            raise ValueError(
                f"A batch of {length} tokens is longer than target_length ({self.target_length}): PoSE trains a "
                "window shorter than the length it reaches toward."
            )
        ids = [
            pose_position_ids(length, self.target_length, self.chunks, self._generator(row))
            for row in batch["input_ids"]
        ]
        batch["position_ids"] = torch.stack(ids).to(batch["input_ids"].device)
        return batch

    def _generator(self, tokens: torch.Tensor) -> torch.Generator | None:
        if self.seed is None:
            return None
        digest = hashlib.blake2b(tokens.cpu().numpy().tobytes(), digest_size=8, key=str(self.seed).encode())
        return torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little") >> 1)
