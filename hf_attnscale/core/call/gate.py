"""Gated attention: each head's output times a sigmoid gate of the token's own input, before the output
projection (Bondarenko et al. 2023; Qiu et al. 2025, the G1 position of Qwen3-Next and Qwen3.5).

    out[b, t, h] *= 2·sigmoid(x[b, t] · W + b)      "head": one gate per head; "element": one per channel

``W`` and ``b`` start at zero, so the gate starts at exactly 1 and a retrofit starts where the pretrained model
is. ``x`` is the attention module's own input (its ``hidden_states``). A forward pre-hook that the patch puts
on each gated module (and `unpatch` removes) hands it to the attention call through a context variable,
private to the thread
(`hf_attnscale.core.install.gate_hooks`); a cache that runs the module's class forward itself sets it with `gate_input`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

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


def remember_gate_input(module: nn.Module, hidden_states: torch.Tensor | None) -> None:
    """Hand ``hidden_states`` to the gate of ``module``'s next attention calls (None forgets it)."""
    _INPUT.set(None if hidden_states is None else (module, hidden_states))


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
            "not its forward, or wrap the call in hf_attnscale.core.call.gate.gate_input)."
        )
    logits = gate(x.to(gate.weight.dtype))  # (B, T, H) or (B, T, H·Dv)
    factor = 2 * torch.sigmoid(logits).view(*out.shape[:3], -1)
    return out * factor.to(out.dtype)
