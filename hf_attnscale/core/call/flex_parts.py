"""Keys in bands of distance under one softmax, on CUDA, through PyTorch's public `flex_attention`.

ReRoPE's near and far keys (`hf_attnscale.core.call.rerope`) are two bands of the distance ``d = i − j`` between
a query at position i and a key at j: near keys have ``0 ≤ d < w``, far ones ``d ≥ w`` (both below a sliding
window, where there is one). A `Band` is queries, keys and values scored only where ``lo ≤ d < hi`` (and where
the model's mask shows the key). Each band is one call of the compiled flex kernel over the whole sequence with
a block mask built from the band's bounds, so it skips the blocks outside it: the far band costs about one causal
attention, the near one a window's width. Each call returns its output ``o_b`` and log-sum-exp ``l_b``; with
``L = logsumexp(l_1, l_2, …, s)`` (s the exit's logit) the result is ``y = Σ_b exp(l_b − L) · o_b``, and
autograd runs through the kernel's own backward, which takes the log-sum-exp's gradient too.

On CUDA this replaces the public formulation on doubled channels and a dense mask
(`hf_attnscale.core.call.key_parts.joined`), which no flash kernel takes. Each combination of dtypes, heads and
options passes a first-use check against the plain formula in float64 before it serves
(`hf_attnscale.core.call.first_use`); ``HF_ATTNSCALE_FLEX_PARTS=0`` turns the path off. flex is compiled with
dynamic shapes, whole (``fullgraph``), in a function of its own: past torch.compile's recompile limit a call
raises rather than running flex uncompiled, which would hold every score, and takes the chunked formulation.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch._dynamo

from hf_attnscale.core.call import first_use
from hf_attnscale.core.call.key_parts import KeyPart, merge, plain_parts
from hf_attnscale.core.call.masks import softmax_scale

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
    """Queries ``(B, H, Tq, D)``, keys and values ``(B, Hkv, Tk, D)`` scored where ``lo ≤ i − j < hi``: the queries
    are the last Tq of the Tk positions."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    lo: int
    hi: int


BandsFn = Callable[[Sequence[Band], torch.Tensor | None], torch.Tensor | None]
"""Attention over bands, with the model's mask as bool ``(B|1, 1|H, Tq, Tk)`` or None (causal):
``(bands, visible) -> (B, Tq, H, D)``."""


class Combination(NamedTuple):
    """What the first-use check covers: one verdict per combination."""

    dtype: str
    head_dim: int
    heads: int
    kv_heads: int
    exit: bool
    masked: bool
    scaling: float | None


CHECK = first_use.FirstUseCheck("flex key bands", ENV_SWITCH)


def serves(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    exit_logits: torch.Tensor | None,
    masked: bool,
    scaling: float | None,
) -> bool:
    """Whether `attention` takes these tensors: CUDA, eager (a model compiled whole takes the chunked
    formulation), no autocast, one head dim (at least flex's least) in a served dtype, the switch not off, and
    the combination's check passed (run here on its first use)."""
    if (
        not first_use.may_serve(query, ENV_SWITCH, tuple(SERVED_DEVICES))
        or query.dtype not in SERVED_DTYPES
        or not (key.dtype == value.dtype == query.dtype)
        or not (query.shape[-1] == key.shape[-1] == value.shape[-1] >= SERVED_DEVICES[query.device.type])
    ):
        return False
    combination = Combination(
        str(query.dtype),
        query.shape[-1],
        query.shape[1],
        key.shape[1],
        exit_logits is not None,
        masked,
        scaling,
    )
    return CHECK.passes(combination, lambda: _check(combination, query.device))


