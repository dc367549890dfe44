"""What a stream must know of the model it runs on, found once per stream; and every reason a model cannot stream.

This is the one place that decides whether a `SinkCache` can serve a model. A `StreamSpec` (kept by the cache)
checks the model's family when the stream starts, its backend at every call, and each attention module the
first time the stream meets it, where it also finds what the module's steps need (`LayerSpec`): the family's
rotation, the RoPE table, and what the layer holds and reads. `check_streaming_model` asks the same questions
of a whole model, before a stream starts.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from hf_attnscale.core.families import attention_modules, takes_position_embeddings
from hf_attnscale.core.gate import gate_input
from hf_attnscale.core.routing import cache_argument, rotary_of
from hf_attnscale.core.state import get_config, state_of
from hf_attnscale.core.wrappers import unwrap

from .plan import LayerGeometry, layer_geometry
from .rope import RopeFn, RopeTable, first_dims_rope, length_dependent, no_rotation, pair_rope, rotary_output

STREAMING_BACKENDS = ("eager", "sdpa")
ROPE_FUNCTION = "apply_rotary_pos_emb"
"""The name under which an attention forward calls its family's rotation, ``(q, k, cos, sin)``."""
UNPATCHED_MESSAGE = (
    "This attention module cannot stream with a SinkCache. SinkCache needs a RoPE decoder patched with "
    "hfa.patch(model) (with no options it changes nothing else), using eager or sdpa attention; unpatched "
    "models, encoders and models without RoPE cannot stream."
)
_GPTJ = (
    "GPT-J and CodeGen rotate interleaved pairs with (sin, cos) read from a table of their own, which pos-shift "
    "does not re-place"
)
REFUSED_FAMILIES = {
    "gpt_oss": "gpt-oss interleaves its RoPE halves (cos/sin of half the head), which pos-shift does not re-place",
    "gptj": _GPTJ,
    "codegen": _GPTJ,
    "dory": "Dory runs its middle layers in loops, each loop writing its own copy of their cache layers (or "
    "reading the last loop's keys), which a SinkCache does not hold",
    "beam": "Beam's NoPE layers scale attention by absolute position, with no RoPE to re-place",
    "doge": "Doge builds a dynamic mask from all its cached values, which a window evicts",
    "jetmoe": "JetMoE's mixture-of-attention routes keys through experts of its own",
    "zaya": "ZAYA's attention takes a dict of masks and a convolution state of its own",
    "falcon_h1": "Falcon-H1 runs a state-space mixer beside every attention layer, whose state a SinkCache does "
    "not hold",
}
"""Families a `SinkCache` cannot serve, by ``model_type``, and why."""


def check_streaming_model(model: nn.Module) -> None:
    """Raise ValueError unless ``model`` can run with a `SinkCache` (a patched RoPE decoder, eager or sdpa)."""
    root = unwrap(model)
    if get_config(root) is None:
        raise ValueError(UNPATCHED_MESSAGE)
    modules = attention_modules(root)
    encoder = not all(getattr(m, "is_causal", True) for m in modules)
    if encoder or not all(takes_position_embeddings(m) for m in modules):
        what = "an encoder" if encoder else "a decoder whose attention takes no RoPE position_embeddings"
        raise ValueError(
            f"SinkCache needs a RoPE decoder; {type(root).__name__} (model_type "
            f"{root.config.model_type!r}) is {what}."
        )
    _raise(family_refusal(root.config))
    layers = getattr(root.config.get_text_config(), "num_hidden_layers", None)
    if isinstance(layers, int) and len(modules) < layers:
        raise ValueError(
            f"SinkCache cannot stream this {type(root).__name__} (model_type {root.config.model_type!r}): only "
            f"{len(modules)} of its {layers} layers are attention; the others (recurrent, linear attention or "
            "state-space layers) keep a state of their own that a SinkCache does not hold."
        )
    for module in modules:
        _raise(_module_refusal(module))
    check_backend(root.config._attn_implementation)


def family_refusal(model_config: Any) -> str | None:
    """Why a `SinkCache` cannot serve this model family (from its config alone), or None."""
    model_type = getattr(model_config, "model_type", None)
    reason = REFUSED_FAMILIES.get(model_type)
    if reason is None and getattr(model_config, "kv_lora_rank", None) is not None:
        reason = (
            "its multi-head latent attention builds keys from a rotated and an unrotated part computed apart, "
            "which pos-shift cannot re-place inside the cache"
        )
    return None if reason is None else f"SinkCache cannot stream model_type {model_type!r}: {reason}."


def check_backend(attn_implementation: str | None) -> None:
    """Raise ValueError unless the backend takes the dense band mask streaming needs (`STREAMING_BACKENDS`)."""
    inner = attn_implementation or "eager"
    if inner not in STREAMING_BACKENDS:
        raise ValueError(
            f"SinkCache streaming needs {' or '.join(STREAMING_BACKENDS)} attention (its band mask is a dense 4D "
            f"mask); this model uses {inner!r}. Switch with model.set_attn_implementation('sdpa')."
        )


def _module_refusal(module: nn.Module) -> str | None:
    """Why this attention module cannot stream, as far as its code and the patch tell (None: it can)."""
    if state_of(module) is None:
        return UNPATCHED_MESSAGE
    if rotary_of(module) is None:
        return (
            f"SinkCache cannot find the one rotary embedding module that feeds {type(module).__name__} (none, or "
            "several to choose between), so it cannot place keys inside the cache."
        )
    if _family_rope(module) is None:
        return (
            f"SinkCache cannot stream {type(module).__name__}: its forward does not rotate by the family's "
            f"{ROPE_FUNCTION}(q, k, cos, sin), which pos-shift re-places keys with."
        )
    return None


