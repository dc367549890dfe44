"""One streaming call, planned once for every layer: ranks, positions, visibility, writes and eviction.

The token-by-token definition (mit-han-lab/streaming-llm with pos-shift): a query of stream rank ``a_q`` sees
the first ``S`` tokens of its row (the sinks) and its own last ``W`` tokens (itself included), numbered
``0..n-1`` in stream order. In RoPE's relative terms, a window key of rank ``a_k`` sits at its true distance
``a_q - a_k``, and sink ``i`` at ``min(a_q, S + W - 1) - i``.

How a layer stores its keys (`hf_attnscale.streaming.cache`): window keys are kept rotated at their rank minus
a per-row ``base``, so a new token costs one rotation and the cache is never re-rotated. The base moves every
``capacity = S + W`` tokens or more (a "rebase", which rotates the stored keys back by the move), so positions
stay below ``2 * capacity + q`` however long the stream. The sinks are kept un-rotated beside the cache and
rotated afresh into reserved slots ``0..S-1`` for each call, at the distance the call needs. A call is then:

* ``SINGLE``: every query of a row sees the sinks at one offset from their true distance (one new token, or a
  chunk whose queries all still see the sinks at their true distance): one attention over the slots;
* ``DOUBLED``: queries of one chunk see the sinks at different distances. The head dim is doubled: queries
  ``[R(a_q) q, R(m_q) q]`` with ``m_q = min(a_q, S + W - 1)``, window keys ``[R(a_k) k, 0]``, the sinks at their
  true distance in the reserved slots and once more as ``[0, R(i) k]``; the mask picks each query's copy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .rope import RopeTable

CosSin = tuple[torch.Tensor, torch.Tensor]


class Mode(enum.Enum):
    """How one call attends (see the module docstring)."""

    SINGLE = "single"
    DOUBLED = "doubled"


@dataclass(frozen=True, eq=False)
class Bookkeeping:
    """A layer's record of its slots; every layer holds the same one between calls."""

    rank: torch.Tensor  # (B, C): stream rank of the token in each slot, -1 free; slots 0..S-1 are the sinks
    seen_valid: torch.Tensor  # (B,): real tokens streamed per row
    base: torch.Tensor  # (B,): stored window keys are rotated at (rank - base)
    seen: int  # tokens streamed, padding included (what generate() slices its inputs by)

    @classmethod
    def empty(cls, batch: int, sinks: int, device: torch.device) -> Bookkeeping:
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return cls(torch.full((batch, sinks), -1, dtype=torch.long, device=device), zeros, zeros, 0)

    def same_as(self, other: Bookkeeping) -> bool:
        return self.seen == other.seen and all(
            a is b or (a.shape == b.shape and torch.equal(a, b))
            for a, b in (
                (self.rank, other.rank),
                (self.seen_valid, other.seen_valid),
                (self.base, other.base),
            )
        )


@dataclass(eq=False)
class StepPlan:
    """Everything one model call needs that does not depend on the layer's keys.

    Positions are relative to each row's new base, for the `RopeTable` of the layer (see `rotations`).
    """

    before: Bookkeeping
    after: Bookkeeping
    new_valid: torch.Tensor  # (B, q): which new tokens are real
    dtype: torch.dtype
    in_place: bool
    mode: Mode
    sinks: int
    new_positions: torch.Tensor  # (B, q): the new keys, and the queries (their first half when doubled)
    sink_positions: torch.Tensor  # (B, S): the sinks in their reserved slots
    mid_positions: torch.Tensor | None  # (B, q): the queries' second half (DOUBLED)
    rebase: torch.Tensor | None  # (B,): rotate the stored window keys back by this much first
    new_sink_rank: torch.Tensor | None  # (B, q): rank of each new token that is a sink, else -1
    write_slot: torch.Tensor | None  # (B,): decoding writes its one token into this slot, in place
    mask: torch.Tensor | None  # (B, 1, q, K) additive; None when one query sees every slot
    keep_index: torch.Tensor | None  # slots kept after an appending call (1D, or (B, C') per row)
    _rotations: dict[int, dict[str, CosSin]] = field(default_factory=dict)

    def matches(
        self, before: Bookkeeping, new_valid: torch.Tensor, dtype: torch.dtype, in_place: bool
    ) -> bool:
        """Whether this plan was built for a layer holding ``before`` and this call's inputs."""
        same_valid = self.new_valid is new_valid or (
            self.new_valid.shape == new_valid.shape and torch.equal(self.new_valid, new_valid)
        )
        return (
            self.dtype == dtype and self.in_place == in_place and same_valid and self.before.same_as(before)
        )

    def rotations(self, table: RopeTable) -> dict[str, CosSin]:
        """cos/sin of each rotation of this call, for one layer type's table (computed once per call, in one
        call of the table)."""
        if id(table) not in self._rotations:
            device = self.new_positions.device
            positions = {
                "new": self.new_positions,
                "sinks": self.sink_positions,
                "mid": self.mid_positions,
                "sink_slots": torch.arange(self.sinks, device=device)[None]
                if self.mode is Mode.DOUBLED
                else None,
            }
            positions = {k: p for k, p in positions.items() if p is not None}
            batch = max(p.shape[0] for p in positions.values())
            widths = [p.shape[1] for p in positions.values()]
            cos, sin = table(torch.cat([p.expand(batch, -1) for p in positions.values()], dim=1))
            rotations = dict(zip(positions, zip(cos.split(widths, dim=1), sin.split(widths, dim=1))))
            if self.rebase is not None:  # stored keys move back: a pure rotation, no second attention scaling
                rotations["rebase"] = table.relative(-self.rebase[:, None])
            self._rotations[id(table)] = rotations
        return self._rotations[id(table)]


