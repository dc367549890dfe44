"""StreamingLLM's pos-shift for RoPE decoders, without copying any family's attention forward.

`install_streaming_forward` gives one attention module a per-instance forward. Without a `SinkCache` it
calls the class's own forward unchanged. With one, it calls that same forward with RoPE turned into the
identity (cos = 1, sin = 0, in the real cos/sin shapes, so Phi-3's partial rotary stays right): q and k come
out un-rotated, `SinkCache` stores the keys as they are and returns them rotated by their slots, and the
query is rotated by the core's ``query_hook`` just before the attention function. That function is the core
wrapper, so log-n scaling (n counted from our mask) and the zero-KV exit compose without special cases.
"""

from __future__ import annotations

import inspect
import sys
import types

import torch
from torch import nn

from .attention import STATE_NAME, inner_backend
from .cache import UNPATCHED_MESSAGE, SinkCache

ROTARY_KEY = "_hfa_rotary_emb"
"""Where the model's rotary embedding is kept in the module's ``__dict__`` (not a submodule: no double
registration in ``state_dict``, and ``deepcopy``/``.to()`` follow the model's own module)."""

STREAMING_BACKENDS = ("eager", "sdpa")
PIECE_TOKENS = 1024
"""Calls with more new tokens than this (long prompts) are processed in pieces inside each layer."""


def install_streaming_forward(module: nn.Module, model: nn.Module) -> None:
    """Route this module's calls that carry a `SinkCache` through the pos-shift path (this instance only)."""
    rotary = find_rotary_embedding(model)
    if rotary is None:
        return  # no model-level RoPE to rotate with: a SinkCache then fails with UNPATCHED_MESSAGE
    module.__dict__[ROTARY_KEY] = rotary
    module.forward = types.MethodType(streaming_attention_forward, module)


def find_rotary_embedding(model: nn.Module) -> nn.Module | None:
    """The model's shared rotary embedding module (``model.model.rotary_emb`` in the supported families)."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "rotary_emb":
            return module
    return None


def check_streaming_model(model: nn.Module) -> None:
    """Raise ValueError unless ``model`` can run with a `SinkCache` (patched RoPE decoder, eager or sdpa)."""
    from .families import attention_modules, family_for
    from .patching import _base_model, get_config

    base = _base_model(model)
    model_type = getattr(base.config, "model_type", None)
    family = family_for(model_type)
    if not (family.decoder and family.rope) or family.forward is not None:
        raise ValueError(
            f"SinkCache needs a RoPE decoder; model_type {model_type!r} is "
            f"{'an encoder' if not family.decoder else 'not a RoPE decoder'}."
        )
    if get_config(base) is None or not any(
        m.__dict__.get(ROTARY_KEY) is not None for m in attention_modules(base, family)
    ):
        raise ValueError(UNPATCHED_MESSAGE)
    _check_backend(base.config._attn_implementation)


def _check_backend(attn_implementation: str) -> None:
    inner = inner_backend(attn_implementation or "eager")
    if inner not in STREAMING_BACKENDS:
        raise ValueError(
            f"SinkCache streaming needs eager or sdpa attention (its band mask is a dense 4D mask); this model "
            f"uses {inner!r}. Load it with attn_implementation='sdpa'."
        )


def _check_sliding_window(module: nn.Module, cache: SinkCache) -> None:
    # Qwen2/3 keep the window per layer (None on full-attention layers); Mistral and Phi-3 read the config.
    own = (
        module.sliding_window
        if hasattr(module, "sliding_window")
        else getattr(module.config, "sliding_window", None)
    )
    if own is not None and own < cache.window:
        raise ValueError(
            f"This model's layer {module.layer_idx} uses sliding-window attention over {own} tokens, fewer than "
            f"the SinkCache window ({cache.window}); its queries would see keys it never saw in training. "
            f"Use SinkCache(window <= {own})."
        )


def streaming_attention_forward(self: nn.Module, *args, **kwargs):
    """Per-instance forward: the class's own forward, with pos-shift when ``past_key_values`` is a SinkCache."""
    if args[1:]:  # positional call: find the arguments by name
        bound = inspect.signature(type(self).forward).bind(self, *args, **kwargs)
        bound.arguments.pop("self")
        extra = bound.arguments.pop("kwargs", {})
        args, kwargs = (), {**bound.arguments, **extra}
    if not isinstance(kwargs.get("past_key_values"), SinkCache):
        return type(self).forward(self, *args, **kwargs)
    if args:
        kwargs["hidden_states"] = args[0]
    return _pos_shift_forward(self, **kwargs)


def _pos_shift_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    past_key_values: SinkCache,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
):
    state = self._modules.get(STATE_NAME)
    if state is None:
        raise ValueError(UNPATCHED_MESSAGE)
    _check_backend(self.config._attn_implementation)
    _check_sliding_window(self, past_key_values)
    batch, q_len = hidden_states.shape[:2]
    new_valid = new_token_validity(attention_mask, batch, q_len, hidden_states.device)
    if not bool(new_valid.any()):
        raise ValueError(
            "The attention_mask marks every new token as padding. With a cache, pass a 2D attention_mask "
            "that covers the past and the new tokens, (batch, past + new), as generate() does; or none."
        )
    if position_embeddings is None:
        zeros = torch.zeros(1, q_len, dtype=torch.long, device=hidden_states.device)
        position_embeddings = self.__dict__[ROTARY_KEY](hidden_states, zeros)
    cos, sin = position_embeddings
    # RoPE as the identity, in the real cos/sin shapes (Phi-3 rotates only part of the head).
    identity = (torch.ones_like(cos), torch.zeros_like(sin))
    if q_len <= PIECE_TOKENS:
        return _pos_shift_piece(
            self, state, hidden_states, new_valid, identity, past_key_values, True, kwargs
        )
    # A long prompt: this layer's queries in pieces, each attending to the cache the previous piece left.
    # Exact (a token's output depends only on earlier tokens), and memory stays O(piece x (S + W + piece)).
    outputs = []
    for start in range(0, q_len, PIECE_TOKENS):
        piece = slice(start, start + PIECE_TOKENS)
        part = tuple(x[:, piece] if x.shape[-2] == q_len else x for x in identity)
        out, _ = _pos_shift_piece(
            self,
            state,
            hidden_states[:, piece],
            new_valid[:, piece],
            part,
            past_key_values,
            start == 0,
            kwargs,
        )
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


def _pos_shift_piece(
    self: nn.Module,
    state: nn.Module,
    hidden_states: torch.Tensor,
    new_valid: torch.Tensor,
    identity: tuple[torch.Tensor, torch.Tensor],
    cache: SinkCache,
    new_call: bool,
    kwargs: dict,
):
    """One call of the class's forward over ``hidden_states`` (B, q, hidden), with pos-shift through ``cache``."""
    rotary = self.__dict__[ROTARY_KEY]
    plan = cache.plan(self.layer_idx, new_valid, hidden_states, rotary, new_call=new_call)
    rope = sys.modules[type(self).__module__].apply_rotary_pos_emb
    layer = cache.layer(self.layer_idx)
    layer._pending = (plan, rope)
    state.query_hook = lambda query: plan.rotate_query(rope, query)
    if plan.mode == "doubled":  # values were zero-padded to the doubled key width; drop the padding
        state.output_hook = lambda out: out[..., : out.shape[-1] // 2]
    try:
        return type(self).forward(
            self,
            hidden_states=hidden_states,
            position_embeddings=identity,
            attention_mask=plan.mask,
            past_key_values=cache,
            **kwargs,
        )
    finally:
        state.query_hook = state.output_hook = None
        layer._pending = None


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
