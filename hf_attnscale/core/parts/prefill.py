"""A method's prefill (several queries: a prompt, or a chunk onto the cache), by the first of its executions that
serves the call (`EXECUTIONS`):

* `FlexBands`: on CUDA under sdpa, with nothing flex lacks, each part one compiled flex call over the whole
  sequence (`hf_attnscale.core.parts.flex_parts`);
* `QueryChunks`: the queries in chunks, each chunk's parts one call of `hf_attnscale.core.parts.key_parts` (the
  CPU's fused kernel per part, or the parts joined on side-by-side channels, one backend call). A chunk of queries
  only reads the keys its parts can reach, so no T × T tensor is held. Where the model passes no mask and the fused
  kernel serves, a part's keys go in blocks: query i meets ``L(i) .. R(i)`` (`Part.reach`), both non-decreasing,
  so every query of the chunk meets ``[L(last), R(first)]``, unmasked (a mask makes the kernel compute every
  block, and read the mask), and only the keys at either side, at most a chunk wide, are masked; DCA's chunks stay
  within its cells. Else one masked block a part.

Both read the call's queries and keys turned at each part's positions (`Prefill`). Before either, the call's
``position_ids`` are checked (`check_positions`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hf_attnscale.core.call.hooks import Execution
from hf_attnscale.core.call.masks import chunk_visible, visible_entries
from hf_attnscale.core.call.memo import shared_by_layers
from hf_attnscale.core.options.declare import Method, Part
from hf_attnscale.core.parts import flex_parts, key_parts
from hf_attnscale.core.parts.flex_parts import Band
from hf_attnscale.core.parts.key_parts import KeyPart
from hf_attnscale.core.parts.turns import PartsRotation, Turned, row_offsets

MASK_CHUNK = 2**24
"""Mask entries per chunk call (queries × keys): 64 MiB of a float32 mask, 1,024 queries at 16k keys."""
SPLIT_ROWS = 512
"""Queries per chunk where a part's keys go in blocks (`_blocks`; their masks are at most rows × rows, so
MASK_CHUNK bounds nothing there). The masked blocks, computed whole, cost a query about 1.5 × rows keys where a
causal kernel computes some 256 beyond its own (at 512 rows, 6% of the 8k keys of a 16k forward's average
query); fewer rows cost more kernel calls, each copying its keys to every query head, on smaller tiles. On a 4k
forward (one thread) 256 rows were 3% faster than 512; at 16k the masked blocks weigh a quarter of that, the
copies as much."""


class Prefill(NamedTuple):
    """One prefill call: what the executions read. ``queries[p]`` and ``keys[p]`` are part p's, turned at its
    positions; ``keys[p]`` is ``(keys from its first place, that place)``; ``shift``: each row's offset of the
    cache's places from the model's positions, where the method places pairs by position (None: by distance);
    ``positions``: every key's own position ``(B|1, Tk)``, where they jump (PoSE's; else None)."""

    call: PartsRotation
    run: Execution
    value: torch.Tensor
    mask: torch.Tensor | None
    sliding_window: int | None
    shift: torch.Tensor | None
    positions: torch.Tensor | None
    queries: list[torch.Tensor]
    keys: list[tuple[torch.Tensor, int]]
    q_len: int
    k_len: int


class FlexBands:
    """Each part one compiled flex call over the whole sequence (CUDA, sdpa, nothing flex lacks)."""

    whole_keys = True  # a band takes every key of its part

    @staticmethod
    def serves(call: PartsRotation, run: Execution, query, key, value, mask, shift, positions) -> bool:
        return (
            run.fusable
            and positions is None
            and flex_parts.serves(
                query,
                key,
                value,
                run.exit_logits,
                mask is not None,
                run.scaling,
                call.method,
                shift is not None,
            )
        )

    @staticmethod
    def run(p: Prefill) -> torch.Tensor | None:
        """The output, or None where flex cannot take the call after all (the next execution then runs)."""
        reach = min(p.sliding_window or p.k_len, p.k_len)  # every distance seen is below it
        bands = [
            Band(q, k, p.value, part)
            for part, q, (k, _) in zip(p.call.method.parts, p.queries, p.keys)
            if part.unit > 1 or part.lo < reach
        ]
        visible = None
        if p.mask is not None:
            visible = visible_entries(p.mask[..., : p.k_len]).expand(*p.mask.shape[:2], p.q_len, p.k_len)
        return flex_parts.attention(bands, visible, p.run.exit_logits, p.run.scaling, reach, p.shift)


class QueryChunks:
    """The queries in chunks, each chunk's parts one call of `key_parts` (every device)."""

    whole_keys = False  # each part's keys from the first that any query reaches

    @staticmethod
    def serves(call: PartsRotation, run: Execution, query, key, value, mask, shift, positions) -> bool:
        return True

    @staticmethod
    def run(p: Prefill) -> torch.Tensor:
        return _chunks(p)


