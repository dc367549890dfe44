"""The cos/sin a method's parts turn queries and keys by, made once in a forward: at the method's store
(`at_store`), at each `At` of a prefill's parts (`Turned`), at distances from kept tables (`distance_rows`); and the
places a call's queries and keys sit at (`row_offsets`, `step_positions`).

Every layer of one forward computes them alike from the call's positions alone, so the first layer makes them and
the later ones read them (`hf_attnscale.core.call.memo.shared_by_layers`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_attnscale.core.call.memo import shared_by_layers
from hf_attnscale.core.call.rope import CosSin, RotaryFrequencies, RotateFn
from hf_attnscale.core.options.declare import MOVING, RAW, At, Method


@dataclass(frozen=True)
class PartsRotation:
    """What one attention call of ``method`` turns its queries and keys by (`hf_attnscale.core.parts.engine.PartsCall`
    calls it).

    Attributes:
        method: the declaration.
        rope: the family's rotation ``(x, cos, sin)`` over its rotary dims.
        frequencies: the rotary module's, as of this call.
        own: the model's own cos/sin for the call's new tokens.
        positions: the model's ``position_ids`` of the call's new tokens, where its layer passes them.
        layer: the attention module's ``layer_idx`` (None: its layer makes what the others could share).
        kept: the call's keys go into a cache that a later call may read (a cache, out of training): positions
            that jump are then refused, as a later call could not see them (`prefill.check_positions`).
    """

    method: Method
    rope: RotateFn
    frequencies: RotaryFrequencies
    own: CosSin
    positions: torch.Tensor | None = None
    layer: int | None = None
    kept: bool = False


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


class Turned:
    """A call's queries and keys rotated at each `At` its parts name, each once; the cos/sin of each turn made by
    the forward's first layer and read by the others (`shared_by_layers`: they depend on the places alone)."""

    def __init__(
        self, call: PartsRotation, query, key, past: int, shift, position_ids, positions=None
    ) -> None:
        self.call, self.query, self.key, self.past, self.shift = call, query, key, past, shift
        self.positions = positions  # every key's own position, where they jump (PoSE's): (B|1, Tk)
        # what the places depend on
        self.position_ids = None if shift is None and positions is None else position_ids
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
            return table_rows(
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
                if self.positions is not None:
                    return make(self.positions[:, begin:end])
                return make(places if self.shift is None else places - self.shift[:, None])

            tensors = (self.position_ids, call.frequencies.inv_freq)
            self.done[what] = shared_by_layers(call.layer, static, tensors, made)
        return self.done[what]


def row_offsets(position_ids: torch.Tensor | None, past: int) -> torch.Tensor | None:
    """Each row's offset of the cache's places from the model's positions ``(B,)`` (its left padding), read at
    its highest position (a real token, whichever side the padding is on); None without positions."""
    if position_ids is None:
        return None
    highest, index = position_ids.max(dim=-1)
    return past + index - highest


def step_positions(position_ids, k_len: int, start: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoding step's query position ``(B|1, 1)`` and the positions of the cache's keys from ``start`` on
    ``(B|1, n)``: the cache's places less each row's offset (`_shift`), or the places where no positions came."""
    shift = row_offsets(position_ids, k_len - 1)
    i = torch.full((1, 1), k_len - 1, device=device) if shift is None else (k_len - 1 - shift)[:, None]
    j = torch.arange(start, k_len, device=device)[None]
    return i, j if shift is None else j - shift[:, None]


def table_rows(table: CosSin, start: int, stop: int) -> CosSin:
    """The cos/sin at distances ``start .. stop-1`` of a table from 0 (`RotaryFrequencies.at_distances`)."""
    return table[0][:, start:stop], table[1][:, start:stop]


def distance_rows(frequencies, first, last, slower, dtype, device) -> CosSin:
    """cos/sin at the distances ``first, first + 1, .. last`` (the slower RoPE's), from a kept table where they
    are whole numbers on one side of 0, else computed."""
    if float(first).is_integer() and first >= 0:
        return table_rows(
            frequencies.at_distances(int(last) + 1, dtype, device, slower), int(first), int(last) + 1
        )
    if float(first).is_integer() and last <= 0:
        length = int(-first) + 1
        table = frequencies.at_distances(length, dtype, device, slower, before=True)
        return table_rows(table, 0, int(last - first) + 1)
    steps = first + torch.arange(round(last - first) + 1, device=device, dtype=torch.float64)[None]
    return frequencies.cos_sin(steps, dtype, slower)


def rotary_times(x: torch.Tensor, factor: float, width: int) -> torch.Tensor:
    """``x`` with its first ``width`` dims (the rotary ones) times ``factor``, the rest as they are."""
    if width >= x.shape[-1]:
        return x * factor
    return torch.cat([x[..., :width] * factor, x[..., width:]], dim=-1)
