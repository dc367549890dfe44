"""A method's decoding step (one query, at the cache's last place i), by the first of its executions that serves
the call (`EXECUTIONS`):

* `RowsByKey`: a method whose every part keeps its keys as stored (DCA), under sdpa with nothing the definition
  lacks: the query turned to each part's place, every key scored by its own part's turn, under one softmax
  (`key_parts.rows_by_key`: the keys read once, none copied);
* `ByDistance`: every part depends on the distance alone and the keys are stored raw (ReRoPE): the query turned to
  the largest lower bound of a part (the window) and each key by its distance from there, from tables kept across
  layers and steps (`RotaryFrequencies.at_distances`), the keys a part holds fixed not at all;
* `FromStore`: any other method: the query turned to where the unbounded part places it, and only the keys of the
  other parts turn (those of the unbounded part sit where the store keeps them: leaky ReRoPE's at j/k,
  Self-Extend's at ⌊j/G⌋), by cos/sin that depend on the step's positions alone, made by the first layer of the
  forward and read by the others (`shared_by_layers`).

The keys the last two keep as stored and those they turn are segments of the cache: on the CPU each is scored where
it lies, by the definition (`scores_in_place`); elsewhere they are joined, one backend call at the model's width.
"""

from __future__ import annotations

import torch

from hf_attnscale.core.call.hooks import Execution
from hf_attnscale.core.call.masks import chunk_visible
from hf_attnscale.core.call.memo import shared_by_layers
from hf_attnscale.core.call.rope import CosSin, RotaryFrequencies
from hf_attnscale.core.options.declare import RAW, Method
from hf_attnscale.core.parts import key_parts
from hf_attnscale.core.parts.key_parts import KeyPart
from hf_attnscale.core.parts.turns import (
    PartsRotation,
    distance_rows,
    step_positions,
    table_rows,
)


class RowsByKey:
    """DCA's step: every key scored where it is stored, by its part's turn of the query."""

    @staticmethod
    def serves(method: Method, run: Execution) -> bool:
        return method.keeps_keys and run.fusable

    @staticmethod
    def run(call: PartsRotation, run: Execution, query, key, value, shown, position_ids) -> torch.Tensor:
        return _rows_by_key(call, run, query, key, value, shown, position_ids)


class ByDistance:
    """ReRoPE's step: raw keys turned by their distance, from kept tables."""

    @staticmethod
    def serves(method: Method, run: Execution) -> bool:
        return method.store == RAW and method.by_distance

    @staticmethod
    def run(call: PartsRotation, run: Execution, query, key, value, shown, position_ids) -> torch.Tensor:
        return _scored(run, *_turned_by_distance(call, query, key), value, shown)


class FromStore:
    """Any method's step: the keys turned from where the store keeps them."""

    @staticmethod
    def serves(method: Method, run: Execution) -> bool:
        return True

    @staticmethod
    def run(call: PartsRotation, run: Execution, query, key, value, shown, position_ids) -> torch.Tensor:
        # a method of distances counts them in the cache: no row's offset
        positions = None if call.method.by_distance else position_ids
        return _scored(run, *_turned_from_store(call, query, key, positions), value, shown)


EXECUTIONS = (RowsByKey, ByDistance, FromStore)
"""A decoding step's executions, the first that serves the call runs."""


def decode(
    call: PartsRotation, run: Execution, query, key, value, mask, sliding_window, position_ids
) -> torch.Tensor:
    """The method's output ``(B, 1, H, Dv)`` for one query at the cache's last place, on the keys in their order."""
    k_len, device = key.shape[2], query.device
    shown = None  # no mask where the model passed none: the backend takes grouped heads as they are
    if mask is not None or sliding_window:
        at_i = torch.arange(k_len - 1, k_len, device=device)[:, None]
        shown = chunk_visible(mask, 0, 1, k_len, at_i, sliding_window, device)
    execution = next(e for e in EXECUTIONS if e.serves(call.method, run))
    return execution.run(call, run, query, key, value, shown, position_ids)


def _scored(run: Execution, query, segments: list[torch.Tensor], value, shown) -> torch.Tensor:
    """The step over the keys' ``segments`` (in the cache's order): each scored where it lies where
    `scores_in_place`, else joined, one call."""
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


def scores_in_place(run: Execution, query: torch.Tensor) -> bool:
    """Whether a decoding step scores its keys' segments where they lie, by the definition (``run`` has nothing
    it lacks): on the CPU, whose step is bound by memory, so that the cache is not copied to join them. A GPU's
    eager step is bound by launches, which the definition has more of: there they are joined."""
    return run.fusable and query.device.type == "cpu"


