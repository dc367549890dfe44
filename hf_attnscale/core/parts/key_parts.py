"""One softmax over keys that come in parts, each part scored by its own queries (a method's parts,
`hf_attnscale.core.options.declare`).

A `KeyPart` is queries, keys, values and which keys each query sees. Row i's scores are ``q_p[i] · k_p[j]`` for
every visible key j of every part p, and one softmax (with the exit, where there is one) runs over all of them.
Two formulations:

* `joined`, public, on every device: the parts side by side on their own channels, one backend call. The
  queries are ``[q_1, q_2, …]``, a key of part p is ``k_p`` on part p's channels and zeros elsewhere, and the
  values are zero-padded to the same width (sdpa's fused kernels take one head dim). It costs the kernel P times
  the channels.
* `fused_parts`, the CPU's, guarded: PyTorch's CPU flash kernel once per part at the model's own width, each
  returning its output ``o_p`` and log-sum-exp ``l_p``; with ``L = logsumexp(l_1, l_2, …, s)`` (s the exit's
  logit), the result is ``y = Σ_p exp(l_p − L) · o_p``. Backward is the kernel's own, once per part, fed ``y``
  and ``L``: it recomputes each part's probabilities as ``exp(scores − L)``, the whole softmax's, and its row
  term as ``rowsum(dy · y)``, the whole row's, so every part's gradient is exact. The exit's logit gets
  ``−Σ rowsum(dy · y) · exp(s − L)``.

`attention` takes the fused path where it serves and its combination has passed its first-use check
(`hf_attnscale.core.call.first_use`) against the plain formula in float64, else the public one.
``HF_ATTNSCALE_FUSED_PARTS=0`` turns the fused path off. A row that sees no key of any part (a padding query)
gets a finite output that no real token reads, under either formulation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv

from hf_attnscale.core.call import cpu_flash, first_use
from hf_attnscale.core.call.hooks import ChunkFn, Execution
from hf_attnscale.core.call.masks import additive_mask, softmax_scale

ENV_SWITCH = "HF_ATTNSCALE_FUSED_PARTS"


class KeyPart(NamedTuple):
    """Keys scored by their own queries: q ``(B, H, c, D)``, k ``(B, Hkv, n, D)``, v ``(B, Hkv, n, Dv)``, and
    ``visible``, bool, broadcastable to ``(B, H, c, n)``, or None where every query sees every key."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    visible: torch.Tensor | None