def build_plan(
    before: Bookkeeping,
    new_valid: torch.Tensor,
    sinks: int,
    window: int,
    dtype: torch.dtype,
    in_place: bool,
    all_valid: bool = False,
) -> StepPlan:
    """Plan one call of ``new_valid.shape[1]`` new tokens (see the module docstring).

    ``all_valid`` says that no new token is padding (``new_valid`` is all True): decoding then takes a
    shorter path to the same plan.
    """
    if all_valid and in_place and new_valid.shape[1] == 1:
        plan = _decode_plan(before, new_valid, sinks, window, dtype)
        if plan is not None:
            return plan
    capacity = sinks + window
    new_rank = (before.seen_valid[:, None] + new_valid.long().cumsum(1) - 1).masked_fill(~new_valid, -1)
    seen_valid = before.seen_valid + new_valid.sum(1)
    base, rebase = _new_base(before, seen_valid, capacity)
    write_slot = _write_slot(before.rank, new_rank, sinks, in_place)
    key_rank, query_slot = _key_ranks(before.rank, new_rank, seen_valid, write_slot, sinks)
    doubled = new_rank.shape[1] > 1 and sinks > 0 and int(new_rank.max()) >= capacity
    mode = Mode.DOUBLED if doubled else Mode.SINGLE
    visible = _visibility(key_rank, new_rank, query_slot, sinks, window, mode)
    sink_ids = torch.arange(sinks, device=new_valid.device)[None]
    sink_positions = sink_ids - base[:, None]
    if mode is Mode.SINGLE:
        # Queries past rank S + W - 1 see the sinks that much further than their true distance.
        sink_positions = sink_positions + (new_rank - (capacity - 1)).clamp_min(0).amax(1, keepdim=True)
    is_new_sink = (new_rank >= 0) & (new_rank < sinks)
    keep_index, next_rank = _eviction(key_rank, seen_valid, sinks, window, write_slot is not None)
    return StepPlan(
        before=before,
        after=Bookkeeping(next_rank, seen_valid, base, before.seen + new_valid.shape[1]),
        new_valid=new_valid,
        dtype=dtype,
        in_place=in_place,
        mode=mode,
        sinks=sinks,
        new_positions=(new_rank - base[:, None]).clamp_min(0),
        sink_positions=sink_positions,
        mid_positions=new_rank.clamp(0, capacity - 1) if mode is Mode.DOUBLED else None,
        rebase=rebase,
        new_sink_rank=new_rank.masked_fill(~is_new_sink, -1) if bool(is_new_sink.any()) else None,
        write_slot=write_slot,
        mask=_additive(visible, dtype, decoding=write_slot is not None),
        keep_index=keep_index,
    )


