"""LongLoRA's shifted sparse attention (S²-Attn) against a per-pair reference, forward and backward; no future leak;
dense in eval; through hfa.patch on eager and sdpa."""

from __future__ import annotations

import pytest
import torch
from conftest import SHARP_VOCAB, sharp_model

import hf_attnscale as hfa
from hf_attnscale.core.call.shifted import shifted_sparse_attention


def reference(q, k, v, group, allowed=None, scaling=None):
    """Per pair: query i of head h sees key j <= i in its own group, the second half of the heads' groups (the
    smaller of an odd count's) shifted by G/2 (``(i + G/2) // G``), and where ``allowed`` (B, T, T) says so;
    plain softmax."""
    batch, heads, length, dim = q.shape
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scaling = dim**-0.5 if scaling is None else scaling
    out = torch.zeros(batch, length, heads, dim, dtype=q.dtype)
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    for h in range(heads):
        shift = group // 2 if h >= heads - heads // 2 else 0
        sees = (j <= i) & ((i + shift) // group == (j + shift) // group)
        for b in range(batch):
            mask = sees if allowed is None else sees & allowed[b]
            scores = (q[b, h] @ k[b, h].T) * scaling
            scores = scores.masked_fill(~mask, float("-inf"))
            out[b, :, h] = torch.softmax(scores, dim=-1) @ v[b, h]
    return out


def draw(batch=2, heads=4, kv_heads=2, length=21, dim=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(batch, heads, length, dim, generator=g, dtype=dtype) * 2).requires_grad_()
    k = (torch.randn(batch, kv_heads, length, dim, generator=g, dtype=dtype) * 2).requires_grad_()
    v = torch.randn(batch, kv_heads, length, dim, generator=g, dtype=dtype).requires_grad_()
    return q, k, v


@pytest.mark.parametrize("length, group", [(21, 8), (24, 8), (5, 8), (16, 2), (30, 6)])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_matches_the_per_pair_reference_forward_and_backward(length, group, kv_heads):
    q, k, v = draw(kv_heads=kv_heads, length=length)
    got = shifted_sparse_attention(q, k, v, None, group)
    want = reference(q, k, v, group)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    grad = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10 * b.abs().max().item())


@pytest.mark.parametrize("additive", [False, True])
def test_the_models_mask_padding_and_packing_is_kept_within_each_group(additive):
    q, k, v = draw(batch=2, length=20)
    causal = torch.ones(20, 20, dtype=torch.bool).tril()
    allowed = causal.repeat(2, 1, 1)
    allowed[0, :, :3] = False  # row 0 left-padded by 3 (a padding query still sees itself)
    allowed[0, torch.arange(3), torch.arange(3)] = True
    allowed[1, 11:, :11] = False  # row 1 packs two sequences, 0-10 and 11-19
    mask = allowed[:, None]
    if additive:
        mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, torch.finfo(q.dtype).min)
    got = shifted_sparse_attention(q, k, v, mask, 8)
    torch.testing.assert_close(got, reference(q, k, v, 8, allowed), rtol=0, atol=1e-12)


def test_nothing_leaks_from_the_end_to_the_first_half_group():
    """The authors' roll wraps the first G/2 tokens into the last group; here they never see what follows."""
    q, k, v = draw(length=24)
    out = shifted_sparse_attention(q, k, v, None, 8)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, 4:] += 5.0
    v2[:, :, 4:] += 5.0
    moved = shifted_sparse_attention(q, k2, v2, None, 8)
    torch.testing.assert_close(
        moved[:, :4], out[:, :4], rtol=0, atol=0
    )  # every head: tokens 0-3 see only 0-3
    assert not torch.allclose(moved[:, 4:], out[:, 4:])


def test_a_cache_is_refused_in_one_line():
    q, k, v = draw(length=8)
    with pytest.raises(ValueError, match="8 queries against 9 keys") as err:
        shifted_sparse_attention(q, torch.cat([k, k[:, :, :1]], 2), torch.cat([v, v[:, :, :1]], 2), None, 4)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("heads", [3, 9, 1])
def test_an_odd_head_count_shifts_the_smaller_half(heads):
    """SmolLM2's 9 heads: the first 5 in groups, the last 4 shifted, as the authors' ``chunk(2)`` splits them;
    one head alone is never shifted."""
    q, k, v = draw(heads=heads, kv_heads=1, length=21)
    torch.testing.assert_close(shifted_sparse_attention(q, k, v, None, 6), reference(q, k, v, 6))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"shifted_sparse_group": 7}, "must be even"),
        ({"shifted_sparse_group": 1}, "must be an int >= 2"),
        ({"shifted_sparse_group": 8, "zero_kv": True}, "cannot be combined with zero_kv / sink_logit"),
        ({"shifted_sparse_group": 8, "rerope_window": 4}, "cannot be combined with rerope_window"),
    ],
)
def test_bad_options_are_one_line(options, message):
    with pytest.raises(ValueError, match=message) as err:
        hfa.AttnScaleConfig(**options)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_patched_model_trains_in_groups_and_reads_densely(attn):
    ids = torch.randint(0, SHARP_VOCAB, (2, 28), generator=torch.Generator().manual_seed(0))
    plain = sharp_model(attn=attn)
    model = sharp_model(attn=attn)
    hfa.patch(model, shifted_sparse_group=8, scale="logn", train_length=16)
    reference_model = sharp_model(attn=attn)
    hfa.patch(reference_model, scale="logn", train_length=16)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids).logits, reference_model(ids).logits, rtol=0, atol=0
        )  # eval: dense
    model.train()
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    with torch.no_grad():
        dense = reference_model.train()(ids, labels=ids).loss
    assert not torch.isclose(loss.detach(), dense)  # training saw groups
    hfa.unpatch(model)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=0, atol=0)
