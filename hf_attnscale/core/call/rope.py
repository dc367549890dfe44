"""RoPE as the patch applies it itself: a family's rotation over its rotary dims, and cos/sin at any position
from a rotary module's own frequencies (ReRoPE here; `SinkCache` streaming builds its tables on these).

A rotary module computes ``cos, sin = (cos(p·θ), sin(p·θ)) · s`` from its ``inv_freq`` θ (scaled as its rope
type says: YaRN, llama3, linear, dynamic NTK...) and its ``attention_scaling`` s, in the halves layout
``[θ, θ]``. `RotaryFrequencies` reads both, and gives cos/sin at any positions, in float64 angles, so that
positions far past the trained length keep full precision. The cos/sin at the distances that every layer of every
ReRoPE decoding step reads (the window's; leaky ReRoPE's far keys') are kept in tables
(`RotaryFrequencies.at_distances`).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_attnscale.core.call.memo import memoize

CosSin = tuple[torch.Tensor, torch.Tensor]
"""RoPE's cos and sin, ``(B, n, rotary_dim)`` each."""
RotateFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""A rotation ``(x, cos, sin) -> x`` of ``x`` ``(B, H, n, D)`` by cos/sin ``(B, n, rotary_dim)`` over its rotary
dims, as its family rotates (`family_rotation`)."""
ROPE_FUNCTION = "apply_rotary_pos_emb"
"""The name under which an attention forward calls its family's RoPE."""


def family_rope(module: nn.Module) -> Callable[..., Any] | None:
    """The rotation ``module``'s forward calls, where Python finds it: ``apply_rotary_pos_emb`` in the forward's
    own globals (None: it rotates otherwise, or not at all)."""
    forward = inspect.unwrap(type(module).forward)
    if ROPE_FUNCTION not in getattr(getattr(forward, "__code__", None), "co_names", ()):
        return None
    return forward.__globals__.get(ROPE_FUNCTION)


def rotary_output(
    rotary: nn.Module, layer_type: str | None, like: torch.Tensor, positions: torch.Tensor
) -> Any:
    """What ``rotary`` (for ``layer_type``) returns at ``positions``, in ``like``'s dtype: ``(cos, sin)``."""
    return rotary(like, positions) if layer_type is None else rotary(like, positions, layer_type)


@memoize()  # built per layer and call under ReRoPE: reading the signature each time costs more than it
def family_rotation(rope: Callable[..., Any], width: int) -> RotateFn:
    """The family's RoPE ``rope`` as a `RotateFn` over the first ``width`` dims of each head, the rest passed
    through (Phi, Persimmon, StableLM and GPT-NeoX slice their partial rotary part off before they call theirs).

    Gemma-3n/4 rotate one tensor at a time, ``(x, cos, sin)``. The others rotate a pair ``(q, k, cos, sin)``:
    where that is transformers' usual ``x·cos + rotate_half(x)·sin``, checked bitwise, it runs as
    `halves_rotation` on the one tensor; otherwise (an interleaved layout, an upcast) the family's function
    turns it as its ``k``, beside a one-head stand-in for ``q`` (wasting 1/H of the work). A compiled graph
    takes the second way, which it fuses, rather than run the check."""
    if next(iter(inspect.signature(rope).parameters)) == "x":
        turn = rope
    elif not torch.compiler.is_compiling() and _computes_halves(rope, width):
        turn = halves_rotation
    else:

        def turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            return rope(x[:, :1], x, cos, sin)[1]

    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != width:
            return torch.cat([turn(x[..., :width], cos, sin), x[..., width:]], dim=-1)
        return turn(x, cos, sin)

    return apply


def halves_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the halves layout, ``x·cos + rotate_half(x)·sin`` with cos/sin broadcast over heads, in the order
    of operations of transformers' ``apply_rotary_pos_emb`` (so that it gives the same bits)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _computes_halves(rope: Callable[..., Any], width: int) -> bool:
    """Whether the pair rotation ``rope`` gives exactly `halves_rotation`'s bits, on random q, k (two heads and
    one), cos and sin, in float32 and bfloat16."""
    if width % 2:
        return False
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        q, k = (
            torch.randn(1, heads, 3, width, generator=generator, device="cpu").to(dtype) for heads in (2, 1)
        )
        cos, sin = (torch.randn(1, 3, width, generator=generator, device="cpu").to(dtype) for _ in range(2))
        try:
            got = rope(q, k, cos, sin)
        except Exception:
            return False
        if not (isinstance(got, tuple) and len(got) == 2):
            return False
        for g, w in zip(got, (halves_rotation(q, cos, sin), halves_rotation(k, cos, sin))):
            if not (
                isinstance(g, torch.Tensor)
                and g.shape == w.shape
                and g.dtype == w.dtype
                and torch.equal(g, w)
            ):
                return False
    return True


def no_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """For layers that use no RoPE (Cohere-2's global layers, SmolLM3's NoPE layers): positions do nothing."""
    return x


