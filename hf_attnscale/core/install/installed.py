"""Which modules of a model carry a patch, and the patch in force on it."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from hf_attnscale.core.call.state import STATE_NAME, active_state
from hf_attnscale.core.install.wrappers import unwrap
from hf_attnscale.core.options.config import AttnScaleConfig


def patched_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` of every module of ``model`` (unwrapped) that carries a patch state, in order."""
    for name, module in unwrap(model).named_modules():
        if module._modules.get(STATE_NAME) is not None:
            yield name, module


def get_config(model: nn.Module) -> AttnScaleConfig | None:
    """The `AttnScaleConfig` in force on ``model`` (or any wrapper of it, or any model inside it), or None.

    Only a patch whose state is installed counts: a model built from a patched model's config, or loaded
    without `hfa.patch`, reports None even though its config records a patch.
    """
    for _, module in patched_modules(model):
        state = active_state(module._modules[STATE_NAME])
        if state is not None:
            return state.config
    return None
