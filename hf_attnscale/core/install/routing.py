"""A patched RoPE attention module's forward: its own, unless the cache runs the attention step itself, or the
patch asks for ReRoPE.

StreamingLLM's pos-shift must place keys and queries at positions inside the cache, which only the cache
knows. So a patched module that takes RoPE's ``position_embeddings``
gets this per-instance forward: when the ``past_key_values`` it is called with has an ``attention_step``
method (`hf_attnscale.SinkCache` has), that method runs the step, calling the class's forward as it needs;
otherwise the class's forward runs unchanged. The core never imports the streaming layer: this attribute, the
rotary embedding the patch found for each module (`rotary_of`) and the per-call hooks (`forward_with_hooks`)
are the whole protocol.

Under a method of key parts (ReRoPE, Self-Extend, DCA: `hf_attnscale.core.parts`), the class's forward runs with
the identity rotation in place of the model's cos/sin, so its attention call gets raw queries and keys (and its
cache stores raw keys), with hooks that carry what the call needs to rotate them at each part's positions
(`hf_attnscale.core.parts.engine.PartsCall`). A layer that applies no RoPE (the patch found none for it) runs as
it is.

Why this lives in the core: the patch is the one place that sees the whole model (to find the rotary module
that feeds each attention module) and the one transaction that installs and removes per-instance forwards
all at once, exactly; the streaming layer builds on it and only reads what it records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import StaticLayer

from hf_attnscale.core.call.gate import gate_input
from hf_attnscale.core.call.hooks import HOOKS_KWARG, CallHooks, ambient_hooks, using_hooks
from hf_attnscale.core.call.memo import memoize
from hf_attnscale.core.call.rope import RotaryFrequencies, family_rope, family_rotation
from hf_attnscale.core.call.state import state_of
from hf_attnscale.core.install.families import Rotary, own_sliding_window
from hf_attnscale.core.install.wrappers import wrapped
from hf_attnscale.core.options.declare import RAW, Method
from hf_attnscale.core.options.methods import method_of
from hf_attnscale.core.parts.engine import PartsCall, check_parts_backend
from hf_attnscale.core.parts.turns import at_store

ATTENTION_STEP = "attention_step"
CACHE_ARGUMENTS = ("past_key_values", "cache", "layer_past")
"""The names attention forwards take the cache under, across the transformers versions supported."""
ROTARY_ATTR = "_hfa_rotary"
"""Per-instance attribute where the patch records the rotary embedding feeding a RoPE attention module."""


@memoize()
def _signature(function) -> inspect.Signature:
    return inspect.signature(function)  # cached: it costs more than a small model's attention step


def cache_argument(module: nn.Module) -> str:
    """The name under which ``module``'s forward (an attention module's, or a whole model's) takes the cache:
    ``past_key_values`` (transformers < 5.24), ``cache`` (5.24 on, where the old name is deprecated) or
    GPT-NeoX's ``layer_past``. A wrapper whose forward names none (PEFT's ``PeftModelForCausalLM``, which
    passes its keywords on; DataParallel; torch.compile) takes it under the name of the model it wraps;
    ``past_key_values`` where no forward names one."""
    seen: nn.Module | None = module
    while seen is not None:
        parameters = _signature(type(seen).forward).parameters
        name = next((name for name in CACHE_ARGUMENTS if name in parameters), None)
        if name is not None:
            return name
        seen = wrapped(seen)
    return CACHE_ARGUMENTS[0]


def cache_routed_forward(self: nn.Module, *args, **kwargs):
    """Per-instance forward: the class's own, or ``past_key_values.attention_step(self, **arguments)``."""
    if args[1:]:  # positional call: find the arguments by name
        bound = _signature(type(self).forward).bind(self, *args, **kwargs)
        bound.arguments.pop("self")
        extra = bound.arguments.pop("kwargs", {})
        args, kwargs = (), {**bound.arguments, **extra}
    name = next((n for n in CACHE_ARGUMENTS if hasattr(kwargs.get(n), ATTENTION_STEP)), None)
    if name is None:
        state = state_of(self)
        method = None if state is None else _method(state.config)
        if method is not None and rotary_of(self) is not None and not _sees_nothing_changed(self, method):
            if args:
                kwargs["hidden_states"] = args[0]
            return _parts_forward(self, method, **kwargs)
        return type(self).forward(self, *args, **kwargs)
    if args:
        kwargs["hidden_states"] = args[0]
    cache = kwargs.pop(name)
    return getattr(cache, ATTENTION_STEP)(self, past_key_values=cache, **kwargs)


@memoize()
def _method(config: Any) -> Method | None:
    return method_of(config)  # a config is frozen: its method, declared once


def _sees_nothing_changed(module: nn.Module, method: Method) -> bool:
    """Whether ``module``'s own sliding window keeps every pair nearer than the distances ``method`` changes (Gemma-3's
    local layers, 512 keys, under ReRoPE w8192): the layer then runs as the model has it, without the factor."""
    window = own_sliding_window(module)
    return window is not None and window <= method.exact_below


