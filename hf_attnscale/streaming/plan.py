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

**Layers with a sliding window of their own** (Gemma-2/3's local layers, Mistral's, Cohere-2's) see what the
model's own mask lets them see with the cache in place of the whole history: a query sits at position
``m_q = min(a_q, S + W - 1)`` of the cache, and a layer with window ``w`` reads the keys less than ``w``
positions before it. A window key keeps its true distance, so the layer reads the window keys nearer than
``min(W, w)``; sink ``i`` sits at ``m_q - i``, so it reads the sinks nearer than ``w`` there. Each layer's
`LayerGeometry` (`layer_geometry`) holds exactly that, and no more:

* ``w >= S + W``: the layer sees everything a global layer sees, ``(S, W)``;
* ``w <= W``: it sees no sink once the stream is past them, and its own last ``w`` tokens: a cache of
  ``(0, w)``, whose memory is its own window;
* in between: ``(S, W)``, with the sinks further than ``w`` hidden (``local = w``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .rope import CosSin, RopeTable


class AttentionMode(enum.Enum):
    """How the queries of one call attend (see the module docstring)."""

    SINGLE = "single"
    DOUBLED = "doubled"


class WriteMode(enum.Enum):
    """How one call stores its new keys."""

    IN_PLACE = "in place"  # decoding without autograd: each row's one token into a free slot, nothing copied
    APPEND = "append"  # the new keys after the stored ones, then the kept slots gathered into new tensors


@dataclass(frozen=True, eq=False)
class SlotRecord:
    """What a layer's slots hold; every layer holds the same record between calls.

    A token's *index* is its place among the real (non-padding) tokens of its row: 0, 1, 2, ...
    """

    index: torch.Tensor  # (B, C): index of the token in each slot, -1 free; slots 0..S-1 are the sinks'
    real_tokens: torch.Tensor  # (B,): real tokens streamed per row
    base: torch.Tensor  # (B,): stored window keys are rotated at (index - base)
    seen: int  # tokens streamed, padding included (what generate() slices its inputs by)

    @classmethod
    def empty(cls, batch: int, sinks: int, device: torch.device) -> SlotRecord:
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return cls(torch.full((batch, sinks), -1, dtype=torch.long, device=device), zeros, zeros, 0)

    def same_as(self, other: SlotRecord) -> bool:
        return self.seen == other.seen and all(
            a is b or (a.shape == b.shape and torch.equal(a, b))
            for a, b in (
                (self.index, other.index),
                (self.real_tokens, other.real_tokens),
                (self.base, other.base),
            )
        )

    def select_rows(self, select) -> SlotRecord:
        """The record of the rows ``select`` picks (beam search reorders, repeats and drops rows)."""
        return SlotRecord(select(self.index), select(self.real_tokens), select(self.base), self.seen)


@dataclass(frozen=True)
class Rotations:
    """cos/sin of every rotation one call applies, for one layer type's RoPE table."""

    new: CosSin  # the new keys, and the queries (their first half when DOUBLED)
    sinks: CosSin  # the sinks in their reserved slots
    mid: CosSin | None  # DOUBLED: the queries' second half
    sink_copies: CosSin | None  # DOUBLED: the sinks' second copies, at their own index
    rebase: CosSin | None  # the stored window keys' move back (None: the base did not move)


@dataclass(eq=False)
class StepPlan:
    """Everything one model call needs that does not depend on the layer's keys.

    Positions are relative to each row's new base, for the `RopeTable` of the layer (see `rotations`).
    """

    before: SlotRecord
    after: SlotRecord
    new_valid: torch.Tensor  # (B, q): which new tokens are real
    dtype: torch.dtype
    in_place: bool  # whether the call may write in place (no autograd)
    mode: AttentionMode
    write: WriteMode
    sinks: int
    new_positions: torch.Tensor  # (B, q): the new keys, and the queries (their first half when DOUBLED)
    sink_positions: torch.Tensor  # (B, S): the sinks in their reserved slots
    mid_positions: torch.Tensor | None  # (B, q): DOUBLED only: the queries' second half
    rebase: torch.Tensor | None  # (B,): rotate the stored window keys back by this much first; None: no move
    new_sink_index: (
        torch.Tensor | None
    )  # (B, q): index of each new token that is a sink, else -1; None: none is
    write_slot: torch.Tensor | None  # (B,): IN_PLACE only: the slot each row's one token goes to
    keep_index: torch.Tensor | None  # APPEND only: slots kept after the call (1D, or (B, C') per row)
    mask: torch.Tensor | None  # (B, 1, q, K) additive; None when one query sees every slot
    _rotations: dict[int, Rotations] = field(default_factory=dict)

    @property
    def has_new_sinks(self) -> bool:
        return self.new_sink_index is not None

    def matches(
        self, before: SlotRecord, new_valid: torch.Tensor, dtype: torch.dtype, in_place: bool
    ) -> bool:
        """Whether this plan was built for a layer holding ``before`` and this call's inputs."""
        same_valid = self.new_valid is new_valid or (
            self.new_valid.shape == new_valid.shape and torch.equal(self.new_valid, new_valid)
        )
        return (
            self.dtype == dtype and self.in_place == in_place and same_valid and self.before.same_as(before)
        )

    def rotations(self, table: RopeTable) -> Rotations:
        """cos/sin of each rotation of this call for one layer type's table (worked out once per call, in one
        call of the table)."""
        if id(table) not in self._rotations:
            doubled = self.mode is AttentionMode.DOUBLED
            positions = [self.new_positions, self.sink_positions]
            if doubled:
                positions += [
                    self.mid_positions,
                    torch.arange(self.sinks, device=self.new_positions.device)[None],
                ]
            batch = max(p.shape[0] for p in positions)
            widths = [p.shape[1] for p in positions]
            cos, sin = table(torch.cat([p.expand(batch, -1) for p in positions], dim=1))
            parts = list(zip(cos.split(widths, dim=1), sin.split(widths, dim=1)))
            self._rotations[id(table)] = Rotations(
                new=parts[0],
                sinks=parts[1],
                mid=parts[2] if doubled else None,
                sink_copies=parts[3] if doubled else None,
                # stored keys move back: a pure rotation, no second attention scaling
                rebase=None if self.rebase is None else table.relative(-self.rebase[:, None]),
            )
        return self._rotations[id(table)]


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


def layer_geometry(sinks: int, window: int, own_window: int | None) -> LayerGeometry:
    """The geometry of a layer whose own sliding window is ``own_window`` (None: a global layer), in a stream of
    ``sinks`` sinks and a ``window`` (see the module docstring)."""
    if own_window is None or own_window >= sinks + window:
        return LayerGeometry(sinks, window)
    if own_window <= window:
        return LayerGeometry(0, own_window)
    return LayerGeometry(sinks, window, local=own_window)


# The rules. Each is written once, and works on Python ints (one row decoding on the CPU) and on tensors.


def _rebase_due(real_tokens, base, capacity: int):
    """Whether a row's base moves in this call.

    Moving the base rotates every stored window key, O(capacity). So it moves rarely: once the newest key would
    sit more than ``2 * capacity`` past it, and then to ``capacity`` tokens before the call's first new token.
    That is once per ``capacity`` tokens or more (O(1) per token), and positions stay below
    ``2 * capacity + q``: small integers, exact in float32, and a RoPE table no longer than that.
    """
    return real_tokens - base > 2 * capacity


def _moved_base(real_before, capacity: int):
    """Where a moving base goes: ``capacity`` tokens before the call's first new token (not below 0)."""
    return _clamp_min0(real_before - capacity)


def _oldest_in_window(real_tokens, window: int):
    """The index of the oldest window token the next query sees; older window tokens are evicted."""
    return real_tokens - (window - 1)


def _sink_shift(index, capacity: int):
    """How much further than their true distance the query of ``index`` sees the sinks: queries past
    ``S + W - 1`` see sink ``i`` at distance ``S + W - 1 - i`` (its distance in a cache that holds only them)."""
    return _clamp_min0(index - (capacity - 1))


def _write_slot_of(index, first_free_window_slot, sinks: int):
    """The slot a decoded token goes to: a sink to its reserved slot (its index), any other to a free one."""
    is_sink = index < sinks
    if isinstance(is_sink, torch.Tensor):
        return torch.where(is_sink, index, first_free_window_slot)
    return index if is_sink else first_free_window_slot


def _sink_distance(index, sink, capacity: int):
    """Where the query of ``index`` sees sink ``sink``: at ``min(index, S + W - 1) - sink`` (its place in a cache
    that holds the sinks and the query's window)."""
    return index - _sink_shift(index, capacity) - sink


def _clamp_min0(x):
    return x.clamp_min(0) if isinstance(x, torch.Tensor) else max(0, x)


# The builders.


def build_plan(
    before: SlotRecord,
    new_valid: torch.Tensor,
    geometry: LayerGeometry,
    dtype: torch.dtype,
    in_place: bool,
    all_valid: bool = False,
) -> StepPlan:
    """Plan one call of ``new_valid.shape[1]`` new tokens for the layers of one geometry (see the module
    docstring).

    ``all_valid`` says that no new token is padding (``new_valid`` is all True): decoding then takes a
    shorter path to the same plan (where the layer hides no sink: the short paths read every stored key).
    """
    sinks, window, capacity = geometry.sinks, geometry.window, geometry.capacity
    if all_valid and in_place and new_valid.shape[1] == 1 and geometry.local is None:
        plan = _decode_plan(before, new_valid, sinks, window, dtype)
        if plan is not None:
            return plan
    new_index = (before.real_tokens[:, None] + new_valid.long().cumsum(1) - 1).masked_fill(~new_valid, -1)
    real_tokens = before.real_tokens + new_valid.sum(1)
    base, rebase = _new_base(before, real_tokens, capacity)
    write_slot = _write_slot(before.index, new_index, sinks) if in_place else None
    key_index, query_slot = _key_indices(before.index, new_index, real_tokens, write_slot, sinks)
    # Several queries reaching index S + W - 1 see the sinks at different shifts: one rotation cannot serve them.
    doubled = new_index.shape[1] > 1 and sinks > 0 and int(new_index.max()) >= capacity
    mode = AttentionMode.DOUBLED if doubled else AttentionMode.SINGLE
    visible = _visibility(key_index, new_index, query_slot, geometry, mode)
    sink_positions = torch.arange(sinks, device=new_valid.device)[None] - base[:, None]
    if mode is AttentionMode.SINGLE:
        sink_positions = sink_positions + _sink_shift(new_index, capacity).amax(1, keepdim=True)
    is_new_sink = (new_index >= 0) & (new_index < sinks)
    keep = _kept(key_index, real_tokens, sinks, window)
    if write_slot is not None:
        keep_index, next_index = None, key_index.masked_fill(~keep, -1)
    else:
        keep_index, next_index = _keep_index(keep, key_index, capacity)
    return StepPlan(
        before=before,
        after=SlotRecord(next_index, real_tokens, base, before.seen + new_valid.shape[1]),
        new_valid=new_valid,
        dtype=dtype,
        in_place=in_place,
        mode=mode,
        write=WriteMode.APPEND if write_slot is None else WriteMode.IN_PLACE,
        sinks=sinks,
        new_positions=(new_index - base[:, None]).clamp_min(0),
        sink_positions=sink_positions,
        mid_positions=new_index.clamp(0, capacity - 1) if mode is AttentionMode.DOUBLED else None,
        rebase=rebase,
        new_sink_index=new_index.masked_fill(~is_new_sink, -1) if bool(is_new_sink.any()) else None,
        write_slot=write_slot,
        keep_index=keep_index,
        mask=_additive(visible, dtype, decoding=write_slot is not None),
    )


def _decode_plan(
    before: SlotRecord, new_valid: torch.Tensor, sinks: int, window: int, dtype: torch.dtype
) -> StepPlan | None:
    """`build_plan` for one real token per row written in place, in a third of the tensor operations (a
    decoding step of a small model costs little more than them). None when a row has no free slot."""
    if before.index.shape[0] == 1 and before.index.device.type == "cpu":
        return _decode_plan_one_row(before, new_valid, sinks, window, dtype)
    capacity = sinks + window
    token = before.real_tokens  # each row's new token: its index
    real_tokens = token + 1
    base, rebase = _new_base(before, real_tokens, capacity)
    write_slot = _write_slot(before.index, token[:, None], sinks)
    if write_slot is None:
        return None
    # Every slot the token reads: the cache's, with the token in its own (its reserved one if it is a sink).
    key_index = before.index.scatter(1, write_slot[:, None], token[:, None])
    # Every stored key is in the token's window (the last call evicted the others), so it reads every real one.
    visible = key_index >= 0
    keep = _kept(key_index, real_tokens, sinks, window)
    is_sink = token < sinks
    return _decoding_step(
        before=before,
        after=SlotRecord(key_index.masked_fill(~keep, -1), real_tokens, base, before.seen + 1),
        new_valid=new_valid,
        dtype=dtype,
        sinks=sinks,
        new_positions=(token - base)[:, None],
        sink_positions=torch.arange(sinks, device=token.device)[None]
        + (_sink_shift(token, capacity) - base)[:, None],
        rebase=rebase,
        new_sink_index=token.masked_fill(~is_sink, -1)[:, None] if bool(is_sink.any()) else None,
        write_slot=write_slot,
        mask=_additive(visible[:, None], dtype, decoding=True),
    )


def _decode_plan_one_row(
    before: SlotRecord, new_valid: torch.Tensor, sinks: int, window: int, dtype: torch.dtype
) -> StepPlan | None:
    """`_decode_plan` for one stream on the CPU, worked out in Python numbers: a handful of small tensors
    instead of some thirty tensor operations.

    It relies on what every plan leaves behind: window slots hold indices of at least
    ``_oldest_in_window(real_tokens, W)`` (or -1), so this step evicts at most the one just below it.
    """
    capacity = sinks + window
    token, base = before.real_tokens.item(), before.base.item()
    indices = before.index.tolist()[0]
    if _rebase_due(token + 1, base, capacity):
        new_base = _moved_base(token, capacity)
        rebase = _long(new_base - base, 1)
    else:
        new_base, rebase = base, None
    slot = _write_slot_of(token, _window_slot(indices, -1, sinks), sinks)
    if slot is None:
        return None
    indices[slot] = token
    index = before.index.clone()
    index[0, slot] = token
    visible = index >= 0 if -1 in indices else None  # None: every slot is read
    stale = _oldest_in_window(token + 1, window) - 1  # window slots never hold a sink's index
    evicted = _window_slot(indices, stale, sinks) if stale >= sinks else None
    if evicted is not None:
        index[0, evicted] = -1
    offset = _sink_shift(token, capacity) - new_base
    return _decoding_step(
        before=before,
        after=SlotRecord(
            index, _long(token + 1, 1), before.base if rebase is None else _long(new_base, 1), before.seen + 1
        ),
        new_valid=new_valid,
        dtype=dtype,
        sinks=sinks,
        new_positions=_long(token - new_base, 1, 1),
        sink_positions=torch.arange(offset, offset + sinks)[None],
        rebase=rebase,
        new_sink_index=_long(token, 1, 1) if token < sinks else None,
        write_slot=_long(slot, 1),
        mask=None if visible is None else _additive(visible[:, None], dtype, decoding=True),
    )


def _decoding_step(**fields) -> StepPlan:
    """The plan of a decoding step: one query per row, SINGLE, its token written in place."""
    return StepPlan(
        in_place=True,
        mode=AttentionMode.SINGLE,
        write=WriteMode.IN_PLACE,
        mid_positions=None,
        keep_index=None,
        **fields,
    )


def _window_slot(indices: list[int], index: int, sinks: int) -> int | None:
    """The first window slot (past the ``sinks`` reserved ones) holding ``index``, or None."""
    try:
        return indices.index(index, sinks)
    except ValueError:
        return None


def _long(value: int, *shape: int) -> torch.Tensor:
    return torch.full(shape, value, dtype=torch.long)


def _new_base(
    before: SlotRecord, real_tokens: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's base after this call, and how far it moved (None: no row moved)."""
    moving = _rebase_due(real_tokens, before.base, capacity)
    if not bool(moving.any()):
        return before.base, None
    base = torch.where(moving, _moved_base(before.real_tokens, capacity), before.base)
    return base, base - before.base


def _write_slot(index: torch.Tensor, new_index: torch.Tensor, sinks: int) -> torch.Tensor | None:
    """When decoding (one real token per row, room in every row): the slot each row writes its token into."""
    if new_index.shape[1] != 1 or not bool((new_index >= 0).all()):
        return None
    token = new_index[:, 0]
    free = index[:, sinks:] < 0
    if not bool((free.any(1) | (token < sinks)).all()):
        return None  # a row with no free slot: append, and compact afterwards
    first_free = free.to(torch.int8).argmax(1) if free.shape[1] else torch.zeros_like(token)
    return _write_slot_of(token, sinks + first_free, sinks)


def _key_indices(
    index: torch.Tensor,
    new_index: torch.Tensor,
    real_tokens: torch.Tensor,
    write_slot: torch.Tensor | None,
    sinks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The index of every slot the call reads, and the slot of each new token (padding sees only its own)."""
    ids = torch.arange(sinks, device=index.device)[None]
    reserved = torch.where(ids < real_tokens[:, None], ids, -1)  # sink i exists once i real tokens came
    window_indices = index[:, sinks:]
    if write_slot is not None:
        token = new_index[:, :1]
        slots = torch.arange(window_indices.shape[1], device=index.device)[None]
        written = (slots == (write_slot[:, None] - sinks)) & (token >= sinks)
        return torch.cat([reserved, torch.where(written, token, window_indices)], dim=1), write_slot[:, None]
    appended = new_index.masked_fill(new_index < sinks, -1)  # new sinks are read from their reserved slots
    first = index.shape[1]
    query_slot = torch.arange(first, first + new_index.shape[1], device=index.device).expand_as(new_index)
    return torch.cat([reserved, window_indices, appended], dim=1), query_slot


def _visibility(
    key_index: torch.Tensor,
    new_index: torch.Tensor,
    query_slot: torch.Tensor,
    geometry: LayerGeometry,
    mode: AttentionMode,
) -> torch.Tensor:
    """``(B, q, K)`` bool: which slots each query reads (DOUBLED: ``K + S``, the sinks' second copies last)."""
    sinks = geometry.sinks
    a_q, a_k = new_index[:, :, None], key_index[:, None, :]
    real = (a_k >= 0) & (a_q >= 0)
    distance = a_q - a_k
    in_window = real & (distance >= 0) & (distance < geometry.window)
    sink = real[..., :sinks] & (distance[..., :sinks] >= 0)
    if geometry.local is not None:  # the layer's own window hides the sinks it sees further than it
        sink = sink & (_sink_distance(a_q, a_k[..., :sinks], geometry.capacity) < geometry.local)
    if mode is AttentionMode.SINGLE:
        visible = in_window | F.pad(sink, (0, key_index.shape[1] - sinks))
    else:  # reserved slots hold the sinks at their true distance; the copies, at their sink distance
        copies = sink & (distance[..., :sinks] >= geometry.window)
        visible = torch.cat([in_window, copies], dim=-1)
    # A padding query sees only itself: its output is discarded, but it must not be NaN (NaN * 0 = NaN later).
    own = torch.zeros_like(visible).scatter_(2, query_slot[:, :, None], (new_index < 0)[:, :, None])
    return visible | own


def _additive(visible: torch.Tensor, dtype: torch.dtype, decoding: bool) -> torch.Tensor | None:
    if decoding and bool(visible.all()):
        return None  # one query that reads every slot: no mask, the backend's fastest path
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min).unsqueeze(1)


def _kept(key_index: torch.Tensor, real_tokens: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """``(B, K)`` bool: the slots later calls still read: the sinks' and the window's."""
    is_sink_slot = torch.arange(key_index.shape[1], device=key_index.device) < sinks
    in_window = key_index >= _oldest_in_window(real_tokens, window)[:, None]
    return is_sink_slot | ((key_index >= 0) & in_window)


def _keep_index(
    keep: torch.Tensor, key_index: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots to copy into the new cache tensors (kept ones first, in order), and their indices (-1: spare).

    The new tensors get room to grow (double the kept count, at most ``capacity``), so that the following
    decoding steps write in place instead of copying the cache every step.
    """
    batch = keep.shape[0]
    kept = int(keep.sum(1).max())
    size = min(capacity, max(kept + 1, 2 * kept))
    if batch == 1 or bool((keep == keep[:1]).all()):
        index = keep[0].nonzero().squeeze(1)
        token_index = key_index.index_select(1, index)
    else:  # rows keep different slots: each row's kept slots first, in order
        index = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :kept]
        token_index = key_index.gather(1, index).masked_fill(~keep.gather(1, index), -1)
    spare = size - index.shape[-1]
    index = F.pad(index, (0, spare))  # spare slots copy slot 0: finite, and marked free
    return index, F.pad(token_index, (0, spare), value=-1)
