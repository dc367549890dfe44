"""ReRoPE (Su 2023, `bojone/rerope`): RoPE with its relative distance clamped at a window.

A query at position i and a key at j, ``d = i − j`` apart, are scored at distance ``d`` while ``d < w``, and at
``w`` from there on (leaky ReRoPE: at ``w + (d − w) / k``), so no distance is ever one the model did not see:

    near (d < w):   (R(i) q) · (R(j) k)            the model's own RoPE
    far  (d ≥ w):   (R(w) q) · k                  = q · R(−w) k
    leaky far:      (R'(i + w(k − 1)) q) · (R'(j) k),  R' of frequencies θ / k

The patched module's forward runs with the identity rotation (`hf_attnscale.core.install.routing`), so the
call receives raw queries and keys, and its cache stores raw keys; here they are rotated both ways. Each query
chunk's keys are two parts under one softmax (`hf_attnscale.core.call.key_parts`): the far keys ``k``, scored by
``R(w) q``, and the near ones ``R(j) k``, scored by ``R(i) q``, each shown to the queries it is far or near to.
On CUDA under sdpa the queries are not chunked: the near and far keys are two bands of distance, each one call
of the compiled flex kernel over the whole sequence, merged by their log-sum-exp
(`hf_attnscale.core.call.flex_parts`). On the CPU under sdpa PyTorch's flash kernel runs each chunk's parts at
the model's width, merged the same way; elsewhere (eager, a clipped softmax, dropout, float64) the parts go side
by side on doubled channels, one call of the backend. A chunk with no far keys is one call at the model's width.
A chunk of queries [a, a + c) only ever sees near keys in [a − w + 1, a + c) and far keys before a + c − w, so
no T × T tensor is ever held.

Positions are counted in the cache (the queries are its last ones): a row's distances are those of its tokens
whenever its positions are consecutive, left padding included (the padding is masked), and packed sequences
too (transformers masks each from the others). Where a family hands attention its ``position_ids``, a call's
queries are checked for that (`check_positions`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from hf_attnscale.core.call.backends import check_backend
from hf_attnscale.core.call.flex_parts import Band, BandsFn
from hf_attnscale.core.call.key_parts import KeyPart, PartsFn
from hf_attnscale.core.call.masks import visible_entries
from hf_attnscale.core.call.rope import CosSin, RotaryFrequencies, RotateFn

BACKENDS = ("eager", "sdpa")
"""The backends ReRoPE runs on: it shows each key near or far by a dense mask."""


def check_rerope_backend(backend: str | None) -> None:
    """Refuse, in one line, a backend ReRoPE cannot run on (checked when patching and at every call, as
    ``set_attn_implementation`` may switch it in between)."""
    check_backend(backend, BACKENDS, "ReRoPE (it shows each key near or far by a dense mask)")


MASK_CHUNK = 2**24
"""Mask entries per chunk call (queries × keys): 64 MiB of a float32 mask, 1,024 queries at 16k keys."""


@dataclass(frozen=True)
class ReRoPECall:
    """What one attention call needs for ReRoPE, carried by its hooks (`hf_attnscale.core.call.hooks`).

    Attributes:
        window: w, the distance from which scores are clamped.
        leak: k of leaky ReRoPE, or None.
        rope: the family's rotation ``(q, k, cos, sin)`` over its rotary dims.
        frequencies: the rotary module's, as of this call.
        own: the model's own cos/sin for the call's new tokens (used while the cache held nothing before).
    """

    window: int
    leak: float | None
    rope: RotateFn
    frequencies: RotaryFrequencies
    own: CosSin


def rerope_attention(
    attend: PartsFn,
    call: ReRoPECall,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    sliding_window: int | None = None,
    bands: BandsFn | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """ReRoPE over raw ``query`` ``(B, H, Tq, D)`` and ``key`` / ``value`` ``(B, Hkv, Tk, D)``, causal, the queries
    being the last ``Tq`` keys; ``mask`` None (causal, ``sliding_window`` keys at most) or 4D, bool or
    additive. Several queries go to ``bands`` where it is given (the accelerator's whole-sequence path; it
    returns None where it cannot take them), else to ``attend`` in chunks; their ``position_ids``, the model's,
    where the family passes them, are checked first (`check_positions`). Returns ``(B, Tq, H, Dv)``."""
    q_len, k_len, dtype = query.shape[2], key.shape[2], query.dtype
    past, window = k_len - q_len, call.window
    device = query.device
    if q_len == 1:
        return _decode(attend, call, query, key, value, mask, sliding_window)
    check_positions(position_ids, mask, past)
    positions = torch.arange(k_len, device=device)[None]
    # the first key rotated as near: for the chunks, the first near to any query; the bands take them all
    lowest = 0 if bands is not None else max(0, past - window + 1)
    # a prefill takes the model's own cos/sin; a call onto a cache, the frequencies' from its first near key
    near_cos_sin = call.own if past == 0 else call.frequencies.cos_sin(positions[:, lowest:], dtype)
    near_q = call.rope(query, *(t[:, past - lowest :] for t in near_cos_sin))
    near_k = call.rope(key[:, :, lowest:], *near_cos_sin)
    if call.leak is not None:
        shifted = positions[:, past:] + window * (call.leak - 1)
        far_q = call.rope(query, *call.frequencies.cos_sin(shifted, dtype, call.leak))
        far_k = call.rope(key, *call.frequencies.cos_sin(positions, dtype, call.leak))
    else:
        table = call.frequencies.at_distances(window + 1, dtype, device)
        far_q = call.rope(query, *_rows(table, window, window + 1))
        unscaled = call.frequencies.scaling == 1.0
        far_k = key if unscaled else call.rope(key, *_rows(table, 0, 1))
    if bands is not None:
        limit = min(sliding_window or k_len, k_len)  # every distance seen is below it
        parts = [Band(near_q, near_k, value, 0, min(window, limit))]
        if window < limit:
            parts.insert(0, Band(far_q, far_k, value, window, limit))
        visible = None
        if mask is not None:
            visible = visible_entries(mask[..., :k_len]).expand(*mask.shape[:2], q_len, k_len)
        out = bands(parts, visible)
        if out is not None:
            return out  # else flex cannot take it: the chunks below (their near keys counted from 0)
    # Queries per chunk: at most a window's (a chunk's keys past the causal edge are its own, so the work stays
    # within a window's worth of dense causal attention) and a mask of at most MASK_CHUNK entries.
    rows = max(1, min(window, MASK_CHUNK // (k_len + window)))
    outs = []
    for start in range(0, q_len, rows):
        stop = min(q_len, start + rows)
        first, last = past + start, past + stop - 1  # the chunk's query positions
        # keys [far_start, far_end) may be far for some query, [near_start, near_end) near (to the causal
        # edge); none further back than a sliding window reaches
        reach = sliding_window or k_len
        far_start, far_end = max(0, first - reach + 1), max(0, last - window + 1)
        near_start, near_end = max(0, first - min(window, reach) + 1), last + 1
        q_pos = torch.arange(first, last + 1, device=device)[:, None]
        visible = _visible(mask, start, stop, k_len, q_pos, sliding_window, device)
        near_keys = torch.arange(near_start, near_end, device=device)
        parts = [
            KeyPart(
                near_q[:, :, start:stop],
                near_k[:, :, near_start - lowest : near_end - lowest],
                value[:, :, near_start:near_end],
                visible[..., near_start:near_end] & (q_pos - near_keys < window),
            )
        ]
        if far_end > far_start:
            far_keys = torch.arange(far_start, far_end, device=device)
            far = slice(far_start, far_end)
            far_visible = visible[..., far] & (q_pos - far_keys >= window)
            parts.insert(0, KeyPart(far_q[:, :, start:stop], far_k[:, :, far], value[:, :, far], far_visible))
        outs.append(attend(parts))
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0].contiguous()


def check_positions(position_ids: torch.Tensor | None, mask: torch.Tensor | None, past: int) -> None:
    """Raise ValueError, in one line, where a call's ``position_ids`` ``(B|1, Tq)`` (the model's, for its queries,
    the cache's last ``Tq`` keys after ``past``) do not run on by one over the queries each of them sees: ReRoPE
    counts distances in the cache, and would score such a pair at another distance than the model's. Keys that
    ``mask`` hides do not count, nor do padding queries (they do not see themselves), so padding on either side
    and packed sequences pass. Checked once per ``position_ids`` and ``mask`` (a forward's layers share them: one
    mask, or two with sliding-window layers), with one wait on the device; not under torch.compile, nor for the
    keys before the call (the cache keeps no positions)."""
    if (
        position_ids is None
        or position_ids.dim() != 2  # multimodal RoPE's (3, B, T) sections: not a ReRoPE model
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
        for start in range(0, q_len, rows):
            stop = min(q_len, start + rows)
            # the call's own keys only: those before it have no positions here
            seen = _visible(mask[..., past : past + q_len], start, stop, q_len, None, None, mask.device)
            seen = seen.expand(*seen.shape[:-2], stop - start, q_len)
            row = torch.arange(stop - start, device=seen.device)
            # a padding query does not see itself: it does not count
            itself = seen[..., row, row + start, None]
            apart = offsets[:, None, start:stop, None] != offsets[:, None, None, :]
            wrong = wrong | (seen & itself & apart).any()
    if wrong.item():
        raise ValueError(
            "rerope_window: position_ids jump or restart within what a query sees (ReRoPE counts distances in "
            "the cache, so it would score other distances than the model's); pass positions that run on by "
            "one, as generate() and the model's defaults do, or pack sequences with no attention mask and no "
            "cache (use_cache=False), which transformers masks apart."
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


def _decode(attend: PartsFn, call: ReRoPECall, query, key, value, mask, sliding_window) -> torch.Tensor:
    """One query (a decoding step, at position i = the cache's last), one backend call at the model's own head
    dim, on the keys in their order, values untouched. The query is turned to the window, ``R(w) q``, so a far
    key is scored as it is stored (``(R(w) q) · k``) and only the w near keys turn, by ``j − i + w``
    (``(R(w) q) · (R(j − i + w) k) = (R(i) q) · (R(j) k)``). Leaky ReRoPE's far keys each turn by the slower
    RoPE R' (frequencies θ / k) at ``j − i + w``: ``(R(w) q) · (R'(j − i + w) k) = (R'(i + w(k − 1)) q) · (R'(j) k)``,
    since R(w) is R'(wk). Their cos/sin, like the window's, come from a table kept across layers and steps."""
    k_len, dtype, window, device = key.shape[2], query.dtype, call.window, query.device
    i = k_len - 1
    far_end = max(0, i - window + 1)
    table = call.frequencies.at_distances(window + 1, dtype, device)
    query = call.rope(query, *_rows(table, window, window + 1))
    near = call.rope(key[:, :, far_end:], *_rows(table, far_end - i + window, window + 1))
    if call.leak is None:
        far = key[:, :, :far_end]
        if (scaling := call.frequencies.scaling) != 1.0:
            # YaRN's attention scaling s rides on cos/sin, so every score carries s²: the query takes the far
            # keys' s, and the near keys give theirs back, rather than the far keys all turn by s in every step
            query, near = query * scaling, near / scaling
    else:  # the far keys turn by R', its cos/sin carrying s as the near keys' do
        slower = call.frequencies.at_distances(far_end, dtype, device, call.leak, before=True)
        far = call.rope(key[:, :, :far_end], *slower)
    keys = torch.cat([far, near], dim=2)
    shown = None  # no mask where the model passed none: the backend takes grouped heads as they are
    if mask is not None or sliding_window:
        at_i = torch.arange(i, k_len, device=device)[:, None]
        shown = _visible(mask, 0, 1, k_len, at_i, sliding_window, device)
    return attend([KeyPart(query, keys, value, shown)])


def _rows(table: CosSin, start: int, stop: int) -> CosSin:
    """The cos/sin at distances ``start .. stop-1`` of a table from 0 (`RotaryFrequencies.at_distances`)."""
    return table[0][:, start:stop], table[1][:, start:stop]


def _visible(mask, start, stop, k_len, q_pos, sliding_window, device) -> torch.Tensor:
    """Which keys the chunk's queries see before ReRoPE, bool ``(B|1, 1|H, c, Tk)``."""
    if mask is not None:
        rows = mask[..., start:stop, :k_len] if mask.shape[-2] > 1 else mask[..., :k_len]
        return visible_entries(rows)
    keys = torch.arange(k_len, device=device)
    visible = keys <= q_pos
    if sliding_window:
        visible = visible & (q_pos - keys < sliding_window)
    return visible[None, None]
