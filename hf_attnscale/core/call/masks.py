"""Which keys each query row sees, from the mask a backend receives (or, without one, from the shapes).

Every backend's conventions: a 2D padding mask (flash), a 4D bool or additive mask (eager, sdpa), a flex
BlockMask, or none (sdpa's ``is_causal``; causal prefill aligned top-left by sdpa and eager, bottom-right by flash);
and their default scale of the scores, where a call gives none.
"""

from __future__ import annotations

from typing import Any

import torch


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
    dense, mask = _dense(q_len, k_len, mask)
    if dense is not None:
        return dense.sum(-1, dtype=torch.float32)
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
    dense, mask = _dense(q_len, k_len, mask)
    if dense is not None:
        return dense
    lo, hi = _visible_range(q_len, k_len, mask, causal, sliding_window, bottom_right, device)
    keys = torch.arange(k_len, device=lo.device)
    visible = ((keys >= lo[:, None]) & (keys < hi[:, None])).view(1, 1, q_len, k_len)
    return visible if mask is None else visible & mask.bool()[:, None, None, :]


def _dense(q_len: int, k_len: int, mask: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(which keys each query sees, None)`` where the backend got a 4D mask or a flex BlockMask, bool
    ``(B|1, 1|H, Tq, Tk)``; else ``(None, mask)``: no mask, or a 2D padding mask, read by key ranges."""
    if mask is not None and not isinstance(mask, torch.Tensor):
        mask = _dense_block_mask(mask, q_len, k_len)
    if mask is not None and mask.dim() == 4:
        return visible_entries(mask)[..., :k_len], None
    return None, mask


def softmax_scale(query: torch.Tensor, scaling: float | None) -> float:
    """The scores' scale: the model's ``scaling``, else the backends' default, one over the root of the head dim."""
    return query.shape[-1] ** -0.5 if scaling is None else scaling


def additive_mask(shown: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the additive one every backend takes: 0 where shown, the dtype's minimum elsewhere."""
    return torch.zeros(shown.shape, dtype=dtype, device=shown.device).masked_fill_(
        ~shown, torch.finfo(dtype).min
    )


def visible_entries(mask: torch.Tensor) -> torch.Tensor:
    """Which entries of a bool or additive mask are visible: an additive entry is masked at or below half its
    dtype's minimum (transformers masks with the minimum; adding a finite score keeps it below half)."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def chunk_visible(mask, start, stop, k_len, q_pos, sliding_window, device) -> torch.Tensor:
    """Which keys a chunk of queries sees, bool ``(B|1, 1|H, c, Tk)``: the rows ``start .. stop - 1`` of ``mask``
    (4D, or one row for all), else causal at the places ``q_pos`` ``(c, 1)``, within ``sliding_window``."""
    if mask is not None:
        rows = mask[..., start:stop, :k_len] if mask.shape[-2] > 1 else mask[..., :k_len]
        return visible_entries(rows)
    keys = torch.arange(k_len, device=device)
    visible = keys <= q_pos
    if sliding_window:
        visible = visible & (q_pos - keys < sliding_window)
    return visible[None, None]


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
