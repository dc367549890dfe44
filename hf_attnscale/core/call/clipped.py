"""Clipped softmax (Bondarenko et al. 2023): probabilities ``clip((ζ − γ)·softmax(x) + γ, 0, 1)``.

With ``γ < 0`` a head can put exactly zero weight on a token (and with ``ζ > 1`` exactly one), so it needs no
huge logit to do nothing. The clip acts on the probabilities, which no fused kernel exposes: on every backend
the wrapper runs this eager formula itself, materialising ``B·H·Tq·Tk`` float32 scores per layer, as eager
attention does. The backend's own conventions are kept: its mask (visible keys counted as in
`hf_attnscale.core.call.masks.visible_keys`, a float mask's values added), the family's soft-capping where it
passes one, its relative position bias, and its own sinks (``s_aux``) as a zero-valued column of the softmax.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hf_attnscale.core.call.masks import softmax_scale, visible_keys


def clipped_softmax_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask,
    gamma: torch.Tensor,
    zeta: torch.Tensor,
    *,
    causal: bool,
    bottom_right: bool,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sliding_window: int | None = None,
    position_bias: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with clipped probabilities; ``gamma`` and ``zeta`` per head ``(H,)``.

    q ``(B, H, Tq, D)``, k ``(B, Hkv, Tk, D)``, v ``(B, Hkv, Tk, Dv)``. Returns the output ``(B, Tq, H, Dv)`` and
    the clipped probabilities ``(B, H, Tq, Tk)`` (masked keys exactly zero).
    """
    heads, q_len, k_len = query.shape[1], query.shape[2], key.shape[2]
    groups = heads // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scaling = softmax_scale(query, scaling)
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    visible = visible_keys(
        q_len,
        k_len,
        mask,
        causal=causal,
        sliding_window=sliding_window,
        bottom_right=bottom_right,
        device=query.device,
    )
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.is_floating_point():
        scores = scores + mask[..., :k_len].float()  # a float mask's values (ALiBi, Doge's dynamic mask)
    if position_bias is not None:
        scores = scores + position_bias.float()
    scores = scores.masked_fill(~visible, -math.inf)
    own = s_aux if s_aux is not None else sinks
    if own is not None:  # the family's own sinks: a zero-valued column, per head (or per row, Inkling-2's)
        column = own.float().reshape((1, -1, 1, 1) if own.dim() == 1 else own.shape)
        column = column.expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :k_len]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = probs.nan_to_num(0.0)  # a row that sees no key
    gamma, zeta = gamma.float().view(1, -1, 1, 1), zeta.float().view(1, -1, 1, 1)
    probs = ((zeta - gamma) * probs + gamma).clamp(0.0, 1.0).masked_fill(~visible, 0.0)
    weights = F.dropout(probs, p=dropout, training=module.training).to(value.dtype)
    out = torch.matmul(weights, value)
    return out.transpose(1, 2).contiguous(), probs.to(query.dtype)