def joined(parts: Sequence[KeyPart]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The parts as one call on side-by-side channels: ``(q, k, v, visible)``, v zero-padded to the queries'
    width (at least Dv)."""
    count, dim, dim_v = len(parts), parts[0].query.shape[-1], parts[0].value.shape[-1]
    query = torch.cat([part.query for part in parts], dim=-1) if count > 1 else parts[0].query
    key = torch.cat(
        [F.pad(part.key, (index * dim, (count - 1 - index) * dim)) for index, part in enumerate(parts)], dim=2
    )
    width = max(count * dim, dim_v)
    value = F.pad(torch.cat([part.value for part in parts], dim=2), (0, width - dim_v))
    masks = [part.visible for part in parts if part.visible is not None]
    shape = torch.broadcast_shapes((1, 1, query.shape[2]), *(mask.shape[:-1] for mask in masks))
    visible = torch.cat(
        [
            torch.ones(1, 1, 1, 1, dtype=torch.bool, device=query.device).expand(*shape, part.key.shape[2])
            if part.visible is None
            else part.visible.expand(*shape, part.visible.shape[-1])
            for part in parts
        ],
        dim=-1,
    )
    return query, key, value, visible


def public_parts(attend: ChunkFn, parts: Sequence[KeyPart]) -> torch.Tensor:
    """The public formulation: one call of ``attend`` on the joined parts, ``(B, c, H, Dv)``. One part goes as it
    is, with no mask where every query sees it whole (transformers' sdpa then takes grouped heads as they are)."""
    if len(parts) == 1:  # nothing to join: the keys and values as they are
        query, key, value, visible = parts[0]
        out, _ = attend(query, key, value, None if visible is None else additive_mask(visible, query.dtype))
        return out
    query, key, value, visible = joined(parts)
    out, _ = attend(query, key, value, additive_mask(visible, query.dtype))
    return out[..., : parts[0].value.shape[-1]]


def attention(run: Execution, parts: Sequence[KeyPart]) -> torch.Tensor:
    """One softmax over ``parts`` (with ``run``'s exit, if any), ``(B, c, H, Dv)``: fused where ``run.fusable``
    (the backend is sdpa, with nothing the kernel lacks: no dropout, soft-cap, position bias or clipped softmax),
    there are parts to merge, their tensors are float32, bfloat16 or float16 with one head dim and 4D masks, and
    the combination has passed its check; else through ``run.chunk``, the backend's own call with the exit (one
    part: at the model's width, as a decoding step's keys are)."""
    exit_logits, scaling = run.exit_logits, run.scaling
    combination = _combination(parts, exit_logits) if run.fusable and len(parts) > 1 else None
    if combination is None or not CHECK.passes(combination, lambda: _check(combination, scaling)):
        return public_parts(run.chunk, parts)
    return fused_parts(parts, exit_logits, scaling)


class Combination(NamedTuple):
    """What a key-parts path's first-use check covers (the CPU's fused parts here, CUDA's flex in
    `hf_attnscale.core.parts.flex_parts`): one verdict per combination."""

    dtype: torch.dtype
    head_dim: int
    heads: int
    kv_heads: int
    masks: tuple
    """Per part: None (no mask), or whether its mask differs by row of the batch, by head (flex: one entry where
    the model passes a mask)."""
    exit: bool
    batched: bool
    """Several rows (flex: rows at offsets of their own)."""
    layout: tuple = ()
    """flex: the method's parts as the check samples them, ``(lo, hi, unit)`` each (`flex_parts.layout`)."""
    scaling: float | None = None


SERVED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CHECK = first_use.FirstUseCheck("fused CPU key parts", ENV_SWITCH)


def may_fuse(run: Execution, query: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether `attention` may take the fused path for parts of these queries and values (its check aside): the
    engine splits a part's keys into blocks for it alone, as the joined formulation's cost grows with them."""
    return run.fusable and _serves(query) and query.shape[-1] == value.shape[-1]


def _serves(query: torch.Tensor) -> bool:
    return (
        first_use.may_serve(query, ENV_SWITCH, ("cpu",))
        and query.dtype in SERVED_DTYPES  # float64: the merge and its check are float32's
    )


def _combination(parts: Sequence[KeyPart], exit_logits: torch.Tensor | None) -> Combination | None:
    first = parts[0]
    if not _serves(first.query) or any(
        part.query.shape[-1] != part.value.shape[-1]
        or (
            part.visible is not None
            and (part.visible.dim() != 4 or part.visible.shape[2] != part.query.shape[2])
        )
        or part.key.dtype != first.query.dtype
        or part.value.dtype != first.query.dtype
        or part.key.shape[2] == 0
        for part in parts
    ):
        return None
    return Combination(
        dtype=first.query.dtype,
        head_dim=first.query.shape[-1],
        heads=first.query.shape[1],
        kv_heads=first.key.shape[1],
        masks=tuple(
            None if part.visible is None else (part.visible.shape[0] > 1, part.visible.shape[1] > 1)
            for part in parts
        ),
        exit=exit_logits is not None,
        batched=first.query.shape[0] > 1,
    )


def merge(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], exit_logits: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, L)``: the parts' outputs ``o_p`` ``(B, H, c, D)`` merged by their log-sum-exps ``l_p`` ``(B, H, c)``,
    the exit's per-head logits s (if any) one more term: ``L = logsumexp(l_1, l_2, …, s)`` and
    ``y = Σ_p exp(l_p − L) · o_p``, computed in float32, ``y`` returned in the outputs' dtype."""
    lses = [lse.float() for lse in lses]
    if exit_logits is not None:
        lses.append(exit_logits.float().view(1, -1, 1).expand_as(lses[0]))
    total = torch.logsumexp(torch.stack(lses), dim=0)
    merged = sum(out.float() * (lse - total).exp().unsqueeze(-1) for out, lse in zip(outs, lses))
    return merged.to(outs[0].dtype), total


class _MergedParts(torch.autograd.Function):
    """``y = Σ_p exp(l_p − L) · o_p`` from the kernel, forward and backward. Inputs: the scale, the parts'
    additive masks, the exit's logits (or None), then each part's q, k, v, all ``(B, H, ·, D)``."""

    @staticmethod
    def forward(ctx, scale, masks, exit_logits, *tensors):
        outs, lses = [], []
        for index, mask in enumerate(masks):
            query, key, value = tensors[3 * index : 3 * index + 3]
            out, lse = cpu_flash.flash_forward(query, key, value, False, mask, scale)
            outs.append(out)
            lses.append(lse)
        result, total = merge(outs, lses, exit_logits)
        ctx.save_for_backward(*tensors, *masks, result, total, exit_logits)
        ctx.scale, ctx.count = scale, len(masks)
        return result

    @staticmethod
    def backward(ctx, grad):
        saved, count = ctx.saved_tensors, ctx.count
        tensors, masks = saved[: 3 * count], saved[3 * count : 4 * count]
        result, total, exit_logits = saved[4 * count :]
        grad_exit = None
        if exit_logits is not None and ctx.needs_input_grad[2]:
            rows = (grad.float() * result.float()).sum(-1)
            grad_exit = -(rows * (exit_logits.float().view(1, -1, 1) - total).exp()).sum((0, 2))
        grads, grad = [], grad.contiguous()
        for index, mask in enumerate(masks):
            query, key, value = tensors[3 * index : 3 * index + 3]
            grads.extend(
                cpu_flash.flash_backward(grad, query, key, value, result, total, False, mask, ctx.scale)
            )
        return None, None, grad_exit, *grads


def fused_parts(
    parts: Sequence[KeyPart], exit_logits: torch.Tensor | None, scaling: float | None
) -> torch.Tensor:
    """The fused formulation, unchecked, ``(B, c, H, D)``."""
    dtype, heads = parts[0].query.dtype, parts[0].query.shape[1]
    scale = softmax_scale(parts[0].query, scaling)
    masks = tuple(None if part.visible is None else additive_mask(part.visible, dtype) for part in parts)
    tensors = []
    for part in parts:
        groups = heads // part.key.shape[1]
        tensors.extend((part.query, repeat_kv(part.key, groups), repeat_kv(part.value, groups)))
    out = _MergedParts.apply(scale, masks, exit_logits, *tensors)
    return out.transpose(1, 2)


def plain_parts(
    parts: Sequence[KeyPart], exit_logits: torch.Tensor | None, scaling: float | None
) -> torch.Tensor:
    """The definition, in the inputs' dtype (the softmax in float32 at least): every part's scores, the exit's
    column, one softmax, ``(B, c, H, Dv)``. The query heads that share a key head meet it as rows of one product
    ``(B, Hkv, G·c, ·)``, so no key or value is copied (a decoding step's parts are slices of the cache)."""
    batch, heads, rows = parts[0].query.shape[:3]
    kv_heads = parts[0].key.shape[1]
    groups = heads // kv_heads
    scale = softmax_scale(parts[0].query, scaling)
    scores = []
    for query, key, _, visible in parts:
        score = query.reshape(batch, kv_heads, groups * rows, -1) @ key.transpose(-1, -2) * scale
        if visible is not None:  # as (B|1, H|1, c, n), then its rows as the queries' (B|1, Hkv|1, G·c, n)
            visible = visible.reshape((1,) * (4 - visible.dim()) + visible.shape)
            shape = (
                visible.shape[0],
                kv_heads if visible.shape[1] > 1 else 1,
                groups,
                rows,
                visible.shape[-1],
            )
            visible = visible.unsqueeze(2).reshape(*shape[:2], -1, rows, shape[-1]).expand(shape)
            score = score.masked_fill(~visible.flatten(2, 3), -math.inf)
        scores.append(score)
    if exit_logits is not None:
        exit_column = exit_logits.to(scores[0].dtype).view(1, kv_heads, groups, 1).repeat_interleave(rows, 2)
        scores.append(exit_column.expand(*scores[0].shape[:-1], 1))
    weights = torch.softmax(
        torch.cat(scores, dim=-1), dim=-1, dtype=torch.promote_types(scores[0].dtype, torch.float32)
    ).to(scores[0].dtype)
    out, start = 0, 0
    for part in parts:
        count = part.key.shape[2]
        out = out + weights[..., start : start + count] @ part.value
        start += count
    return out.view(batch, heads, rows, -1).transpose(1, 2)


def rows_by_key(
    rows: torch.Tensor,
    part_of: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor | None,
    exit_logits: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """One query whose keys each belong to one part, by the definition, ``(B, 1, H, Dv)``: ``rows`` ``(B, H, P, D)``
    the query as each part places it, ``part_of`` ``(B|1, n)`` the part of each key; each key scored by its
    part's row (all rows of a key head's queries in one product: the keys read once, none copied), ``visible``
    ``(B|1, H|1, 1, n)`` or None, the exit's column, one softmax."""
    batch, heads, count, dim = rows.shape
    kv_heads, n = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    every = rows.reshape(batch, kv_heads, groups * count, dim) @ key.transpose(-1, -2)
    index = part_of.view(part_of.shape[0], 1, 1, 1, n).expand(batch, kv_heads, groups, 1, n)
    scores = every.view(batch, kv_heads, groups, count, n).gather(3, index).squeeze(3) * softmax_scale(
        rows, scaling
    )
    if visible is not None:
        visible = (
            visible.view(visible.shape[0], -1, 1, n)
            if visible.shape[1] == 1
            else visible.view(-1, kv_heads, groups, n)
        )
        scores = scores.masked_fill(~visible, -math.inf)
    if exit_logits is not None:
        exit_column = exit_logits.to(scores.dtype).view(1, kv_heads, groups, 1).expand(batch, -1, -1, 1)
        scores = torch.cat([scores, exit_column], dim=-1)
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    out = weights[..., :n].to(value.dtype) @ value  # (B, Hkv, G, Dv)
    return out.view(batch, 1, heads, -1)


def _check(combination: Combination, scaling: float | None) -> str | None:
    """The fused path against `plain_parts` in float64, forward and backward, on a sharp input as large as the
    kernel's blocks (more than 512 keys, more than 64 queries), with rows that see no key of a part and, with
    the exit, a row that sees the exit only; None if they agree, else why not."""
    parts, exit_logits = _sample(combination)
    fused = lambda: fused_parts(parts, exit_logits, scaling)  # noqa: E731
    return against_definition(
        fused, parts, exit_logits, scaling, tolerance=first_use.tolerance(parts[0].query.dtype)
    )


def against_definition(
    run,
    parts: Sequence[KeyPart],
    exit_logits: torch.Tensor | None,
    scaling: float | None,
    *,
    tolerance: float,
) -> str | None:
    """A fast path's check: ``run()`` (its output over ``parts``, whose q, k, v take gradients, as the exit's
    logits do) against `plain_parts` in float64, forward and backward (`first_use.against`)."""
    leaves = tuple(t for part in parts for t in part[:3]) + (
        (exit_logits,) if exit_logits is not None else ()
    )

    def definition() -> torch.Tensor:
        doubles = [KeyPart(*(t.double() for t in part[:3]), part.visible) for part in parts]
        return plain_parts(doubles, None if exit_logits is None else exit_logits.double(), scaling)

    names = ("output", *(f"{g}{i}" for i in range(len(parts)) for g in ("dq", "dk", "dv")), "dexit")
    return first_use.against(run, definition, leaves, names, tolerance)


def _sample(combination: Combination) -> tuple[list[KeyPart], torch.Tensor | None]:
    """The check's input: the parts (their q, k, v taking gradients) and the exit's logits."""
    sample = first_use.Sampler(combination.dtype)
    batch, heads, dim = 2 if combination.batched else 1, combination.heads, combination.head_dim
    queries, spread = 80, first_use.sharp(dim)

    parts = []
    for index, mask in enumerate(combination.masks):
        keys = 600 if index == 0 else 70
        visible = None
        if mask is not None:
            shape = (batch if mask[0] else 1, heads if mask[1] else 1, queries, keys)
            visible = torch.rand(shape, generator=sample.generator) < 0.7
            visible[..., index :: len(combination.masks), :] = False  # rows that see no key of this part
            if combination.exit and all(combination.masks):
                visible[..., -1, :] = False  # a row that sees the exit only
        key = sample(batch, combination.kv_heads, keys, dim, spread=spread)
        value = sample(batch, combination.kv_heads, keys, dim)
        parts.append(KeyPart(sample(batch, heads, queries, dim, spread=spread), key, value, visible))
    # the exit's logits near the rows' log-sum-exp: beside a part without a mask no row sees the exit alone, and
    # an exit of no weight would leave its gradient all rounding
    keys = sum(part.key.shape[2] for part in parts)
    exit_logits = torch.linspace(-1.0, 3.0, heads) + math.log(keys) if combination.exit else None
    return parts, None if exit_logits is None else exit_logits.requires_grad_()
