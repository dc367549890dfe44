"""Perplexity by position: a document's tokens grouped by where they stand, so a reader sees where a model breaks.

A bucket holds the tokens at positions ``[start, end)`` of a document (position 0: its first token). Buckets are
given by their edges: ``(2048, 4096)`` makes ``0-2k``, ``2k-4k`` and ``4k+``. lm-eval's tasks report one
``ppl_<label>`` metric per bucket (`hf_attnscale.integrations.lm_eval_tasks_data`), ``hf-attnscale eval`` one
column per bucket.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

DEFAULT_EDGES = (2048, 4096, 8192, 16384, 32768)
"""Edges of the default buckets: 0-2k, 2k-4k, 4k-8k, 8k-16k, 16k-32k, 32k+."""


@dataclass(frozen=True)
class PositionBucket:
    """The tokens at positions ``[start, end)`` of a document; ``end`` None: to the document's end."""

    start: int
    end: int | None

    @property
    def label(self) -> str:
        """``"0-2k"``, ``"2k-4k"``, ``"32k+"`` (k = 1,024 where it divides, else the number itself)."""
        start = _short(self.start)
        return f"{start}+" if self.end is None else f"{start}-{_short(self.end)}"

    @property
    def metric(self) -> str:
        """The lm-eval metric of this bucket's perplexity: ``ppl_`` and the label."""
        return f"ppl_{self.label}"


def position_buckets(edges: Iterable[int] | str | int | None = None) -> tuple[PositionBucket, ...]:
    """The buckets between ``edges`` (increasing positive token counts; default `DEFAULT_EDGES`), the last open.

    ``edges`` may be written as text, ``"2048;4096"`` (lm-eval's ``model_args`` are comma-separated), or one
    number. Raises ValueError, in one line, for anything else.
    """
    if edges is None:
        edges = DEFAULT_EDGES
    if isinstance(edges, str):
        text = edges.strip("[]() ")
        try:
            edges = [int(part) for part in text.replace(",", ";").split(";") if part.strip()]
        except ValueError:
            raise ValueError(
                f"position_buckets must be token counts separated by ';' (e.g. 2048;4096;8192), got {text!r}."
            ) from None
    elif isinstance(edges, int):
        edges = [edges]
    edges = list(edges)
    if (
        not edges
        or any(not isinstance(e, int) or isinstance(e, bool) or e < 1 for e in edges)
        or edges != sorted(set(edges))
    ):
        raise ValueError(
            f"position_buckets must be increasing positive token counts (e.g. 2048;4096;8192), got {edges}."
        )
    starts = [0, *edges]
    return tuple(PositionBucket(s, e) for s, e in zip(starts, [*edges, None]))


def bucket_sums(
    nll: torch.Tensor | Sequence[float], buckets: Sequence[PositionBucket], first_position: int = 0
) -> list[tuple[float, int]]:
    """``(summed NLL, token count)`` of each bucket over one document's per-token NLL (``nll[i]``: the NLL of
    the token at position ``first_position + i``), in float64; ``(0.0, 0)`` for a bucket the document does
    not reach."""
    values = torch.as_tensor(nll, dtype=torch.float64).flatten()
    sums = []
    for bucket in buckets:
        start = max(bucket.start - first_position, 0)
        end = None if bucket.end is None else max(bucket.end - first_position, 0)
        part = values[start:end]
        sums.append((part.sum().item(), part.numel()))
    return sums


def _short(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens and tokens % 1024 == 0 else str(tokens)