def _decode_plan(
    before: Bookkeeping, new_valid: torch.Tensor, sinks: int, window: int, dtype: torch.dtype
) -> StepPlan | None:
    """`build_plan` for one real token per row written in place, in a third of the tensor operations (a
    decoding step of a small model costs little more than them). None when a row has no free slot."""
    if before.rank.shape[0] == 1 and before.rank.device.type == "cpu":
        return _decode_plan_one_row(before, new_valid, sinks, window, dtype)
    capacity = sinks + window
    token = before.seen_valid  # each row's new token: its rank
    seen_valid = token + 1
    base, rebase = _new_base(before, seen_valid, capacity)
    free = before.rank[:, sinks:] < 0
    is_sink = token < sinks
    if not free.shape[1]:
        if not bool(is_sink.all()):
            return None
        write_slot = token
    elif not bool((free.any(1) | is_sink).all()):
        return None
    else:
        write_slot = torch.where(is_sink, token, sinks + free.to(torch.int8).argmax(1))
    # Every slot the token reads: the cache's, with the token in its own (its reserved one if it is a sink).
    key_rank = before.rank.scatter(1, write_slot[:, None], token[:, None])
    is_sink_slot = torch.arange(key_rank.shape[1], device=key_rank.device) < sinks
    # Every stored key is in the token's window (the last call evicted the others), so it reads every real one.
    visible = key_rank >= 0
    keep = is_sink_slot | (visible & (key_rank >= seen_valid[:, None] - (window - 1)))
    offset = (token - (capacity - 1)).clamp_min(0) - base
    return StepPlan(
        before=before,
        after=Bookkeeping(key_rank.masked_fill(~keep, -1), seen_valid, base, before.seen + 1),
        new_valid=new_valid,
        dtype=dtype,
        in_place=True,
        mode=Mode.SINGLE,
        sinks=sinks,
        new_positions=(token - base)[:, None],
        sink_positions=torch.arange(sinks, device=token.device)[None] + offset[:, None],
        mid_positions=None,
        rebase=rebase,
        new_sink_rank=token.masked_fill(~is_sink, -1)[:, None] if bool(is_sink.any()) else None,
        write_slot=write_slot,
        mask=_additive(visible[:, None], dtype, decoding=True),
        keep_index=None,
    )


def _decode_plan_one_row(
    before: Bookkeeping, new_valid: torch.Tensor, sinks: int, window: int, dtype: torch.dtype
) -> StepPlan | None:
    """`_decode_plan` for one stream on the CPU, worked out in Python numbers: a handful of small tensors
    instead of some thirty tensor operations.

    It relies on what every plan leaves behind: window slots hold ranks of at least ``seen_valid - (W - 1)``
    (or -1), so this step evicts at most the one of rank ``token + 1 - W``.
    """
    capacity = sinks + window
    token, base = before.seen_valid.item(), before.base.item()
    ranks = before.rank.tolist()[0]
    if token + 1 - base > 2 * capacity:
        new_base = max(0, token - capacity)
        rebase = _long(new_base - base, 1)
    else:
        new_base, rebase = base, None
    slot = token if token < sinks else _window_slot(ranks, -1, sinks)
    if slot is None:
        return None
    ranks[slot] = token
    rank = before.rank.clone()
    rank[0, slot] = token
    visible = rank >= 0 if -1 in ranks else None  # None: every slot is read
    stale = token + 1 - window  # the one rank this step can evict (window slots never hold a sink's rank)
    evicted = _window_slot(ranks, stale, sinks) if stale >= sinks else None
    if evicted is not None:
        rank[0, evicted] = -1
    offset = max(0, token - (capacity - 1)) - new_base
    return StepPlan(
        before=before,
        after=Bookkeeping(
            rank, _long(token + 1, 1), before.base if rebase is None else _long(new_base, 1), before.seen + 1
        ),
        new_valid=new_valid,
        dtype=dtype,
        in_place=True,
        mode=Mode.SINGLE,
        sinks=sinks,
        new_positions=_long(token - new_base, 1, 1),
        sink_positions=torch.arange(offset, offset + sinks)[None],
        mid_positions=None,
        rebase=rebase,
        new_sink_rank=_long(token, 1, 1) if token < sinks else None,
        write_slot=_long(slot, 1),
        mask=None if visible is None else _additive(visible[:, None], dtype, decoding=True),
        keep_index=None,
    )


def _window_slot(ranks: list[int], rank: int, sinks: int) -> int | None:
    """The first window slot (past the ``sinks`` reserved ones) holding ``rank``, or None."""
    try:
        return ranks.index(rank, sinks)
    except ValueError:
        return None


def _long(value: int, *shape: int) -> torch.Tensor:
    return torch.full(shape, value, dtype=torch.long)


