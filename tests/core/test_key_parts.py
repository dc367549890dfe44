"""Keys in parts under one softmax (`hf_attnscale.core.parts.key_parts`, ReRoPE's near and far keys): the fused CPU
path and the public one against a row-by-row definition, forward and backward; the first-use check against
injected faults; and what never reaches the kernel."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import watch_fused_parts
from core.test_exit import Attention
from core.test_fused_exit import FAULTS
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_attnscale.core.call import cpu_flash, exit
from hf_attnscale.core.call.hooks import Execution
from hf_attnscale.core.parts import key_parts
from hf_attnscale.core.parts.key_parts import KeyPart

HEADS, KV_HEADS, DIM, QUERIES, SCALING = 4, 2, 8, 6, 0.4
SINKS = torch.tensor([0.0, 1.5, -2.0, 3.0])


def definition(parts, sinks, scaling=SCALING):
    """Row by row, head by head: every visible key's score (its part's query against it) and the exit's
    logit, exponentiated and normalised, weighing the keys' values. ``(B, c, H, Dv)``."""
    batch, heads, queries = parts[0].query.shape[:3]
    rows = []
    for b in range(batch):
        for h in range(heads):
            for i in range(queries):
                logits, values = [], []
                for part in parts:
                    kv = h // (heads // part.key.shape[1])
                    every = torch.ones(1, 1, 1, 1, dtype=torch.bool)
                    mask = every if part.visible is None else part.visible
                    shown = mask.expand(batch, heads, queries, part.key.shape[2])[b, h, i]
                    logits.append(part.key[b, kv, shown] @ part.query[b, h, i] * scaling)
                    values.append(part.value[b, kv, shown])
                if sinks is not None:
                    logits.append(sinks[h].view(1).to(logits[0].dtype))
                    values.append(parts[0].value.new_zeros(1, parts[0].value.shape[-1]))
                weights = torch.softmax(torch.cat(logits), dim=0)
                rows.append(weights @ torch.cat(values))
    return torch.stack(rows).view(batch, heads, queries, -1).transpose(1, 2)


def sample_parts(per_batch=True, key_counts=(9, 5), seed=0, unmasked_first=False):
    """Sharp q/k (GQA) and masks where a padded row of the batch sees fewer keys, and (of two parts or more) one
    query row sees no key of the last part."""
    generator = torch.Generator().manual_seed(seed)
    parts = []
    for count in key_counts:
        query = torch.randn(2, HEADS, QUERIES, DIM, generator=generator) * 2
        key, value = (torch.randn(2, KV_HEADS, count, DIM, generator=generator) * 2 for _ in range(2))
        visible = torch.rand(2 if per_batch else 1, 1, QUERIES, count, generator=generator) < 0.7
        visible[..., 0] = True
        parts.append(KeyPart(query, key, value, visible))
    if len(parts) > 1:
        parts[-1].visible[..., 2, :] = False
    if unmasked_first:  # every query sees the first part's every key
        parts[0] = parts[0]._replace(visible=None)
    return parts


