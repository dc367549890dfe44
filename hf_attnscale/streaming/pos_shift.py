"""StreamingLLM's pos-shift: what a `SinkCache` needs to run an attention module's step, with no copied forward.

A patched RoPE attention module hands its step to the cache (`hf_attnscale.core.routing`). The step calls the
module's own class forward with RoPE turned into the identity (cos = 1, sin = 0, in the real shapes, so partial
rotary stays right): q and k come out un-rotated, the cache stores the keys and returns them rotated at the
positions the call needs, and the query is rotated by the call's query hook (`hf_attnscale.core.hooks`) just before the attention
function. That function is the core wrapper, so log-n scaling (n counted from the cache's mask) and the exit
compose without special cases.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import nn
from transformers import DynamicCache

from hf_attnscale.core.families import attention_modules, rule_for, takes_position_embeddings
from hf_attnscale.core.gate import gate_input
from hf_attnscale.core.routing import cache_argument, rotary_of
from hf_attnscale.core.state import get_config
from hf_attnscale.core.wrappers import unwrap

STREAMING_BACKENDS = ("eager", "sdpa")
_ROTATES: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
"""Whether each attention module applies RoPE (`layer_rotates`), kept here rather than on the module, which
`hf_attnscale.core` owns: nothing of streaming stays on a model, and a module that is freed drops its entry."""
_FINDING_ROTATION = threading.Lock()
UNPATCHED_MESSAGE = (
    "This attention module cannot stream with a SinkCache. SinkCache needs a RoPE decoder patched with "
    "hfa.patch(model) (with no options it changes nothing else), using eager or sdpa attention; unpatched "
    "models, encoders and models without RoPE cannot stream."
)


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
    reason = streaming_refusal(root.config)
    if reason:
        raise ValueError(reason)
    layers = getattr(root.config.get_text_config(), "num_hidden_layers", None)
    if isinstance(layers, int) and len(modules) < layers:
        raise ValueError(
            f"SinkCache cannot stream this {type(root).__name__} (model_type {root.config.model_type!r}): only "
            f"{len(modules)} of its {layers} layers are attention; the others (recurrent, linear attention or "
            "state-space layers) keep a state of their own that a SinkCache does not hold."
        )
    if any(rotary_of(m) is None for m in modules):
        raise ValueError(
            f"SinkCache cannot find the one rotary embedding module of this {type(root).__name__} "
            "(none, or several to choose between), so it cannot place keys inside the cache."
        )
    check_streaming_backend(root.config._attn_implementation)


def streaming_refusal(model_config) -> str | None:
    """Why a `SinkCache` cannot serve this model family (from its config alone), or None."""
    model_type = getattr(model_config, "model_type", None)
    reason = rule_for(model_config).no_streaming
    if reason is None and getattr(model_config, "kv_lora_rank", None) is not None:
        reason = (
            "its multi-head latent attention builds keys from a rotated and an unrotated part computed apart, "
            "which pos-shift cannot re-place inside the cache"
        )
    return None if reason is None else f"SinkCache cannot stream model_type {model_type!r}: {reason}."


def check_streaming_backend(attn_implementation: str | None) -> None:
    """Raise ValueError unless the backend takes the dense band mask streaming needs (`STREAMING_BACKENDS`)."""
    inner = attn_implementation or "eager"
    if inner not in STREAMING_BACKENDS:
        raise ValueError(
            f"SinkCache streaming needs {' or '.join(STREAMING_BACKENDS)} attention (its band mask is a dense 4D "
            f"mask); this model uses {inner!r}. Switch with model.set_attn_implementation('sdpa')."
        )


def own_sliding_window(module: nn.Module) -> int | None:
    """The layer's own sliding window (its queries see themselves and the ``w - 1`` tokens before), or None."""
    # Qwen2/3, Gemma-2/3 and Cohere-2 keep the window per layer (None on global layers); Mistral and Phi-3 read
    # the config. 0 is no window (Qwen2-MoE keeps 0 on full layers).
    own = (
        module.sliding_window
        if hasattr(module, "sliding_window")
        else getattr(module.config, "sliding_window", None)
    )
    return own or None


