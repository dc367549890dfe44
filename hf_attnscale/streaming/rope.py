"""RoPE for a stream: the model's cos/sin at any position, frequencies fixed for the stream, and the rotations.

A stream keeps keys rotated between calls, so a `RopeTable` fixes the frequencies (which dynamic NTK and
LongRoPE change with the length of the call) at those of the cache's capacity. Angles are computed in float64
from the rotary module's own frequencies once shown to give its output: any position keeps full precision.
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
_BUILDING = threading.Lock()


def length_dependent(rotary: nn.Module) -> bool:
    """Whether ``rotary`` changes its frequencies with the length of the call (dynamic NTK, LongRoPE)."""
    kind = getattr(rotary, "rope_type", "default")
    return any(
        "dynamic" in k or k == "longrope" for k in (kind.values() if isinstance(kind, dict) else [kind])
    )


def rope_rescales_with_length(model: nn.Module) -> bool:
    """Whether a rotary embedding of ``model`` changes its frequencies with the length read: reading it in
    chunks through a cache then differs from reading it in one call."""
    return any(length_dependent(m) for m in model.modules() if hasattr(m, "rope_type"))


def rotary_output(
    rotary: nn.Module, layer_type: str | None, like: torch.Tensor, positions: torch.Tensor
) -> Any:
    """What ``rotary`` (for ``layer_type``) returns at ``positions``, in ``like``'s dtype: ``(cos, sin)``."""
    return rotary(like, positions) if layer_type is None else rotary(like, positions, layer_type)


class RopeTable:
    """cos/sin of ``rotary`` (for one layer type) at integer positions, frequencies fixed at ``length`` tokens;
    ``exact`` when they are computed in float64 from its ``inv_freq`` (else the module is called). ``width`` is
    the rotary dims, None where the module gives no ``(cos, sin)`` pair (complex frequencies): no table then."""

    def __init__(self, rotary: nn.Module, layer_type: str | None, like: torch.Tensor, length: int) -> None:
        self.rotary, self.layer_type, self.dtype = rotary, layer_type, like.dtype
        device = like.device
        # Position 0 first: a dynamic rotary that saw a long input resets to its original frequencies, so that the
        # call at `length` sets those of `length`. Under a lock: a dynamic rotary changes them in place.
        with _BUILDING:
            at_zero = rotary_output(
                rotary, layer_type, like, torch.zeros(1, 1, dtype=torch.long, device=device)
            )
            self.width: int | None = None
            if not (isinstance(at_zero, tuple) and len(at_zero) == 2):
                return
            reference = rotary_output(rotary, layer_type, like, torch.arange(length, device=device)[None])
        self.width = reference[0].shape[-1]
        prefix = f"{layer_type}_" if layer_type else ""
        inv_freq = getattr(rotary, f"{prefix}inv_freq", None)
        scaling = getattr(rotary, f"{prefix}attention_scaling", getattr(rotary, "attention_scaling", None))
        self.inv_freq = None if inv_freq is None else inv_freq.detach().to(device, torch.float64).clone()
        self.scaling = None if scaling is None else float(scaling)
        self.exact = self.inv_freq is not None and self.scaling is not None
        if self.exact:
            check = min(length, 16)  # positions checked against the module's own
            computed = self._computed(torch.arange(check, device=device)[None])
            self.exact = all(
                got.shape == want[:, :check].shape
                and torch.allclose(got.float(), want[:, :check].float(), atol=1e-5)
                for got, want in zip(computed, reference)
            )

    def _computed(self, positions: torch.Tensor) -> CosSin:
        angles = positions.to(torch.float64)[..., None] * self.inv_freq
        emb = torch.cat([angles, angles], dim=-1)
        return (emb.cos() * self.scaling).to(self.dtype), (emb.sin() * self.scaling).to(self.dtype)

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


def family_rotation(rope: Callable[..., Any], width: int) -> RopeFn:
    """The family's RoPE as ``(q, k, cos, sin)`` over the first ``width`` dims of each head, the rest passed
    through: Gemma-3n/4 rotate one tensor at a time, ``(x, cos, sin)``; Phi, Persimmon, StableLM and GPT-NeoX
    slice their partial rotary part off before they call theirs."""
    one_tensor = next(iter(inspect.signature(rope).parameters)) == "x"

    def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        if q.shape[-1] != width or k.shape[-1] != width:
            q_rot, k_rot = apply(q[..., :width], k[..., :width], cos, sin)
            return torch.cat([q_rot, q[..., width:]], dim=-1), torch.cat([k_rot, k[..., width:]], dim=-1)
        return (rope(q, cos, sin), rope(k, cos, sin)) if one_tensor else rope(q, k, cos, sin)

    return apply


def no_rotation(q, k, cos, sin, *args, **kwargs):
    """For layers that use no RoPE (Cohere-2's global layers, SmolLM3's NoPE layers): positions do nothing."""
    return q, k


def rotate_keys(rope: RopeFn, x: torch.Tensor, cos_sin: CosSin) -> torch.Tensor:
    """Keys ``(B, H, n, D)`` rotated by the family's own function (its partial rotary, its layout)."""
    # The family's function rotates a (q, k) pair; a one-head stand-in for q keeps the wasted work to 1/H.
    return rope(x[:, :1], x, *cos_sin)[1]


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
    got, want = a * cos.unsqueeze(1) + b * sin.unsqueeze(1), rotate_keys(rope, keys, (cos, sin))
    return (a, b) if got.shape == want.shape and torch.equal(got, want) else None
