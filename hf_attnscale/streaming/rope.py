"""RoPE for a stream: the model's cos/sin at any position, frequencies fixed for the stream, and the rotations.

Some RoPE types change their frequencies with the length of the call (dynamic NTK, longrope). A stream keeps
keys rotated between calls, so a `RopeTable` fixes the frequencies at those the model uses for a sequence of
the cache's capacity (``sink_tokens + window``), the most tokens a query ever sees. Angles are computed in
float64 from the rotary module's own frequencies and scaling, once they are shown to give its output, so
positions of any size keep full precision.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

CosSin = tuple[torch.Tensor, torch.Tensor]
"""RoPE's cos and sin, ``(B, n, rotary_dim)`` each."""
RopeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""A family's ``apply_rotary_pos_emb(q, k, cos, sin)``."""
LAYOUT_CHECK_POSITIONS = 16
_BUILDING = threading.Lock()


def _rope_types(rotary: nn.Module) -> list[str]:
    kind = getattr(rotary, "rope_type", "default")
    return list(kind.values()) if isinstance(kind, dict) else [str(kind)]


def length_dependent(rotary: nn.Module) -> bool:
    """Whether ``rotary`` changes its frequencies with the length of the call: transformers' own rule
    (``dynamic_rope_update``), dynamic NTK and LongRoPE."""
    return any("dynamic" in kind or kind == "longrope" for kind in _rope_types(rotary))


def rope_rescales_with_length(model: nn.Module) -> bool:
    """Whether a rotary embedding of ``model`` changes its frequencies with the length read: reading it in
    chunks through a cache then differs from reading it in one call."""
    return any(length_dependent(m) for m in model.modules() if hasattr(m, "rope_type"))


def rotary_output(
    rotary: nn.Module, layer_type: str | None, like: torch.Tensor, positions: torch.Tensor
) -> Any:
    """What ``rotary`` (for ``layer_type``) returns at ``positions``: ``(cos, sin)`` in ``like``'s dtype, for
    every family a `SinkCache` streams."""
    return rotary(like, positions) if layer_type is None else rotary(like, positions, layer_type)


