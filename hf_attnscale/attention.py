"""The attention function that wraps a model's own backend (eager, sdpa, flash, flex).

For each call it (1) counts the keys n each query row sees, (2) multiplies the query by the scale law
of n, (3) adds the zero-value exit (zero_kv / sink logit), (4) runs the inner backend. It is registered
under ``hfa_<backend>`` in transformers' AttentionInterface and AttentionMaskInterface; a model is patched
by pointing its ``config._attn_implementation`` there, so other models in the process are untouched.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from .config import AttnScaleConfig
from .laws import query_multiplier, ssmax_init

PREFIX = "hfa_"
STATE_NAME = "hfa"
"""Name of the child module that holds a patched attention module's state (and learnable parameters)."""

AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


class AttnScaleState(nn.Module):
    """Per-attention-module patch state: the config and the learnable sink / SSMax parameters.

    Being a child module named ``hfa``, its parameters appear as ``...self_attn.hfa.sink`` and
    ``...self_attn.hfa.ssmax`` in the state dict, and PEFT can train them via ``modules_to_save=["hfa"]``.
    """

    def __init__(self, config: AttnScaleConfig, num_heads: int):
        super().__init__()
        self.config = config
        self.num_heads = num_heads
        self.sink = nn.Parameter(torch.zeros(num_heads)) if config.sink_logit == "learnable" else None
        self.ssmax = (
            nn.Parameter(torch.full((num_heads,), ssmax_init(config.train_length)))
            if config.scale == "ssmax"
            else None
        )
        self.query_hook: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Set for the duration of a call by the streaming forward to rotate queries into cache slots."""
        self.output_hook: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Set with ``query_hook``: maps the attention output ``(B, Tq, H, Dv)`` (the streaming forward pads Dv)."""

    def sink_logits(self, device: torch.device) -> torch.Tensor:
        """The exit logit of each head, float32 ``(H,)``."""
        if self.sink is not None:
            return self.sink.float()
        return torch.full((self.num_heads,), self.config.fixed_sink_logit, device=device)

    def extra_repr(self) -> str:
        return f"{self.config}"


def backend_name(inner: str) -> str:
    """The registered name of the wrapper around backend ``inner``."""
    return PREFIX + inner


def inner_backend(attn_implementation: str) -> str:
    return attn_implementation.removeprefix(PREFIX)


def register_backend(inner: str) -> str:
    """Register the wrapper around ``inner`` (once per process) and return its name."""
    name = backend_name(inner)
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _make_wrapper(inner))
        mask_fn = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(inner)
        if mask_fn is not None:
            AttentionMaskInterface.register(name, mask_fn)
    return name


def _inner_function(module: nn.Module, inner: str) -> AttentionFn:
    if inner == "eager":
        # Eager is model-specific: each modeling file defines its own `eager_attention_forward`.
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[inner]


def _make_wrapper(inner: str) -> AttentionFn:
    def hfa_attention_forward(module, query, key, value, attention_mask, **kwargs):
        state = module._modules.get(STATE_NAME)
        fn = _inner_function(module, inner)
        if state is None:  # e.g. cross-attention modules of a patched model
            return fn(module, query, key, value, attention_mask, **kwargs)
        out, weights = scaled_attention(state, inner, fn, module, query, key, value, attention_mask, **kwargs)
        return (out if state.output_hook is None else state.output_hook(out)), weights

    hfa_attention_forward.__name__ = f"hfa_{inner}_attention_forward"
    return hfa_attention_forward


