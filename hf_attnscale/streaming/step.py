"""One attention module's step through a `SinkCache`: the module's own forward, run under the call's plan.

A patched RoPE attention module hands its step to the cache (`hf_attnscale.core.install.routing`), which runs
`attention_step`: the module's class forward, given the plan's cos/sin in place of the model's (so it rotates
its queries and new keys at their positions inside the cache) and the plan's mask. The cache's ``update``
stores the keys and returns every key the queries read. When queries of one chunk see the sinks at different
distances (a plan with sink channels, `hf_attnscale.streaming.plan`), the call's query hook gives each query its
logits against the sinks at its sink distance, one channel each, and its output hook drops the values' padding.
The attention function is the core's wrapper, so log-n scaling (n counted from the plan's mask) and the exit
compose with no special case.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from transformers.cache_utils import Cache

from hf_attnscale.core.call.hooks import CallHooks
from hf_attnscale.core.call.masks import visible_entries
from hf_attnscale.core.call.rope import CosSin, RotateFn
from hf_attnscale.core.install.routing import cache_argument, forward_with_hooks

from .plan import Rotations, SlotRecord, StepPlan, build_plan, decode_plan
from .spec import LayerSpec, token_slice

PIECE_TOKENS = 1024
"""Calls with more new tokens than this (long prompts) are processed in pieces inside each layer."""
_NO_HOOKS = CallHooks()


class PendingUpdate(NamedTuple):
    """What the running layer's ``cache.update`` does: store and return keys for ``layer_idx`` under ``plan``."""

    layer_idx: int
    plan: StepPlan
    rotations: Rotations
    rope: RotateFn


@dataclass
class Call:
    """One model call through the cache, from its first attention layer to its last (the next call starts anew)."""

    first_layer: int
    new_valid: torch.Tensor  # (B, q): which new tokens are real
    masked: bool  # the call came with a mask (its new tokens may be padding)
    # each piece's plan and rotations, by the layers' geometry, the piece's start and the layers' RoPE type
    plans: dict[tuple, tuple[StepPlan, Rotations]] = field(default_factory=dict)
    pending: PendingUpdate | None = None

    @classmethod
    def begin(
        cls, first_layer: int, attention_mask: torch.Tensor | None, hidden_states: torch.Tensor
    ) -> Call:
        """The call whose first attention layer gets ``hidden_states`` and ``attention_mask``."""
        new_valid = new_token_validity(attention_mask, *hidden_states.shape[:2], hidden_states.device)
        return cls(first_layer, new_valid, attention_mask is not None)

    @functools.cached_property
    def all_valid(self) -> bool:
        """Whether no new token is padding: a host sync, which only the general path pays (never a decoding
        step). Raises ValueError when every new token is."""
        if not self.masked:
            return True
        if not bool(self.new_valid.any()):
            raise ValueError(
                "The attention_mask marks every new token as padding. With a cache, pass a 2D attention_mask "
                "that covers the past and the new tokens, (batch, past + new), as generate() does; or none."
            )
        return bool(self.new_valid.all())


def attention_step(
    cache: Cache,
    module: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: CosSin | None = None,
    attention_mask: torch.Tensor | None = None,
    past_key_values: Cache | None = None,
    **kwargs,
):
    """One attention module's step over ``hidden_states`` (B, q, hidden) through ``cache``, a `SinkCache`; the
    plan's positions replace the model's ``position_embeddings``."""
    if cache.call is None or module.layer_idx <= cache.call.first_layer:  # a new model call: its first layer
        cache.start_call(module.config.model_config, module.layer_idx, attention_mask, hidden_states)
    call, spec = cache.call, cache.spec.layer(module, hidden_states, kwargs)
    q_len, outputs, weights = hidden_states.shape[1], [], None
    for start in range(0, q_len, PIECE_TOKENS):
        # A long prompt: this layer's queries in pieces, each reading the cache the previous piece left.
        # Exact (a token's output depends only on earlier tokens); memory stays O(piece x (S + W + piece)).
        piece, whole = slice(start, start + PIECE_TOKENS), q_len <= PIECE_TOKENS
        plan, rotations = _planned(call, cache, module.layer_idx, spec, start, hidden_states.dtype)
        call.pending = PendingUpdate(module.layer_idx, plan, rotations, spec.rope)
        try:
            out, weights = forward_with_hooks(
                module,
                _sink_channel_hooks(spec.rope, rotations, lambda: cache.layers[module.layer_idx].sink_keys)
                if plan.sink_channels
                else _NO_HOOKS,
                called_as_module=whole,  # its gate has this input (a piece's is handed to it)
                hidden_states=hidden_states if whole else hidden_states[:, piece],
                position_embeddings=rotations.new,
                attention_mask=plan.mask,
                **{cache_argument(module): cache},
                **(kwargs if whole else token_slice(kwargs, q_len, piece)),
            )
        finally:
            call.pending = None
        outputs.append(out)
    return (outputs[0], weights) if len(outputs) == 1 else (torch.cat(outputs, dim=1), None)