class RopeTable:
    """cos/sin of ``rotary`` (for one layer type) at integer positions, frequencies fixed at ``length`` tokens.

    ``exact`` says whether they are computed in float64 from its ``inv_freq`` (else the module is called).
    """

    def __init__(self, rotary: nn.Module, layer_type: str | None, like: torch.Tensor, length: int) -> None:
        self.rotary, self.layer_type, self.dtype = rotary, layer_type, like.dtype
        device = like.device
        # Position 0 first: a dynamic rotary that saw a long input resets to its original frequencies, so that the
        # call at `length` sets those of `length`. Under a lock: a dynamic rotary changes them in place.
        with _BUILDING:
            rotary_output(rotary, layer_type, like, torch.zeros(1, 1, dtype=torch.long, device=device))
            reference = rotary_output(rotary, layer_type, like, torch.arange(length, device=device)[None])
        self.width = reference[0].shape[-1]
        prefix = f"{layer_type}_" if layer_type else ""
        inv_freq = getattr(rotary, f"{prefix}inv_freq", None)
        scaling = getattr(rotary, f"{prefix}attention_scaling", getattr(rotary, "attention_scaling", None))
        self.inv_freq = None if inv_freq is None else inv_freq.detach().to(device, torch.float64).clone()
        self.scaling = None if scaling is None else float(scaling)
        check = torch.arange(min(length, LAYOUT_CHECK_POSITIONS), device=device)[None]
        computed = self._computed(check) if self.inv_freq is not None and self.scaling is not None else None
        self.exact = computed is not None and all(
            got.shape == want[:, : check.shape[1]].shape
            and torch.allclose(got.float(), want[:, : check.shape[1]].float(), atol=1e-5)
            for got, want in zip(computed, reference)
        )

    def _computed(self, positions: torch.Tensor) -> CosSin:
        angles = positions.to(torch.float64)[..., None] * self.inv_freq
        emb = torch.cat([angles, angles], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(self.dtype), sin.to(self.dtype)

    def __call__(self, positions: torch.Tensor) -> CosSin:
        """cos, sin at ``positions`` ``(B, n)`` (any integers, negative too): ``(B, n, rotary_dim)`` each."""
        if positions.shape[0] > 1 and bool((positions == positions[:1]).all()):
            positions = positions[:1]
        if self.exact:
            return self._computed(positions)
        like = torch.empty(0, dtype=self.dtype, device=positions.device)
        return rotary_output(self.rotary, self.layer_type, like, positions)

    def relative(self, positions: torch.Tensor) -> CosSin:
        """cos, sin of a pure rotation by ``positions``, for keys that are already rotated: without the
        attention scaling that YaRN and LongRoPE fold into cos/sin (applied once, when a key is first rotated)."""
        cos, sin = self(positions)
        if self.scaling is None or self.scaling == 1.0:
            return cos, sin
        return cos / self.scaling, sin / self.scaling


def pair_rope(rope: Callable[..., Any]) -> RopeFn:
    """The family's RoPE as a ``(q, k, cos, sin)`` function; Gemma-3n/4 rotate one tensor, ``(x, cos, sin)``."""
    if next(iter(inspect.signature(rope).parameters)) != "x":
        return rope
    return lambda q, k, cos, sin: (rope(q, cos, sin), rope(k, cos, sin))


def first_dims_rope(rope: RopeFn, width: int) -> RopeFn:
    """``rope`` applied to the first ``width`` dims of each head, the rest passed through: partial rotary as
    Phi, Persimmon, StableLM and GPT-NeoX lay it out (their attention slices the rotary part off first)."""

    def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        if q.shape[-1] == width and k.shape[-1] == width:
            return rope(q, k, cos, sin)
        q_rot, k_rot = rope(q[..., :width], k[..., :width], cos, sin)
        return torch.cat([q_rot, q[..., width:]], dim=-1), torch.cat([k_rot, k[..., width:]], dim=-1)

    return apply


def no_rotation(q, k, cos, sin, *args, **kwargs):
    """For layers that use no RoPE (Cohere-2's global layers, SmolLM3's NoPE layers): positions do nothing."""
    return q, k


def rotate_keys(rope: RopeFn, x: torch.Tensor, cos_sin: CosSin) -> torch.Tensor:
    """Keys ``(B, H, n, D)`` rotated by the family's own function (its partial rotary, its layout)."""
    # The family's function rotates a (q, k) pair; a one-head stand-in for q keeps the wasted work to 1/H.
    return rope(x[:, :1], x, *cos_sin)[1]


def rotate_queries(rope: RopeFn, x: torch.Tensor, cos_sin: CosSin) -> torch.Tensor:
    """Queries ``(B, H, n, D)`` rotated by the family's own function."""
    return rope(x, x[:, :1], *cos_sin)[0]


def rotation_basis(
    rope: RopeFn, keys: torch.Tensor, cos_sin: CosSin
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(a, b)`` such that ``rotate_keys(rope, keys, (cos, sin))`` is ``a * cos + b * sin`` (cos, sin broadcast
    over heads): RoPE's form ``k·cos + rot(k)·sin``, found once so that later rotations of the same keys cost
    two products and a sum. None unless the family's own rotation gives exactly that, checked bitwise at cos/sin
    of ``cos_sin``'s shape that differ in every channel (at the identity, any function would pass)."""
    cos, sin = cos_sin
    if cos.dim() != 3 or cos.shape[-1] != keys.shape[-1]:
        return None  # partial rotary, or an unusual layout: rotate the usual way
    a = rotate_keys(rope, keys, (torch.ones_like(cos), torch.zeros_like(sin)))
    b = rotate_keys(rope, keys, (torch.zeros_like(cos), torch.ones_like(sin)))
    angle = torch.linspace(0.3, 1.1, cos.shape[-1], device=cos.device, dtype=torch.float64)
    cos, sin = angle.cos().to(cos.dtype).expand_as(cos), angle.sin().to(sin.dtype).expand_as(sin)
    want = rotate_keys(rope, keys, (cos, sin))
    got = a * cos.unsqueeze(1) + b * sin.unsqueeze(1)
    return (a, b) if got.shape == want.shape and torch.equal(got, want) else None
