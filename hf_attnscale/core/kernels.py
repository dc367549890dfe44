"""Fused attention with an exit column: the kernel's own log-sum-exp gives ``out · sigmoid(lse − s)``.

softmax over the keys plus one extra logit ``s`` whose value is zero equals the plain softmax output scaled
by ``α = sigmoid(lse − s)``, where ``lse`` is the log-sum-exp of the row's key logits. So a kernel that returns
``lse`` (sdpa's CPU flash kernel does) gives the exit for free: no extra key, no materialised mask, and the
causal fast path kept.
"""

from __future__ import annotations

import math

import torch


class _ExitAttentionCPU(torch.autograd.Function):
    """sdpa's CPU flash kernel plus an exit of logit ``s`` per head: ``out · sigmoid(lse − s)``.

    The backward reuses the kernel's own backward: calling it with ``grad_out = α·dy`` and ``out = y``
    (α = sigmoid(lse − s)) yields exactly the gradient of attention over the keys plus the exit column,
    including the path through lse that a plain autograd graph over (out, lse) would drop.
    """

    @staticmethod
    def forward(ctx, query, key, value, exit_logits, mask, is_causal, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=mask, scale=scale
        )
        alpha = torch.sigmoid(lse - exit_logits.view(1, -1, 1))  # (B, H, Tq) float32
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
        grad_exit = -((1 - alpha) * (grad_y.float() * y.float()).sum(-1)).sum(dim=(0, 2))
        return grad_q, grad_k, grad_v, grad_exit, None, None, None


def fused_exit_attention_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    exit_logits: torch.Tensor,
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
    # The kernel reads the head dimension as contiguous: a tensor whose last stride is not 1 (Inkling's keys are
    # a transposed view) gives wrong results silently, so those are copied.
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # The kernel takes the projections' strided (B, T, H, D) layout as is and returns that layout, so the
    # caller's transpose back to (B, T, H, D) copies nothing.
    return _ExitAttentionCPU.apply(query, key, value, exit_logits, mask, is_causal, scale)
