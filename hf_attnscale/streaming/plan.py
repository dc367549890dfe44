"""One streaming call, planned once for every layer: ranks, positions, visibility, writes and eviction.

The token-by-token definition (mit-han-lab/streaming-llm with pos-shift): a query of stream rank ``a_q`` sees
the first ``S`` tokens of its row (the sinks) and its own last ``W`` tokens (itself included), numbered
``0..n-1`` in stream order. In RoPE's relative terms, a window key of rank ``a_k`` sits at its true distance
``a_q - a_k``, and sink ``i`` at ``min(a_q, S + W - 1) - i``.

How keys are stored: the module rotates its queries and new keys itself, at their rank minus a per-row
``base``, so the window is never re-rotated. A call with several new tokens (the general path, `build_plan`)
moves the base once ``capacity = S + W`` tokens or more have come since (a "rebase" rotates the stored keys
back by the move), so its positions stay below ``2 * capacity + q``. The sinks are kept as they came (rotated
at their own rank ``i``: the base is 0 then) and rotated into reserved slots ``0..S-1`` for each call, by the
one offset the call needs. A call is then:

* decoding (`decode_plan`): one token per row, with no host sync, so that ``torch.compile`` takes the step whole
  and a CUDA graph can replay it. Every layer is laid out at its capacity (fixed shapes) and its window slots
  are a ring: the token goes into its row's oldest slot, which it no longer sees. The base does not move (a
  `RopeTable` computes any position exactly, in float64, so positions may grow; the next general call rebases);
* single: every query of a row sees the sinks at one offset from their true distance (a chunk whose queries
  all still see the sinks at their true distance): one attention over the slots;
* with sink channels: queries of one chunk see the sinks at different distances. Each query gets ``S`` more
  channels, its logits against the sinks at its sink distance, ``R(m_q) q · R(i) k_i`` with
  ``m_q = min(a_q, S + W - 1)`` (``S`` dot products per query); window keys are ``[R(a_k) k, 0]``, the sinks
  sit at their true distance in the reserved slots and once more as one-hot copies ``[0, e_i]`` with their
  values; the mask picks each query's copy. One backend call over ``D + S`` channels.

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
    seen: torch.Tensor  # 0-d: tokens streamed, padding included (what generate() slices its inputs by)
    sinks_held: bool  # every row holds all its sinks: decoding steps then never store one (`decode_plan`)

    @classmethod
    def empty(cls, batch: int, sinks: int, device: torch.device) -> SlotRecord:
        """The record of a layer that holds nothing yet."""
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return cls(zeros[:, None].expand(-1, sinks) - 1, zeros, zeros, zeros.new_zeros(()), sinks == 0)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every field (all tensors), in order."""
        return self.index, self.real_tokens, self.base, self.seen

    def same_as(self, other: SlotRecord) -> bool:
        """Whether both records hold the same slots."""
        pairs = zip(self.tensors(), other.tensors())
        same = all(a.shape == b.shape and torch.equal(a, b) for a, b in pairs)
        return same and self.sinks_held == other.sinks_held

    def select_rows(self, select) -> SlotRecord:
        """The record of the rows ``select`` picks (beam search reorders, repeats and drops rows)."""
        rows = (select(self.index), select(self.real_tokens), select(self.base))
        return SlotRecord(*rows, self.seen, self.sinks_held)


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
    query: CosSin | None  # with sink channels: the queries' move from their new position to m_q (pure)
    rebase: CosSin | None  # the stored window keys' move back (pure; None: the base did not move)