EXECUTIONS = (FlexBands, QueryChunks)
"""A prefill's executions, the first that serves the call runs."""


def prefill(
    call: PartsRotation, run: Execution, query, key, value, mask, sliding_window, position_ids
) -> torch.Tensor:
    """The method's output ``(B, Tq, H, Dv)`` over ``query`` ``(B, H, Tq, D)``, the cache's last ``Tq`` keys."""
    method = call.method
    q_len, k_len = query.shape[2], key.shape[2]
    past = k_len - q_len
    # positions that jump (PoSE's, no cache): every pair at the positions themselves, whatever the method
    jumps = check_positions(method, position_ids, mask, past, kept=call.kept, layer=call.layer)
    positions = position_ids if jumps else None
    shift = None if method.by_distance or positions is not None else row_offsets(position_ids, past)
    chosen = [e for e in EXECUTIONS if e.serves(call, run, query, key, value, mask, shift, positions)]
    # the first key of each part that any query reaches (flex's bands take them all)
    lowest = [
        0 if chosen[0].whole_keys or part.hi is None else max(0, past - part.hi * part.unit + 1)
        for part in method.parts
    ]
    turned = Turned(call, query, key, past, shift, position_ids, positions)
    queries = [turned.queries(part.query) for part in method.parts]
    keys = [
        turned.keys(part.key, min(low for low, other in zip(lowest, method.parts) if other.key == part.key))
        for part in method.parts
    ]
    p = Prefill(call, run, value, mask, sliding_window, shift, positions, queries, keys, q_len, k_len)
    for execution in chosen:  # the last, QueryChunks, always gives one
        out = execution.run(p)
        if out is not None:
            break
    return out


def _chunks(p: Prefill) -> torch.Tensor:
    """`QueryChunks`: where the fused kernel serves and the model passes no mask, each part's keys in blocks;
    else one masked block a part."""
    call, run, value, mask, sliding_window, shift = p.call, p.run, p.value, p.mask, p.sliding_window, p.shift
    method, q_len, k_len = call.method, p.q_len, p.k_len
    queries, keys, device = p.queries, p.keys, value.device
    past = k_len - q_len
    # Where the fused kernel serves and the model passes no mask, each part's keys go in blocks: those every
    # query of the chunk meets, unmasked, and a masked block at either side (`_blocks`); else one block a
    # part, masked, at most a span's queries (where the parts meet) and MASK_CHUNK mask entries a chunk.
    fuses = mask is None and p.positions is None and key_parts.may_fuse(run, queries[0], value)
    offset = _offset(shift, method) if fuses else None
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
            visible = chunk_visible(mask, start, stop, k_len, at, sliding_window, device)
            q_pos = _positions(at, shift, p.positions, first, last + 1, query_side=True)
        parts = []
        for part, q, (k, base) in zip(method.parts, queries, keys):
            if offset is None:
                begin, end = _reached(part, first, last, jumps=p.positions is not None)
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
                        k_pos = _positions(k_at, shift, p.positions, begin, end, query_side=False)
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


def _reached(part: Part, first: int, last: int, jumps: bool = False) -> tuple[int, int]:
    """The places ``[begin, end)`` of the keys that queries at places ``first .. last`` may meet in ``part``,
    whatever the row's offset: ``⌊x/u⌋·u`` lies in ``(x − u, x]``. Where positions jump (``jumps``), two places
    are at least as far apart in positions as in places, so a part's nearest key may be any up to the query."""
    unit = part.unit
    begin = 0 if part.hi is None else max(0, first - part.hi * unit + 1)
    end = min(last + 1, last - part.lo * unit + unit) if part.lo and not jumps else last + 1
    return begin, end


def _positions(places, shift, positions, begin: int, end: int, *, query_side: bool) -> torch.Tensor:
    """The positions of ``places`` (the queries' ``(c, 1)``, or the keys' ``(n,)``, the cache's ``begin .. end -
    1``), shaped to meet the other side's: as they are (a method of distances), less each row's offset
    (``shift``), or where positions jump, each place's own (``positions``)."""
    if positions is not None:
        rows = positions[:, begin:end]
        return rows[:, None, :, None] if query_side else rows[:, None, None, :]
    return places if shift is None else places - shift[:, None, None, None]