def no_rotation(q, k, cos, sin, *args, **kwargs):
    """For layers that use no RoPE (Cohere-2's global layers, SmolLM3's NoPE layers): positions do nothing."""
    return q, k


def layer_rotates(module: nn.Module, hidden_states, position_embeddings, identity, **extra) -> bool:
    """Whether this layer applies RoPE at all, found once by running it with and without a rotation.

    Some families skip RoPE on some layers (NoPE); rotating their keys in the cache would be wrong. The keys
    the layer hands its cache are compared under the identity and under real, non-trivial cos/sin.
    """
    found = _ROTATES.get(module)
    if found is None:
        with _FINDING_ROTATION:  # found once per module, whichever stream asks first; never changed after
            if module not in _ROTATES:
                _ROTATES[module] = _rotates(module, hidden_states, position_embeddings, identity, extra)
            found = _ROTATES[module]
    return found


def _rotates(module: nn.Module, hidden_states, position_embeddings, identity, extra: dict) -> bool:
    """Compare the keys the layer hands its cache under the identity and under a real, non-trivial rotation."""
    probe = hidden_states[:1, :2].detach()
    extra = per_token_slice(extra, hidden_states.shape[1], slice(0, 2), batch=slice(0, 1))
    cos, sin = position_embeddings
    turned = (cos[:1, -1:].expand(1, probe.shape[1], -1), sin[:1, -1:].expand(1, probe.shape[1], -1))
    turned = turned if bool((turned[1] != 0).any()) else _some_rotation(turned)
    keys = []
    for embeddings in (
        (identity[0][:1, :1].expand_as(turned[0]), identity[1][:1, :1].expand_as(turned[1])),
        turned,
    ):
        recorder = DynamicCache()
        with torch.no_grad(), gate_input(module, probe):
            type(module).forward(
                module,
                hidden_states=probe,
                position_embeddings=embeddings,
                attention_mask=None,
                **{cache_argument(module): recorder},
                **extra,
            )
        keys.append(recorder.layers[module.layer_idx].keys)
    return not torch.equal(keys[0], keys[1])


def per_token_slice(kwargs: dict, q_len: int, tokens: slice, batch: slice = slice(None)) -> dict:
    """``kwargs`` with each per-token tensor (last dim ``q_len``: Ministral-3's ``position_ids``) cut to
    ``tokens``, for a call on part of the chunk."""
    return {
        name: value[batch, ..., tokens]
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[-1] == q_len
        else value
        for name, value in kwargs.items()
    }


def _some_rotation(cos_sin):
    cos, sin = cos_sin
    angle = torch.linspace(0.3, 1.1, cos.shape[-1], device=cos.device)
    return angle.cos().to(cos.dtype).expand_as(cos), angle.sin().to(sin.dtype).expand_as(sin)


def new_token_validity(
    mask: torch.Tensor | None, batch: int, q_len: int, device: torch.device
) -> torch.Tensor:
    """``(B, q)`` bool: which new tokens are real, read from the mask transformers built for them.

    `SinkCache.get_mask_sizes` makes that mask cover the new tokens only: ``(B|1, 1, q, q)``, causal and
    padded, so its diagonal is exactly the padding of the new tokens (None: no padding).
    """
    if mask is None:
        return torch.ones(batch, q_len, dtype=torch.bool, device=device)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-2:] != (q_len, q_len):
        raise ValueError(
            "With a SinkCache, pass a 2D attention_mask (batch, past + new tokens), or none; got "
            f"{type(mask).__name__} of shape {tuple(getattr(mask, 'shape', ()))}."
        )
    diagonal = mask[:, 0].diagonal(dim1=-2, dim2=-1)
    if diagonal.dtype != torch.bool:
        diagonal = diagonal > torch.finfo(diagonal.dtype).min / 2
    return diagonal.expand(batch, q_len).to(device)
