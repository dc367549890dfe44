"""RoFormer self-attention, which computes its scores inline instead of using the AttentionInterface.

The replacement keeps RoFormer's projections and rotary step and hands the rest to `scaled_attention`.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_attnscale.core.call.backends import BACKENDS
from hf_attnscale.core.call.hooks import take_hooks
from hf_attnscale.core.call.scaled import scaled_attention
from hf_attnscale.core.call.state import state_of


def _roformer_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """RoFormer's own score computation, in the AttentionInterface signature."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = nn.functional.softmax(scores, dim=-1)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def roformer_self_attention_forward(
    self,
    hidden_states,
    attention_mask=None,
    sinusoidal_pos=None,
    encoder_hidden_states=None,
    cache=None,
    output_attentions=False,
    past_key_values=None,
    **kwargs,
):
    """Patched `RoFormerSelfAttention.forward` (self-attention; cross-attention runs unpatched). The cache comes
    as ``cache`` from transformers 5.24 on, as ``past_key_values`` before."""
    cache = cache if cache is not None else past_key_values
    if encoder_hidden_states is not None:
        return type(self).forward(
            self,
            hidden_states,
            attention_mask,
            sinusoidal_pos,
            encoder_hidden_states,
            cache,
            output_attentions,
            **kwargs,
        )
    hidden_shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
    query = self.query(hidden_states).view(hidden_shape).transpose(1, 2)
    key = self.key(hidden_states).view(hidden_shape).transpose(1, 2)
    value = self.value(hidden_states).view(hidden_shape).transpose(1, 2)
    if sinusoidal_pos is not None:
        rotated = self.apply_rotary_position_embeddings(
            sinusoidal_pos, query, key, value if self.rotary_value else None
        )
        query, key = rotated[0], rotated[1]
        value = rotated[2] if self.rotary_value else value
    if cache is not None:
        cache = getattr(cache, "self_attention_cache", cache)
        key, value = cache.update(key, value, self.layer_idx)
    out, probs = scaled_attention(
        state_of(self),
        take_hooks(kwargs),
        BACKENDS["eager"],
        _roformer_eager,
        self,
        query,
        key,
        value,
        attention_mask,
        scaling=self.attention_head_size**-0.5,
        dropout=self.dropout.p,
        is_causal=self.is_decoder,
    )
    return out.reshape(*hidden_states.shape[:-1], self.all_head_size), probs