def attention(
    bands: Sequence[Band],
    visible: torch.Tensor | None,
    exit_logits: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor | None:
    """One softmax over the ``bands`` (with the exit of per-head logits ``exit_logits``, if any), each key shown
    where ``visible`` (bool ``(B|1, 1|H, Tq, Tk)``; None: causal), ``(B, Tq, H, D)``. A row that sees no key
    (a padding query) gets zeros. None where torch.compile has reached its recompile limit for a call it has no
    kernel for: uncompiled, flex would hold every score, so the caller takes its chunked formulation."""
    query = bands[0].query
    batch, heads, q_len = query.shape[:3]
    k_len = bands[0].key.shape[2]
    scale = softmax_scale(query, scaling)
    if visible is not None:  # flex reads it at every query's batch row and head
        visible = visible.expand(batch, heads, q_len, k_len)
    one_band = _kernel(query.device.type)
    outs, lses = [], []
    try:
        for band in bands:
            block_mask = band_block_mask(q_len, k_len, band.lo, band.hi, visible, query.device)
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
    "hf_attnscale: ReRoPE's flex kernel reached torch.compile's recompile limit "
    "(torch._dynamo.config.recompile_limit); calls with new shapes or options take the chunked public "
    "formulation (the same result, slower). Raise the limit to keep them on flex."
)


@functools.cache
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
    q_len: int, k_len: int, lo: int, hi: int, visible: torch.Tensor | None, device: torch.device
):
    """The flex BlockMask of the band ``lo ≤ i − j < hi`` (queries at the last ``q_len`` of ``k_len`` positions),
    also where ``visible`` shows the key. Built from the blocks' distance ranges, so no ``Tq × Tk`` tensor is
    made: a block wholly inside the band is full (no mask inside it) unless ``visible`` is given, a block wholly
    outside it is skipped."""
    if visible is None:
        return _cached_band(q_len, k_len, lo, hi, device)
    return _band(q_len, k_len, lo, hi, visible, device)


@functools.lru_cache(maxsize=16)
def _cached_band(q_len, k_len, lo, hi, device):
    """Every layer of a forward asks for the same few bands."""
    return _band(q_len, k_len, lo, hi, None, device)


