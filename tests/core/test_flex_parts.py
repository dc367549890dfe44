"""Keys in bands of distance through flex_attention (`hf_attnscale.core.call.flex_parts`, CUDA's ReRoPE path)
against the plain formula: one softmax over every band's visible keys (and the exit). Here flex runs uncompiled
on the CPU, forward only; tests/test_gpu.py runs it compiled, with its first-use check (backward included).
The shapes span several of flex's blocks of 128, so whole blocks are skipped or taken without a mask."""

from __future__ import annotations

import math

import pytest
import torch

from hf_attnscale.core.call import flex_parts
from hf_attnscale.core.call.flex_parts import Band
from hf_attnscale.core.call.key_parts import KeyPart, plain_parts

SCALING = 0.3


def sample(q_len, k_len, bounds, heads=4, kv_heads=2, dim=16, seed=0):
    """Bands of sharp random q and k (one value tensor), with their ``(lo, hi)`` bounds."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator) * scale

    value = randn(2, kv_heads, k_len, dim)
    return [
        Band(randn(2, heads, q_len, dim, scale=2.0), randn(2, kv_heads, k_len, dim, scale=2.0), value, lo, hi)
        for lo, hi in bounds
    ]


def definition(bands, visible, exit_logits):
    """Every band's scores where ``lo ≤ i − j < hi`` and the mask shows the key, one softmax, in float64."""
    q_len, k_len = bands[0].query.shape[2], bands[0].key.shape[2]
    distance = torch.arange(k_len - q_len, k_len)[:, None] - torch.arange(k_len)
    shown = [
        (distance >= band.lo) & (distance < band.hi) & (True if visible is None else visible)
        for band in bands
    ]
    parts = [KeyPart(*(t.double() for t in band[:3]), seen) for band, seen in zip(bands, shown)]
    return plain_parts(parts, None if exit_logits is None else exit_logits.double(), SCALING)


def left_padded(q_len, k_len):
    """Row 1 of the batch left-padded by 150 keys (more than a block), row 0 not."""
    visible = torch.ones(2, 1, q_len, k_len, dtype=torch.bool)
    visible[1, ..., :150] = False
    return visible


CASES = {  # (queries, keys, bands): ReRoPE's far and near bands, a window of 70
    "prefill": (300, 300, [(70, 300), (0, 70)]),
    "onto a cache": (200, 430, [(70, 430), (0, 70)]),  # 230 keys before the first query
    "sliding window": (300, 300, [(70, 200), (0, 70)]),  # every distance below 200
    "near only": (60, 60, [(0, 70)]),
}


@pytest.mark.parametrize("exit", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_definition(case, padded, exit):
    q_len, k_len, bounds = CASES[case]
    bands = sample(q_len, k_len, bounds)
    visible = left_padded(q_len, k_len) if padded else None
    exit_logits = torch.linspace(-1.0, 2.0, 4) if exit else None
    got = flex_parts.attention(bands, visible, exit_logits, SCALING)
    want = definition(bands, visible, exit_logits)
    if padded and not exit and q_len == k_len:  # row 1's first 150 queries see nothing: zeros here, NaN there
        assert got[1, :150].abs().max() == 0 and want[1, :150].isnan().all()
        got, want = got[:, 150:], want[:, 150:]
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_whole_blocks_are_skipped_or_taken_without_a_mask():
    """The far band of a prefill: blocks past the causal edge and inside the window are skipped, blocks
    wholly far of the diagonal are taken whole (no mask inside), and the rest are read through the mask."""
    mask = flex_parts.band_block_mask(512, 512, 70, 512, None, torch.device("cpu"))
    partial, whole = mask.kv_num_blocks[0, 0].tolist(), mask.full_kv_num_blocks[0, 0].tolist()
    # query block a: key blocks before a - 1 lie wholly 129 or more before it; blocks a - 1 and a hold distances
    # on both sides of 70 (block 0 alone for a = 0); blocks after a are skipped
    assert whole == [0, 0, 1, 2] and partial == [1, 2, 2, 2]
    assert mask.full_kv_indices[0, 0, 3, :2].tolist() == [0, 1]
    assert mask.kv_indices[0, 0, 3, :2].tolist() == [2, 3]
    near = flex_parts.band_block_mask(512, 512, 0, 70, None, torch.device("cpu"))
    assert near.kv_num_blocks[0, 0].tolist() == [1, 2, 2, 2] and near.full_kv_num_blocks.sum() == 0


def test_a_row_that_sees_nothing_has_finite_gradients():
    """Padding queries that see no key of any band and no exit: zeros, with no NaN in the merge (flex reports
    their log-sum-exp as -inf). The merge alone, as on CPU flex has no backward."""
    out = torch.zeros(1, 1, 2, 4, requires_grad=True)
    lse = torch.tensor([[[-math.inf, 0.5]]], requires_grad=True)
    finite = lse.masked_fill(lse == -math.inf, flex_parts.NOTHING)
    total = torch.logsumexp(torch.stack([finite, finite]), 0)
    merged = sum(out * (finite - total).exp().unsqueeze(-1) for _ in range(2))
    merged.sum().backward()
    assert torch.isfinite(lse.grad).all() and torch.isfinite(out.grad).all()
