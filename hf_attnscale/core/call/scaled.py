"""One patched attention call: count the visible keys, scale the query, add the exit, run the backend.

The steps, for each call that reaches a module carrying a patch state (`hf_attnscale.core.call.state`):

1. count the keys n each query row sees, from the mask the backend receives, or from the shapes when the
   backend runs without one (sdpa's ``is_causal``);
2. multiply the query by the scale law of n (`hf_attnscale.core.options.laws`), on top of the model's own scaling;
3. add the exit (zero_kv / sink logit): natively where the backend has sinks (flash, flex), else as one more
   zero-valued key (`hf_attnscale.core.call.exit`): on extra channels through public sdpa, or a mask column (eager);
4. run the inner backend; or, with a clipped softmax, its eager formula (`hf_attnscale.core.call.clipped`).

A call may bring hooks of its own (`hf_attnscale.core.call.hooks`): a query map, an output map, a probe.

How calls get here (names, registration) is `hf_attnscale.core.call.dispatch`; this module is only the maths.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.integrations import sdpa_attention

from hf_attnscale.core import compat
from hf_attnscale.core.call.clipped import clipped_softmax_attention
from hf_attnscale.core.call.exit import combined_exit_logits, extra_key_attention
from hf_attnscale.core.call.fused_exit import exit_attention
from hf_attnscale.core.call.gate import apply_gate
from hf_attnscale.core.call.hooks import CallHooks
from hf_attnscale.core.call.masks import visible_key_counts
from hf_attnscale.core.call.state import AttnScaleState
from hf_attnscale.core.options.laws import query_multiplier

AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]

create_position_bias_mask = getattr(
    sdpa_attention, "create_position_bias_mask", compat.create_position_bias_mask
)
"""transformers' own (5.14 and later); `hf_attnscale.core.compat`'s copy where the installed one lacks it."""


def scaled_attention(
    state: AttnScaleState,
    hooks: CallHooks | None,
    backend: str,
    backend_fn: AttentionFn,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Apply the patch around one call of ``backend_fn``, the function of backend ``backend``; ``hooks`` are this
    call's own additions (`hf_attnscale.core.call.hooks`). Shapes: q ``(B,H,Tq,D)``, k/v ``(B,Hkv,Tk,D)``."""
    config = state.config
    if hooks is not None and hooks.query is not None:
        query = hooks.query(query)
    is_causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if config.scale != "none":
        n = visible_key_counts(
            query.shape[2],
            key.shape[2],
            attention_mask,
            causal=causal,
            sliding_window=kwargs.get("sliding_window"),
            bottom_right=backend.startswith("flash"),
            device=query.device,
        )
        query = query * query_multiplier(config, n, state.ssmax).unsqueeze(-1).to(query.dtype)
    if config.has_exit:
        check_exit_backend(backend, query.device)
    exit_logits = state.exit_logits(query.device) if config.has_exit else None
    if hooks is not None and hooks.probe is not None:
        hooks.probe(
            module,
            query,
            key,
            attention_mask,
            causal=causal,
            exit_logits=exit_logits,
            backend=backend,
            **kwargs,
        )
    if config.clipped_softmax is not None:
        if backend == "sdpa":
            kwargs.pop("softcap", None)  # sdpa never caps; neither does its clipped formula
        out, weights = clipped_softmax_attention(
            module,
            query,
            key,
            value,
            attention_mask,
            *state.clip_bounds(query.device),
            causal=causal,
            bottom_right=backend.startswith("flash"),
            **kwargs,
        )
    else:
        out, weights = _attend(
            backend, backend_fn, module, query, key, value, attention_mask, exit_logits, causal, **kwargs
        )
    if hooks is not None and hooks.output is not None:
        out = hooks.output(out)
    if state.output_gate is not None:
        out = apply_gate(state.output_gate, module, out)
    return out, weights


def _attend(backend, backend_fn, module, query, key, value, attention_mask, exit_logits, causal, **kwargs):
    """The backend's attention, with the exit where ``exit_logits`` (per head) is given."""
    if exit_logits is None:
        return backend_fn(module, query, key, value, attention_mask, **kwargs)
    if backend.startswith("flash") or backend == "flex_attention":
        # These backends take one row of sink logits (`s_aux`). A family with sinks of its own passes its row
        # already: two exits whose values are zero are one exit, of logit logaddexp(s1, s2).
        sinks = combined_exit_logits(exit_logits, kwargs.pop("s_aux", None))
        return backend_fn(module, query, key, value, attention_mask, s_aux=sinks, **kwargs)
    if kwargs.get("position_bias") is not None:  # a relative position bias (Inkling): fold it into the mask
        attention_mask = create_position_bias_mask(
            kwargs.pop("position_bias"), attention_mask, causal, query, key
        )
    if backend == "sdpa":
        out = exit_attention(
            backend_fn, module, query, key, value, attention_mask, exit_logits, causal, **kwargs
        )
        return out, None
    return extra_key_attention(
        backend_fn, module, query, key, value, attention_mask, exit_logits, causal, **kwargs
    )


def check_exit_backend(backend: str, device: torch.device) -> None:
    """Raise ValueError where the exit cannot run: flex_attention's sinks need CUDA (transformers' own limit)."""
    if backend == "flex_attention" and device.type == "cpu":
        raise ValueError(
            "zero_kv / sink_logit under flex_attention need a GPU (transformers runs flex sinks via its CUDA "
            "logsumexp); on CPU use attn_implementation='sdpa' or 'eager'."
        )
