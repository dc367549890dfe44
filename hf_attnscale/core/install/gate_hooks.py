"""The gate's forward hooks on each gated module: they hand the module's input to its attention calls
(`hf_attnscale.core.call.gate`). `hfa.patch` puts them on; `unpatch` takes them off."""

from __future__ import annotations

from typing import Any

from torch import nn

from hf_attnscale.core.call.gate import remember_gate_input


def capture_gate_input(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Forward pre-hook: remember the module's input for its attention call."""
    remember_gate_input(module, args[0] if args else kwargs.get("hidden_states"))


def release_gate_input(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    """Forward hook: forget it."""
    remember_gate_input(module, None)


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
