"""A faster exit for the CPU, guarded: PyTorch's CPU flash kernel at the model's own width, its log-sum-exp
turned into the exit.

The public formulation (`hf_attnscale.core.call.exit.sdpa_exit_attention`) widens every head by two channels, which
the CPU kernel pays for in full (about 8% of attention time at width 64, 12% at 8k tokens). Here the kernel runs
unwidened and returns ``lse``, the log-sum-exp of the real keys' scores; one more key of value zero and logit
``s`` then scales each row by ``w = σ(lse − s)``::

    y = o · w

Backward is the kernel's own, fed ``y`` for its output and ``w·dy`` for its gradient: the kernel's row term
``D = rowsum(dO·O)`` becomes ``w²·rowsum(dy·o)``, which is exactly ``D`` less the gradient that reaches the
scores through ``lse``; the exit logit's gradient is ``−Σ rowsum(dy·y)·(1 − w)``.

The kernel is private, so nothing is trusted unchecked (`hf_attnscale.core.call.first_use`): each combination
it would serve (dtype, head dim, heads and key-value heads, mask kind, causal, one query or many, batch) is run
once, at its first use, forward and backward on a small input against the public formulation. A mismatch or an
error gives one warning, and that combination takes the public formulation for the rest of the process.
``HF_ATTNSCALE_FUSED_EXIT=0`` turns the fused path off. Everything else (accelerators, autocast, dropout, a
learnable mask, a soft-cap, head dims that differ) takes the public formulation directly.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import NamedTuple

import torch
from transformers.integrations.sdpa_attention import repeat_kv

from hf_attnscale.core.call import cpu_flash, first_use
from hf_attnscale.core.call.exit import ExitCall, sdpa_exit_attention
from hf_attnscale.core.call.masks import additive_mask, softmax_scale

ENV_SWITCH = "HF_ATTNSCALE_FUSED_EXIT"


class _FlashExit(torch.autograd.Function):
    """``y = o · σ(lse − s)`` with the kernel's forward and backward; q/k/v ``(B, H, T, D)``, s ``(H,)``."""

    @staticmethod
    def forward(ctx, query, key, value, exit_logits, mask, is_causal, scale):
        out, lse = cpu_flash.flash_forward(query, key, value, is_causal, mask, scale)
        weight = torch.sigmoid(lse.float() - exit_logits.float().view(1, -1, 1)).unsqueeze(-1)
        result = out.mul_(weight) if out.dtype == weight.dtype else (out.float() * weight).to(out.dtype)
        ctx.save_for_backward(query, key, value, result, lse, weight, mask)
        ctx.is_causal, ctx.scale = is_causal, scale
        return result

    @staticmethod
    def backward(ctx, grad):
        query, key, value, result, lse, weight, mask = ctx.saved_tensors
        grad_exit = None
        if ctx.needs_input_grad[3]:
            rows = (grad.float() * result.float()).sum(-1, keepdim=True)
            grad_exit = -(rows * (1 - weight)).sum((0, 2, 3))
        grads = (None, None, None)
        if any(ctx.needs_input_grad[:3]):
            scaled = (grad.float() * weight).to(grad.dtype)
            grads = cpu_flash.flash_backward(
                scaled, query, key, value, result, lse, ctx.is_causal, mask, ctx.scale
            )
        return *grads, grad_exit, None, None, None


class MaskKind(NamedTuple):
    """What of a 4D mask the check must reproduce: its dtype and which of its dims are not broadcast."""

    dtype: torch.dtype
    per_batch: bool
    per_head: bool
    per_query: bool


class Combination(NamedTuple):
    """What the first-use check of the fused path covers: one verdict per combination."""

    dtype: torch.dtype
    head_dim: int
    heads: int
    kv_heads: int
    mask: MaskKind | None
    causal: bool
    queries: str  # "one", "square" (as many queries as keys) or "more keys"
    batched: bool


CHECK = first_use.FirstUseCheck("fused CPU exit", ENV_SWITCH)