def _family_rope(module: nn.Module) -> Any:
    """The rotation the module's forward calls, where Python finds it: in the forward's own globals."""
    forward = inspect.unwrap(type(module).forward)
    code = getattr(forward, "__code__", None)
    if code is None or ROPE_FUNCTION not in code.co_names:
        return None
    return forward.__globals__.get(ROPE_FUNCTION)


def _raise(reason: str | None) -> None:
    if reason is not None:
        raise ValueError(reason)


@dataclass(frozen=True)
class LayerSpec:
    """What the steps of one attention module need: the family's rotation over its rotary dims (none on NoPE
    layers), the RoPE table of its layer type, and what its layer holds and reads."""

    rope: RopeFn
    table: RopeTable
    geometry: LayerGeometry


class StreamSpec:
    """What one stream knows of its model, found once: the family checked when it starts, each layer when the
    stream first meets it.

    Args:
        model_config: the model's config (the stream's first call reads it).
        sinks, window: the stream's cache size.
    """

    def __init__(self, model_config: Any, sinks: int, window: int) -> None:
        _raise(family_refusal(model_config))
        self.model_config, self.sinks, self.window = model_config, sinks, window
        self.tables: dict[str | None, RopeTable] = {}  # by layer type (Gemma-3's sliding / full layers)
        self.layers: dict[int, LayerSpec] = {}

    def check_call(self) -> None:
        """Refuse a call the model's current backend cannot run (it may change between calls)."""
        check_backend(self.model_config._attn_implementation)

    def layer(self, module: nn.Module, hidden_states: torch.Tensor, kwargs: dict) -> LayerSpec:
        """The `LayerSpec` of ``module``, found at its first call (``hidden_states`` and ``kwargs`` are that
        call's); raises ValueError, saying why, if the module cannot stream."""
        found = self.layers.get(module.layer_idx)
        if found is None:
            found = self.layers[module.layer_idx] = self._find(module, hidden_states, kwargs)
        return found

    def _find(self, module: nn.Module, hidden_states: torch.Tensor, kwargs: dict) -> LayerSpec:
        _raise(_module_refusal(module))
        rotary, layer_type = rotary_of(module)
        if layer_type not in self.tables:
            at_zero = torch.zeros(1, 1, dtype=torch.long, device=hidden_states.device)
            output = rotary_output(rotary, layer_type, hidden_states, at_zero)
            if not (isinstance(output, tuple) and len(output) == 2):
                raise ValueError(
                    f"SinkCache cannot stream {type(module).__name__}: its RoPE is not a (cos, sin) pair (complex "
                    "frequencies, as in Llama-4 and DeepSeek-V2), so pos-shift cannot re-place its keys."
                )
            table = RopeTable(rotary, layer_type, hidden_states, self.sinks + self.window)
            if not table.exact and length_dependent(rotary):
                raise ValueError(
                    f"SinkCache cannot fix the frequencies of this model's {rotary.rope_type} RoPE "
                    f"({type(rotary).__name__} does not compute cos/sin from inv_freq in the usual layout), so its "
                    "keys could not stay rotated between calls. Stream it with a static rope type."
                )
            self.tables[layer_type] = table
        table = self.tables[layer_type]
        rotates = _applies_rope(module, hidden_states, table.width, kwargs)
        rope = first_dims_rope(pair_rope(_family_rope(module)), table.width) if rotates else no_rotation
        return LayerSpec(rope, table, layer_geometry(self.sinks, self.window, _own_sliding_window(module)))


def _own_sliding_window(module: nn.Module) -> int | None:
    """The layer's own sliding window (its queries see themselves and the ``w - 1`` tokens before), or None."""
    # Qwen2/3, Gemma-2/3 and Cohere-2 keep the window per layer (None on global layers); Mistral and Phi-3 read
    # the config. 0 is no window (Qwen2-MoE keeps 0 on full layers).
    if hasattr(module, "sliding_window"):
        return module.sliding_window or None
    return getattr(module.config, "sliding_window", None) or None


def _applies_rope(module: nn.Module, hidden_states: torch.Tensor, width: int, kwargs: dict) -> bool:
    """Whether the layer applies RoPE at all: NoPE layers (Cohere-2's global ones, SmolLM3's) decide it in their
    own code, which no config field states for every family. So the module runs once, on one token, with a zero
    rotation (cos = sin = 0): the keys it hands its cache vanish in the rotary dims exactly when it rotates."""
    probe = hidden_states[:1, :1].detach()
    zero = probe.new_zeros(1, 1, width)
    recorder = DynamicCache()
    with torch.no_grad(), gate_input(module, probe):
        type(module).forward(
            module,
            hidden_states=probe,
            position_embeddings=(zero, zero),
            attention_mask=None,
            **{cache_argument(module): recorder},
            **token_slice(kwargs, hidden_states.shape[1], slice(0, 1), rows=slice(0, 1)),
        )
    return not bool(recorder.layers[module.layer_idx].keys[..., :width].any())


def token_slice(kwargs: dict, q_len: int, tokens: slice, rows: slice = slice(None)) -> dict:
    """``kwargs`` with each per-token tensor (last dim ``q_len``: Ministral-3's ``position_ids``) cut to
    ``tokens`` (and ``rows``), for a call on part of the chunk."""
    return {
        name: value[rows, ..., tokens]
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[-1] == q_len
        else value
        for name, value in kwargs.items()
    }
