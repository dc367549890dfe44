"""The fused CPU exit (`hf_attnscale.core.call.fused_exit`): the kernel's formulation against the eager reference, the
first-use check against injected faults, and what it never serves.

The rest of the suite runs with the fused path off (``HF_ATTNSCALE_FUSED_EXIT=0``, tests/conftest.py), so that it
proves the public formulation every device runs; these tests turn it on.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import FEATURES, model_output, patched_and_reference, sample_inputs
from core.test_exit import SHAPES, SINKS, Attention, exit_through_sdpa, visible_keys
from reference import reference_attention
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_attnscale.core.call import cpu_flash, exit, fused_exit
from hf_attnscale.core.call.exit import ExitCall


@pytest.fixture
def fused(monkeypatch):
    """The fused path on, with no verdict kept from earlier tests; yields the kernel calls' counter."""
    monkeypatch.setenv(fused_exit.ENV_SWITCH, "1")
    monkeypatch.setattr(fused_exit.CHECK, "verdicts", {})
    calls = {"forward": 0}
    kernel = cpu_flash.flash_forward

    def counting(*args):
        calls["forward"] += 1
        return kernel(*args)

    monkeypatch.setattr(cpu_flash, "flash_forward", counting)
    return calls


def call(q, k, v, mask, sinks, causal, scaling=0.3):
    """The exit as `core.attention` calls it under sdpa, ``(B, H, Tq, D)``."""
    module = Attention(q.shape[1] // k.shape[1], causal)
    out = fused_exit.exit_attention(
        ExitCall(sdpa_attention_forward, module, q, k, v, mask, sinks, causal, {"scaling": scaling})
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize("head_dim", [8, 64])
@pytest.mark.parametrize(("causal", "q_len", "k_len", "mask_kind"), SHAPES)
def test_fused_exit_matches_reference(causal, q_len, k_len, mask_kind, head_dim):
    """Forward and backward (q, k, v, the per-head sink) of the kernel's formulation, unchecked, against the
    reference, fp32 1e-5, GQA, in every shape the public formulation's tests take."""
    generator = torch.Generator().manual_seed(head_dim + q_len)
    q = torch.randn(2, 4, q_len, head_dim, generator=generator) * 2
    k, v = (torch.randn(2, 2, k_len, head_dim, generator=generator) for _ in range(2))
    visible = visible_keys(2, q_len, k_len, causal, padded=mask_kind is not None)
    bias = None
    if mask_kind == "bool":
        mask = visible
    elif mask_kind is not None:
        bias = torch.randn(2, 4, q_len, k_len, generator=generator)
        mask = bias.masked_fill(~visible, torch.finfo(torch.float32).min)
    else:
        mask = None
    mine = [t.clone().requires_grad_() for t in (q, k, v, SINKS)]
    leaves = [t.clone().requires_grad_() for t in (q, k, v, SINKS)]
    module = Attention(2, causal)
    fused = ExitCall(None, module, *mine[:3], mask, mine[3], causal, {"scaling": 0.3})
    got = fused_exit.fused_exit_attention(fused).transpose(1, 2)
    want = reference_attention(
        *leaves[:3],
        visible,
        0.3,
        sink=leaves[3],
        bias=None if bias is None else bias.masked_fill(~visible, 0),
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    grad = torch.randn(want.shape, generator=generator)
    got.backward(grad)
    want.backward(grad)
    for a, b in zip(mine, leaves, strict=True):
        assert b.grad.abs().max() > 0
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5 * b.grad.abs().max(), rtol=1e-4)


def test_a_query_that_sees_no_key_gives_zeros_and_no_nan():
    q, k, v = (torch.randn(1, 4, 3, 8, requires_grad=True) for _ in range(3))
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool).tril()
    mask[:, :, 0] = False
    sinks = SINKS.clone().requires_grad_()
    out = fused_exit.fused_exit_attention(
        ExitCall(None, Attention(1, True), q, k, v, mask, sinks, True, {"scaling": 0.3})
    )
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v, sinks))


def test_the_checked_path_serves_and_remembers_its_verdict(fused):
    """One check per combination, then the kernel alone; the result equals the public formulation's."""
    q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = call(q, k, v, None, SINKS, True)
    assert list(fused_exit.CHECK.verdicts.values()) == [True]
    checked = fused["forward"]
    assert checked >= 2  # the check's run, then the call's
    call(q, k, v, None, SINKS, True)
    assert fused["forward"] == checked + 1 and len(fused_exit.CHECK.verdicts) == 1
    torch.testing.assert_close(got, exit_through_sdpa(q, k, v, None, SINKS, True, 0.3), atol=1e-5, rtol=1e-5)
    call(q[:, :, -1:], k, v, None, SINKS, True)  # one query is another combination
    assert len(fused_exit.CHECK.verdicts) == 2


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_the_check_runs_inside_no_grad_and_inference_mode(context, fused):
    """Evaluation runs without autograd; the check (which needs gradients) passes there too."""
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    with warnings.catch_warnings(), context():
        warnings.simplefilter("error")
        got = call(q, k, v, None, SINKS, True)
    assert list(fused_exit.CHECK.verdicts.values()) == [True]
    torch.testing.assert_close(got, exit_through_sdpa(q, k, v, None, SINKS, True, 0.3), atol=1e-5, rtol=1e-5)


