"""accelerate's hooks on a module as the attention call reads them: whether the patch's own parameters are
offloaded, and taking them back (`keep_resident`), so that each call finds them on its device
(`hf_attnscale.core.install.offload` says why they are never offloaded). Nothing here imports accelerate: a
dispatched model carries its hooks, and they are read as accelerate defines them."""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

HOOK_ATTR = "_hf_hook"
"""Where accelerate keeps a module's hook (`accelerate.hooks.add_hook_to_module`)."""
HOOKED_FORWARD_ATTR = "_old_forward"
"""The forward accelerate's hook wrapper calls between its ``pre_forward`` and ``post_forward``."""


def hooks_of(module: nn.Module) -> list[Any]:
    """The accelerate hooks on ``module`` itself (those of a ``SequentialHook`` one by one)."""
    hook = module.__dict__.get(HOOK_ATTR)
    return [] if hook is None else list(getattr(hook, "hooks", None) or [hook])


def hook_device(module: nn.Module) -> torch.device | None:
    """The execution device of ``module``'s own accelerate hook, or None."""
    for hook in hooks_of(module):
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return torch.device(device)  # an index names the accelerator, as for accelerate
    return None


def is_offloaded(module: nn.Module) -> bool:
    """Whether accelerate offloads ``module``'s own tensors (they are ``meta`` between its hook's calls)."""
    hook = module.__dict__.get(HOOK_ATTR)  # read on every attention call: kept short
    return hook is not None and any(getattr(h, "offload", False) for h in getattr(hook, "hooks", (hook,)))


_TAKING_BACK = threading.Lock()


def keep_resident(module: nn.Module) -> None:
    """Take back from accelerate the tensors of ``module`` and its submodules that it offloads: its hooks put their
    values back (`ModelHook.detach_hook`), and they stay, for good, on the hooks' execution device."""
    with _TAKING_BACK:  # a model is shared by threads: the first caller takes them back, the others find them
        for sub in module.modules():
            if not is_offloaded(sub):
                continue
            stored = next(hook.weights_map for hook in hooks_of(sub) if getattr(hook, "offload", False)) or {}
            lost = [
                name for name, t in sub.named_parameters(recurse=False) if t.is_meta and name not in stored
            ]
            if lost:
                raise ValueError(
                    f"accelerate offloaded this model's patch parameters ({', '.join(lost)}) without their values: "
                    "it was dispatched after it was patched, from a state dict that lacked them (PEFT does so when "
                    "it loads an adapter onto a model offloaded to CPU or disk). Patch the model after dispatching "
                    "it; for an adapter trained with learnable patch parameters, load it onto the model loaded "
                    "whole, merge it (merge_and_unload) and save it, then load that with hfa.from_pretrained("
                    "ModelClass, path, device_map=...)."
                )
            device = hook_device(sub)
            sub.__dict__[HOOK_ATTR].detach_hook(sub)
            for attr in (HOOK_ATTR, HOOKED_FORWARD_ATTR, "forward"):
                sub.__dict__.pop(attr, None)
            if device is not None:
                sub.to(device)
