"""A method's key parts under one softmax, on CUDA, through PyTorch's public `flex_attention`.

Each part of a method (`hf_attnscale.core.options.declare`) covers the pairs of a query at position i and a key at
j with ``lo ≤ ⌊i/u⌋ − ⌊j/u⌋ < hi`` (and ``j ≤ i``): a band of distance where the unit u is 1 (ReRoPE's near and far
keys), a relation between chunks otherwise (DCA's). A `Band` is a part's rotated queries, keys and values, and
the part. Each is one call of the compiled flex kernel over the whole sequence with a block mask built from the
blocks' ranges of ``⌊i/u⌋ − ⌊j/u⌋``, so it skips the blocks outside the part: a far band costs about one causal
attention, a near one a window's width. Each call returns its output ``o_b`` and log-sum-exp ``l_b``; with
``L = logsumexp(l_1, l_2, …, s)`` (s the exit's logit) the result is ``y = Σ_b exp(l_b − L) · o_b``, and autograd
runs through the kernel's own backward, which takes the log-sum-exp's gradient too.

On CUDA this replaces the public formulation on side-by-side channels and a dense mask
(`hf_attnscale.core.parts.key_parts.joined`), which no flash kernel takes. Each combination of dtypes, heads,
options and the method's layout of parts passes a first-use check against the plain formula in float64 before it
serves (`hf_attnscale.core.call.first_use`); ``HF_ATTNSCALE_FLEX_PARTS=0`` turns the path off. flex is compiled
with dynamic shapes, whole (``fullgraph``), in a function of its own: past torch.compile's recompile limit a call
raises rather than running flex uncompiled, which would hold every score, and takes the chunked formulation.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch._dynamo

from hf_attnscale.core.call import first_use
from hf_attnscale.core.call.masks import softmax_scale
from hf_attnscale.core.call.memo import memoize
from hf_attnscale.core.options.declare import At, Method, Part
from hf_attnscale.core.parts.key_parts import Combination, KeyPart, against_definition, merge, plain_parts

ENV_SWITCH = "HF_ATTNSCALE_FLEX_PARTS"
BLOCK = 128
"""The block mask's block, flex's default: a band skips every block of queries × keys wholly outside it."""
SERVED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SERVED_DEVICES = {"cuda": 16}
"""The devices the path serves (where flex_attention compiles and has a backward), each with the least head dim
its kernel takes there."""
NOTHING = -1e30
"""The log-sum-exp of a row that sees no key of a band: its weight is 0 beside any key's, and flex's zero output
stays zero where a row sees no key at all."""


class Band(NamedTuple):
    """Queries ``(B, H, Tq, D)``, keys and values ``(B, Hkv, Tk, D)`` scored where ``part`` covers the pair: the
    queries are the last Tq of the Tk positions."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    part: Part


CHECK = first_use.FirstUseCheck("flex key parts", ENV_SWITCH)


def serves(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    exit_logits: torch.Tensor | None,
    masked: bool,
    scaling: float | None,
    method: Method,
    shifted: bool,
) -> bool:
    """Whether `attention` takes these tensors: CUDA, eager (a model compiled whole takes the chunked
    formulation), no autocast, one head dim (at least flex's least) in a served dtype, the switch not off, and
    the combination (``method``'s layout of parts among it) has passed its check (run here on its first use)."""
    if (
        not first_use.may_serve(query, ENV_SWITCH, tuple(SERVED_DEVICES))
        or query.dtype not in SERVED_DTYPES
        or not (key.dtype == value.dtype == query.dtype)
        or not (query.shape[-1] == key.shape[-1] == value.shape[-1] >= SERVED_DEVICES[query.device.type])
    ):
        return False
    combination = Combination(
        dtype=query.dtype,
        head_dim=query.shape[-1],
        heads=query.shape[1],
        kv_heads=key.shape[1],
        exit=exit_logits is not None,
        batched=shifted,
        masks=(True,) if masked else (),
        layout=layout(method),
        scaling=scaling,
    )
    return CHECK.passes(combination, lambda: _check(combination, query.device))