def check_positions(
    method: Method,
    position_ids: torch.Tensor | None,
    mask: torch.Tensor | None,
    past: int,
    kept: bool = False,
    layer: int | None = None,
) -> bool:
    """Whether a call's ``position_ids`` ``(B|1, Tq)`` (the model's, for its queries, the cache's last ``Tq`` keys
    after ``past``) jump forward within what a query sees, as PoSE's skips do, in a call with no keys before it
    whose keys no later call reads (``kept`` False: no cache, or training): then every method places each pair at
    the positions themselves (`prefill`). Raise ValueError, in one line, where they go back or restart within
    what a query sees, or jump with keys before the call or kept for a later one: a method of
    distances counts them in the cache, and would score such a pair at another distance than the model's; and
    where, running on by one, a method of positions would take each row's offset at its highest position, so
    every real query of a row must share it (packed sequences are refused). Keys that ``mask`` hides do not
    count, nor do padding queries (they do not see themselves). Checked once per ``position_ids`` and ``mask`` in
    a forward (its layers share them: `shared_by_layers`, ``layer`` the asking layer's index), with one wait on
    the device; not under torch.compile, nor for the keys before the call."""
    if (
        position_ids is None
        or position_ids.dim() != 2
        or position_ids.shape[-1] < 2
        or torch.compiler.is_compiling()
    ):
        return False
    return shared_by_layers(
        layer,
        ("positions checked", method, past, kept),
        (position_ids, mask),
        lambda: _jumps(method, position_ids, mask, past, kept),
    )


def _jumps(
    method: Method, position_ids: torch.Tensor, mask: torch.Tensor | None, past: int, kept: bool
) -> bool:
    """`check_positions`' verdict, found on the device."""
    q_len, device = position_ids.shape[-1], position_ids.device
    # a position less its index: the same along what a query sees, where the positions run on by one
    offsets = position_ids - torch.arange(q_len, device=device)
    no = torch.zeros((), dtype=torch.bool, device=device)
    if mask is None:  # causal: each query sees every query before it
        steps = offsets.diff(dim=-1)
        ahead, behind, elsewhere = (steps > 0).any(), (steps < 0).any(), no
    else:
        ahead, behind, elsewhere = no, no, no
        rows_of = max(mask.shape[0], position_ids.shape[0]) * mask.shape[1]  # (batch, head) rows of the mask
        rows = max(1, MASK_CHUNK // (q_len * rows_of))
        own = mask[
            ..., past : past + q_len
        ]  # the call's own keys only: those before it have no positions here
        highest = offsets.gather(-1, position_ids.argmax(-1, keepdim=True))
        for start in range(0, q_len, rows):
            stop = min(q_len, start + rows)
            seen = chunk_visible(own, start, stop, q_len, None, None, mask.device)
            seen = seen.expand(*seen.shape[:-2], stop - start, q_len)
            row = torch.arange(stop - start, device=seen.device)
            itself = seen[
                ..., row, row + start, None
            ]  # a padding query does not see itself: it does not count
            shown = seen & itself
            query_offsets, key_offsets = offsets[:, None, start:stop, None], offsets[:, None, None, :]
            ahead = ahead | (shown & (query_offsets > key_offsets)).any()
            behind = behind | (shown & (query_offsets < key_offsets)).any()
            # one offset for every real query of a row (a method of positions, where they run on by one)
            elsewhere = (
                elsewhere | (itself[..., 0] & (offsets[:, None, start:stop] != highest[:, None])).any()
            )
    ahead, behind, elsewhere = torch.stack([ahead, behind, elsewhere]).tolist()
    jumps = ahead and past == 0 and not kept
    if behind or (ahead and not jumps) or (elsewhere and not jumps and not method.by_distance):
        raise ValueError(
            f"{method.option}: position_ids "
            + (
                "jump and go back"
                if ahead and behind
                else "jump in a call onto or into a cache"
                if ahead
                else "go back or restart"  # a row's own offsets apart: packed sequences
            )
            + f" within what a query sees ({method.name} counts positions in the cache, so it would score other "
            "positions than the model's); pass positions that run on by one, as generate() and the model's "
            "defaults do, or that only jump forward with no cache or while training (PoSE's)"
            + (
                ", or pack sequences with no attention mask and no cache (use_cache=False), which transformers "
                "masks apart."
                if method.by_distance
                else "; packed sequences are not served (each row must be one sequence)."
            )
        )
    return jumps
