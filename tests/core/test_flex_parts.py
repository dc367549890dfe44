"""Keys in bands of distance through flex_attention (`hf_attnscale.core.parts.flex_parts`, CUDA's ReRoPE path)
against the plain formula: one softmax over every band's visible keys (and the exit). Here flex runs uncompiled
on the CPU, forward only, and reads every entry through the mask function, so the block lists that the compiled
kernel follows (which blocks it skips, which it takes whole, with no mask) are tested against the definition
block by block. tests/test_gpu.py runs the bands compiled, with their first-use check (backward included)."""

from __future__ import annotations

import math

import pytest
import torch

from hf_attnscale.core.options.declare import At, Part
from hf_attnscale.core.parts import flex_parts, key_parts
from hf_attnscale.core.parts.flex_parts import Band
from hf_attnscale.core.parts.key_parts import KeyPart, plain_parts

SCALING = 0.3


def sample(q_len, k_len, bounds, heads=4, kv_heads=2, dim=16, seed=0):
    """Bands of sharp random q and k (one value tensor), with their ``(lo, hi)`` bounds."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator) * scale

    value = randn(2, kv_heads, k_len, dim)
    return [
        Band(
            randn(2, heads, q_len, dim, scale=2.0),
            randn(2, kv_heads, k_len, dim, scale=2.0),
            value,
            Part(lo, hi, At(), At()),
        )
        for lo, hi in bounds
    ]


def definition(bands, visible, exit_logits):
    """Every band's scores where ``lo ≤ i − j < hi`` and the mask shows the key, one softmax, in float64."""
    q_len, k_len = bands[0].query.shape[2], bands[0].key.shape[2]
    distance = torch.arange(k_len - q_len, k_len)[:, None] - torch.arange(k_len)
    shown = [
        (distance >= band.part.lo) & (distance < band.part.hi) & (True if visible is None else visible)
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
        torch.testing.assert_close(got[1, 150:].double(), want[1, 150:], atol=1e-5, rtol=1e-5)
        got, want = got[:1], want[:1]
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


BLOCK_CASES = {  # (queries, keys, lo, hi, padded): ragged last blocks throughout
    "far band, prefill": (300, 300, 70, 300, False),
    "near band, prefill": (300, 300, 0, 70, False),
    "far band after a cache": (200, 430, 70, 430, False),
    "near band after a cache": (200, 430, 0, 70, False),
    "far band, sliding window": (300, 300, 70, 200, False),
    "one query after a cache": (1, 333, 70, 333, False),
    "a window at a block's farthest distance": (300, 300, 127, 300, False),  # the diagonal block's 127
    "a sliding window at a block's farthest distance": (512, 512, 70, 383, False),  # block (2, 0): 129 to 383
    "far band, padded": (300, 300, 70, 300, True),
    "near band after a cache, padded": (200, 430, 0, 70, True),
}


@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_the_block_lists_against_the_definition(case):
    """Compiled flex reads a block only if the block mask lists it, and reads a whole block with no mask: so
    every block that holds a visible entry is listed, and a whole block holds only visible entries. Without a
    padding mask the lists are exact: no empty block is listed, and every complete block that holds only
    visible entries is whole. (With one, blocks are listed by the band alone and read through the mask.)"""
    q_len, k_len, lo, hi, padded = BLOCK_CASES[case]
    visible = left_padded(q_len, k_len).expand(2, 4, q_len, k_len) if padded else None
    mask = flex_parts.band_block_mask(q_len, k_len, lo, hi, visible, torch.device("cpu"))
    distance = torch.arange(k_len - q_len, k_len)[:, None] - torch.arange(k_len)
    shown = ((distance >= lo) & (distance < hi)).expand(2, 4, q_len, k_len)
    if padded:
        shown = shown & visible
    block = flex_parts.BLOCK
    rows, cols = -(-q_len // block), -(-k_len // block)
    padded_shown = torch.nn.functional.pad(shown, (0, cols * block - k_len, 0, rows * block - q_len))
    per_block = padded_shown.reshape(2, 4, rows, block, cols, block).transpose(3, 4).flatten(-2)
    complete = torch.zeros(rows, cols, dtype=torch.bool)
    complete[: q_len // block, : k_len // block] = True
    for b, h in ((0, 0), (1, 3)):
        listed = lists(mask.kv_num_blocks, mask.kv_indices, b, h, rows, cols)
        whole = lists(mask.full_kv_num_blocks, mask.full_kv_indices, b, h, rows, cols)
        some, every = per_block[b, h].any(-1), per_block[b, h].all(-1) & complete
        assert not (some & ~(listed | whole)).any(), case  # every visible entry's block is read
        assert not (listed & whole).any()
        assert not (whole & ~every).any()  # a whole block has no entry to mask
        if not padded:  # the band alone: no empty block is read, and every full block is whole
            assert torch.equal(listed | whole, some) and torch.equal(whole, every)


def lists(counts, indices, b, h, rows, cols) -> torch.Tensor:
    """A block mask's lists as a bool ``(query blocks, key blocks)``."""
    dense = torch.zeros(rows, cols, dtype=torch.bool)
    batch, heads = counts.shape[:2]
    for row in range(rows):
        count = counts[b % batch, h % heads, row]
        dense[row, indices[b % batch, h % heads, row, :count].long()] = True
    return dense


def test_a_row_that_sees_nothing_has_finite_gradients():
    """Padding queries that see no key of either band and no exit: zeros, and no NaN in any gradient, through the
    merge the bands share with the CPU's key parts (flex reports such a row's log-sum-exp as -inf). The merge
    alone: on the CPU flex has no backward."""
    outs = [  # as flex gives them: zeros where a row sees nothing (row 0)
        torch.tensor([[[[0.0] * 4, [value] * 4]]], requires_grad=True) for value in (1.0, 2.0)
    ]
    lses = [torch.tensor([[[-math.inf, 0.5]]], requires_grad=True) for _ in range(2)]
    merged, _ = key_parts.merge(outs, [flex_parts.finite(lse) for lse in lses], None)
    merged.sum().backward()
    assert torch.isfinite(merged).all() and merged[0, 0, 0].abs().max() < 1e-6
    assert all(torch.isfinite(t.grad).all() for t in [*outs, *lses])


def test_compiled_once_per_kind_of_call_and_past_the_limit_handed_back(monkeypatch):
    """flex compiled as `_kernel` compiles it (an eager backend here: the CPU's compiler has no log-sum-exp):
    one graph serves every prefill's length, one more every chunk onto a cache (the keys outnumber the queries),
    and a padding mask one more; where a call would need a graph past torch.compile's recompile limit, it
    raises, and `attention` hands the call back (None) with one warning, rather than running flex uncompiled."""
    graphs = []

    def backend(graph, inputs):
        graphs.append(graph)
        return graph.forward

    torch.compiler.reset()
    compiled = torch.compile(flex_parts._kernel.__wrapped__("cpu"), backend=backend, **flex_parts.COMPILE)
    monkeypatch.setattr(flex_parts, "_kernel", lambda device_type: compiled)
    with torch.no_grad():
        for q_len, k_len, count in [
            (300, 300, 1),
            (517, 517, 1),
            (700, 700, 1),
            (200, 430, 2),
            (300, 600, 2),
        ]:
            bands = sample(q_len, k_len, [(70, k_len), (0, 70)], seed=q_len)
            got = flex_parts.attention(bands, None, None, SCALING)
            torch.testing.assert_close(got.double(), definition(bands, None, None), atol=1e-5, rtol=1e-5)
            assert len(graphs) == count, (q_len, k_len)
        bands, visible = sample(300, 300, [(70, 300), (0, 70)]), left_padded(300, 300)
        with (
            torch._dynamo.config.patch(recompile_limit=2),
            pytest.warns(RuntimeWarning, match="recompile limit"),
        ):
            assert flex_parts.attention(bands, visible, None, SCALING) is None
        got = flex_parts.attention(bands, visible, None, SCALING)
    assert len(graphs) == 3
    want = definition(bands, visible, None)
    torch.testing.assert_close(got[0].double(), want[0], atol=1e-5, rtol=1e-5)
    torch.compiler.reset()