@dataclass(eq=False)
class StepPlan:
    """Everything one model call needs that does not depend on the layer's keys (positions: from the new base)."""

    geometry: LayerGeometry  # of the layers it plans for
    after: SlotRecord
    sink_channels: bool  # queries see the sinks at different distances (see the module docstring)
    new_positions: torch.Tensor  # (B, q): the new keys and the queries
    sink_offset: torch.Tensor  # (B, 1): the stored sinks' move into their reserved slots
    query_offset: torch.Tensor | None  # (B, q): with sink channels only: the queries' move to m_q
    rebase: torch.Tensor | None  # (B,): rotate the stored window keys back by this much first; None: no move
    new_sink_index: torch.Tensor | None  # (B, q): each new sink's index, else -1; None: no new sink
    write_slot: torch.Tensor | None  # (B,): decoding (in place): the slot each row's one token goes to
    keep_index: torch.Tensor | None  # appending: slots kept after the call (1D, or (B, C') per row)
    mask: torch.Tensor  # (B, 1, q, K) additive

    def rotations(self, table: RopeTable) -> Rotations:
        """cos/sin of this call's rotations for one layer type's table (every pure move in one call of it)."""
        moves = [self.sink_offset, *([self.query_offset] if self.sink_channels else [])]
        moves += [] if self.rebase is None else [-self.rebase[:, None]]
        cos, sin = table.relative(torch.cat(moves, dim=1))
        parts = list(zip(*(x.split([m.shape[1] for m in moves], 1) for x in (cos, sin))))
        query, rebase = (
            parts[1] if self.sink_channels else None,
            parts[-1] if self.rebase is not None else None,
        )
        return Rotations(table(self.new_positions), parts[0], query, rebase)


def build_plan(
    before: SlotRecord,
    new_valid: torch.Tensor,
    geometry: LayerGeometry,
    dtype: torch.dtype,
    all_valid: bool,
    full_size: bool,
) -> StepPlan:
    """Plan one call of ``new_valid.shape[1]`` new tokens (``new_valid``: False for padding) for the layers of one
    geometry holding ``before``: the new tokens after the stored ones, compacted after the call (the general path,
    with host syncs). ``dtype`` is the mask's; ``all_valid`` says no new token is padding (it spares a few checks);
    ``full_size`` lays the kept slots out at the geometry's capacity, for the decoding steps that follow."""
    sinks, window, capacity = geometry.sinks, geometry.window, geometry.capacity
    q_len = new_valid.shape[1]
    new_index = (before.real_tokens[:, None] + new_valid.long().cumsum(1) - 1).masked_fill(~new_valid, -1)
    real_tokens = before.real_tokens + new_valid.sum(1)
    # The base moves when the newest key would sit more than 2 * capacity past it (rotating the stored keys is
    # O(capacity), so once per capacity tokens or more), to capacity tokens before the call's first new token.
    moving = real_tokens - before.base > 2 * capacity
    base = torch.where(moving, (before.real_tokens - capacity).clamp_min(0), before.base)
    rebase = base - before.base if bool(moving.any()) else None
    # The new tokens after the stored ones; new sinks are read from their reserved slots.
    ids = torch.arange(sinks, device=new_index.device)[None]
    reserved = torch.where(ids < real_tokens[:, None], ids, -1)
    appended = new_index.masked_fill(new_index < sinks, -1)
    key_index = torch.cat([reserved, before.index[:, sinks:], appended], dim=1)
    first = before.index.shape[1]
    query_slot = torch.arange(first, first + q_len, device=new_index.device).expand_as(new_index)
    sink_channels = q_len > 1 and sinks > 0 and int(new_index.max()) >= capacity
    # Queries past S + W - 1 see sink i at S + W - 1 - i: further than its true distance by this shift.
    shift = (new_index - (capacity - 1)).clamp_min(0)
    oldest = (real_tokens - (window - 1)).clamp_min(0)[:, None]  # older window tokens are evicted
    keep = (torch.arange(key_index.shape[1], device=key_index.device) < sinks) | (key_index >= oldest)
    keep_index, after_index = _keep_index(keep, key_index, capacity, full_size)
    new_positions, new_sink = (new_index - base[:, None]).clamp_min(0), (new_index >= 0) & (new_index < sinks)
    visible = _visibility(key_index, new_index, shift, geometry, sink_channels)
    if not all_valid:  # a padding query sees only itself: discarded, but it must not be NaN (NaN * 0 = NaN)
        padding = (new_index < 0)[:, :, None]
        visible = visible | torch.zeros_like(visible).scatter_(2, query_slot[:, :, None], padding)
    return StepPlan(
        geometry=geometry,
        after=SlotRecord(
            after_index,
            real_tokens,
            base,
            before.seen + q_len,
            sinks == 0 or bool((real_tokens >= sinks).all()),
        ),
        sink_channels=sink_channels,
        new_positions=new_positions,
        sink_offset=(-base if sink_channels else shift.amax(1) - base)[:, None],
        query_offset=new_index.clamp(0, capacity - 1) - new_positions if sink_channels else None,
        rebase=rebase,
        new_sink_index=new_index.masked_fill(~new_sink, -1) if bool(new_sink.any()) else None,
        write_slot=None,
        keep_index=keep_index,
        mask=additive_mask(visible, dtype)[:, None],
    )


