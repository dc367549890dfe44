"""The engine: one attention call of a method declared in parts (`hf_attnscale.core.options.declare`).

The patched module's forward rotates its queries and keys at the method's store in place of the model's
positions (`hf_attnscale.core.install.routing`; ReRoPE's store is RAW: the identity), so the model's cache keeps
each key there. Each part turns them from there to its own positions (by cos/sin of the places alone, which
the forward's first layer makes and its later layers read: `shared_by_layers`) and scores the pairs it covers;
one softmax runs over every part (with the exit, where there is one):

* several queries (a prefill, or a chunk onto the cache): on CUDA under sdpa, with nothing flex lacks, each part
  is one compiled flex call over the whole sequence (`hf_attnscale.core.parts.flex_parts`); else the queries go in
  chunks, each chunk's parts one call of `hf_attnscale.core.parts.key_parts` (the CPU's fused kernel per part, or
  the parts joined on side-by-side channels, one backend call). A chunk of queries only reads the keys its parts
  can reach, so no T × T tensor is held. Where the model passes no mask and the fused kernel serves, a part's
  keys go in blocks: query i meets ``L(i) .. R(i)`` (`Part.reach`), both non-decreasing, so every query of the
  chunk meets ``[L(last), R(first)]``, unmasked (a mask makes the kernel compute every block, and read the
  mask), and only the keys at either side, at most a chunk wide, are masked; DCA's chunks stay within its cells.
  Else one masked block a part.
* one query (a decoding step): the keys in their order, each turned relative to the query. Where every part
  depends on the distance alone and the keys are stored raw (ReRoPE), the query is turned to the largest lower
  bound of a part (the window) and each key by its distance from there, from tables kept across layers and steps
  (`RotaryFrequencies.at_distances`), the keys a part holds fixed not at all; else the query is turned to where
  the unbounded part places it, and only the keys of the other parts turn (those of the unbounded part sit where
  the store keeps them: leaky ReRoPE's at j/k, Self-Extend's at ⌊j/G⌋), by cos/sin that depend on the step's
  positions alone: made by the first layer of the forward and read by the others (`shared_by_layers`), as are
  the cos/sin at the store of the call's new tokens (`at_store`). The keys kept as stored and those turned are
  segments of the cache: on the CPU each is scored where it lies, by the definition (`scores_in_place`);
  elsewhere they are joined, one backend call at the model's width. A method whose every part keeps its keys as stored (DCA) turns
  no key: under sdpa, with nothing the definition lacks, the query is turned to each part's place, and every key
  scored by its own part's turn, under one softmax by the definition (`key_parts.rows_by_key`: the keys read once,
  none copied).

Positions: a method whose scores depend on the distance alone counts it in the cache, so a row's distances are
those of its tokens whenever its positions run on by one (`check_positions`). Others place queries and keys at
the model's positions: a row's offset from the cache (its left padding) is read off ``position_ids``, which must
then hold one offset for every real token of the row.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hf_attnscale.core.call.backends import check_backend
from hf_attnscale.core.call.hooks import Execution
from hf_attnscale.core.call.masks import visible_entries
from hf_attnscale.core.call.rope import CosSin, RotaryFrequencies, RotateFn
from hf_attnscale.core.options.declare import MOVING, RAW, At, Method, Part
from hf_attnscale.core.parts import flex_parts, key_parts
from hf_attnscale.core.parts.flex_parts import Band
from hf_attnscale.core.parts.key_parts import KeyPart

BACKENDS = ("eager", "sdpa")
"""The backends the engine runs on: it shows each key its part by a dense mask."""
MASK_CHUNK = 2**24
"""Mask entries per chunk call (queries × keys): 64 MiB of a float32 mask, 1,024 queries at 16k keys."""
SPLIT_ROWS = 512
"""Queries per chunk where a part's keys go in blocks (`_blocks`; their masks are at most rows × rows, so
MASK_CHUNK bounds nothing there). The masked blocks, computed whole, cost a query about 1.5 × rows keys where a
causal kernel computes some 256 beyond its own (at 512 rows, 6% of the 8k keys of a 16k forward's average
query); fewer rows cost more kernel calls, each copying its keys to every query head, on smaller tiles. On a 4k
forward (one thread) 256 rows were 3% faster than 512; at 16k the masked blocks weigh a quarter of that, the
copies as much."""


def check_parts_backend(backend: str | None, method: Method) -> None:
    """Refuse, in one line, a backend the engine cannot run on (checked when patching and at every call, as
    ``set_attn_implementation`` may switch it in between)."""
    check_backend(
        backend, BACKENDS, f"{method.option}: {method.name} (it shows each key its part by a dense mask)"
    )


@dataclass(frozen=True)
class PartsCall:
    """One attention call of ``method``, carried by its hooks (`hf_attnscale.core.call.hooks`).

    Attributes:
        method: the declaration.
        rope: the family's rotation ``(x, cos, sin)`` over its rotary dims.
        frequencies: the rotary module's, as of this call.
        own: the model's own cos/sin for the call's new tokens.
        positions: the model's ``position_ids`` of the call's new tokens, where its layer passes them.
        layer: the attention module's ``layer_idx`` (None: its layer makes what the others could share).
    """

    method: Method
    rope: RotateFn
    frequencies: RotaryFrequencies
    own: CosSin
    positions: torch.Tensor | None = None
    layer: int | None = None

    def __call__(
        self,
        run: Execution,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        *,
        sliding_window: int | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The method over raw ``query`` ``(B, H, Tq, D)`` and ``key`` / ``value`` ``(B, Hkv, Tk, D)``, causal, the
        queries being the last ``Tq`` keys; ``mask`` None (causal, ``sliding_window`` keys at most) or 4D, bool or
        additive; ``position_ids`` the attention call's, where the layer's were not given. ``(B, Tq, H, Dv)``."""
        if (
            self.method.factor != 1.0
        ):  # on cos/sin of queries and keys: the scores' rotary dims times its square
            query = rotary_times(query, self.method.factor**2, self.own[0].shape[-1])
        position_ids = self.positions if self.positions is not None else position_ids
        if position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[-1] != query.shape[2]):
            position_ids = None  # multimodal RoPE's (3, B, T) sections: not a model the engine serves
        if query.shape[2] == 1:
            return self._decode(run, query, key, value, mask, sliding_window, position_ids)
        past = key.shape[2] - query.shape[2]
        check_positions(self.method, position_ids, mask, past)
        return self._prefill(run, query, key, value, mask, sliding_window, position_ids)

    def _prefill(self, run, query, key, value, mask, sliding_window, position_ids) -> torch.Tensor:
        method, device = self.method, query.device
        q_len, k_len = query.shape[2], key.shape[2]
        past = k_len - q_len
        shift = None if method.by_distance else _shift(position_ids, past)
        flex = run.fusable and flex_parts.serves(
            query, key, value, run.exit_logits, mask is not None, run.scaling, method, shift is not None
        )
        # the first key of each part that any query reaches (the flex bands take them all)
        lowest = [
            0 if flex or part.hi is None else max(0, past - part.hi * part.unit + 1) for part in method.parts
        ]
        turned = _Turned(self, query, key, past, shift, position_ids)
        queries = [turned.queries(part.query) for part in method.parts]
        keys = [
            turned.keys(
                part.key, min(low for low, other in zip(lowest, method.parts) if other.key == part.key)
            )
            for part in method.parts
        ]
        if flex:
            reach = min(sliding_window or k_len, k_len)  # every distance seen is below it
            bands = [
                Band(q, k, value, part)
                for part, q, (k, _) in zip(method.parts, queries, keys)
                if part.unit > 1 or part.lo < reach
            ]
            visible = None
            if mask is not None:
                visible = visible_entries(mask[..., :k_len]).expand(*mask.shape[:2], q_len, k_len)
            out = flex_parts.attention(bands, visible, run.exit_logits, run.scaling, reach, shift)
            if out is not None:
                return out  # else flex cannot take it: the chunks below
        # Where the fused kernel serves and the model passes no mask, each part's keys go in blocks: those every
        # query of the chunk meets, unmasked, and a masked block at either side (`_blocks`); else one block a
        # part, masked, at most a span's queries (where the parts meet) and MASK_CHUNK mask entries a chunk.
        offset = _offset(shift, method) if mask is None and key_parts.may_fuse(run, query, value) else None
        span, reach = method.span, sliding_window or k_len
        if offset is None:
            rows, cell = max(1, min(span, MASK_CHUNK // (k_len + span))), 1
        else:  # no chunk crosses a cell of DCA's (its parts' unit): there only the diagonal block is masked
            rows, cell = min(span, SPLIT_ROWS), max(part.unit for part in method.parts)
        outs, start = [], 0
        while start < q_len:
            stop = min(q_len, start + rows)
            if cell > 1:  # to the end of the cell of the chunk's first query
                stop = min(stop, start + cell - (past + start - offset) % cell)
            first, last = past + start, past + stop - 1  # the chunk's queries' places in the cache
            at = torch.arange(first, last + 1, device=device)[:, None]
            if offset is None:
                visible = _visible(mask, start, stop, k_len, at, sliding_window, device)
                q_pos = at if shift is None else at - shift[:, None, None, None]
            parts = []
            for part, q, (k, base) in zip(method.parts, queries, keys):
                if offset is None:
                    begin, end = _reached(part, first, last)
                    blocks = [(max(begin, first - reach + 1, base), end, True)]
                else:
                    blocks = _blocks(part, first, last, offset, base, reach)
                for begin, end, masked in blocks:
                    if end <= begin:
                        continue
                    shown = None
                    if masked:
                        k_at = torch.arange(begin, end, device=device)
                        if offset is None:
                            k_pos = k_at if shift is None else k_at - shift[:, None, None, None]
                            shown = visible[..., begin:end] & part.covers(q_pos, k_pos)
                        else:  # the model's mask is None: causal (in covers), within its sliding window
                            shown = part.covers(at - offset, k_at - offset)[None, None]
                            if sliding_window:
                                shown = shown & (at - k_at < sliding_window)
                    parts.append(
                        KeyPart(
                            q[:, :, start:stop],
                            k[:, :, begin - base : end - base],
                            value[:, :, begin:end],
                            shown,
                        )
                    )
            outs.append(key_parts.attention(run, parts))
            start = stop
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0].contiguous()

    def _decode(self, run, query, key, value, mask, sliding_window, position_ids) -> torch.Tensor:
        """One query at the cache's last place i, on the keys in their order, each turned relative to the query (in
        segments: those a part turns, those it keeps as stored). On the CPU, under sdpa with nothing the
        definition lacks, each segment is scored where it lies (`key_parts.plain_parts`); else the segments are
        joined, one call at the model's width."""
        k_len, device = key.shape[2], query.device
        i = k_len - 1
        shown = None  # no mask where the model passed none: the backend takes grouped heads as they are
        if mask is not None or sliding_window:
            at_i = torch.arange(i, k_len, device=device)[:, None]
            shown = _visible(mask, 0, 1, k_len, at_i, sliding_window, device)
        if self.method.keeps_keys and run.fusable:
            return self._decode_in_parts(run, query, key, value, shown, position_ids)
        if self.method.store == RAW and self.method.by_distance:
            query, segments = self._turn_by_distance(query, key)
        else:  # a method of distances counts them in the cache: no row's offset
            query, segments = self._turn_from_store(
                query, key, None if self.method.by_distance else position_ids
            )
        if len(segments) > 1 and scores_in_place(run, query):
            parts, begin = [], 0
            for segment in segments:
                end = begin + segment.shape[2]
                seen = None if shown is None else shown[..., begin:end]
                parts.append(KeyPart(query, segment, value[:, :, begin:end], seen))
                begin = end
            return key_parts.plain_parts(parts, run.exit_logits, run.scaling)
        keys = torch.cat(segments, dim=2) if len(segments) > 1 else segments[0]
        return key_parts.attention(run, [KeyPart(query, keys, value, shown)])

    def _decode_in_parts(self, run, query, key, value, shown, position_ids) -> torch.Tensor:
        """A step of a method whose parts all keep their keys as stored (DCA), where the backend adds nothing to
        the definition: the query turned to each part's place, every key scored by the turn of its own part, one
        softmax (`key_parts.rows_by_key`): every key read once, none turned or copied. The turns and which part
        holds each key depend on the step's positions alone (`shared_by_layers`)."""
        frequencies, k_len = self.frequencies, key.shape[2]
        turns, part_of = shared_by_layers(
            self.layer,
            ("by key", self.method, k_len, query.dtype, query.device, frequencies.scaling),
            (position_ids, frequencies.inv_freq),
            lambda: _parts_by_key(self.method, frequencies, k_len, position_ids, query.dtype, query.device),
        )
        rows = self.rope(query.expand(-1, -1, turns[0].shape[-2], -1), *turns)  # (B, H, P, D)
        return key_parts.rows_by_key(rows, part_of, key, value, shown, run.exit_logits, run.scaling)

    def _turn_by_distance(self, query, key) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A method of distances alone: the query turned to r (the largest lower bound of a part, so that a part
        of fixed positions meeting there keeps its keys as stored), each key by ``k(j) − q(i) + r`` (the same
        scores: ``(R(r) q) · (R(k(j) − q(i) + r) k) = (R(q(i)) q) · (R(k(j)) k)``), from kept tables. YaRN's
        attention scaling s rides on cos/sin, so every score carries s²: where a part's keys stay as stored,
        the query takes their s, and the turned keys give theirs back. The keys come in segments, in the cache's
        order."""
        parts, frequencies, dtype, device = self.method.parts, self.frequencies, query.dtype, query.device
        k_len = key.shape[2]
        i = k_len - 1
        r = max(part.lo for part in parts)
        query = self.rope(query, *_rows(frequencies.at_distances(r + 1, dtype, device), r, r + 1))
        segments, as_stored, turned = [], False, []
        for part in sorted(parts, key=lambda part: -part.lo):  # the farthest keys first: the cache's order
            begin = 0 if part.hi is None else max(0, i - part.hi + 1)
            end = min(k_len, max(begin, i - part.lo + 1))
            if end <= begin:
                continue
            if part.query.fixed is not None:
                turn = part.key.fixed - part.query.fixed + r  # the same for every key
                if turn == 0:
                    segments.append(key[:, :, begin:end])
                    as_stored = True
                    continue
                first, last, slower = turn, turn, 1.0  # one cos/sin for every key
            else:
                slower = part.key.slower
                offset = part.key.shift - part.query.shift + r * slower  # in the slower RoPE's positions
                first, last = begin - i + offset, end - 1 - i + offset
            cos_sin = _distance_rows(frequencies, first, last, slower, dtype, device)
            segment = self.rope(key[:, :, begin:end], *cos_sin)
            segments.append(segment)
            turned.append(len(segments) - 1)
        if as_stored and (scaling := frequencies.scaling) != 1.0:
            query = query * scaling
            for index in turned:
                segments[index] = segments[index] / scaling
        return query, segments

    def _turn_from_store(self, query, key, position_ids) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Any method: the query turned from where it comes (the method's store) to where the unbounded part
        (the anchor) places it, each key by ``k(j) − store(j) − (q(i) − anchor(i))`` for its part (the same
        scores: every pair's angle is ``k(j) − q(i)``), which is 0 for the anchor's keys where they sit where
        they are stored: then only the keys of the other parts turn, all within their reach of the query. Turns
        of what is stored rotated are pure rotations; raw keys (a store of RAW) all turn, with the attention
        scaling. The keys come in segments, in the cache's order: those kept as stored, those turned. The cos/sin
        depend on the step's positions alone: every layer of the forward reads the first one's
        (`shared_by_layers`)."""
        frequencies, k_len = self.frequencies, key.shape[2]
        start, turn_query, turn_keys = shared_by_layers(
            self.layer,
            ("from store", self.method, k_len, query.dtype, query.device, frequencies.scaling),
            (position_ids, frequencies.inv_freq),
            lambda: _turns_from_store(
                self.method, frequencies, k_len, position_ids, query.dtype, query.device
            ),
        )
        if turn_query is not None:
            query = self.rope(query, *turn_query)
        if turn_keys is None:
            return query, [key]
        near = self.rope(key[:, :, start:], *turn_keys)
        return query, [near] if start == 0 else [key[:, :, :start], near]


def rotary_times(x: torch.Tensor, factor: float, width: int) -> torch.Tensor:
    """``x`` with its first ``width`` dims (the rotary ones) times ``factor``, the rest as they are."""
    if width >= x.shape[-1]:
        return x * factor
    return torch.cat([x[..., :width] * factor, x[..., width:]], dim=-1)


def scores_in_place(run: Execution, query: torch.Tensor) -> bool:
    """Whether a decoding step scores its keys' segments where they lie, by the definition (``run`` has nothing
    it lacks): on the CPU, whose step is bound by memory, so that the cache is not copied to join them. A GPU's
    eager step is bound by launches, which the definition has more of: there they are joined."""
    return run.fusable and query.device.type == "cpu"


def _turns_from_store(
    method: Method, frequencies: RotaryFrequencies, k_len: int, position_ids, dtype, device
) -> tuple[int, CosSin | None, CosSin | None]:
    """`PartsCall._turn_from_store`'s turns at a step of ``k_len`` keys: the first key that turns, the query's
    cos/sin (None: it stays) and the keys' from there on (None: none turns)."""
    store = method.store
    raw = store == RAW
    anchor = next((part for part in method.parts if part.hi is None), method.parts[0])
    start = 0
    if not raw and anchor.hi is None and anchor.key == store:
        reaches = [part.hi * part.unit for part in method.parts if part is not anchor]
        reach = max(reaches) if reaches else 0  # (no `default=`: torch.compile takes max without it)
        start = max(0, k_len - reach)
    i, j = _step_positions(position_ids, k_len, start, device)
    turn_query = None
    if raw or anchor.query != store:
        turn = anchor.query.angle(i) - store.angle(i)
        turn_query = frequencies.cos_sin(turn, dtype, scaled=raw)
    cos = sin = None
    for part in method.parts:
        if part is anchor and not raw and part.key == store:
            continue  # as stored
        towards = part.query.angle(i) - anchor.query.angle(i)  # (B|1, 1)
        # the same for every key of the part where its keys sit as stored
        angle = -towards if part.key == store and not raw else part.key.angle(j) - store.angle(j) - towards
        turned = frequencies.cos_sin(angle, dtype, scaled=raw)
        covered = part.covers(i, j)[..., None]
        cos = torch.where(covered, turned[0], 1.0 if cos is None else cos)
        sin = torch.where(covered, turned[1], 0.0 if sin is None else sin)
    return start, turn_query, None if cos is None else (cos, sin)


def _step_positions(position_ids, k_len: int, start: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoding step's query position ``(B|1, 1)`` and the positions of the cache's keys from ``start`` on
    ``(B|1, n)``: the cache's places less each row's offset (`_shift`), or the places where no positions came."""
    shift = _shift(position_ids, k_len - 1)
    i = torch.full((1, 1), k_len - 1, device=device) if shift is None else (k_len - 1 - shift)[:, None]
    j = torch.arange(start, k_len, device=device)[None]
    return i, j if shift is None else j - shift[:, None]


def _parts_by_key(
    method: Method, frequencies: RotaryFrequencies, k_len: int, position_ids, dtype, device
) -> tuple[CosSin, torch.Tensor]:
    """`PartsCall._decode_in_parts`'s step of ``k_len`` keys: the query's turns from the store to each part's
    place ``(B|1, P, rotary_dim)``, and which part covers each key ``(B|1, k_len)`` (the parts cover every key
    once)."""
    store = method.store
    i, j = _step_positions(position_ids, k_len, 0, device)
    turns = [part.query.angle(i) - store.angle(i) for part in method.parts]
    part_of = sum(index * part.covers(i, j) for index, part in enumerate(method.parts))
    return frequencies.cos_sin(torch.cat(turns, dim=-1), dtype, scaled=False), part_of


def at_store(
    method: Method,
    frequencies: RotaryFrequencies,
    positions: torch.Tensor,
    dtype: torch.dtype,
    layer: int | None,
) -> CosSin:
    """cos/sin at the method's store of the model's ``positions`` ``(B|1, n)`` (of the call's new tokens), which
    the patched forward rotates its queries and keys by: the same in every layer of the forward
    (`shared_by_layers`)."""
    store = method.store
    return shared_by_layers(
        layer,
        ("at store", store, dtype, positions.device, frequencies.scaling),
        (positions, frequencies.inv_freq),
        lambda: frequencies.cos_sin(store.value(positions), dtype, store.slower),
    )


class _SharedByLayers:
    """What every layer of one forward computes alike from the call's positions (`shared_by_layers`): the last
    few, each with the ``(static, tensors)`` it was made for and the last layer that read it; replaced as one
    tuple, so that threads only ever make one again."""

    KEPT = 4

    def __init__(self) -> None:
        self._entries: tuple[tuple[tuple, tuple, int, Any], ...] = ()

    def get(self, layer: int | None, static: tuple, tensors: tuple, make: Callable[[], Any]) -> Any:
        if layer is None or torch.compiler.is_compiling():
            return make()  # a graph computes it itself (it fuses it), as a layer with no index does
        entries = self._entries
        for index, (kept, held, last, value) in enumerate(entries):
            if kept == static and all(a is b for a, b in zip(held, tensors)):
                if layer > last:  # a later layer of the same forward
                    self._entries = ((kept, held, layer, value), *entries[:index], *entries[index + 1 :])
                    return value
                entries = entries[:index] + entries[index + 1 :]  # another forward: made again
                break
        value = make()
        self._entries = ((static, tensors, layer, value), *entries[: self.KEPT - 1])
        return value


_SHARED = _SharedByLayers()


def shared_by_layers(layer: int | None, static: tuple, tensors: tuple, make: Callable[[], Any]) -> Any:
    """``make()``, which depends only on ``static`` (hashable: lengths, dtype, device...) and on ``tensors`` (the
    call's ``position_ids``, the rotary's ``inv_freq``; None where absent), made by the first layer of a forward
    that asks and read by its later ones (``layer``: the asking layer's index; None: made for it alone).

    A forward's layers pass the same tensor objects, and run in the order of their indices; an entry serves a
    layer after the last one that read it, for the same ``static`` and the same tensor objects (compared by
    identity: no value is read, so nothing waits on the device). A layer at or before it starts another
    forward, which makes it again: so a new step, a tensor changed in place between forwards (an inference
    tensor counts no changes), a rotary replaced, or another model's rotary, never reads what was made before.
    Under torch.compile the graph computes it in each layer (it fuses it into its kernels). Kept: the last
    `_SharedByLayers.KEPT` (one layer's cos/sin each, at most a part's reach of keys)."""
    return _SHARED.get(layer, static, tensors, make)


class _Turned:
    """A call's queries and keys rotated at each `At` its parts name, each once; the cos/sin of each turn made by
    the forward's first layer and read by the others (`shared_by_layers`: they depend on the places alone)."""

    def __init__(self, call: PartsCall, query, key, past: int, shift, position_ids) -> None:
        self.call, self.query, self.key, self.past, self.shift = call, query, key, past, shift
        self.position_ids = None if shift is None else position_ids  # what the places depend on
        self.done: dict = {}

    def queries(self, at: At) -> torch.Tensor:
        if ("q", at) not in self.done:
            self.done["q", at] = self._turned(self.query, at, self.past, self.key.shape[2])
        return self.done["q", at]

    def keys(self, at: At, lowest: int) -> tuple[torch.Tensor, int]:
        """The keys from ``lowest`` on, rotated at ``at`` (as stored where they sit there), and ``lowest``."""
        if ("k", at) not in self.done:
            call, store = self.call, self.call.method.store
            if at == store and (store != RAW or call.frequencies.scaling == 1.0):
                self.done["k", at] = (self.key[:, :, lowest:], lowest)
            else:
                self.done["k", at] = (
                    self._turned(self.key[:, :, lowest:], at, lowest, self.key.shape[2]),
                    lowest,
                )
        return self.done["k", at]

    def _turned(self, x: torch.Tensor, at: At, begin: int, end: int) -> torch.Tensor:
        """``x``, the cache's places ``begin .. end - 1`` as they come (at the method's store), turned to ``at``:
        from raw, rotated there with the attention scaling; from a store, by a pure rotation of the difference."""
        store = self.call.method.store
        if store == RAW:
            return self.call.rope(x, *self._cos_sin(at, begin, end))
        if at == store:
            return x
        cos_sin = self._shared(
            ("from store", at, begin, end),
            lambda places: self.call.frequencies.cos_sin(
                at.angle(places) - store.angle(places), x.dtype, scaled=False
            ),
        )
        return self.call.rope(x, *cos_sin)

    def _cos_sin(self, at: At, begin: int, end: int) -> CosSin:
        """cos/sin at ``at`` of the cache's places ``begin .. end - 1``."""
        frequencies, dtype, device = self.call.frequencies, self.query.dtype, self.query.device
        if at.fixed is not None and float(at.fixed).is_integer() and at.fixed >= 0:
            return _rows(
                frequencies.at_distances(int(at.fixed) + 1, dtype, device), int(at.fixed), int(at.fixed) + 1
            )
        if at == MOVING and self.past == 0 and begin == 0:
            return self.call.own  # the model's own, at its positions (every place here is a new token)
        return self._shared(
            ("at", at, begin, end), lambda places: frequencies.cos_sin(at.value(places), dtype, at.slower)
        )

    def _shared(self, what: tuple, make: Callable[[torch.Tensor], CosSin]) -> CosSin:
        """``make(places)`` at the places ``what`` names, the model's positions of the cache's ``begin .. end - 1``
        ``(B|1, n)``, made once in a forward (`shared_by_layers`)."""
        if what not in self.done:  # the queries' and the keys' turn to the same places: one
            call, query = self.call, self.query
            *_, begin, end = what
            static = (*what, call.method, self.past, query.dtype, query.device, call.frequencies.scaling)

            def made() -> CosSin:
                places = torch.arange(begin, end, device=query.device)[None]
                return make(places if self.shift is None else places - self.shift[:, None])

            tensors = (self.position_ids, call.frequencies.inv_freq)
            self.done[what] = shared_by_layers(call.layer, static, tensors, made)
        return self.done[what]


def _offset(shift: torch.Tensor | None, method: Method) -> int | None:
    """The rows' one offset of the cache's places from the model's positions, on the host, where a part's
    pairs depend on it (a unit above 1: DCA's chunks); 0 where none does; None where rows differ."""
    if shift is None or all(part.unit == 1 for part in method.parts):
        return 0
    offsets = set(shift.tolist())
    return offsets.pop() if len(offsets) == 1 else None


def _blocks(
    part: Part, first: int, last: int, offset: int, base: int, reach: int
) -> list[tuple[int, int, bool]]:
    """The keys that the queries at the cache's places ``first .. last`` meet in ``part``, as blocks
    ``(begin, end, masked)``: every query meets each key of the unmasked one, ``[L(last), R(first)]``, where
    ``L`` and ``R`` (`Part.reach`, at the positions: the places less ``offset``) bound query i's keys and never
    decrease, so that only the keys at either side need a mask (each at most the chunk's width, where it spans
    no boundary of the part's unit); one masked block where no key is met by all. No key before ``base`` (the
    first turned), nor ``reach`` (the sliding window) or more before its query."""
    (low_first, high_first), (low_last, high_last) = (part.reach(i - offset) for i in (first, last))
    begin, inner = (
        max(base, i - reach + 1, 0 if low is None else low + offset)
        for i, low in ((first, low_first), (last, low_last))
    )
    inner_end, end = high_first + offset + 1, high_last + offset + 1
    if inner >= inner_end:
        return [(begin, end, True)]
    return [(inner, inner_end, False), (begin, inner, True), (inner_end, end, True)]


def _reached(part: Part, first: int, last: int) -> tuple[int, int]:
    """The places ``[begin, end)`` of the keys that queries at places ``first .. last`` may meet in ``part``,
    whatever the row's offset: ``⌊x/u⌋·u`` lies in ``(x − u, x]``."""
    unit = part.unit
    begin = 0 if part.hi is None else max(0, first - part.hi * unit + 1)
    end = min(last + 1, last - part.lo * unit + unit) if part.lo else last + 1
    return begin, end


def _shift(position_ids: torch.Tensor | None, past: int) -> torch.Tensor | None:
    """Each row's offset of the cache's places from the model's positions ``(B,)`` (its left padding), read at
    its highest position (a real token, whichever side the padding is on); None without positions."""
    if position_ids is None:
        return None
    highest, index = position_ids.max(dim=-1)
    return past + index - highest


def _rows(table: CosSin, start: int, stop: int) -> CosSin:
    """The cos/sin at distances ``start .. stop-1`` of a table from 0 (`RotaryFrequencies.at_distances`)."""
    return table[0][:, start:stop], table[1][:, start:stop]


def _distance_rows(frequencies, first, last, slower, dtype, device) -> CosSin:
    """cos/sin at the distances ``first, first + 1, .. last`` (the slower RoPE's), from a kept table where they
    are whole numbers on one side of 0, else computed."""
    if float(first).is_integer() and first >= 0:
        return _rows(
            frequencies.at_distances(int(last) + 1, dtype, device, slower), int(first), int(last) + 1
        )
    if float(first).is_integer() and last <= 0:
        length = int(-first) + 1
        table = frequencies.at_distances(length, dtype, device, slower, before=True)
        return _rows(table, 0, int(last - first) + 1)
    steps = first + torch.arange(round(last - first) + 1, device=device, dtype=torch.float64)[None]
    return frequencies.cos_sin(steps, dtype, slower)


def _visible(mask, start, stop, k_len, q_pos, sliding_window, device) -> torch.Tensor:
    """Which keys the chunk's queries see before the method, bool ``(B|1, 1|H, c, Tk)``."""
    if mask is not None:
        rows = mask[..., start:stop, :k_len] if mask.shape[-2] > 1 else mask[..., :k_len]
        return visible_entries(rows)
    keys = torch.arange(k_len, device=device)
    visible = keys <= q_pos
    if sliding_window:
        visible = visible & (q_pos - keys < sliding_window)
    return visible[None, None]


def check_positions(
    method: Method, position_ids: torch.Tensor | None, mask: torch.Tensor | None, past: int
) -> None:
    """Raise ValueError, in one line, where a call's ``position_ids`` ``(B|1, Tq)`` (the model's, for its queries,
    the cache's last ``Tq`` keys after ``past``) do not run on by one over the queries each of them sees: a method
    of distances counts them in the cache, and would score such a pair at another distance than the model's;
    a method of positions takes each row's offset at its highest position, so every real query of a row must
    share it (packed sequences are refused). Keys that ``mask`` hides do not count, nor do padding queries (they
    do not see themselves). Checked once per ``position_ids`` and ``mask`` (a forward's layers share them),
    with one wait on the device; not under torch.compile, nor for the keys before the call."""
    if (
        position_ids is None
        or position_ids.dim() != 2
        or position_ids.shape[-1] < 2
        or torch.compiler.is_compiling()
        or _CHECKED.seen(position_ids, mask)
    ):
        return
    q_len = position_ids.shape[-1]
    # a position less its index: the same along what a query sees, where the positions run on by one
    offsets = position_ids - torch.arange(q_len, device=position_ids.device)
    if mask is None:  # causal: each query sees every query before it
        wrong = (offsets != offsets[:, :1]).any()
    else:
        wrong = torch.zeros((), dtype=torch.bool, device=position_ids.device)
        rows_of = max(mask.shape[0], position_ids.shape[0]) * mask.shape[1]  # (batch, head) rows of the mask
        rows = max(1, MASK_CHUNK // (q_len * rows_of))
        own = mask[
            ..., past : past + q_len
        ]  # the call's own keys only: those before it have no positions here
        for start in range(0, q_len, rows):
            stop = min(q_len, start + rows)
            seen = _visible(own, start, stop, q_len, None, None, mask.device)
            seen = seen.expand(*seen.shape[:-2], stop - start, q_len)
            row = torch.arange(stop - start, device=seen.device)
            itself = seen[
                ..., row, row + start, None
            ]  # a padding query does not see itself: it does not count
            apart = offsets[:, None, start:stop, None] != offsets[:, None, None, :]
            wrong = wrong | (seen & itself & apart).any()
            if not method.by_distance:  # one offset for every real query of a row
                highest = offsets.gather(-1, position_ids.argmax(-1, keepdim=True))
                elsewhere = offsets[:, None, start:stop] != highest[:, None]
                wrong = wrong | (itself[..., 0] & elsewhere).any()
    if wrong.item():
        raise ValueError(
            f"{method.option}: position_ids jump or restart within what a query sees ({method.name} counts "
            "positions in the cache, so it would score other positions than the model's); pass positions that "
            "run on by one, as generate() and the model's defaults do"
            + (
                ", or pack sequences with no attention mask and no cache (use_cache=False), which transformers "
                "masks apart."
                if method.by_distance
                else "; packed sequences are not served (each row must be one sequence)."
            )
        )
    _CHECKED.remember(position_ids, mask)


class _Checked:
    """The last few ``position_ids`` and masks found right, held weakly, so that a forward's layers check them
    once; replaced as one tuple, so that threads only ever check again."""

    KEPT = 4

    def __init__(self) -> None:
        self._pairs: tuple[tuple[weakref.ref, weakref.ref | None], ...] = ()

    def seen(self, position_ids: torch.Tensor, mask: torch.Tensor | None) -> bool:
        return any(
            positions() is position_ids
            and (masked is None if mask is None else masked is not None and masked() is mask)
            for positions, masked in self._pairs
        )

    def remember(self, position_ids: torch.Tensor, mask: torch.Tensor | None) -> None:
        pair = (weakref.ref(position_ids), None if mask is None else weakref.ref(mask))
        self._pairs = (pair, *self._pairs[: self.KEPT - 1])


_CHECKED = _Checked()
