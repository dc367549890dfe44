"""What a stream must know of its model, found once per stream; and the one place that decides whether a
`SinkCache` can serve a model. A `StreamSpec`, kept by the cache, checks the family when the stream starts, the
backend at every call, and each attention module when the stream first meets it, where it also finds what the
module's steps need (`LayerSpec`). `check_streaming_model` asks the same of a whole model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_attnscale.core.call.backends import DENSE_MASK_BACKENDS, check_backend
from hf_attnscale.core.call.rope import ROPE_FUNCTION, RotateFn, family_rope, family_rotation, no_rotation
from hf_attnscale.core.call.state import state_of
from hf_attnscale.core.install.families import (
    attention_modules,
    is_causal_attention,
    own_sliding_window,
    takes_position_embeddings,
)
from hf_attnscale.core.install.installed import get_config
from hf_attnscale.core.install.routing import applies_rope, rotary_of
from hf_attnscale.core.install.wrappers import unwrap

from .plan import LayerGeometry, layer_geometry
from .rope import RopeTable, length_dependent

UNPATCHED_MESSAGE = (
    "This attention module cannot stream with a SinkCache, which needs a RoPE decoder patched with hfa.patch(model) "
    "(with no options it changes nothing else) on eager or sdpa attention; not encoders or models without RoPE."
)
_GPTJ = "GPT-J and CodeGen rotate interleaved pairs by a (sin, cos) table of their own, not the model's RoPE"
REFUSED_FAMILIES = {  # by model_type: why a SinkCache cannot serve the family
    "gpt_oss": "gpt-oss interleaves its RoPE halves (cos/sin of half the head), which pos-shift does not re-place",
    "gptj": _GPTJ,
    "codegen": _GPTJ,
    "dory": "Dory runs its middle layers in loops, each writing its own copy of their cache, which a SinkCache lacks",
    "beam": "Beam's NoPE layers scale attention by absolute position, with no RoPE to re-place",
    "doge": "Doge builds a dynamic mask from all its cached values, which a window evicts",
    "jetmoe": "JetMoE's mixture-of-attention routes keys through experts of its own",
    "zaya": "ZAYA's attention takes a dict of masks and a convolution state of its own",
    "falcon_h1": "Falcon-H1 runs a state-space mixer beside every attention layer, whose state a SinkCache lacks",
}
_LATENT = "its multi-head latent attention builds keys from a rotated and an unrotated part computed apart"


def check_streaming_model(model: nn.Module) -> None:
    """Raise ValueError unless ``model`` can run with a `SinkCache` (a patched RoPE decoder, eager or sdpa)."""
    root = unwrap(model)
    if get_config(root) is None:
        raise ValueError(UNPATCHED_MESSAGE)
    modules, name = attention_modules(root), f"{type(root).__name__} (model_type {root.config.model_type!r})"
    encoder = not all(is_causal_attention(m) for m in modules)
    if encoder or not all(takes_position_embeddings(m) for m in modules):
        what = "an encoder" if encoder else "a decoder whose attention takes no RoPE position_embeddings"
        raise ValueError(f"SinkCache needs a RoPE decoder; {name} is {what}.")
    _check_family(root.config)
    layers = getattr(root.config.get_text_config(), "num_hidden_layers", None)
    if isinstance(layers, int) and len(modules) < layers:
        raise ValueError(
            f"SinkCache cannot stream this {name}: only {len(modules)} of its {layers} layers are attention; the "
            "others (recurrent, linear attention or state-space layers) keep a state a SinkCache does not hold."
        )
    for module in modules:
        _check_module(module)
    check_streaming_backend(root.config._attn_implementation)


def check_streaming_backend(attn_implementation: str | None) -> None:
    """Raise ValueError unless the backend takes the dense band mask streaming needs (`DENSE_MASK_BACKENDS`)."""
    check_backend(
        attn_implementation, DENSE_MASK_BACKENDS, "SinkCache streaming (its band mask is a dense 4D mask)"
    )


def _check_family(model_config: Any) -> None:
    model_type = getattr(model_config, "model_type", None)
    reason = REFUSED_FAMILIES.get(model_type)
    if reason is None and getattr(model_config, "kv_lora_rank", None) is not None:
        reason = _LATENT
    if reason is not None:
        raise ValueError(f"SinkCache cannot stream model_type {model_type!r}: {reason}.")


def _check_module(module: nn.Module) -> tuple[nn.Module, str | None, Any]:
    """Refuse an attention module as far as its code and the patch tell; else its rotary module, the layer type
    that rotary takes, and the family's rotation its forward calls."""
    state = state_of(module)
    if state is None:
        raise ValueError(UNPATCHED_MESSAGE)
    if (method := state.config.key_parts) is not None:
        raise ValueError(
            f"SinkCache cannot stream a model patched with {method}: a sink cache already keeps every distance "
            f"within its size (sink_tokens + window). Patch without {method} to stream (a checkpoint's "
            "dual_chunk_attention_config: hfa.patch(model, config=hfa.AttnScaleConfig()))."
        )
    rotary = rotary_of(module)
    if rotary is None:
        raise ValueError(
            f"SinkCache cannot find the one rotary embedding that feeds {type(module).__name__} (none, or several "
            "to choose between), so it cannot place keys inside the cache."
        )
    rotation = family_rope(module)
    if rotation is None:
        raise ValueError(
            f"SinkCache cannot stream {type(module).__name__}: its forward does not rotate by its family's "
            f"{ROPE_FUNCTION}(q, k, cos, sin), with which pos-shift re-places keys."
        )
    return (*rotary, rotation)