def exit_attention(call: ExitCall) -> torch.Tensor:
    """The exit under sdpa: the fused CPU kernel where it serves and has passed its check, else the public
    formulation (`sdpa_exit_attention`); the result as there."""
    combination = _combination(call)
    if combination is None or not CHECK.passes(combination, lambda: _check(combination, call)):
        return sdpa_exit_attention(call)
    return fused_exit_attention(call)


def fused_exit_attention(call: ExitCall) -> torch.Tensor:
    """The exit through the CPU kernel, unchecked; ``(B, Tq, H, D)`` like `sdpa_exit_attention`."""
    query, key, value, mask = call.query, call.key, call.value, call.mask
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    if mask is not None:
        mask = mask[..., : key.shape[2]]
        if mask.dtype == torch.bool:  # the finite minimum, so a row with no visible key gets w = 0, never NaN
            mask = additive_mask(mask, query.dtype)
        mask = mask.to(query.dtype)
    is_causal = bool(call.causal and mask is None and query.shape[2] > 1)
    scaling = softmax_scale(query, call.scaling)
    out = _FlashExit.apply(query, key, value, call.exit_logits, mask, is_causal, scaling)
    return out.transpose(1, 2).contiguous()


def _combination(call: ExitCall) -> Combination | None:
    """What the check must cover for this call, or None where the fused path does not serve it."""
    query, key, value, mask = call.query, call.key, call.value, call.mask
    if (
        not first_use.may_serve(query, ENV_SWITCH, ("cpu",))
        or call.kwargs.get("dropout", 0.0)
        or call.kwargs.get("softcap") is not None
        or query.shape[-1] != value.shape[-1]
        or query.dtype != key.dtype
        or (mask is not None and (mask.requires_grad or mask.dim() != 4))
    ):
        return None
    mask_kind = (
        None
        if mask is None
        else MaskKind(mask.dtype, mask.shape[0] > 1, mask.shape[1] > 1, mask.shape[2] > 1)
    )
    q_len, k_len = query.shape[2], key.shape[2]
    queries = "one" if q_len == 1 else ("square" if q_len == k_len else "more keys")
    return Combination(
        dtype=query.dtype,
        head_dim=query.shape[-1],
        heads=query.shape[1],
        kv_heads=key.shape[1],
        mask=mask_kind,
        causal=bool(call.causal),
        queries=queries,
        batched=query.shape[0] > 1,
    )


def _check(combination: Combination, call: ExitCall) -> str | None:
    """Run ``combination`` fused and public (``call``'s backend and scaling) on a small sharp input, forward
    and backward; None if they agree."""
    dtype, dim, heads, kv_heads, mask_kind, causal, queries, batched = combination  # a Combination
    sample = first_use.Sampler(dtype)
    batch = 2 if batched else 1
    q_len, k_len = {"one": (1, 7), "square": (6, 6), "more keys": (5, 8)}[queries]
    query = sample(batch, heads, q_len, dim, spread=first_use.sharp(dim))
    key = sample(batch, kv_heads, k_len, dim, spread=first_use.sharp(dim))
    value = sample(batch, kv_heads, k_len, dim)
    exit_logits = (torch.linspace(-1.0, 3.0, heads) + math.log(k_len)).requires_grad_()
    mask = None
    if mask_kind is not None:
        mask_dtype, per_batch, per_head, per_query = mask_kind
        shape = (batch if per_batch else 1, heads if per_head else 1, q_len if per_query else 1, k_len)
        visible = torch.rand(shape, generator=sample.generator) < 0.7
        visible[..., 0] = True
        if per_query and q_len > 1:
            visible[..., -1, :] = False  # a row that sees nothing but the exit
        mask = visible if mask_dtype == torch.bool else additive_mask(visible, mask_dtype)
    stand_in = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=causal, training=False)
    kwargs = {"scaling": call.scaling}
    sampled = ExitCall(call.backend_fn, stand_in, query, key, value, mask, exit_logits, causal, kwargs)
    names = ("output", "dq", "dk", "dv", "dexit")
    return first_use.against(
        lambda: fused_exit_attention(sampled),
        lambda: sdpa_exit_attention(sampled),
        (query, key, value, exit_logits),
        names,
        first_use.tolerance(dtype),
    )
