"""PyTorch's CPU flash-attention kernel, which returns its log-sum-exp, and when a fast CPU path may take it.

Two fast CPU paths use the kernel: the exit (`hf_attnscale.core.call.fused_exit`) and keys in parts
(`hf_attnscale.core.parts.key_parts`, the key parts of ReRoPE, Self-Extend and DCA). The kernel is private, so neither trusts it
unchecked: each combination a path would serve passes a `hf_attnscale.core.call.first_use.FirstUseCheck` first.
Each path has its own switch in the environment (``=0`` turns it off).
"""

from __future__ import annotations

import torch


def flash_forward(query, key, value, is_causal, mask, scale):
    """The kernel: ``(output (B, H, Tq, D), log-sum-exp (B, H, Tq))`` over the keys; q/k/v ``(B, H, T, D)``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=mask, scale=scale
    )


def flash_backward(grad_out, query, key, value, out, lse, is_causal, mask, scale):
    """The kernel's backward: ``(grad_query, grad_key, grad_value)``. It recomputes the probabilities as
    ``exp(scores − lse)`` and its row term as ``rowsum(grad_out · out)``, from the ``out`` and ``lse`` given."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale
    )