def _parts_forward(self: nn.Module, method: Method, position_embeddings: Any, **kwargs: Any):
    """The class's forward with the rotation of the method's store in place of the model's (the identity: raw
    queries and keys), its attention call given the method's `PartsCall`."""
    check_parts_backend(self.config.model_config._attn_implementation, method)
    cache = next((kwargs[name] for name in CACHE_ARGUMENTS if kwargs.get(name) is not None), None)
    layers, index = getattr(cache, "layers", ()), getattr(self, "layer_idx", None)
    if index is not None and index < len(layers) and isinstance(layers[index], StaticLayer):
        raise ValueError(
            f"{method.option}: a static cache (StaticCache, cache_implementation='static') hands attention its "
            f"whole buffer, so {method.name} cannot tell how far each key is; decode with a DynamicCache (the "
            "default)."
        )
    cos, sin = position_embeddings
    rotary, layer_type = rotary_of(self)
    frequencies = RotaryFrequencies.of(rotary, layer_type)
    positions = kwargs.get("position_ids")
    call = PartsCall(
        method=method,
        rope=family_rotation(family_rope(self), cos.shape[-1]),
        frequencies=frequencies,
        own=(cos, sin),
        positions=positions,
        layer=index,
        kept=cache is not None and not self.training,
    )
    if method.store == RAW:
        one, zero = _identity(cos.dtype, cos.device)
        stored = (one.expand_as(cos), zero.expand_as(sin))  # views: no operator in any layer
    else:  # where the method keeps its keys: cos/sin at those places of the model's positions
        if positions is None or positions.dim() != 2:
            past = cache.get_seq_length(index) if cache is not None and index is not None else 0
            positions = torch.arange(past, past + cos.shape[-2], device=cos.device)[None]
        stored = at_store(method, frequencies, positions, cos.dtype, index)  # once in a forward
    hooks = CallHooks(parts=call)
    return forward_with_hooks(self, hooks, called_as_module=True, position_embeddings=stored, **kwargs)


@memoize()
def _identity(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos = 1 and sin = 0, ``(1, 1, 1)``, to expand to any call's cos/sin: made once, not in every layer of
    every call (outside inference mode, so that a pair made under it serves training too)."""
    with torch.inference_mode(False):
        return torch.ones(1, 1, 1, dtype=dtype, device=device), torch.zeros(
            1, 1, 1, dtype=dtype, device=device
        )


def applies_rope(module: nn.Module, probe: torch.Tensor, width: int, kwargs: dict[str, Any]) -> bool:
    """Whether the layer applies RoPE at all: NoPE layers (Cohere-2's global ones, SmolLM3's) decide it in their
    own code, which no config field states for every family. So the module runs once, on ``probe`` (one token's
    hidden state, ``(1, 1, hidden)``; ``kwargs``: that token's other arguments), with a zero rotation
    (cos = sin = 0): the keys it hands its cache vanish in the ``width`` rotary dims exactly when it rotates."""
    recorder, zero = DynamicCache(), probe.new_zeros(1, 1, width)
    arguments = {"hidden_states": probe, "position_embeddings": (zero, zero), "attention_mask": None}
    arguments |= {cache_argument(module): recorder, **kwargs}
    with torch.no_grad(), gate_input(module, probe):
        type(module).forward(module, **arguments)
    return not bool(recorder.layers[module.layer_idx].keys[..., :width].any())


def rotary_of(module: nn.Module) -> Rotary | None:
    """The rotary embedding the patch found for ``module`` (None: not patched, no RoPE, or no single one)."""
    return module.__dict__.get(ROTARY_ATTR)


def forward_with_hooks(module: nn.Module, hooks: CallHooks, *, called_as_module: bool = False, **kwargs: Any):
    """``module``'s class forward, with ``hooks`` on the attention call it makes (a probe set around the whole
    model is kept).

    The hooks travel as the forward's keyword argument ``hfa_hooks``, which transformers passes on to the
    attention function; a forward that takes no arbitrary keywords gets them through the context instead.
    ``called_as_module``: the module itself was called (its forward pre-hooks ran, the gate's among them), so its
    gate already has this call's input. Under torch.compile no context variable is read (a graph runs no probe).
    """
    ambient = None if torch.compiler.is_compiling() else ambient_hooks()
    if ambient is not None and hooks.probe is None:
        hooks = dataclasses.replace(hooks, probe=ambient.probe)
    forward = type(module).forward
    given = contextlib.nullcontext() if called_as_module else gate_input(module, kwargs.get("hidden_states"))
    with given:
        if _takes_any_keyword(forward):
            return forward(module, **kwargs, **{HOOKS_KWARG: hooks})
        with using_hooks(hooks):
            return forward(module, **kwargs)


@memoize()
def _takes_any_keyword(function) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in _signature(function).parameters.values())