def _band(q_len, k_len, lo, hi, visible, device):
    from torch.nn.attention.flex_attention import BlockMask

    past = k_len - q_len
    q_blocks, k_blocks = -(-q_len // BLOCK), -(-k_len // BLOCK)
    q_first = torch.arange(q_blocks, device=device) * BLOCK
    q_last = (q_first + BLOCK - 1).clamp_max(q_len - 1)
    k_first = torch.arange(k_blocks, device=device) * BLOCK
    k_last = (k_first + BLOCK - 1).clamp_max(k_len - 1)
    nearest = (q_first + past)[:, None] - k_last[None]  # the least distance in each block
    farthest = (q_last + past)[:, None] - k_first[None]
    some = (farthest >= lo) & (nearest < hi)
    whole = (nearest >= lo) & (farthest < hi)
    whole &= (q_last - q_first + 1 == BLOCK)[:, None] & (k_last - k_first + 1 == BLOCK)[None]
    if visible is not None:
        whole = torch.zeros_like(whole)  # the model's mask is read inside every block
    partial = some & ~whole
    offset = torch.tensor(past, device=device)
    bounds = torch.tensor([lo, hi], device=device)
    if visible is None:

        def mask_mod(b, h, i, j):
            d = i + offset - j
            return (d >= bounds[0]) & (d < bounds[1])

        batch = heads = 1
    else:
        batch, heads = visible.shape[:2]

        def mask_mod(b, h, i, j):
            d = i + offset - j
            return (d >= bounds[0]) & (d < bounds[1]) & visible[b, h, i, j]

    def ordered(blocks):
        """``(count per query block, key-block indices, those present first)``, as flex takes them."""
        blocks = blocks[None, None].expand(batch, heads, -1, -1)
        counts = blocks.sum(-1, dtype=torch.int32)
        order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts, order

    return BlockMask.from_kv_blocks(
        *ordered(partial), *ordered(whole), BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(q_len, k_len)
    )


def _check(combination: Combination, device: torch.device) -> str | None:
    """`attention` against `key_parts.plain_parts` in float64 on a sharp input: near and far bands of 400 queries
    after 200 cached keys (several blocks, some of them whole) with a window of 70, forward and backward; then
    forward alone without gradients (the kernel that inference compiles), on them and on the last 64 queries (a
    short chunk, which flex may run with another kernel). With the exit and a padding mask where the combination
    has them. None if all agree, else why not."""
    float32_tolerance = 1e-5 if torch.get_float32_matmul_precision() == "highest" else 3e-3  # else TF32
    tolerance = float32_tolerance if combination.dtype == "torch.float32" else 3e-2
    try:
        bands, visible, exit_logits = _sample(combination, device)
        leaves = [t for band in bands for t in band[:3]] + ([exit_logits] if exit_logits is not None else [])
        got = attention(bands, visible, exit_logits, combination.scaling)
        if got is None:
            return "torch.compile's recompile limit was reached"
        cotangent = torch.randn(got.shape, generator=torch.Generator().manual_seed(1)).to(got)
        got_grads = torch.autograd.grad(got, leaves, cotangent)
        want = _definition(bands, visible, exit_logits, combination.scaling)
        want_grads = torch.autograd.grad(want, leaves, cotangent.double())
        names = ("output", *(f"{g}{i}" for i in range(len(bands)) for g in ("dq", "dk", "dv")), "dexit")
        failed = first_use.compare(
            (got, *got_grads), (want, *want_grads), names[: 1 + len(leaves)], tolerance
        )
        with torch.no_grad():
            for last in (got.shape[1], 64):
                chunk = [band._replace(query=band.query[:, :, -last:]) for band in bands]
                rows = None if visible is None else visible[..., -last:, :]
                inferred = attention(chunk, rows, exit_logits, combination.scaling)
                if inferred is None:
                    return "torch.compile's recompile limit was reached"
                want = _definition(chunk, rows, exit_logits, combination.scaling)
                failed = failed or first_use.compare(
                    (inferred,), (want,), (f"output without gradients, {last} queries",), tolerance
                )
    except Exception as error:  # any failure of the compiler or kernel means: do not use it
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return failed


def _definition(bands, visible, exit_logits, scaling) -> torch.Tensor:
    """The bands' plain formula in float64: every band's scores where ``lo ≤ i − j < hi`` and the mask shows the
    key, and the exit's column, under one softmax."""
    q_len, k_len = bands[0].query.shape[2], bands[0].key.shape[2]
    device = bands[0].query.device
    distance = torch.arange(k_len - q_len, k_len, device=device)[:, None] - torch.arange(k_len, device=device)
    parts = [
        KeyPart(
            *(t.double() for t in band[:3]),
            (distance >= band.lo) & (distance < band.hi) & (True if visible is None else visible),
        )
        for band in bands
    ]
    return plain_parts(parts, None if exit_logits is None else exit_logits.double(), scaling)


def _sample(combination: Combination, device: torch.device):
    """The check's input: two bands (their q, k, v taking gradients), the mask or None, the exit's logits."""
    dtype = getattr(torch, combination.dtype.removeprefix("torch."))
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = combination.heads, combination.kv_heads, combination.head_dim
    q_len, k_len, window, spread = 400, 600, 70, 3 / math.sqrt(math.sqrt(dim))

    def sample(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device, dtype).requires_grad_()

    value = sample(1, kv_heads, k_len, dim)
    bands = [
        Band(
            sample(1, heads, q_len, dim, scale=spread),
            sample(1, kv_heads, k_len, dim, scale=spread),
            value,
            lo,
            hi,
        )
        for lo, hi in ((0, window), (window, k_len))
    ]
    visible = None
    if combination.masked:  # left padding of 40 keys; with the exit, the first query sees that alone
        visible = torch.ones(1, 1, q_len, k_len, dtype=torch.bool, device=device)
        visible[..., :40] = False
        if combination.exit:
            visible[..., 0, :] = False
    exit_logits = None
    if combination.exit:
        exit_logits = (torch.linspace(-1.0, 3.0, heads) + 1.0).to(device).requires_grad_()
    return bands, visible, exit_logits