@dataclass(frozen=True)
class LayerSpec:
    """What the steps of one attention module need: the family's rotation over its rotary dims (none on NoPE
    layers), the RoPE table of its layer type, and what its layer holds and reads."""

    rope: RotateFn
    table: RopeTable
    geometry: LayerGeometry


class StreamSpec:
    """What one stream knows of its model (``model_config``, checked here), found once; ``stream`` is what the
    stream's global layers hold."""

    def __init__(self, model_config: Any, stream: LayerGeometry) -> None:
        _check_family(model_config)
        self.model_config, self.stream = model_config, stream
        self.tables: dict[str | None, RopeTable] = {}  # by layer type (Gemma-3's sliding / full layers)
        self.layers: dict[int, LayerSpec] = {}

    def check_call(self) -> None:
        """Refuse a call the model's current backend cannot run (it may change between calls)."""
        check_streaming_backend(self.model_config._attn_implementation)

    def layer(self, module: nn.Module, hidden_states: torch.Tensor, kwargs: dict) -> LayerSpec:
        """The `LayerSpec` of ``module``, found at its first call (whose ``hidden_states`` and ``kwargs`` these are);
        raises ValueError, saying why, if the module cannot stream."""
        if module.layer_idx not in self.layers:
            rotary, layer_type, rotation = _check_module(module)
            if layer_type not in self.tables:
                self.tables[layer_type] = self._table(module, rotary, layer_type, hidden_states)
            table = self.tables[layer_type]
            rope = family_rotation(rotation, table.width)
            probe = hidden_states[:1, :1].detach()
            if not applies_rope(
                module,
                probe,
                table.width,
                token_slice(kwargs, hidden_states.shape[1], slice(0, 1), slice(0, 1)),
            ):
                rope = no_rotation
            geometry = layer_geometry(self.stream, own_sliding_window(module))
            self.layers[module.layer_idx] = LayerSpec(rope, table, geometry)
        return self.layers[module.layer_idx]

    def _table(
        self, module: nn.Module, rotary: nn.Module, layer_type: str | None, like: torch.Tensor
    ) -> RopeTable:
        table = RopeTable(rotary, layer_type, like, self.stream.capacity)
        if table.width is None:
            raise ValueError(
                f"SinkCache cannot stream {type(module).__name__}: its RoPE is not a (cos, sin) pair (complex "
                "frequencies, as in Llama-4 and DeepSeek-V2), so pos-shift cannot re-place its keys."
            )
        if not table.exact and length_dependent(rotary):
            raise ValueError(
                f"SinkCache cannot fix the frequencies of this model's {rotary.rope_type} RoPE "
                f"({type(rotary).__name__} does not compute cos/sin from inv_freq in the usual layout), so its keys "
                "could not stay rotated between calls. Stream it with a static rope type."
            )
        return table


def token_slice(kwargs: dict, q_len: int, tokens: slice, rows: slice = slice(None)) -> dict:
    """``kwargs`` with each per-token tensor (last dim ``q_len``: Ministral-3's ``position_ids``) cut to
    ``tokens`` (and ``rows``), for a call on part of the chunk."""
    cut = [
        n for n, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[-1] == q_len
    ]
    return {**kwargs, **{name: kwargs[name][rows, ..., tokens] for name in cut}}
