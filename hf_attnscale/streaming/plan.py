"""One streaming call, planned once for every layer: ranks, positions, visibility, writes and eviction.

The token-by-token definition (mit-han-lab/streaming-llm with pos-shift): a query of stream rank ``a_q`` sees
the first ``S`` tokens of its row (the sinks) and its own last ``W`` tokens (itself included), numbered
``0..n-1`` in stream order. In RoPE's relative terms, a window key of rank ``a_k`` sits at its true distance
``a_q - a_k``, and sink ``i`` at ``min(a_q, S + W - 1) - i``.

How keys are stored: the module rotates its queries and new keys itself, at their rank minus a per-row
``base``, so the window is never re-rotated. The base moves every ``capacity = S + W`` tokens or more (a
"rebase" rotates the stored keys back by the move), so positions stay below ``2 * capacity + q`` however long
the stream. The sinks are kept as they came (rotated at their own rank ``i``: the base is 0 then) and rotated
into reserved slots ``0..S-1`` for each call, by the one offset the call needs. A call is then:

* single: every query of a row sees the sinks at one offset from their true distance (one new token, or a
  chunk whose queries all still see the sinks at their true distance): one attention over the slots;
* doubled: queries of one chunk see the sinks at different distances. The head dim is doubled: queries
  ``[R(a_q) q, R(m_q) q]`` with ``m_q = min(a_q, S + W - 1)``, window keys ``[R(a_k) k, 0]``, the sinks at their
  true distance in the reserved slots and once more as ``[0, R(i) k]``; the mask picks each query's copy.

**A layer with a sliding window of its own** (Gemma-2/3, Mistral, Cohere-2) sees what the model's mask lets it
see in the cache: with a query at ``m_q``, a layer of window ``w`` reads the window keys nearer than
``min(W, w)`` and the sinks nearer than ``w`` (sink ``i`` sits at ``m_q - i``). Its `LayerGeometry` holds just
that: ``(S, W)`` when ``w >= S + W``; ``(0, w)`` when ``w <= W`` (no sink once past them, and only its own
window kept); in between ``(S, W)`` with the sinks further than ``w`` hidden (``local = w``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hf_attnscale.core.call.masks import additive_mask
from hf_attnscale.core.call.rope import CosSin

from .rope import RopeTable


@dataclass(frozen=True, eq=False)
class SlotRecord:
    """What a layer's slots hold, the same in every layer of one geometry between calls. A token's *index* is
    its place among the real (non-padding) tokens of its row: 0, 1, 2, ..."""

    index: torch.Tensor  # (B, C): index of the token in each slot, -1 free; slots 0..S-1 are the sinks'
    real_tokens: torch.Tensor  # (B,): real tokens streamed per row
    base: torch.Tensor  # (B,): stored window keys are rotated at (index - base)
    seen: int  # tokens streamed, padding included (what generate() slices its inputs by)

    @classmethod
    def empty(cls, batch: int, sinks: int, device: torch.device) -> SlotRecord:
        """The record of a layer that holds nothing yet."""
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return cls(zeros[:, None].expand(-1, sinks) - 1, zeros, zeros, 0)

    def same_as(self, other: SlotRecord) -> bool:
        """Whether both records hold the same slots."""
        pairs = ((self.index, other.index), (self.real_tokens, other.real_tokens), (self.base, other.base))
        return self.seen == other.seen and all(a.shape == b.shape and torch.equal(a, b) for a, b in pairs)

    def select_rows(self, select) -> SlotRecord:
        """The record of the rows ``select`` picks (beam search reorders, repeats and drops rows)."""
        return SlotRecord(select(self.index), select(self.real_tokens), select(self.base), self.seen)


@dataclass(frozen=True)
class LayerGeometry:
    """What one layer of a stream holds and reads: ``sinks`` reserved slots, a ``window`` of recent tokens, and
    the layer's own sliding window where it hides some of the sinks (``local``; None: it hides none)."""

    sinks: int
    window: int
    local: int | None = None

    @property
    def capacity(self) -> int:
        """The most tokens the layer holds."""
        return self.sinks + self.window


def layer_geometry(stream: LayerGeometry, own_window: int | None) -> LayerGeometry:
    """The geometry of a layer whose own sliding window is ``own_window`` (None: global) in a stream whose global
    layers hold ``stream`` (see the module docstring)."""
    if own_window is None or own_window >= stream.capacity:
        return stream
    if own_window <= stream.window:
        return LayerGeometry(0, own_window)
    return LayerGeometry(stream.sinks, stream.window, local=own_window)


