"""Gated attention: each head's output times a sigmoid gate of the token's own input, before the output
projection (Bondarenko et al. 2023; Qiu et al. 2025, the G1 position of Qwen3-Next and Qwen3.5).

    out[b, t, h] *= 2·sigmoid(x[b, t] · W + b)      "head": one gate per head; "element": one per channel

``W`` and ``b`` start at zero, so the gate starts at exactly 1 and a retrofit starts where the pretrained model
is. ``x`` is the attention module's own input (its ``hidden_states``). A forward pre-hook that the patch puts
on each gated module (and `unpatch` removes) hands it to the attention call through a context variable,
private to the thread; a cache that runs the module's class forward itself sets it with `gate_input`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

_INPUT: contextvars.ContextVar[tuple[nn.Module, torch.Tensor] | None] = contextvars.ContextVar(
    "hfa_gate_input", default=None
)


def make_gate(kind: str, in_features: int, num_heads: int, head_dim: int) -> nn.Linear:
    """The gate's projection, zero-initialised: ``in_features`` -> one logit per head (or per channel)."""
    gate = nn.Linear(in_features, num_heads if kind == "head" else num_heads * head_dim)
    nn.init.zeros_(gate.weight)
    nn.init.zeros_(gate.bias)
    return gate


def capture_gate_input(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Forward pre-hook: remember the module's input for its attention call."""
    _INPUT.set((module, args[0] if args else kwargs.get("hidden_states")))


def release_gate_input(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    """Forward hook: forget it."""
    _INPUT.set(None)


@contextlib.contextmanager
def gate_input(module: nn.Module, hidden_states: torch.Tensor) -> Iterator[None]:
    """Hand ``hidden_states`` to the gate of ``module``'s attention calls inside the block."""
    token = _INPUT.set((module, hidden_states))
    try:
        yield
    finally:
        _INPUT.reset(token)


def apply_gate(gate: nn.Linear, module: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """``out`` ``(B, T, H, Dv)`` times ``2·sigmoid(gate(x))``, ``x`` the module's input of this call."""
    held = _INPUT.get()
    x = held[1] if held is not None and held[0] is module else None
    if x is None or x.shape[:2] != out.shape[:2]:
        raise RuntimeError(
            f"gate: {type(module).__name__}'s input for this attention call was not seen (call the module, "
            "not its forward, or wrap the call in hf_attnscale.core.gate.gate_input)."
        )
    logits = gate(x.to(gate.weight.dtype))  # (B, T, H) or (B, T, H·Dv)
    factor = 2 * torch.sigmoid(logits).view(*out.shape[:3], -1)
    return out * factor.to(out.dtype)


def set_gate_hooks(module: nn.Module, on: bool) -> None:
    """Put the two hooks on ``module`` (once), or take them off. torch keeps a module's hooks in its
    ``_forward_pre_hooks`` / ``_forward_hooks``; those are read here, not the handles, so that a deep copy of a
    gated model (which copies the hooks) can be un-gated too."""
    for hooks, hook in (
        (module._forward_pre_hooks, capture_gate_input),
        (module._forward_hooks, release_gate_input),
    ):
        for key in [key for key, held in hooks.items() if held is hook]:
            del hooks[key]
    if on:
        module.register_forward_pre_hook(capture_gate_input, with_kwargs=True)
        module.register_forward_hook(release_gate_input, with_kwargs=True)


def has_gate_hooks(module: nn.Module) -> bool:
    return capture_gate_input in module._forward_pre_hooks.values()
