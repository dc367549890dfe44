"""One patched attention call: count the visible keys, scale the query, add the exit, run the backend.

The steps, for each call that reaches a module carrying a patch state (`hf_attnscale.core.call.state`):

1. count the keys n each query row sees, from the mask the backend receives, or from the shapes when the
   backend runs without one (sdpa's ``is_causal``);
2. multiply the query by the scale law of n (`hf_attnscale.core.options.laws`), on top of the model's own scaling;
3. add the exit (zero_kv / sink logit): natively where the backend has sinks (flash, flex), else as one more
   zero-valued key (`hf_attnscale.core.call.exit`): on extra channels through public sdpa, or a mask column (eager);
4. run the inner backend; or, with a clipped softmax, its eager formula (`hf_attnscale.core.call.clipped`);
   under a method of key parts (ReRoPE, Self-Extend, DCA) hand the backend's call to the call's parts
   (`hf_attnscale.core.parts.engine`), which run it on each of theirs.

A call may bring hooks of its own (`hf_attnscale.core.call.hooks`): a query map, an output map, a probe.

How calls get here (names, registration) is `hf_attnscale.core.call.dispatch`; this module is only the maths.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_attnscale.core.call.backends import Backend
from hf_attnscale.core.call.clipped import clipped_softmax_attention
from hf_attnscale.core.call.exit import AttentionFn, ExitCall
from hf_attnscale.core.call.gate import apply_gate
from hf_attnscale.core.call.hooks import CallHooks, Execution
from hf_attnscale.core.call.masks import visible_key_counts
from hf_attnscale.core.call.memo import memoize
from hf_attnscale.core.call.shifted import shifted_sparse_attention
from hf_attnscale.core.call.state import AttnScaleState
from hf_attnscale.core.options.laws import query_multiplier


def scaled_attention(
    state: AttnScaleState,
    hooks: CallHooks | None,
    backend: Backend,
    backend_fn: AttentionFn,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Apply the patch around one call of ``backend_fn``, the function of ``backend``; ``hooks`` are this
    call's own additions (`hf_attnscale.core.call.hooks`). Shapes: q ``(B,H,Tq,D)``, k/v ``(B,Hkv,Tk,D)``."""
    config = state.config
    if hooks is not None and (hooks.query is not None or hooks.parts is not None):
        # a SinkCache's sink channels and joined key parts widen the query: the model's scale is of the head dim
        kwargs["scaling"] = kwargs.get("scaling") or query.shape[-1] ** -0.5
    if hooks is not None and hooks.query is not None:
        query = hooks.query(query)
    is_causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if config.scale != "none":
        shape = (query.shape[2], key.shape[2], causal, kwargs.get("sliding_window"), backend.bottom_right)
        fixed = query.shape[2] == 1 and attention_mask is None and state.ssmax is None
        if fixed:
            multiplier = _step_multiplier(config, *shape, query.device, query.dtype)
        else:
            multiplier = _multiplier(config, *shape, query.device, query.dtype, attention_mask, state.ssmax)
        query = query * multiplier
    exit_logits = None
    if config.has_exit:
        backend.check_exit(query.device)
        exit_logits = state.exit_logits(query.device)
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
    if config.clipped_softmax is not None and not backend.soft_caps:
        kwargs.pop("softcap", None)  # the backend would not cap; neither does its clipped formula

    def attend(query, key, value, attention_mask, causal=causal):
        """The backend's call, or the clipped formula's; with the exit where there is one."""
        if config.clipped_softmax is not None:
            bounds = state.clip_bounds(query.device)
            return clipped_softmax_attention(
                module,
                query,
                key,
                value,
                attention_mask,
                *bounds,
                causal=causal,
                bottom_right=backend.bottom_right,
                **kwargs,
            )
        if exit_logits is None:
            return backend_fn(module, query, key, value, attention_mask, **kwargs)
        return backend.exit(
            ExitCall(backend_fn, module, query, key, value, attention_mask, exit_logits, causal, kwargs)
        )

    parts = None if hooks is None else hooks.parts
    if config.shifted_sparse_group is not None and module.training:  # S2-Attn trains; eval reads densely
        dropout = kwargs.get("dropout", 0.0)
        out = shifted_sparse_attention(
            query, key, value, attention_mask, config.shifted_sparse_group, kwargs.get("scaling"), dropout
        )
        weights = None
    elif parts is None:
        out, weights = attend(query, key, value, attention_mask)
    else:  # a method of key parts: each of its parts a call of the backend, under one softmax
        sliding_window = kwargs.pop("sliding_window", None)
        kwargs["is_causal"] = False
        fusable = (
            backend.fused_parts
            and config.clipped_softmax is None
            and not kwargs.get("dropout")
            and kwargs.get("softcap") is None
            and kwargs.get("position_bias") is None
        )
        chunk = lambda q, k, v, mask: attend(q, k, v, mask, causal=False)  # noqa: E731
        run = Execution(chunk, exit_logits, kwargs.get("scaling"), fusable)
        position_ids = kwargs.get("position_ids")
        out = parts(
            run, query, key, value, attention_mask, sliding_window=sliding_window, position_ids=position_ids
        )
        weights = None
    if hooks is not None and hooks.output is not None:
        out = hooks.output(out)
    if state.output_gate is not None:
        out = apply_gate(state.output_gate, module, out)
    return out, weights


def _multiplier(
    config, q_len, k_len, causal, sliding_window, bottom_right, device, dtype, mask=None, ssmax=None
) -> torch.Tensor:
    """The scale law of the keys each query row sees, ``(B|1, 1|H, Tq, 1)`` in ``dtype``."""
    n = visible_key_counts(
        q_len,
        k_len,
        mask,
        causal=causal,
        sliding_window=sliding_window,
        bottom_right=bottom_right,
        device=device,
    )
    return query_multiplier(config, n, ssmax).unsqueeze(-1).to(dtype)


@memoize(maxsize=64)  # a graph computes it itself
def _step_multiplier(
    config, q_len, k_len, causal, sliding_window, bottom_right, device, dtype
) -> torch.Tensor:
    """`_multiplier` of a decoding step with no mask and a law that learns nothing: the same in every layer, so
    made once per step, one number (made outside inference mode, for calls with gradients)."""
    with torch.inference_mode(False):
        return _multiplier(config, q_len, k_len, causal, sliding_window, bottom_right, device, dtype)
