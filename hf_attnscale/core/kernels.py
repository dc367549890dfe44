"""Fused attention with an exit column: the kernel's own log-sum-exp gives ``out · sigmoid(lse − s)``.

softmax over the keys plus one extra logit ``s`` whose value is zero equals the plain softmax output scaled
by ``α = sigmoid(lse − s)``, where ``lse`` is the log-sum-exp of the row's key logits. So a kernel that returns
``lse`` gives the exit for free: no extra key, no materialised mask, and the causal fast path kept. The kernels
are the ones sdpa itself would pick: its flash kernel on CPU; on CUDA its flash kernel (half precision, no mask,
GQA without copies) or its memory-efficient one (fp32, or a mask). Where none applies, `fused_exit_attention`
returns None and the caller adds the exit as an explicit key.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

aten = torch.ops.aten


@dataclass(frozen=True)
class LseKernel:
    """An sdpa kernel that returns its rows' log-sum-exp, and its own backward.

    ``forward(q, k, v, mask, is_causal, scale)`` gives ``(out, lse, saved)``, with ``lse`` of shape
    ``(B, H, ≥Tq)``; ``backward(grad_out, q, k, v, out, lse, saved, mask, is_causal, scale)`` gives the
    gradients of q, k and v. ``native_gqa``: it takes fewer key/value heads than query heads as they are.
    """

    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor, tuple]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    native_gqa: bool


def _cpu_flash_forward(q, k, v, mask, is_causal, scale):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale
    )
    return out, lse, ()


def _cpu_flash_backward(grad_out, q, k, v, out, lse, saved, mask, is_causal, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale
    )


def _cuda_flash_forward(q, k, v, mask, is_causal, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, is_causal, False, scale=scale
    )
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _cuda_flash_backward(grad_out, q, k, v, out, lse, saved, mask, is_causal, scale):
    cum_q, cum_k, max_q, max_k, seed, offset = saved
    return aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, is_causal, seed, offset, scale=scale
    )


def _cuda_efficient_forward(q, k, v, mask, is_causal, scale):
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
        q, k, v, mask, True, 0.0, is_causal, scale=scale
    )
    return out, lse, (seed, offset)  # lse's query dimension is padded to a multiple of 32


def _cuda_efficient_backward(grad_out, q, k, v, out, lse, saved, mask, is_causal, scale):
    seed, offset = saved
    grad_q, grad_k, grad_v, _ = aten._scaled_dot_product_efficient_attention_backward(
        grad_out,
        q,
        k,
        v,
        mask,
        out,
        lse,
        seed,
        offset,
        0.0,
        [True, True, True, False],
        is_causal,
        scale=scale,
    )
    return grad_q, grad_k, grad_v


CPU_FLASH = LseKernel("cpu flash", _cpu_flash_forward, _cpu_flash_backward, native_gqa=True)
CUDA_FLASH = LseKernel("cuda flash", _cuda_flash_forward, _cuda_flash_backward, native_gqa=True)
CUDA_EFFICIENT = LseKernel(
    "cuda memory-efficient", _cuda_efficient_forward, _cuda_efficient_backward, native_gqa=False
)


class _ExitAttention(torch.autograd.Function):
    """A kernel's attention plus an exit of logit ``s`` per head: ``out · sigmoid(lse − s)``.

    The backward reuses the kernel's own backward: calling it with ``grad_out = α·dy`` and ``out = y``
    (α = sigmoid(lse − s)) yields exactly the gradient of attention over the keys plus the exit column,
    including the path through lse that a plain autograd graph over (out, lse) would drop: the kernel's
    backward forms ``P ∘ (grad_out·Vᵀ − rowsum(grad_out ∘ out))``, which is then ``α·P ∘ (dy·Vᵀ − rowsum(dy ∘ y))``.
    """

    @staticmethod
    def forward(ctx, kernel, query, key, value, exit_logits, mask, is_causal, scale):
        out, lse, saved = kernel.forward(query, key, value, mask, is_causal, scale)
        alpha = torch.sigmoid(lse[..., : query.shape[2]] - exit_logits.view(1, -1, 1))  # (B, H, Tq) float32
        # In place: the backward needs y, never the kernel's own output.
        y = out.mul_(alpha.unsqueeze(-1).to(out.dtype))
        ctx.save_for_backward(query, key, value, y, lse, alpha, mask)
        ctx.kernel, ctx.saved, ctx.is_causal, ctx.scale = kernel, saved, is_causal, scale
        return y

    @staticmethod
    def backward(ctx, grad_y):
        query, key, value, y, lse, alpha, mask = ctx.saved_tensors
        grad_out = (grad_y * alpha.unsqueeze(-1).to(grad_y.dtype)).contiguous()
        grad_q, grad_k, grad_v = ctx.kernel.backward(
            grad_out, query, key, value, y, lse, ctx.saved, mask, ctx.is_causal, ctx.scale
        )
        # d loss / d s_h = -sum over rows of p_exit · <dy, y>, with p_exit = 1 - α.
        grad_exit = -((1 - alpha) * (grad_y.float() * y.float()).sum(-1)).sum(dim=(0, 2))
        return None, grad_q, grad_k, grad_v, grad_exit, None, None, None


def fused_exit_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    exit_logits: torch.Tensor,
    causal: bool,
    scaling: float | None,
) -> torch.Tensor | None:
    """Attention with an exit column, through the fused kernel sdpa would pick, without a materialised
    causal mask. Returns ``(B, H, Tq, D)``, or None where no kernel with a log-sum-exp applies."""
    if query.device.type not in ("cpu", "cuda"):
        return None
    if torch.is_autocast_enabled(query.device.type):  # cast as sdpa does under autocast; raw kernels do not
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    q_len, k_len = query.shape[2], key.shape[2]
    is_causal = causal and mask is None and q_len > 1
    if is_causal and k_len > q_len:  # sdpa's top-left convention, as transformers' sdpa wrapper does
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    if mask is not None:
        mask = mask[..., :k_len]
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill_(
                ~mask, -math.inf
            )
        mask = mask.to(query.dtype)
    # The kernels read the head dimension as contiguous: a tensor whose last stride is not 1 (Inkling's keys are
    # a transposed view) gives wrong results silently, so those are copied.
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    if query.device.type == "cpu":
        kernel = CPU_FLASH
    else:
        kernel, key, value, mask = _cuda_kernel(query, key, value, mask, is_causal)
        if kernel is None:
            return None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # The kernels take the projections' strided (B, T, H, D) layout as is and return that layout, so the
    # caller's transpose back to (B, T, H, D) copies nothing.
    return _ExitAttention.apply(kernel, query, key, value, exit_logits, mask, is_causal, scale)


def _cuda_kernel(query, key, value, mask, is_causal):
    """The CUDA kernel sdpa would pick that returns a log-sum-exp (flash, else memory-efficient), with the keys,
    values and mask in the form it takes; ``(None, ...)`` where neither applies (sdpa's own checks, which also
    honour ``torch.nn.attention.sdpa_kernel``)."""
    gqa = key.shape[1] != query.shape[1]
    if query.shape[-1] % 8 == 0 and torch.backends.cuda.can_use_flash_attention(
        torch.backends.cuda.SDPAParams(query, key, value, mask, 0.0, is_causal, gqa)
    ):
        return CUDA_FLASH, key, value, mask
    if gqa:  # the memory-efficient kernel takes as many key heads as query heads
        groups = query.shape[1] // key.shape[1]
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    if mask is not None:  # its bias must have 8-aligned strides, and one entry per (batch, head)
        if any(stride % 8 for stride in mask.stride()[:-1]) or mask.stride(-1) != 1:
            mask = torch.nn.functional.pad(mask, (0, 8 - mask.shape[-1] % 8))[..., : mask.shape[-1]]
        mask = mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    if torch.backends.cuda.can_use_efficient_attention(
        torch.backends.cuda.SDPAParams(query, key, value, mask, 0.0, is_causal, False)
    ):
        return CUDA_EFFICIENT, key, value, mask
    return None, key, value, mask
