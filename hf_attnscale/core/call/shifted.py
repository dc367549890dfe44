"""LongLoRA's shifted sparse attention (S²-Attn, Chen et al. 2024), while a model trains.

The first half of the heads attend causally within groups of G tokens, [kG, (k+1)G); the second half within
groups shifted by G/2 (of an odd count, the larger half unshifted, as the authors' ``chunk(2)`` splits them), [kG − G/2, (k+1)G − G/2), so the first G/2 tokens and the last ones form groups of their
own. The authors' code rolls the shifted heads' tokens by −G/2 and back, which wraps the sequence's first G/2
tokens into its last group, where its causal mask lets them see the sequence's last tokens: a leak from the future
while training. Here nothing wraps: the shifted heads' sequence is padded by G/2 empty positions in front, and no
query sees an empty position but itself.

Each half is one call of ``torch.nn.functional.scaled_dot_product_attention`` on its groups as a batch
``(B, h, T/G, G, D)``, each group's mask the causal one of its G tokens and'ed with the model's own
``attention_mask`` (padding, packed sequences) on that group's diagonal block: attention costs T·G, not T².
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def shifted_sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    group: int,
    scaling: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """S²-Attn over q ``(B, H, T, D)`` and k, v ``(B, Hkv, T, D)`` (Hkv dividing H), with groups of ``group``
    tokens: the output ``(B, T, H, D)``, as transformers' attention functions return it. ``attention_mask`` is
    the model's, None (causal) or ``(B or 1, 1, T, T)``, boolean (True: seen) or additive.

    Raises:
        ValueError: more keys than queries (a cache: S²-Attn trains on whole sequences).
    """
    heads, length = query.shape[1], query.shape[2]
    if key.shape[2] != length:
        raise ValueError(
            f"shifted_sparse_group: {length} queries against {key.shape[2]} keys; S2-Attn trains on whole "
            "sequences, with no cache (pass use_cache=False, or call model.eval() to read densely)."
        )
    repeat = heads // key.shape[1]
    key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    seen = _seen(attention_mask, length)
    unshifted = heads - heads // 2  # torch.chunk(2)'s first part: SmolLM2's 9 heads, 5 and 4
    outputs = []
    for shift, heads_of in ((0, slice(0, unshifted)), (group // 2, slice(unshifted, heads))):
        q, k, v = (x[:, heads_of] for x in (query, key, value))
        if q.shape[1]:  # one head alone: no shifted half
            outputs.append(_in_groups(q, k, v, seen, group, shift, scaling, dropout))
    return torch.cat(outputs, dim=1).transpose(1, 2).contiguous()


def _seen(mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """Which key each query may see as the model's mask says, ``(B or 1, T, T)`` bool; None for a causal call."""
    if mask is None:
        return None
    mask = mask[:, 0, :, -length:]
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def _in_groups(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seen: torch.Tensor | None,
    group: int,
    shift: int,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """Attention of ``(B, h, T, D)`` within groups of ``group`` tokens that start ``shift`` positions before 0."""
    batch, heads, length, dim = q.shape
    padded = -(-(length + shift) // group) * group
    groups = padded // group
    q, k, v = (
        F.pad(x, (0, 0, shift, padded - length - shift)).view(batch, heads, groups, group, dim)
        for x in (q, k, v)
    )
    real = torch.zeros(padded, dtype=torch.bool, device=q.device)
    real[shift : shift + length] = True
    real = real.view(groups, group)
    allowed = real[:, :, None] & real[:, None, :]  # (groups, G, G): real queries and keys
    if seen is not None:  # the model's own mask on each group's diagonal block
        seen = F.pad(seen, (shift, padded - length - shift, shift, padded - length - shift))
        allowed = allowed & seen.view(-1, groups, group, groups, group).diagonal(dim1=1, dim2=3).permute(
            0, 3, 1, 2
        )
    eye = torch.eye(group, dtype=torch.bool, device=q.device)
    mask = (allowed | eye) & torch.ones_like(eye).tril()  # an empty position sees itself alone
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None] if mask.dim() == 4 else mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(batch, heads, padded, dim)[:, :, shift : shift + length]
