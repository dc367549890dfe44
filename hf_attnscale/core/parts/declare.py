"""The methods, each a declaration of its parts; the engine (`hf_attnscale.core.parts.engine`) runs any of them.

A query at position i and a key at j ≤ i are scored in exactly one part of a method. A `Part` covers the pairs
with ``lo ≤ ⌊i/unit⌋ − ⌊j/unit⌋ < hi`` (a band of distance where ``unit`` is 1, a relation between chunks of
``unit`` positions otherwise), and scores them as ``(R(q(i)) q) · (R(k(j)) k)``, RoPE at the positions `At` gives
its queries and keys. The methods' definitions (DESIGN.md):

    ReRoPE (Su 2023)          near (0, w): (i, j)             far [w, ∞): (w, 0)
    leaky ReRoPE              near (0, w): (i, j)             far [w, ∞): ((i + w(k − 1)) / k, j / k)
    Self-Extend (Jin 2024)    near (0, w): (i, j)             far [w, ∞): (⌊i/G⌋ + w − ⌊w/G⌋, ⌊j/G⌋)
    DCA (An 2024), c = s − l  same chunk: (i mod c, j mod c)  next: (min(i mod c + c, s), j mod c)
                              older chunks: (min(2c − 1, s), j mod c)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hf_attnscale.core.options.config import AttnScaleConfig


class At(NamedTuple):
    """Where a part rotates its queries or its keys: position p at ``min(cap, f(p) + shift) / slower``, with
    ``f(p)`` ``⌊p / group⌋`` or ``p mod period`` (or p); or at ``fixed``, whatever p."""

    group: int = 1
    period: int | None = None
    shift: float = 0.0
    slower: float = 1.0
    cap: float | None = None
    fixed: float | None = None

    def value(self, p: torch.Tensor) -> torch.Tensor:
        """The position before slowing, float64 (RoPE's frequencies are divided by ``slower``)."""
        if self.fixed is not None:
            return torch.full_like(p, self.fixed, dtype=torch.float64)
        if self.period is not None:
            p = torch.remainder(p, self.period)
        elif self.group != 1:
            p = torch.div(p, self.group, rounding_mode="floor")
        p = p.to(torch.float64) + self.shift
        return p if self.cap is None else p.clamp_max(self.cap)

    def angle(self, p: torch.Tensor) -> torch.Tensor:
        """The position RoPE turns by, float64 (``value / slower``)."""
        return self.value(p) / self.slower

    @property
    def moves(self) -> bool:
        """Whether it moves with p by one a position (``p + shift``, slowed)."""
        return self.fixed is None and self.period is None and self.group == 1 and self.cap is None


class Part(NamedTuple):
    """The pairs ``j ≤ i`` with ``lo ≤ ⌊i/unit⌋ − ⌊j/unit⌋ < hi`` (``hi`` None: no bound), scored with the queries
    rotated at ``query`` and the keys at ``key``."""

    lo: int
    hi: int | None
    query: At
    key: At
    unit: int = 1

    def covers(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """Which pairs of positions ``i``, ``j`` (broadcast) the part covers, bool."""
        apart = torch.div(i, self.unit, rounding_mode="floor") - torch.div(
            j, self.unit, rounding_mode="floor"
        )
        covered = (j <= i) & (apart >= self.lo)
        return covered if self.hi is None else covered & (apart < self.hi)

    def reach(self, i: int) -> tuple[int | None, int]:
        """The keys the part covers for the query at position i: ``L(i) .. R(i)`` (L None: every key up to R),
        both non-decreasing in i. ``L(i) = (⌊i/u⌋ − hi + 1)·u``, ``R(i) = min(i, (⌊i/u⌋ − lo + 1)·u − 1)``: for
        a unit of 1, ``i − hi + 1`` and ``i − lo``."""
        cell = i // self.unit * self.unit
        first = None if self.hi is None else cell - (self.hi - 1) * self.unit
        return first, min(i, cell - (self.lo - 1) * self.unit - 1)

    @property
    def by_distance(self) -> bool:
        """Whether its scores depend on i − j alone: a band of distance, rotated at moving positions of one speed,
        or at fixed ones."""
        fixed = self.query.fixed is not None and self.key.fixed is not None
        same_speed = self.query.moves and self.key.moves and self.query.slower == self.key.slower
        return self.unit == 1 and (fixed or same_speed)


RAW = At(fixed=0)
"""Keys and queries as the model projects them, before any RoPE."""
MOVING = At()
"""The model's own positions."""


class Method(NamedTuple):
    """A method's name, the option that asks for it (its errors start with it), its parts, which together cover
    every causal pair once, and where the model's cache holds each key (``store``; the call's queries come at
    the same place): a decoding step turns only the keys whose part places them elsewhere."""

    name: str
    option: str
    parts: tuple[Part, ...]
    store: At = RAW

    @property
    def by_distance(self) -> bool:
        """Whether every score depends on i − j alone, and the keys are stored raw or at positions that move by one
        speed (so that a row's, or a packed sequence's, offset cancels): then positions are counted in the
        cache."""
        moving = self.store == RAW or (self.store.moves and self.store.shift == 0)
        return moving and all(part.by_distance for part in self.parts)

    @property
    def keeps_keys(self) -> bool:
        """Whether every part scores its keys where the store keeps them (DCA): its parts differ only in where they
        place the query."""
        return self.store != RAW and all(part.key == self.store for part in self.parts)

    @property
    def span(self) -> int:
        """The least positive boundary between parts, in positions: a query chunk's natural length (1,024 where
        the parts have none)."""
        bounds = [b * part.unit for part in self.parts for b in (part.lo, part.hi) if b]
        return min(bounds) if bounds else 1024  # (no `default=`: torch.compile takes min without it)


def rerope(window: int, leak: float | None = None) -> Method:
    """ReRoPE (Su 2023, ``bojone/rerope``): distances ``d ≥ w`` scored at w (leaky: at ``w + (d − w) / k``)."""
    near = Part(0, window, At(), At())
    if leak is None:
        return Method("ReRoPE", "rerope_window", (near, Part(window, None, At(fixed=window), At(fixed=0))))
    far = Part(window, None, At(shift=window * (leak - 1), slower=leak), At(slower=leak))
    return Method("leaky ReRoPE", "rerope_window", (near, far), store=far.key)


def self_extend(group: int, window: int) -> Method:
    """Self-Extend (Jin et al. 2024, "LLM Maybe LongLM", ``datamllab/LongLM``): neighbours within ``window`` at
    their own positions, the rest grouped by ``group`` (LongLM's definition)."""
    near = Part(0, window, At(), At())
    far = Part(window, None, At(group=group, shift=window - window // group), At(group=group))
    return Method("Self-Extend", "self_extend_group", (near, far), store=At(group=group))


def dual_chunk(size: int, local: int) -> Method:
    """Dual Chunk Attention (An et al. 2024, ``HKUNLP/ChunkLlama``; vLLM's): chunks of ``c = size − local``
    positions from 0, keys at ``j mod c``, queries by how many chunks back the key is."""
    c = size - local
    key = At(period=c)
    return Method(
        "Dual Chunk Attention",
        "dual_chunk_size",
        (
            Part(0, 1, At(period=c), key, unit=c),
            Part(1, 2, At(period=c, shift=c, cap=size), key, unit=c),
            Part(2, None, At(fixed=min(2 * c - 1, size)), key, unit=c),
        ),
        store=key,
    )


def method_of(config: AttnScaleConfig) -> Method | None:
    """The method a patch's options ask for, or None."""
    if config.rerope_window is not None:
        return rerope(config.rerope_window, config.rerope_leak)
    if config.self_extend_group is not None:
        return self_extend(config.self_extend_group, config.self_extend_window)
    if config.dual_chunk_size is not None:
        return dual_chunk(config.dual_chunk_size, config.dual_chunk_local)
    return None
