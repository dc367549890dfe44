"""A patched RoPE attention module's forward: its own, unless the cache runs the attention step itself.

StreamingLLM's pos-shift must place keys and queries at positions inside the cache, which only the cache
knows, and it must see the keys before RoPE. So a patched module that takes RoPE's ``position_embeddings``
gets this per-instance forward: when the ``past_key_values`` it is called with has an ``attention_step``
method (`hf_attnscale.SinkCache` has), that method runs the step, calling the class's forward as it needs;
otherwise the class's forward runs unchanged. The core never imports the streaming layer: this attribute is
the whole protocol.
"""

from __future__ import annotations

import functools
import inspect

from torch import nn

ATTENTION_STEP = "attention_step"


@functools.cache
def _signature(function) -> inspect.Signature:
    return inspect.signature(function)  # cached: it costs more than a small model's attention step


def cache_argument(module: nn.Module) -> str:
    """The name under which ``module``'s forward takes the cache: ``past_key_values``, or GPT-NeoX's
    ``layer_past``."""
    parameters = _signature(type(module).forward).parameters
    return (
        "layer_past"
        if "layer_past" in parameters and "past_key_values" not in parameters
        else "past_key_values"
    )


def cache_routed_forward(self: nn.Module, *args, **kwargs):
    """Per-instance forward: the class's own, or ``past_key_values.attention_step(self, **arguments)``."""
    if args[1:]:  # positional call: find the arguments by name
        bound = _signature(type(self).forward).bind(self, *args, **kwargs)
        bound.arguments.pop("self")
        extra = bound.arguments.pop("kwargs", {})
        args, kwargs = (), {**bound.arguments, **extra}
    name = cache_argument(self)
    step = getattr(kwargs.get(name), ATTENTION_STEP, None)
    if step is None:
        return type(self).forward(self, *args, **kwargs)
    if args:
        kwargs["hidden_states"] = args[0]
    kwargs["past_key_values"] = kwargs.pop(name)
    return step(self, **kwargs)
