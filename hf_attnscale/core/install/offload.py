"""The patch on models dispatched by accelerate (``device_map``: layers spread over devices, offloaded to CPU or
disk): where its parameters live, and where its per-instance forward goes.

accelerate runs a dispatched model through hooks (``module._hf_hook``): each module runs on its hook's
``execution_device``, and an offloaded weight is a ``meta`` tensor between calls, loaded by its own module's hook
for the length of that module's forward. So:

* the patch's parameters (learnable exit logits, SSMax slopes: a few floats per head) are never offloaded: they
  live on the attention module's execution device, where the attention call that reads them runs. They train
  there (accelerate re-creates an offloaded parameter at every call, so none could), and ``save_pretrained``
  writes them as any weight. A model patched first and dispatched afterwards (``dispatch_model``) has them
  offloaded like its weights: `hf_attnscale.core.call.resident.keep_resident` takes them back from accelerate, values included, when the patch
  is next used (PEFT loading an adapter onto an offloaded model dispatches it again without their values: that
  is refused, saying what to do);
* a per-instance forward goes under the module's hook, into the ``_old_forward`` slot the hook calls, so that the
  hook still runs around it (and the class's forward is what `restore_forward` puts back).

Nothing here imports accelerate: a dispatched model carries its hooks, and they are read as accelerate defines
them.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hf_attnscale.core.call.resident import HOOK_ATTR, HOOKED_FORWARD_ATTR, hook_device


def execution_device(module: nn.Module) -> torch.device | None:
    """The device accelerate runs ``module`` on, or None when it is not dispatched.

    That is the execution device of the module's own hook or, when it has none (`accelerate.cpu_offload` hooks
    only the modules that hold weights), of its first hooked submodule.
    """
    return next((d for d in map(hook_device, module.modules()) if d is not None), None)


def run_device(model: nn.Module) -> torch.device:
    """The device ``model`` runs on and takes its inputs on: accelerate's execution device when it is dispatched
    (its first weights may be offloaded, on ``meta``), else that of its first parameter."""
    return execution_device(model) or next(model.parameters()).device


def parameter_device(module: nn.Module) -> torch.device | None:
    """Where the patch's parameters on ``module`` belong: its execution device when accelerate dispatched it,
    else the device of its weights (None: it has none).

    Raises ValueError when those weights are on ``meta`` with no hook to say where the module will run (a model
    built under ``init_empty_weights`` and not loaded yet): a parameter created there would hold no value.
    """
    device = execution_device(module)
    if device is not None:
        return device
    ref = next(module.parameters(), None)
    if ref is not None and ref.is_meta:
        raise ValueError(
            "This model's weights are on the meta device (built under init_empty_weights, and not loaded yet), so "
            "the patch's learnable parameters (sink_logit='learnable', scale='ssmax') would hold no value. Load "
            "the weights first (accelerate.load_checkpoint_and_dispatch, or from_pretrained with a device_map), "
            "then patch; hfa.from_pretrained(ModelClass, path, device_map=...) does both for a saved patch. The "
            "options without parameters can be patched before loading."
        )
    return None if ref is None else ref.device


def forward_slot(module: nn.Module) -> str:
    """The attribute of ``module`` a per-instance forward goes in: ``_old_forward`` under an accelerate hook
    (the hook's wrapper calls it), else ``forward``."""
    hooked = getattr(module, HOOK_ATTR, None) is not None and HOOKED_FORWARD_ATTR in module.__dict__
    return HOOKED_FORWARD_ATTR if hooked else "forward"


def set_forward(module: nn.Module, forward: Callable[..., Any]) -> None:
    """Make ``forward`` (a function of the module) the module's own forward, under its accelerate hook if any."""
    module.__dict__[forward_slot(module)] = types.MethodType(forward, module)


def restore_forward(module: nn.Module) -> None:
    """Give the module back its class's forward (under its accelerate hook, as the hook found it)."""
    slot = forward_slot(module)
    if slot == "forward":
        module.__dict__.pop("forward", None)
    else:
        module.__dict__[slot] = types.MethodType(type(module).forward, module)