def layout(method: Method) -> tuple[tuple[int, int | None, int], ...]:
    """``method``'s parts as the check samples them, ``(lo, hi, unit)`` each: bands of distance with their bounds
    in order at multiples of `SAMPLE_WINDOW`, chunks of `SAMPLE_CHUNK` positions as they are."""
    bounds = sorted(
        {b for part in method.parts if part.unit == 1 for b in (part.lo, part.hi) if b is not None}
    )
    rank = {bound: index * SAMPLE_WINDOW for index, bound in enumerate(bounds)}
    return tuple(
        (rank[part.lo], None if part.hi is None else rank[part.hi], 1)
        if part.unit == 1
        else (part.lo, part.hi, SAMPLE_CHUNK)
        for part in method.parts
    )


SAMPLE_WINDOW, SAMPLE_CHUNK = 70, 90
"""The check's band width and chunk length: several of flex's blocks, some of them whole."""


def attention(
    bands: Sequence[Band],
    visible: torch.Tensor | None,
    exit_logits: torch.Tensor | None,
    scaling: float | None,
    reach: int | None = None,
    shift: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One softmax over the ``bands`` (with the exit of per-head logits ``exit_logits``, if any), each key shown
    where ``visible`` (bool ``(B|1, 1|H, Tq, Tk)``; None: causal) and nearer than ``reach`` (a sliding window),
    ``(B, Tq, H, D)``; ``shift``: each row's offset ``(B,)`` of the cache's places from its positions, where parts
    of chunks count positions. A row that sees no key (a padding query) gets zeros. None where torch.compile has
    reached its recompile limit for a call it has no kernel for: uncompiled, flex would hold every score, so the
    caller takes its chunked formulation."""
    query = bands[0].query
    batch, heads, q_len = query.shape[:3]
    k_len = bands[0].key.shape[2]
    scale = softmax_scale(query, scaling)
    if visible is not None:  # flex reads it at every query's batch row and head
        visible = visible.expand(batch, heads, q_len, k_len)
    if shift is not None:
        shift = shift.expand(batch)
    one_band = _kernel(query.device.type)
    outs, lses = [], []
    try:
        for band in bands:
            part = band.part
            block_mask = band_block_mask(
                q_len, k_len, part.lo, part.hi, visible, query.device, part.unit, reach, shift
            )
            out, lse = one_band(
                band.query, band.key, band.value, block_mask, scale, heads != band.key.shape[1]
            )
            outs.append(out)
            lses.append(finite(lse))
    except _RECOMPILE_LIMIT:
        warnings.warn(LIMIT_WARNING, RuntimeWarning, stacklevel=2)
        return None
    return merge(outs, lses, exit_logits)[0].transpose(1, 2)


def finite(lse: torch.Tensor) -> torch.Tensor:
    """flex's log-sum-exp with a row that sees no key of its band (-inf) at `NOTHING`: finite, so no gradient
    through the merge is NaN."""
    return lse.float().masked_fill(lse == -math.inf, NOTHING)


_RECOMPILE_LIMIT = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())
"""What a ``fullgraph`` compiled function raises where uncompiled it would run (PyTorch has no public name)."""
LIMIT_WARNING = (
    "hf_attnscale: the key parts' flex kernel reached torch.compile's recompile limit "
    "(torch._dynamo.config.recompile_limit); calls with new shapes or options take the chunked public "
    "formulation (the same result, slower). Raise the limit to keep them on flex."
)


@memoize()
def _kernel(device_type: str) -> Callable:
    """``(q, k, v, block_mask, scale, gqa) -> (output, log-sum-exp)`` of one band through flex_attention: compiled
    whole, with dynamic shapes, in a function of its own, so its recompile budget is its own and hitting it
    raises; uncompiled on the CPU, where the path serves only in tests (flex's own reference implementation)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    def one_band(query, key, value, block_mask, scale, gqa):
        out, aux = flex_attention(
            query,
            key,
            value,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=gqa,
            return_aux=AuxRequest(lse=True),
        )
        return out, aux.lse

    return one_band if device_type == "cpu" else torch.compile(one_band, **COMPILE)


COMPILE = {"fullgraph": True, "dynamic": True}
"""How `_kernel` compiles flex: whole, so the recompile limit raises, and for any length at once."""


def band_block_mask(
    q_len: int,
    k_len: int,
    lo: int,
    hi: int | None,
    visible: torch.Tensor | None,
    device: torch.device,
    unit: int = 1,
    reach: int | None = None,
    shift: torch.Tensor | None = None,
):
    """The flex BlockMask of the part ``lo ≤ ⌊i/unit⌋ − ⌊j/unit⌋ < hi``, ``j ≤ i``, ``i − j < reach`` (queries at the
    last ``q_len`` of ``k_len`` places, at positions less ``shift`` of their row), also where ``visible`` shows
    the key. Built from the blocks' ranges, so no ``Tq × Tk`` tensor is made: a block wholly inside the part is
    full (no mask inside it) unless ``visible`` is given, a block wholly outside it is skipped."""
    if visible is None and shift is None:
        return _cached_band(q_len, k_len, lo, hi, device, unit, reach)
    return _band(q_len, k_len, lo, hi, visible, device, unit, reach, shift)


@memoize(maxsize=16)
def _cached_band(q_len, k_len, lo, hi, device, unit, reach):
    """Every layer of a forward asks for the same few bands."""
    return _band(q_len, k_len, lo, hi, None, device, unit, reach, None)


def _band(q_len, k_len, lo, hi, visible, device, unit, reach, shift):
    from torch.nn.attention.flex_attention import BlockMask

    past = k_len - q_len
    q_blocks, k_blocks = -(-q_len // BLOCK), -(-k_len // BLOCK)
    q_first = torch.arange(q_blocks, device=device) * BLOCK
    q_last = (q_first + BLOCK - 1).clamp_max(q_len - 1)
    k_first = torch.arange(k_blocks, device=device) * BLOCK
    k_last = (k_first + BLOCK - 1).clamp_max(k_len - 1)
    nearest = (q_first + past)[:, None] - k_last[None]  # the least distance in each block
    farthest = (q_last + past)[:, None] - k_first[None]
    if unit == 1:
        least, most = nearest, farthest
    else:  # chunks apart, at the rows' positions
        moved = (
            torch.zeros(1, 1, 1, dtype=torch.long, device=device) if shift is None else shift[:, None, None]
        )

        def chunk(places):
            return torch.div(places - moved, unit, rounding_mode="floor")

        least = chunk((q_first + past)[:, None]) - chunk(k_last[None])
        most = chunk((q_last + past)[:, None]) - chunk(k_first[None])
    some = (most >= lo) & (farthest >= 0)
    whole = (least >= lo) & (nearest >= 0)
    if hi is not None:
        some, whole = some & (least < hi), whole & (most < hi)
    if reach is not None:
        some, whole = some & (nearest < reach), whole & (farthest < reach)
    whole &= (q_last - q_first + 1 == BLOCK)[:, None] & (k_last - k_first + 1 == BLOCK)[None]
    if visible is not None:
        whole = torch.zeros_like(whole)  # the model's mask is read inside every block
    partial = some & ~whole
    offset = torch.tensor(past, device=device)
    # 0-dim tensors, not Python numbers, so that one compiled kernel serves every length and part
    low, high = torch.tensor(lo, device=device), torch.tensor(k_len + 1 if hi is None else hi, device=device)
    below = torch.tensor(k_len + 1 if reach is None else reach, device=device)
    moved = None if shift is None else shift.to(device)

    def covered(b, i, j):
        d = i + offset - j
        if unit == 1:
            apart = d
        else:
            q_pos, k_pos = (i + offset, j) if moved is None else (i + offset - moved[b], j - moved[b])
            apart = q_pos // unit - k_pos // unit
        inside = (apart >= low) & (apart < high) & (d < below)
        return inside if unit == 1 and lo >= 0 else inside & (d >= 0)

    batch = heads = 1
    if visible is None:

        def mask_mod(b, h, i, j):
            return covered(b, i, j)

    else:
        batch, heads = visible.shape[:2]

        def mask_mod(b, h, i, j):
            return covered(b, i, j) & visible[b, h, i, j]

    if partial.dim() == 3:  # per row of the batch (its positions' chunks)
        batch = max(batch, partial.shape[0])

    def ordered(blocks):
        """``(count per query block, key-block indices, those present first)``, as flex takes them."""
        blocks = (blocks if blocks.dim() == 3 else blocks[None])[:, None].expand(batch, heads, -1, -1)
        counts = blocks.sum(-1, dtype=torch.int32)
        order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts, order

    return BlockMask.from_kv_blocks(
        *ordered(partial), *ordered(whole), BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(q_len, k_len)
    )


def _check(combination: Combination, device: torch.device) -> str | None:
    """`attention` against `key_parts.plain_parts` in float64 on a sharp input of the combination's layout of
    parts: 400 queries after 200 cached keys (several blocks, some of them whole), forward and backward
    (`key_parts.against_definition`); then forward alone without gradients (the kernel that inference
    compiles), on them and on the last 64 queries (a short chunk, which flex may run with another kernel). With
    the exit, a padding mask and rows' offsets where the combination has them. None if all agree, else why."""
    tolerance = first_use.tolerance(combination.dtype)
    bands, visible, exit_logits, shift = _sample(combination, device)

    def run(chunk=bands, rows=visible):
        return attention(chunk, rows, exit_logits, combination.scaling, None, shift)

    failed = against_definition(
        run, _definition(bands, visible, shift), exit_logits, combination.scaling, tolerance=tolerance
    )

    def without_gradients() -> str | None:
        with torch.no_grad():
            for last in (bands[0].query.shape[2], 64):
                chunk = [band._replace(query=band.query[:, :, -last:]) for band in bands]
                rows = None if visible is None else visible[..., -last:, :]
                inferred = run(chunk, rows)
                if inferred is None:
                    return "torch.compile's recompile limit was reached"
                parts = _definition(chunk, rows, shift)
                want = plain_parts(
                    [KeyPart(*(t.double() for t in part[:3]), part.visible) for part in parts],
                    None if exit_logits is None else exit_logits.double(),
                    combination.scaling,
                )
                names = (f"output without gradients, {last} queries",)
                if failed := first_use.compare((inferred,), (want,), names, tolerance):
                    return failed
        return None

    return failed or first_use.reason(without_gradients)


def _definition(bands, visible, shift) -> list[KeyPart]:
    """The bands as key parts: each shows the pairs its part covers, at the rows' positions, where ``visible``
    shows the key."""
    q_len, k_len = bands[0].query.shape[2], bands[0].key.shape[2]
    device = bands[0].query.device
    i = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    j = torch.arange(k_len, device=device)[None]
    if shift is not None:
        i, j = i - shift[:, None, None, None], j - shift[:, None, None, None]
    return [
        KeyPart(*band[:3], band.part.covers(i, j) & (True if visible is None else visible)) for band in bands
    ]


def _sample(combination: Combination, device: torch.device):
    """The check's input: a band per part of the layout (their q, k, v taking gradients), the mask or None, the
    exit's logits, the rows' offsets or None."""
    sample = first_use.Sampler(combination.dtype, device)
    heads, kv_heads, dim = combination.heads, combination.kv_heads, combination.head_dim
    q_len, k_len, spread = 400, 600, first_use.sharp(dim)

    value = sample(1, kv_heads, k_len, dim)
    bands = [
        Band(
            sample(1, heads, q_len, dim, spread=spread),
            sample(1, kv_heads, k_len, dim, spread=spread),
            value,
            Part(lo, hi, At(), At(), unit),
        )
        for lo, hi, unit in combination.layout
    ]
    visible = None
    if combination.masks:  # left padding of 40 keys; with the exit, the first query sees that alone
        visible = torch.ones(1, 1, q_len, k_len, dtype=torch.bool, device=device)
        visible[..., :40] = False
        if combination.exit:
            visible[..., 0, :] = False
    exit_logits = None
    if combination.exit:
        exit_logits = (torch.linspace(-1.0, 3.0, heads) + 1.0).to(device).requires_grad_()
    shift = torch.tensor([40], device=device) if combination.batched else None
    return bands, visible, exit_logits, shift
