"""How a patched module's attention calls reach `scaled_attention`, through transformers' AttentionInterface.

transformers v5 attention modules call ``ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
eager_attention_forward)``. A patched module reads its config through a `PatchedConfigView`: the model's
own config in every respect, except that ``_attn_implementation`` names ``hfa_<backend>``, a wrapper registered
once per process (for every supported backend, when the first view is made) around the backend the model
is set to *now*. So:

* the model itself (mask creation, ``output_attentions`` checks, ``set_attn_implementation``) still sees its
  real backend, and switching backends switches the wrapped one: the patch follows;
* only modules given the view (and an `AttnScaleState`) are affected: other models are untouched.
"""

from __future__ import annotations

import threading
from typing import Any

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from hf_attnscale.core.call.backends import BACKENDS, Backend, check_backend
from hf_attnscale.core.call.exit import AttentionFn
from hf_attnscale.core.call.hooks import take_hooks
from hf_attnscale.core.call.scaled import scaled_attention
from hf_attnscale.core.call.state import state_of

PREFIX = "hfa_"


def backend_name(backend: str) -> str:
    """The registered name of the wrapper around ``backend``."""
    return PREFIX + backend


_REGISTERING = threading.Lock()


def register_backends() -> None:
    """Register the wrapper around every supported backend (once per process, whichever thread asks first)."""
    with _REGISTERING:
        for backend in BACKENDS.values():
            if backend_name(backend.name) not in ALL_ATTENTION_FUNCTIONS:
                AttentionInterface.register(backend_name(backend.name), _make_wrapper(backend))


class PatchedConfigView:
    """A patched attention module's ``config``: the model's config, with the hfa wrapper as its backend.

    Reads and writes go to the model's config object (so ``set_attn_implementation`` and later config changes
    are seen at once); only ``_attn_implementation`` differs: ``hfa_<the model's current backend>``.
    """

    def __init__(self, config: Any) -> None:
        register_backends()  # here, not in the attention call: a view exists before any call reads it
        object.__setattr__(self, "model_config", config)

    @property
    def _attn_implementation(self) -> str:
        return backend_name(check_backend(self.model_config._attn_implementation))

    def __getattr__(self, name: str) -> Any:
        if name == "model_config":  # not set yet: being unpickled
            raise AttributeError(name)
        return getattr(self.model_config, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.model_config, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self.model_config, name)

    def __reduce__(self):
        return (PatchedConfigView, (self.model_config,))

    def __repr__(self) -> str:
        return (
            f"PatchedConfigView({self.model_config._attn_implementation!r} -> {self._attn_implementation!r})"
        )


def routed_config(config: Any) -> PatchedConfigView:
    """The view a patched module reads instead of ``config`` (a view is re-based on the model's config)."""
    return PatchedConfigView(config.model_config if isinstance(config, PatchedConfigView) else config)


def _make_wrapper(backend: Backend) -> AttentionFn:
    """The attention function registered as ``hfa_<backend>``: what the backend does was decided in ``backend``."""

    def hfa_attention_forward(module, query, key, value, attention_mask, **kwargs):
        backend_fn = backend.function(module)
        hooks = take_hooks(kwargs)
        state = state_of(module)
        if state is None:  # e.g. cross-attention modules of a patched model
            return backend_fn(module, query, key, value, attention_mask, **kwargs)
        return scaled_attention(
            state, hooks, backend, backend_fn, module, query, key, value, attention_mask, **kwargs
        )

    hfa_attention_forward.__name__ = f"hfa_{backend.name}_attention_forward"
    return hfa_attention_forward