@dataclass(frozen=True)
class Rotations:
    """cos/sin of every rotation of one call, for one layer type's RoPE table."""

    new: CosSin  # the module's own: its queries and new keys, at the plan's new positions
    sinks: CosSin  # the stored sinks into their reserved slots (a pure rotation)
    query: CosSin | None  # doubled: the queries' second half, from their new position to m_q (pure)
    rebase: CosSin | None  # the stored window keys' move back (pure; None: the base did not move)


@dataclass(eq=False)
class StepPlan:
    """Everything one model call needs that does not depend on the layer's keys (positions: from the new base)."""

    geometry: LayerGeometry  # of the layers it plans for
    after: SlotRecord
    doubled: bool  # queries see the sinks at different distances (see the module docstring)
    new_positions: torch.Tensor  # (B, q): the new keys and the queries
    sink_offset: torch.Tensor  # (B, 1): the stored sinks' move into their reserved slots
    query_offset: torch.Tensor | None  # (B, q): doubled only: the queries' second half's move
    rebase: torch.Tensor | None  # (B,): rotate the stored window keys back by this much first; None: no move
    new_sink_index: torch.Tensor | None  # (B, q): each new sink's index, else -1; None: no new sink
    write_slot: torch.Tensor | None  # (B,): in place (decoding): the slot each row's one token goes to
    keep_index: torch.Tensor | None  # appending: slots kept after the call (1D, or (B, C') per row)
    mask: torch.Tensor | None  # (B, 1, q, K) additive; None when one query sees every slot

    def rotations(self, table: RopeTable) -> Rotations:
        """cos/sin of this call's rotations for one layer type's table (every pure move in one call of it)."""
        moves = [self.sink_offset, *([self.query_offset] if self.doubled else [])]
        moves += [] if self.rebase is None else [-self.rebase[:, None]]
        cos, sin = table.relative(torch.cat(moves, dim=1))
        parts = list(zip(*(x.split([m.shape[1] for m in moves], 1) for x in (cos, sin))))
        query, rebase = parts[1] if self.doubled else None, parts[-1] if self.rebase is not None else None
        return Rotations(table(self.new_positions), parts[0], query, rebase)


