"""One patched attention call: count the visible keys, scale the query, add the exit, run the backend.

The steps, for each call that reaches a module carrying a patch state (`hf_attnscale.core.state`):

1. count the keys n each query row sees, from the mask the backend receives, or from the shapes when the
   backend runs without one (sdpa's ``is_causal``);
2. multiply the query by the scale law of n (`hf_attnscale.core.laws`), on top of the model's own scaling;
3. add the exit (zero_kv / sink logit): natively where the backend has sinks (flash, flex), else as one more
   zero-valued key (`hf_attnscale.core.exit`): on extra channels through public sdpa, or a mask column (eager);
4. run the inner backend.

A call may bring hooks of its own (`hf_attnscale.core.hooks`): a query map, an output map, a probe.

How calls get here (names, registration) is `hf_attnscale.core.dispatch`; this module is only the maths.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .compat import create_position_bias_mask
from .exit import combined_exit_logits, extra_key_attention, sdpa_exit_attention
from .hooks import CallHooks
from .laws import query_multiplier
from .state import AttnScaleState

AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


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
    call's own additions (`hf_attnscale.core.hooks`). Shapes: q ``(B,H,Tq,D)``, k/v ``(B,Hkv,Tk,D)``."""
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
    out, weights = _attend(
        backend, backend_fn, module, query, key, value, attention_mask, exit_logits, causal, **kwargs
    )
    if hooks is not None and hooks.output is not None:
        out = hooks.output(out)
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
        out = sdpa_exit_attention(
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


def visible_key_counts(
    q_len: int,
    k_len: int,
    mask: torch.Tensor | None,
    *,
    causal: bool,
    sliding_window: int | None = None,
    bottom_right: bool = False,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Number of keys each query row sees, float32 ``(B or 1, 1 or H, Tq)``.

    ``mask`` is the one the backend receives: None, a 2D padding mask ``(B, Tk)`` (flash), a 4D bool/float
    mask, or a flex BlockMask. Without a 4D mask, causality and ``sliding_window`` follow the backends' own
    conventions: sdpa and eager align a causal prefill top-left, flash aligns bottom-right (queries are the
    last ``Tq`` keys).
    """
    if mask is not None and not isinstance(mask, torch.Tensor):
        mask = _dense_block_mask(mask, q_len, k_len)
    if mask is not None and mask.dim() == 4:
        return _as_bool(mask).sum(-1, dtype=torch.float32)
    lo, hi = _visible_range(q_len, k_len, mask, causal, sliding_window, bottom_right, device)
    if mask is None:
        return (hi - lo).float().view(1, 1, q_len)
    # 2D padding mask: count the valid keys inside each query's [lo, hi) with a prefix sum.
    prefix = torch.nn.functional.pad(mask.to(torch.int32).cumsum(-1), (1, 0))  # (B, Tk + 1)
    return (prefix[:, hi] - prefix[:, lo]).float().unsqueeze(1)


def visible_keys(
    q_len: int,
    k_len: int,
    mask: torch.Tensor | None,
    *,
    causal: bool,
    sliding_window: int | None = None,
    bottom_right: bool = False,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Which keys each query row sees, bool ``(B or 1, 1 or H, Tq, Tk)``: `visible_key_counts` before the sum."""
    if mask is not None and not isinstance(mask, torch.Tensor):
        mask = _dense_block_mask(mask, q_len, k_len)
    if mask is not None and mask.dim() == 4:
        return _as_bool(mask)[..., :k_len]
    lo, hi = _visible_range(q_len, k_len, mask, causal, sliding_window, bottom_right, device)
    keys = torch.arange(k_len, device=lo.device)
    visible = ((keys >= lo[:, None]) & (keys < hi[:, None])).view(1, 1, q_len, k_len)
    return visible if mask is None else visible & mask.bool()[:, None, None, :]


def _as_bool(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def _visible_range(q_len, k_len, mask, causal, sliding_window, bottom_right, device):
    """``[lo, hi)``: the key positions each query may see, before padding ``(Tq,)`` each."""
    device = mask.device if mask is not None else device
    q_pos = torch.arange(q_len, device=device)
    if causal and (bottom_right or q_len == 1 or mask is not None):
        q_pos = q_pos + (k_len - q_len)  # queries are the last q_len keys
    if causal:
        hi = (q_pos + 1).clamp_max(k_len)
        lo = (hi - sliding_window).clamp_min(0) if sliding_window else torch.zeros_like(hi)
    else:
        hi = (q_pos + sliding_window).clamp_max(k_len) if sliding_window else torch.full_like(q_pos, k_len)
        lo = (q_pos - sliding_window + 1).clamp_min(0) if sliding_window else torch.zeros_like(q_pos)
    return lo, hi


def _dense_block_mask(block_mask, q_len: int, k_len: int) -> torch.Tensor:
    # Only flex models need it, and importing flex_attention costs ~0.3 s: imported on first use.
    from torch.nn.attention.flex_attention import create_mask

    batch = block_mask.kv_num_blocks.shape[0]
    return create_mask(block_mask.mask_mod, batch, 1, q_len, k_len, device=block_mask.kv_num_blocks.device)