def _new_base(
    before: Bookkeeping, seen_valid: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's base after this call, and how far it moved (None: no row moved)."""
    moving = seen_valid - before.base > 2 * capacity
    if not bool(moving.any()):
        return before.base, None
    base = torch.where(moving, (before.seen_valid - capacity).clamp_min(0), before.base)
    return base, base - before.base


def _write_slot(
    rank: torch.Tensor, new_rank: torch.Tensor, sinks: int, in_place: bool
) -> torch.Tensor | None:
    """When decoding (one real token per row, room in every row): the slot each row writes its token into."""
    if new_rank.shape[1] != 1 or not in_place or not bool((new_rank >= 0).all()):
        return None
    token = new_rank[:, 0]
    free = rank[:, sinks:] < 0
    is_sink = token < sinks
    if not bool((free.any(1) | is_sink).all()):
        return None  # a row with no free slot: append, and compact afterwards
    first_free = free.to(torch.int8).argmax(1) if free.shape[1] else torch.zeros_like(token)
    return torch.where(is_sink, token, sinks + first_free)


def _key_ranks(
    rank: torch.Tensor,
    new_rank: torch.Tensor,
    seen_valid: torch.Tensor,
    write_slot: torch.Tensor | None,
    sinks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank of every slot the call reads, and the slot of each new token (padding sees only its own)."""
    ids = torch.arange(sinks, device=rank.device)[None]
    reserved = torch.where(ids < seen_valid[:, None], ids, -1)  # sink i exists once i real tokens came
    window_ranks = rank[:, sinks:]
    if write_slot is not None:
        token = new_rank[:, :1]
        slots = torch.arange(window_ranks.shape[1], device=rank.device)[None]
        written = (slots == (write_slot[:, None] - sinks)) & (token >= sinks)
        return torch.cat([reserved, torch.where(written, token, window_ranks)], dim=1), write_slot[:, None]
    appended = new_rank.masked_fill(new_rank < sinks, -1)  # new sinks are read from their reserved slots
    first = rank.shape[1]
    query_slot = torch.arange(first, first + new_rank.shape[1], device=rank.device).expand_as(new_rank)
    return torch.cat([reserved, window_ranks, appended], dim=1), query_slot


def _visibility(
    key_rank: torch.Tensor,
    new_rank: torch.Tensor,
    query_slot: torch.Tensor,
    sinks: int,
    window: int,
    mode: Mode,
) -> torch.Tensor:
    """``(B, q, K)`` bool: which slots each query reads (DOUBLED: ``K + S``, the sinks' second copies last)."""
    a_q, a_k = new_rank[:, :, None], key_rank[:, None, :]
    real = (a_k >= 0) & (a_q >= 0)
    distance = a_q - a_k
    in_window = real & (distance >= 0) & (distance < window)
    is_sink_slot = torch.arange(key_rank.shape[1], device=key_rank.device) < sinks
    if mode is Mode.SINGLE:
        visible = in_window | (real & is_sink_slot & (distance >= 0))
    else:  # reserved slots hold the sinks at their true distance; the copies, at their sink distance
        copies = real[..., :sinks] & (distance[..., :sinks] >= window)
        visible = torch.cat([in_window, copies], dim=-1)
    # A padding query sees only itself: its output is discarded, but it must not be NaN (NaN * 0 = NaN later).
    own = torch.zeros_like(visible).scatter_(2, query_slot[:, :, None], (new_rank < 0)[:, :, None])
    return visible | own


def _additive(visible: torch.Tensor, dtype: torch.dtype, decoding: bool) -> torch.Tensor | None:
    if decoding and bool(visible.all()):
        return None  # one query that reads every slot: no mask, the backend's fastest path
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min).unsqueeze(1)


def _eviction(
    key_rank: torch.Tensor, seen_valid: torch.Tensor, sinks: int, window: int, in_place: bool
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Slots kept for later calls (None: nothing moves, evicted slots are marked free) and their ranks."""
    is_sink_slot = torch.arange(key_rank.shape[1], device=key_rank.device) < sinks
    keep = is_sink_slot | ((key_rank >= 0) & (key_rank >= seen_valid[:, None] - (window - 1)))
    if in_place:
        return None, key_rank.masked_fill(~keep, -1)
    return _keep_index(keep, key_rank, sinks + window)


def _keep_index(
    keep: torch.Tensor, key_rank: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots to copy into the new cache tensors (kept ones first, in order), and their ranks (-1: spare).

    The new tensors get room to grow (double the kept count, at most ``capacity``), so that the following
    decoding steps write in place instead of copying the cache every step.
    """
    batch = keep.shape[0]
    kept = int(keep.sum(1).max())
    size = min(capacity, max(kept + 1, 2 * kept))
    if batch == 1 or bool((keep == keep[:1]).all()):
        index = keep[0].nonzero().squeeze(1)
        rank = key_rank.index_select(1, index)
    else:  # rows keep different slots: each row's kept slots first, in order
        index = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :kept]
        rank = key_rank.gather(1, index).masked_fill(~keep.gather(1, index), -1)
    spare = size - index.shape[-1]
    index = F.pad(index, (0, spare))  # spare slots copy slot 0: finite, and marked free
    return index, F.pad(rank, (0, spare), value=-1)