def _planned(
    call: Call, cache: Cache, layer_idx: int, spec: LayerSpec, start: int, dtype: torch.dtype
) -> tuple[StepPlan, Rotations]:
    """The plan of the piece from ``start`` for the layers of this geometry (the first of them builds it, from
    what its cache layer holds), and its rotations for this layer's table."""
    key = (spec.geometry, start, spec.table.layer_type)
    if key not in call.plans:
        new_valid = call.new_valid[:, start : start + PIECE_TOKENS]
        layer = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
        slots = None if layer is None else layer.slots
        slots = slots or SlotRecord.empty(new_valid.shape[0], spec.geometry.sinks, new_valid.device)
        if slots.real_tokens.shape[0] != new_valid.shape[0]:
            raise ValueError(
                f"This SinkCache holds a batch of {slots.real_tokens.shape[0]} streams but got "
                f"{new_valid.shape[0]}; use one cache per batch (or cache.reset())."
            )
        # Writing into the cache in place would break autograd's saved tensors; decoding steps write in place
        # where the layer is laid out at its capacity and holds its sinks, and the table keeps any position
        # exact (they never rebase).
        laid_out = (
            layer is not None and layer.slots is not None and layer.keys.shape[2] == spec.geometry.capacity
        )
        no_grad = not torch.is_grad_enabled()
        if new_valid.shape[1] == 1 and no_grad and laid_out and slots.sinks_held and spec.table.exact:
            plan = decode_plan(slots, new_valid, spec.geometry, dtype)
        else:
            plan = build_plan(slots, new_valid, spec.geometry, dtype, call.all_valid, full_size=no_grad)
        call.plans[key] = (plan, plan.rotations(spec.table))
    return call.plans[key]


def new_token_validity(
    mask: torch.Tensor | None, batch: int, q_len: int, device: torch.device
) -> torch.Tensor:
    """``(B, q)`` bool: which new tokens are real, read from the mask transformers built for them: it covers the
    new tokens only (`SinkCache.get_mask_sizes`), ``(B|1, 1, q, q)``, so its diagonal is their padding."""
    if mask is None:
        return torch.ones(batch, q_len, dtype=torch.bool, device=device)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-2:] != (q_len, q_len):
        raise ValueError(
            "With a SinkCache, pass a 2D attention_mask (batch, past + new tokens), or none; got "
            f"{type(mask).__name__} of shape {tuple(getattr(mask, 'shape', ()))}."
        )
    return visible_entries(mask[:, 0].diagonal(dim1=-2, dim2=-1)).expand(batch, q_len).to(device)


def _sink_channel_hooks(
    rope: RotateFn, rotations: Rotations, sink_keys: Callable[[], torch.Tensor]
) -> CallHooks:
    """The hooks of a call with sink channels: each query gets one more channel per sink, holding its logit
    against that sink at the query's sink distance (the query moved to ``m_q``, dotted with the sink as stored;
    ``sink_keys()`` reads them once the call's update has stored them), which meets the sink's one-hot copy; the
    output's padding is dropped."""

    def query(q: torch.Tensor) -> torch.Tensor:
        moved, sinks = rope(q, *rotations.query), sink_keys()
        (batch, heads, length, dim), kv_heads = moved.shape, sinks.shape[1]
        grouped = moved.view(batch, kv_heads, heads // kv_heads, length, dim)
        logits = torch.einsum("bkgtd,bksd->bkgts", grouped, sinks).reshape(batch, heads, length, -1)
        return torch.cat([q, logits], dim=-1)

    def output(out: torch.Tensor) -> torch.Tensor:  # contiguous, as some families .view() it
        return out[..., : out.shape[-1] - sink_keys().shape[2]].contiguous()

    return CallHooks(query=query, output=output)