@dataclass(frozen=True)
class RotaryFrequencies:
    """A rotary module's frequencies as they are now: ``inv_freq`` ``(rotary_dim / 2,)`` and the attention
    scaling ``scaling`` (YaRN's and LongRoPE's factor on cos/sin; 1 for most)."""

    inv_freq: torch.Tensor
    scaling: float

    @classmethod
    def of(cls, rotary: nn.Module, layer_type: str | None) -> RotaryFrequencies | None:
        """``rotary``'s (for ``layer_type``: Gemma-3's local and global layers have their own), read now: a
        dynamic rope type changes them with the length of each call. None where it keeps no ``inv_freq``."""
        prefix = f"{layer_type}_" if layer_type else ""
        inv_freq = getattr(rotary, f"{prefix}inv_freq", None)
        scaling = getattr(rotary, f"{prefix}attention_scaling", getattr(rotary, "attention_scaling", None))
        if not isinstance(inv_freq, torch.Tensor) or scaling is None:
            return None
        return cls(inv_freq, float(scaling))

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, slower: float = 1.0, scaled: bool = True
    ) -> CosSin:
        """cos, sin at ``positions`` ``(B, n)`` (any reals), ``(B, n, rotary_dim)``, angles in float64; the
        frequencies divided by ``slower`` (leaky ReRoPE's second RoPE); without the attention scaling where not
        ``scaled`` (a pure turn of what is rotated already)."""
        inv_freq = self.inv_freq.detach().to(positions.device, torch.float64)
        if slower != 1.0:
            inv_freq = inv_freq / slower
        angles = positions.to(torch.float64)[..., None] * torch.cat([inv_freq, inv_freq])
        cos, sin = angles.cos(), angles.sin()
        if self.scaling != 1.0 and scaled:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype), sin.to(dtype)

    def at_distances(
        self, count: int, dtype: torch.dtype, device: torch.device, slower: float = 1.0, before: bool = False
    ) -> CosSin:
        """cos, sin at the distances ``0 .. count-1`` (``before``: ``-(count-1) .. 0``), ``(1, count, rotary_dim)``,
        the frequencies divided by ``slower``. Every layer of every decoding step reads the same ones (ReRoPE's
        window; leaky ReRoPE's far keys, one more at each step), so one table of each kind (slower, before,
        dtype, device) is kept, made as long as asked and then, when a call asks for more, twice as long (at
        least as asked), and its rows returned: up to twice the longest far part, ``2 × rotary_dim`` values a
        row (512 KiB per 1,024 rows at rotary_dim 64 in float32). It is kept while the rotary module holds this
        ``inv_freq`` buffer, and made again when PyTorch counts an in-place change to it (not a write through
        ``.data``). A compiled graph computes the rows itself, and so does a call on an ``inv_freq`` made in
        inference mode, which counts no changes."""
        if torch.compiler.is_compiling() or self.inv_freq.is_inference():
            return self._distances(count, dtype, device, slower, before)
        # the buffer's in-place version counter: a host-side integer, so the lookup never waits on the device
        key = (slower, before, self.scaling, dtype, torch.device(device), self.inv_freq._version)
        tables = _tables_of(self.inv_freq)
        table = tables.get(key)
        if table is None or table[0].shape[1] < count:
            length = count if table is None else max(count, 2 * table[0].shape[1])
            # made outside inference mode: a table kept from an inference-mode call serves calls with gradients
            with torch.inference_mode(False):
                table = self._distances(length, dtype, device, slower, before)
            for stale in [kept for kept in list(tables) if kept[-1] != key[-1]]:
                tables.pop(stale, None)  # another thread may have taken it already
            tables[key] = table
        length = table[0].shape[1]
        rows = slice(length - count, length) if before else slice(0, count)
        return table[0][:, rows], table[1][:, rows]

    def _distances(
        self, count: int, dtype: torch.dtype, device: torch.device, slower: float, before: bool
    ) -> CosSin:
        steps = torch.arange(count, device=device)[None]
        return self.cos_sin(steps - (count - 1) if before else steps, dtype, slower)

    @classmethod
    def checked(
        cls, rotary: nn.Module, layer_type: str | None, like: torch.Tensor, count: int = 8
    ) -> RotaryFrequencies | None:
        """``rotary``'s frequencies, read just after it ran at positions ``0..count-1``, if they give its own
        cos/sin there (the usual halves layout, real cos/sin); None where it computes RoPE some other way."""
        positions = torch.arange(count, device=like.device)[None]
        own = rotary_output(rotary, layer_type, like, positions)
        frequencies = cls.of(rotary, layer_type)
        if frequencies is None or not (isinstance(own, tuple) and len(own) == 2):
            return None
        computed = frequencies.cos_sin(positions, like.dtype)
        same = all(
            got.shape == want.shape and torch.allclose(got.float(), want.float(), atol=1e-5)
            for got, want in zip(computed, own)
        )
        return frequencies if same else None


_TABLES: dict[int, tuple[weakref.ref, dict[tuple[Any, ...], CosSin]]] = {}
"""`RotaryFrequencies.at_distances`' tables, by the ``id`` of the ``inv_freq`` they came from (tensors compare
by value, so Python's weak dictionaries cannot hold them as keys); an entry goes when its ``inv_freq`` does."""


def _tables_of(inv_freq: torch.Tensor) -> dict[tuple[Any, ...], CosSin]:
    key = id(inv_freq)
    entry = _TABLES.get(key)
    if entry is None or entry[0]() is not inv_freq:
        entry = (weakref.ref(inv_freq, lambda _: _TABLES.pop(key, None)), {})
        _TABLES[key] = entry
    return entry[1]