def scaled_attention(
    state: AttnScaleState,
    inner: str,
    fn: AttentionFn,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Apply the patch around one call of the inner backend ``fn``. Shapes: q ``(B,H,Tq,D)``, k/v ``(B,Hkv,Tk,D)``."""
    config = state.config
    if state.query_hook is not None:
        query = state.query_hook(query)
    is_causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if config.scale != "none":
        n = visible_key_counts(
            query.shape[2],
            key.shape[2],
            attention_mask,
            causal=causal,
            sliding_window=kwargs.get("sliding_window"),
            bottom_right=inner.startswith("flash"),
            device=query.device,
        )
        query = query * query_multiplier(config, n, state.ssmax).unsqueeze(-1).to(query.dtype)
    if not config.has_exit:
        return fn(module, query, key, value, attention_mask, **kwargs)

    sink = state.sink_logits(query.device)
    if inner.startswith("flash") or inner == "flex_attention":
        # These backends implement learnable sinks natively (gpt-oss's `s_aux`).
        return fn(module, query, key, value, attention_mask, s_aux=sink, **kwargs)
    dropout = kwargs.get("dropout", 0.0)
    if inner == "sdpa" and query.device.type == "cpu" and dropout == 0.0 and key.shape[-1] == value.shape[-1]:
        out = fused_sink_attention_cpu(query, key, value, attention_mask, sink, causal, kwargs.get("scaling"))
        return out.transpose(1, 2).contiguous(), None
    return _extra_key_attention(fn, module, query, key, value, attention_mask, sink, causal, **kwargs)


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

    ``mask`` is the one the backend receives: None, a 2D padding mask ``(B, Tk)`` (flash), or a 4D bool/float
    mask. Without a 4D mask, causality and ``sliding_window`` follow the backends' own conventions: sdpa and
    eager align a causal prefill top-left, flash aligns bottom-right (queries are the last ``Tq`` keys).
    """
    if mask is not None and not isinstance(mask, torch.Tensor):  # flex BlockMask
        mask = _dense_block_mask(mask, q_len, k_len)
    if mask is not None and mask.dim() == 4:
        visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        return visible.sum(-1, dtype=torch.float32)

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
    if mask is None:
        return (hi - lo).float().view(1, 1, q_len)
    # 2D padding mask: count the valid keys inside each query's [lo, hi) with a prefix sum.
    prefix = torch.nn.functional.pad(mask.to(torch.int32).cumsum(-1), (1, 0))  # (B, Tk + 1)
    return (prefix[:, hi] - prefix[:, lo]).float().unsqueeze(1)


def _dense_block_mask(block_mask, q_len: int, k_len: int) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_mask

    batch = block_mask.kv_num_blocks.shape[0]
    return create_mask(block_mask.mask_mod, batch, 1, q_len, k_len, device=block_mask.kv_num_blocks.device)


def _extra_key_attention(fn, module, query, key, value, mask, sink, causal, **kwargs):
    """Exit as an explicit extra key: a zero key/value first, whose logit comes from a mask column.

    Exact for any backend that takes an additive 4D mask (eager, sdpa). The mask is materialised.
    """
    batch, num_heads, q_len, _ = query.shape
    k_len = key.shape[2]
    dtype = query.dtype
    key = torch.cat([key.new_zeros(batch, key.shape[1], 1, key.shape[3]), key], dim=2)
    value = torch.cat([value.new_zeros(batch, value.shape[1], 1, value.shape[3]), value], dim=2)
    neg = torch.finfo(dtype).min
    if mask is None:
        body = torch.zeros(1, 1, q_len, k_len, dtype=dtype, device=query.device)
        if causal and q_len > 1:
            body.masked_fill_(torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).triu(1), neg)
    elif mask.dtype == torch.bool:
        body = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, neg)
    else:
        body = mask[..., :k_len].to(dtype)
    # One shared column when every head has the same constant exit logit; learnable sinks need their own.
    uniform = not sink.requires_grad and bool((sink == sink[0]).all())
    heads = 1 if uniform else num_heads
    body = body.expand(body.shape[0], heads, q_len, k_len)
    column = sink.to(dtype).view(1, -1, 1, 1)[:, :heads].expand(body.shape[0], heads, q_len, 1)
    out, weights = fn(module, query, key, value, torch.cat([column, body], dim=-1), **kwargs)
    return out, (weights[..., 1:] if weights is not None else None)


class _SinkAttentionCPU(torch.autograd.Function):
    """sdpa's CPU flash kernel plus an exit of logit ``s`` per head: ``out · sigmoid(lse − s)``.

    The backward reuses the kernel's own backward: calling it with ``grad_out = α·dy`` and ``out = y``
    (α = sigmoid(lse − s)) yields exactly the gradient of attention over the keys plus the exit column,
    including the path through lse that a plain autograd graph over (out, lse) would drop.
    """

    @staticmethod
    def forward(ctx, query, key, value, sink, mask, is_causal, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=mask, scale=scale
        )
        alpha = torch.sigmoid(lse - sink.view(1, -1, 1))  # (B, H, Tq) float32
        # In place: the backward needs y, never the kernel's own output.
        y = out.mul_(alpha.unsqueeze(-1).to(out.dtype))
        ctx.save_for_backward(query, key, value, y, lse, alpha, mask)
        ctx.is_causal, ctx.scale = is_causal, scale
        return y

    @staticmethod
    def backward(ctx, grad_y):
        query, key, value, y, lse, alpha, mask = ctx.saved_tensors
        grad_out = (grad_y * alpha.unsqueeze(-1).to(grad_y.dtype)).contiguous()
        grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, y, lse, 0.0, ctx.is_causal, attn_mask=mask, scale=ctx.scale
        )
        # d loss / d s_h = -sum over rows of p_exit · <dy, y>, with p_exit = 1 - α.
        grad_sink = -((1 - alpha) * (grad_y.float() * y.float()).sum(-1)).sum(dim=(0, 2))
        return grad_q, grad_k, grad_v, grad_sink, None, None, None


def fused_sink_attention_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    sink: torch.Tensor,
    causal: bool,
    scaling: float | None,
) -> torch.Tensor:
    """Attention with an exit column on CPU, without a materialised causal mask. Returns ``(B, H, Tq, D)``."""
    q_len, k_len = query.shape[2], key.shape[2]
    is_causal = causal and mask is None and q_len > 1
    if is_causal and k_len > q_len:  # sdpa's top-left convention, as transformers' sdpa wrapper does
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    if mask is not None:
        mask = mask[..., :k_len]
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype).masked_fill_(~mask, -math.inf)
        mask = mask.to(query.dtype)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # The kernel takes the projections' strided (B, T, H, D) layout as is and returns that layout, so the
    # caller's transpose back to (B, T, H, D) copies nothing.
    return _SinkAttentionCPU.apply(query, key, value, sink, mask, is_causal, scale)