def build_plan(
    before: SlotRecord,
    new_valid: torch.Tensor,
    geometry: LayerGeometry,
    dtype: torch.dtype,
    in_place: bool,
    all_valid: bool = False,
) -> StepPlan:
    """Plan one call of ``new_valid.shape[1]`` new tokens (``new_valid``: False for padding) for the layers of one
    geometry holding ``before``; a decoding step is the call of one token. ``dtype`` is the mask's; ``in_place``
    lets one token per row be written into a free slot (no autograd); ``all_valid`` says no new token is
    padding (it spares a few checks)."""
    sinks, window, capacity = geometry.sinks, geometry.window, geometry.capacity
    q_len = new_valid.shape[1]
    new_index = (before.real_tokens[:, None] + new_valid.long().cumsum(1) - 1).masked_fill(~new_valid, -1)
    real_tokens = before.real_tokens + new_valid.sum(1)
    # The base moves when the newest key would sit more than 2 * capacity past it (rotating the stored keys is
    # O(capacity), so once per capacity tokens or more), to capacity tokens before the call's first new token.
    moving = real_tokens - before.base > 2 * capacity
    base = torch.where(moving, (before.real_tokens - capacity).clamp_min(0), before.base)
    rebase = base - before.base if bool(moving.any()) else None
    # Decoding: each row's one token into a slot, a sink into its own, any other into the first free one (when
    # every row has one; else the call appends and compacts afterwards).
    free, token, write_slot = before.index[:, sinks:] < 0, new_index[:, 0], None
    decoding = in_place and q_len == 1 and (all_valid or bool(new_valid.all()))
    if decoding and bool((free.any(1) | (token < sinks)).all()):
        first_free = free.to(torch.int8).argmax(1) if free.shape[1] else torch.zeros_like(token)
        write_slot = torch.where(token < sinks, token, sinks + first_free)
    if write_slot is not None:  # the token goes into its slot: a sink's reserved one, or a free one
        key_index = before.index.scatter(1, write_slot[:, None], new_index)
        query_slot = write_slot[:, None]
    else:  # the new tokens after the stored ones; new sinks are read from their reserved slots
        ids = torch.arange(sinks, device=new_index.device)[None]
        reserved = torch.where(ids < real_tokens[:, None], ids, -1)
        appended = new_index.masked_fill(new_index < sinks, -1)
        key_index = torch.cat([reserved, before.index[:, sinks:], appended], dim=1)
        first = before.index.shape[1]
        query_slot = torch.arange(first, first + q_len, device=new_index.device).expand_as(new_index)
    doubled = q_len > 1 and sinks > 0 and int(new_index.max()) >= capacity
    # Queries past S + W - 1 see sink i at S + W - 1 - i: further than its true distance by this shift.
    shift = (new_index - (capacity - 1)).clamp_min(0)
    oldest = (real_tokens - (window - 1)).clamp_min(0)[:, None]  # older window tokens are evicted
    keep = (torch.arange(key_index.shape[1], device=key_index.device) < sinks) | (key_index >= oldest)
    keep_index, after_index = None, key_index.masked_fill(~keep, -1)
    if write_slot is None:
        keep_index, after_index = _keep_index(keep, key_index, capacity)
    new_positions, new_sink = (new_index - base[:, None]).clamp_min(0), (new_index >= 0) & (new_index < sinks)
    visible = _visibility(key_index, new_index, shift, geometry, doubled)
    if not all_valid:  # a padding query sees only itself: discarded, but it must not be NaN (NaN * 0 = NaN)
        padding = (new_index < 0)[:, :, None]
        visible = visible | torch.zeros_like(visible).scatter_(2, query_slot[:, :, None], padding)
    mask = None  # a decoding query that reads every slot needs none: the backend's fastest path
    if write_slot is None or not bool(visible.all()):
        mask = additive_mask(visible, dtype)[:, None]
    return StepPlan(
        geometry=geometry,
        after=SlotRecord(after_index, real_tokens, base, before.seen + q_len),
        doubled=doubled,
        new_positions=new_positions,
        sink_offset=(-base if doubled else shift.amax(1) - base)[:, None],
        query_offset=new_index.clamp(0, capacity - 1) - new_positions if doubled else None,
        rebase=rebase,
        new_sink_index=new_index.masked_fill(~new_sink, -1) if bool(new_sink.any()) else None,
        write_slot=write_slot,
        keep_index=keep_index,
        mask=mask,
    )


def _visibility(
    key_index: torch.Tensor,
    new_index: torch.Tensor,
    shift: torch.Tensor,
    geometry: LayerGeometry,
    doubled: bool,
) -> torch.Tensor:
    """``(B, q, K)`` bool: which slots each query reads (doubled: ``K + S``, the sinks' second copies last)."""
    sinks = geometry.sinks
    a_q, a_k = new_index[:, :, None], key_index[:, None, :]
    distance = a_q - a_k
    real = (a_k >= 0) & (a_q >= 0) & (distance >= 0)
    in_window = real & (distance < geometry.window)
    sink = real[..., :sinks]
    if geometry.local is not None:  # the layer's own window hides the sinks it sees further than it
        sink = sink & (distance[..., :sinks] - shift[:, :, None] < geometry.local)
    if doubled:  # reserved slots hold the sinks at their true distance; the copies, at their sink distance
        return torch.cat([in_window, sink & (distance[..., :sinks] >= geometry.window)], dim=-1)
    return in_window | F.pad(sink, (0, key_index.shape[1] - sinks))


def _keep_index(
    keep: torch.Tensor, key_index: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots to copy into the new cache tensors (kept ones first, in order), and their indices (-1: spare). The
    new tensors get room to grow (twice the kept count, at most ``capacity``): decoding then writes in place."""
    kept = int(keep.sum(1).max())
    size = min(capacity, max(kept + 1, 2 * kept))
    if keep.shape[0] == 1 or bool((keep == keep[:1]).all()):
        index = keep[0].nonzero().squeeze(1)
        token_index = key_index.index_select(1, index)
    else:  # rows keep different slots: each row's kept slots first, in order
        index = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :kept]
        token_index = key_index.gather(1, index).masked_fill(~keep.gather(1, index), -1)
    spare = size - index.shape[-1]
    index = F.pad(index, (0, spare))  # spare slots copy slot 0: finite, and marked free
    return index, F.pad(token_index, (0, spare), value=-1)
