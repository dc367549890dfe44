"""RoPE for a stream: the model's cos/sin at any position, frequencies fixed for the stream, and the rotations.

A stream keeps keys rotated between calls, so a `RopeTable` fixes the frequencies (which dynamic NTK and
LongRoPE change with the length of the call) at those of the cache's capacity. Angles are computed in float64
from the rotary module's own frequencies once shown to give its output: any position keeps full precision.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

from hf_attnscale.core.call.rope import CosSin, RotaryFrequencies, RotateFn, rotary_output

_BUILDING = threading.Lock()


def length_dependent(rotary: nn.Module) -> bool:
    """Whether ``rotary`` changes its frequencies with the length of the call (dynamic NTK, LongRoPE)."""
    kind = getattr(rotary, "rope_type", "default")
    return any(
        "dynamic" in k or k == "longrope" for k in (kind.values() if isinstance(kind, dict) else [kind])
    )


def rope_rescales_with_length(model: nn.Module) -> bool:
    """Whether a rotary embedding of ``model`` changes its frequencies with the length read: reading it in
    chunks through a cache then differs from reading it in one call, but under `frequencies_of_length`."""
    return any(length_dependent(m) for m in model.modules() if hasattr(m, "rope_type"))


@contextlib.contextmanager
def frequencies_of_length(model: nn.Module, length: int) -> Iterator[None]:
    """Within it, each rotary embedding of ``model`` whose frequencies change with the length of the call
    (`length_dependent`) gives cos/sin at the frequencies of one call over ``length`` tokens, whatever positions
    it is asked for: a read of ``length`` tokens in chunks through a cache then rotates every query and key as one
    call over them all would. transformers' dynamic update takes the length from the largest position asked
    for, so each call asks for position ``length - 1`` too, and that column of cos/sin is dropped."""

    def widen(rotary: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x, positions, *rest = args if len(args) >= 2 else (*args, kwargs.pop("position_ids"))
        last = positions.new_full((*positions.shape[:-1], 1), length - 1)
        return (x, torch.cat([positions, last], dim=-1), *rest), kwargs

    def narrow(rotary: nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
        return tuple(part[..., :-1, :] for part in output)

    rotaries = [m for m in model.modules() if hasattr(m, "rope_type") and length_dependent(m)]
    handles = [rotary.register_forward_pre_hook(widen, with_kwargs=True) for rotary in rotaries]
    handles += [rotary.register_forward_hook(narrow, with_kwargs=True) for rotary in rotaries]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


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
        frequencies = RotaryFrequencies.of(rotary, layer_type)
        self.inv_freq = (
            None if frequencies is None else frequencies.inv_freq.to(device, torch.float64).clone()
        )
        self.scaling = None if frequencies is None else frequencies.scaling
        self.exact = frequencies is not None
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


def rotation_basis(
    rope: RotateFn, keys: torch.Tensor, cos_sin: CosSin
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(a, b)`` such that ``rope(keys, cos, sin)`` is ``a * cos + b * sin`` (cos, sin broadcast
    over heads): RoPE's form ``k·cos + rot(k)·sin``, found once so that later rotations of the same keys cost
    two products and a sum. None unless the family's own rotation gives exactly that, checked bitwise at cos/sin
    of ``cos_sin``'s shape that differ in every channel (at the identity, any function would pass)."""
    cos, sin = cos_sin
    if cos.dim() != 3 or cos.shape[-1] != keys.shape[-1]:
        return None  # partial rotary, or an unusual layout: rotate the usual way
    a = rope(keys, torch.ones_like(cos), torch.zeros_like(sin))
    b = rope(keys, torch.zeros_like(cos), torch.ones_like(sin))
    angle = torch.linspace(0.3, 1.1, cos.shape[-1], device=cos.device, dtype=torch.float64)
    cos, sin = angle.cos().to(cos.dtype).expand_as(cos), angle.sin().to(sin.dtype).expand_as(sin)
    got, want = a * cos.unsqueeze(1) + b * sin.unsqueeze(1), rope(keys, cos, sin)
    return (a, b) if got.shape == want.shape and torch.equal(got, want) else None