def backend(sinks):
    """The backend's call on joined parts as `hf_attnscale.core.call.scaled` makes it: transformers' sdpa, with
    the exit's public channels where there is one."""
    module = Attention(HEADS // KV_HEADS, False)

    def attend(q, k, v, mask):
        if sinks is None:
            return sdpa_attention_forward(module, q, k, v, mask, scaling=SCALING, is_causal=False)
        out = exit.sdpa_exit_attention(
            exit.ExitCall(sdpa_attention_forward, module, q, k, v, mask, sinks, False, {"scaling": SCALING})
        )
        return out, None

    return attend


def public(parts, sinks):
    return key_parts.public_parts(backend(sinks), parts)


def fused(parts, sinks):
    return key_parts.fused_parts(parts, sinks, SCALING)


def leaves_of(parts, sinks):
    """Copies of the inputs that take gradients, and the parts made of them."""
    copies = [KeyPart(*(t.clone().requires_grad_() for t in part[:3]), part.visible) for part in parts]
    sink = None if sinks is None else sinks.clone().requires_grad_()
    return copies, sink, [t for part in copies for t in part[:3]] + ([sink] if sink is not None else [])


@pytest.mark.parametrize("formulation", [fused, public])
@pytest.mark.parametrize("sinks", [None, SINKS], ids=["no exit", "exit"])
@pytest.mark.parametrize(
    ("key_counts", "unmasked_first"),
    [((9, 5), False), ((9, 5), True), ((7,), False), ((7,), True)],
    ids=["two parts", "two parts, the first unmasked", "one part", "one part, unmasked"],
)
def test_matches_the_definition(formulation, sinks, key_counts, unmasked_first):
    """Output and every gradient (each part's q, k, v and the exit's logits), fp32, to 1e-5 of their size."""
    parts = sample_parts(key_counts=key_counts, unmasked_first=unmasked_first)
    mine, my_sink, my_leaves = leaves_of(parts, sinks)
    theirs, their_sink, their_leaves = leaves_of(parts, sinks)
    got, want = formulation(mine, my_sink), definition(theirs, their_sink)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    cotangent = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
    for a, b in zip(
        torch.autograd.grad(got, my_leaves, cotangent),
        torch.autograd.grad(want, their_leaves, cotangent),
        strict=True,
    ):
        assert (a - b).abs().max() <= 1e-5 * (b.abs().max() + 1e-6)


def test_across_the_kernels_blocks():
    """More keys than one of the kernel's key blocks (512) and more queries than one query block: forward and
    backward against the definition, with rows that see no key of one part or the other."""
    generator = torch.Generator().manual_seed(5)
    parts = []
    for index, count in enumerate((700, 90)):
        query = torch.randn(1, HEADS, 70, DIM, generator=generator) * 2
        key, value = (torch.randn(1, KV_HEADS, count, DIM, generator=generator) * 2 for _ in range(2))
        visible = torch.rand(1, 1, 70, count, generator=generator) < 0.7
        visible[..., index::2, :] = False
        parts.append(KeyPart(query, key, value, visible))
    mine, my_sink, my_leaves = leaves_of(parts, SINKS)
    theirs, their_sink, their_leaves = leaves_of(parts, SINKS)
    got, want = fused(mine, my_sink), definition(theirs, their_sink)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(
        torch.autograd.grad(got.sum(), my_leaves), torch.autograd.grad(want.sum(), their_leaves), strict=True
    ):
        assert (a - b).abs().max() <= 1e-5 * (b.abs().max() + 1e-6)


def test_a_row_that_sees_only_the_exit_is_zero():
    parts = sample_parts()
    for part in parts:
        part.visible[..., 4, :] = False
    out = fused(parts, SINKS)
    assert torch.equal(out[:, 4], torch.zeros_like(out[:, 4]))
    assert torch.isfinite(fused(parts, None)).all()  # no exit: finite, and read by no real token


@pytest.fixture
def switched_on(monkeypatch):
    """The fused path on, no verdict kept from before; yields the kernel calls' counter."""
    return watch_fused_parts(monkeypatch, True)


def through_attention(parts, sinks, fusable=True):
    return key_parts.attention(Execution(backend(sinks), sinks, SCALING, fusable), parts)


def test_checked_once_then_fused(switched_on):
    parts = sample_parts()
    torch.testing.assert_close(
        through_attention(parts, SINKS), definition(parts, SINKS), atol=1e-5, rtol=1e-5
    )
    checked = len(switched_on)
    through_attention(parts, SINKS)
    assert list(key_parts.CHECK.verdicts.values()) == [True] and len(switched_on) == checked + 2
    unmasked = sample_parts(unmasked_first=True)  # a part without a mask: a combination of its own
    torch.testing.assert_close(
        through_attention(unmasked, None), definition(unmasked, None), atol=1e-5, rtol=1e-5
    )
    assert list(key_parts.CHECK.verdicts.values()) == [True, True]


@pytest.mark.parametrize(("stage", "fault"), FAULTS)
def test_a_kernel_that_disagrees_is_caught_and_never_used(switched_on, monkeypatch, stage, fault):
    """An injected fault in the kernel fails the check: one warning, and the public formulation's result, the
    gradients too, from then on."""
    monkeypatch.setattr(cpu_flash, stage, fault(getattr(cpu_flash, stage)))
    parts = sample_parts()
    results = []
    for through in (through_attention, public):
        copies, sink, leaves = leaves_of(parts, SINKS)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = through(copies, sink)
            out = through(copies, sink)  # the verdict is kept: no second warning
        results.append(
            (out, torch.autograd.grad(out.square().sum(), leaves), [str(w.message) for w in caught])
        )
    (got, got_grads, warned), (want, want_grads, _) = results
    assert len(warned) == 1 and "fused CPU key parts failed its check" in warned[0], warned
    assert list(key_parts.CHECK.verdicts.values()) == [False]
    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert torch.equal(a, b)


def test_what_never_reaches_the_kernel(switched_on, monkeypatch):
    """Not fusable (clipped softmax, dropout, soft-cap), autocast, a head dim of values unlike the queries',
    float64, a mask that is not 4D, the switch off, an accelerator (here: meta, whose combination is None): the public formulation, unchecked."""
    parts = sample_parts()
    through_attention(parts, None, fusable=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        through_attention(parts, None)
    wide = [part._replace(value=torch.cat([part.value, part.value], -1)) for part in parts]
    through_attention(wide, None)
    through_attention([KeyPart(*(t.double() for t in part[:3]), part.visible) for part in parts], None)
    flat = [part._replace(visible=part.visible[0, 0]) for part in parts]  # a 2D mask: its shape is not read
    through_attention(flat, None)
    monkeypatch.setenv(key_parts.ENV_SWITCH, "0")
    through_attention(parts, None)
    assert not switched_on and not key_parts.CHECK.verdicts
    monkeypatch.setenv(key_parts.ENV_SWITCH, "1")
    meta = [KeyPart(*(t.to("meta") for t in part[:3]), part.visible.to("meta")) for part in parts]
    assert key_parts._combination(meta, None) is None