def decode_plan(
    before: SlotRecord, new_valid: torch.Tensor, geometry: LayerGeometry, dtype: torch.dtype
) -> StepPlan:
    """Plan a decoding step (one new token per row; ``new_valid`` ``(B, 1)``) for layers whose slots are laid out
    at the geometry's capacity and whose rows hold all their sinks, with no host sync, so that ``torch.compile``
    takes it whole and a CUDA graph can replay it. The window slots are a ring: a token goes into its row's
    oldest slot (a free one first: free slots hold index -1), which the new token no longer sees. A padding
    row's token goes there too, marked free (its query reads nothing it needs: discarded, finite). The base does
    not move (an exact `RopeTable` keeps any position exact; the general path rebases)."""
    sinks, capacity = geometry.sinks, geometry.capacity
    new_index = before.real_tokens[:, None].masked_fill(~new_valid, -1)  # (B, 1): the new token's index
    write_slot = before.index[:, sinks:].argmin(1, keepdim=True) + sinks
    key_index = before.index.scatter(1, write_slot, new_index)
    shift = (new_index - (capacity - 1)).clamp_min(0)
    base = before.base[:, None]
    visible = _visibility(key_index, new_index, shift, geometry, sink_channels=False)
    real_tokens = before.real_tokens + new_valid[:, 0]
    return StepPlan(
        geometry=geometry,
        after=SlotRecord(key_index, real_tokens, before.base, before.seen + 1, before.sinks_held),
        sink_channels=False,
        new_positions=(new_index - base).clamp_min(0),
        sink_offset=shift - base,
        query_offset=None,
        rebase=None,
        new_sink_index=None,
        write_slot=write_slot[:, 0],
        keep_index=None,
        mask=additive_mask(visible, dtype)[:, None],
    )


def _visibility(
    key_index: torch.Tensor,
    new_index: torch.Tensor,
    shift: torch.Tensor,
    geometry: LayerGeometry,
    sink_channels: bool,
) -> torch.Tensor:
    """``(B, q, K)`` bool: which slots each query reads (with sink channels: ``K + S``, the sinks' copies last)."""
    sinks = geometry.sinks
    a_q, a_k = new_index[:, :, None], key_index[:, None, :]
    distance = a_q - a_k
    real = (a_k >= 0) & (a_q >= 0) & (distance >= 0)
    in_window = real & (distance < geometry.window)
    sink = real[..., :sinks]
    if geometry.local is not None:  # the layer's own window hides the sinks it sees further than it
        sink = sink & (distance[..., :sinks] - shift[:, :, None] < geometry.local)
    if sink_channels:
        # reserved slots hold the sinks at their true distance; the copies, at their sink distance
        return torch.cat([in_window, sink & (distance[..., :sinks] >= geometry.window)], dim=-1)
    return in_window | F.pad(sink, (0, key_index.shape[1] - sinks))


def _keep_index(
    keep: torch.Tensor, key_index: torch.Tensor, capacity: int, full_size: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots to copy into the new cache tensors (kept ones first, in order), and their indices (-1: spare). The
    new tensors hold ``capacity`` slots where ``full_size`` (decoding then writes in place), else room to grow
    (twice the kept count, at most ``capacity``)."""
    kept = int(keep.sum(1).max())
    size = capacity if full_size else min(capacity, max(kept + 1, 2 * kept))
    if keep.shape[0] == 1 or bool((keep == keep[:1]).all()):
        index = keep[0].nonzero().squeeze(1)
        token_index = key_index.index_select(1, index)
    else:  # rows keep different slots: each row's kept slots first, in order
        index = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :kept]
        token_index = key_index.gather(1, index).masked_fill(~keep.gather(1, index), -1)
    spare = size - index.shape[-1]
    index = F.pad(index, (0, spare))  # spare slots copy slot 0: finite, and marked free
    return index, F.pad(token_index, (0, spare), value=-1)
