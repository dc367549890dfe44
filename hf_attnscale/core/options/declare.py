"""The vocabulary a method of key parts is declared in (`hf_attnscale.core.options.methods`): `At`, `Part`, `Method`.

A query at position i and a key at j ≤ i are scored in exactly one part of a method. A `Part` covers the pairs
with ``lo ≤ ⌊i/unit⌋ − ⌊j/unit⌋ < hi`` (a band of distance where ``unit`` is 1, a relation between chunks of
``unit`` positions otherwise), and scores them as ``(R(q(i)) q) · (R(k(j)) k)``, RoPE at the positions `At` gives
its queries and keys. The engine (`hf_attnscale.core.parts.engine`) runs any such declaration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # tensors are used through their own methods: importing the vocabulary costs no torch
    import torch


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
            return p.double().new_full(p.shape, self.fixed)
        if self.period is not None:
            p = p.remainder(self.period)
        elif self.group != 1:
            p = p.div(self.group, rounding_mode="floor")
        p = p.double() + self.shift
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
        apart = i.div(self.unit, rounding_mode="floor") - j.div(self.unit, rounding_mode="floor")
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
    """A method's name, its parts, which together cover every causal pair once, where the model's cache holds each
    key (``store``; the call's queries come at the same place: a decoding step turns only the keys whose part
    places them elsewhere), the factor its authors put on cos and sin (``factor``, on queries and keys both:
    every score's rotary dims times its square), the distance below which every pair is scored at its own
    distance (``exact_below``: a layer whose own sliding window is no wider sees nothing the method changes, and
    runs as the model has it, without the factor), and the option that asks for it (``option``: its errors start
    with it; `hf_attnscale.core.options.methods.method_of` fills it in)."""

    name: str
    parts: tuple[Part, ...]
    store: At = RAW
    factor: float = 1.0
    exact_below: int = 0
    option: str = ""

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