def _rows_by_key(call: PartsRotation, run: Execution, query, key, value, shown, position_ids) -> torch.Tensor:
    """A step of a method whose parts all keep their keys as stored (DCA), where the backend adds nothing to
    the definition: the query turned to each part's place, every key scored by the turn of its own part, one
    softmax (`key_parts.rows_by_key`): every key read once, none turned or copied. The turns and which part
    holds each key depend on the step's positions alone (`shared_by_layers`)."""
    frequencies, k_len = call.frequencies, key.shape[2]
    turns, part_of = shared_by_layers(
        call.layer,
        ("by key", call.method, k_len, query.dtype, query.device, frequencies.scaling),
        (position_ids, frequencies.inv_freq),
        lambda: _parts_by_key(call.method, frequencies, k_len, position_ids, query.dtype, query.device),
    )
    rows = call.rope(query.expand(-1, -1, turns[0].shape[-2], -1), *turns)  # (B, H, P, D)
    return key_parts.rows_by_key(rows, part_of, key, value, shown, run.exit_logits, run.scaling)


def _parts_by_key(
    method: Method, frequencies: RotaryFrequencies, k_len: int, position_ids, dtype, device
) -> tuple[CosSin, torch.Tensor]:
    """`RowsByKey`'s step of ``k_len`` keys: the query's turns from the store to each part's
    place ``(B|1, P, rotary_dim)``, and which part covers each key ``(B|1, k_len)`` (the parts cover every key
    once)."""
    store = method.store
    i, j = step_positions(position_ids, k_len, 0, device)
    turns = [part.query.angle(i) - store.angle(i) for part in method.parts]
    part_of = sum(index * part.covers(i, j) for index, part in enumerate(method.parts))
    return frequencies.cos_sin(torch.cat(turns, dim=-1), dtype, scaled=False), part_of


def _turned_by_distance(call: PartsRotation, query, key) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A method of distances alone: the query turned to r (the largest lower bound of a part, so that a part
    of fixed positions meeting there keeps its keys as stored), each key by ``k(j) − q(i) + r`` (the same
    scores: ``(R(r) q) · (R(k(j) − q(i) + r) k) = (R(q(i)) q) · (R(k(j)) k)``), from kept tables. YaRN's
    attention scaling s rides on cos/sin, so every score carries s²: where a part's keys stay as stored,
    the query takes their s, and the turned keys give theirs back. The keys come in segments, in the cache's
    order."""
    parts, frequencies, dtype, device = call.method.parts, call.frequencies, query.dtype, query.device
    k_len = key.shape[2]
    i = k_len - 1
    r = max(part.lo for part in parts)
    query = call.rope(query, *table_rows(frequencies.at_distances(r + 1, dtype, device), r, r + 1))
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
        cos_sin = distance_rows(frequencies, first, last, slower, dtype, device)
        segment = call.rope(key[:, :, begin:end], *cos_sin)
        segments.append(segment)
        turned.append(len(segments) - 1)
    if as_stored and (scaling := frequencies.scaling) != 1.0:
        query = query * scaling
        for index in turned:
            segments[index] = segments[index] / scaling
    return query, segments


def _turned_from_store(
    call: PartsRotation, query, key, position_ids
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Any method: the query turned from where it comes (the method's store) to where the unbounded part
    (the anchor) places it, each key by ``k(j) − store(j) − (q(i) − anchor(i))`` for its part (the same
    scores: every pair's angle is ``k(j) − q(i)``), which is 0 for the anchor's keys where they sit where
    they are stored: then only the keys of the other parts turn, all within their reach of the query. Turns
    of what is stored rotated are pure rotations; raw keys (a store of RAW) all turn, with the attention
    scaling. The keys come in segments, in the cache's order: those kept as stored, those turned. The cos/sin
    depend on the step's positions alone: every layer of the forward reads the first one's
    (`shared_by_layers`)."""
    frequencies, k_len = call.frequencies, key.shape[2]
    start, turn_query, turn_keys = shared_by_layers(
        call.layer,
        ("from store", call.method, k_len, query.dtype, query.device, frequencies.scaling),
        (position_ids, frequencies.inv_freq),
        lambda: _turns_from_store(call.method, frequencies, k_len, position_ids, query.dtype, query.device),
    )
    if turn_query is not None:
        query = call.rope(query, *turn_query)
    if turn_keys is None:
        return query, [key]
    near = call.rope(key[:, :, start:], *turn_keys)
    return query, [near] if start == 0 else [key[:, :, :start], near]


def _turns_from_store(
    method: Method, frequencies: RotaryFrequencies, k_len: int, position_ids, dtype, device
) -> tuple[int, CosSin | None, CosSin | None]:
    """`FromStore`'s turns at a step of ``k_len`` keys: the first key that turns, the query's
    cos/sin (None: it stays) and the keys' from there on (None: none turns)."""
    store = method.store
    raw = store == RAW
    anchor = next((part for part in method.parts if part.hi is None), method.parts[0])
    start = 0
    if not raw and anchor.hi is None and anchor.key == store:
        reaches = [part.hi * part.unit for part in method.parts if part is not anchor]
        reach = max(reaches) if reaches else 0  # (no `default=`: torch.compile takes max without it)
        start = max(0, k_len - reach)
    i, j = step_positions(position_ids, k_len, start, device)
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