def _lse_off_by_ln2(kernel):
    def faulty(*args):
        out, lse = kernel(*args)
        return out, lse + math.log(2)

    return faulty


def _transposed_output(kernel):
    def faulty(*args):
        out, lse = kernel(*args)
        return out.transpose(1, 2).reshape(out.shape), lse

    return faulty


def _raising(kernel):
    def faulty(*args):
        raise RuntimeError("the kernel refused these inputs")

    return faulty


def _backward_lse_off_by_ln2(kernel):
    def faulty(grad, query, key, value, out, lse, *args):
        return kernel(grad, query, key, value, out, lse + math.log(2), *args)

    return faulty


FAULTS = [
    ("flash_forward", _lse_off_by_ln2),
    ("flash_forward", _transposed_output),
    ("flash_forward", _raising),
    ("flash_backward", _backward_lse_off_by_ln2),
]
"""Faults injected into `hf_attnscale.core.call.cpu_flash`: (which function, what wraps it)."""


@pytest.mark.parametrize(("stage", "fault"), FAULTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_injected_fault_falls_back_with_one_warning(stage, fault, dtype, fused, monkeypatch):
    """A faulty kernel fails the check: one warning, and the combination takes the public formulation from then
    on, so the results (forward and gradients) are exactly the public formulation's."""
    monkeypatch.setattr(cpu_flash, stage, fault(getattr(cpu_flash, stage)))
    generator = torch.Generator().manual_seed(0)
    inputs = [
        (torch.randn(shape, generator=generator) * 2).to(dtype)
        for shape in ((2, 4, 9, 16), (2, 2, 9, 16), (2, 2, 9, 16))
    ]
    mask = visible_keys(2, 9, 9, True, padded=True)
    results = []
    for through in (call, exit_through_sdpa):
        leaves = [t.clone().requires_grad_() for t in (*inputs, SINKS)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = through(*leaves[:3], mask, leaves[3], True, 0.3)
            out = through(*leaves[:3], mask, leaves[3], True, 0.3)  # the verdict is kept: no second warning
        out.sum().backward()
        results.append((out, [t.grad for t in leaves], [str(w.message) for w in caught]))
    (got, got_grads, warned), (want, want_grads, _) = results
    assert len(warned) == 1 and "fused CPU exit failed its check" in warned[0], warned
    assert list(fused_exit.CHECK.verdicts.values()) == [False]
    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert torch.equal(a, b)


def test_switched_off_or_not_served_never_reaches_the_kernel(fused, monkeypatch):
    """``HF_ATTNSCALE_FUSED_EXIT=0``, a learnable mask, autocast and dropout all take the public formulation."""
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8)
    bias = torch.zeros(1, 4, 6, 6, requires_grad=True)
    module = Attention(1, True)
    plain = ExitCall(sdpa_attention_forward, module, q, k, v, None, SINKS, True, {})
    fused_exit.exit_attention(plain._replace(mask=bias))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused_exit.exit_attention(plain)
    fused_exit.exit_attention(plain._replace(kwargs={"dropout": 0.1}))
    monkeypatch.setenv(fused_exit.ENV_SWITCH, "0")
    fused_exit.exit_attention(plain)
    assert fused["forward"] == 0 and not fused_exit.CHECK.verdicts


@pytest.mark.parametrize("feature", ["logn+zero_kv", "ssmax+sink_learnable"])
def test_a_patched_model_under_the_fused_exit_matches_reference(feature, fused):
    """End to end on a padded batch: logits, and the gradients of the learnable sink and slopes, against the
    eager reference; the kernel did the work."""
    patched, reference, states, refs = patched_and_reference("llama", "sdpa", FEATURES[feature])
    inputs = sample_inputs("llama")
    got, want = model_output(patched, **inputs), model_output(reference, **inputs)
    rows = inputs["attention_mask"].bool()
    torch.testing.assert_close(got[rows], want[rows], atol=1e-5, rtol=1e-5)
    assert fused["forward"] > 0 and all(fused_exit.CHECK.verdicts.values())
    got[rows].square().mean().backward()
    want[rows].square().mean().backward()
    for state, ref in zip(states, refs, strict=True):
        for mine, theirs in ((state.sink, ref.sink), (state.ssmax, ref.slope)):
            if mine is not None and mine.requires_grad:
                torch.testing.assert_close(
                    mine.grad, theirs.grad, atol=1e-5 * theirs.grad.abs().max(), rtol=1e-4
                )


def test_the_public_formulation_is_what_accelerators_get():
    """Not the CPU: the fused path never serves (its combination is None)."""
    q = torch.empty(1, 4, 6, 8, device="meta")
    module = Attention(1, True)
    assert fused_exit._combination(ExitCall(None, module, q, q, q, None, SINKS, True, {})) is None
    assert exit.width_multiple(torch.device("cuda")) == 8
