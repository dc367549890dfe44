"""Clipped softmax (`hf_attnscale.core.call.clipped`): its contract beyond the reference matrix of test_attention.py
and test_families.py (where fixed and learnable clipping are held to tests/reference.py on every family)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import model_output, patched_and_reference, sample_inputs, tiny_model

import hf_attnscale as hfa


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", ["llama", "mistral", "bert"])
def test_gamma_zero_zeta_one_is_the_unpatched_model(model_type, attn):
    plain = tiny_model(model_type, attn)
    patched = hfa.patch(copy.deepcopy(plain), clipped_softmax=(0.0, 1.0))
    inputs = sample_inputs(model_type)
    rows = inputs["attention_mask"].bool()
    with torch.no_grad():
        got, want = model_output(patched, **inputs), model_output(plain, **inputs)
    torch.testing.assert_close(got[rows], want[rows], atol=1e-5, rtol=1e-5)


def test_clipping_zeroes_small_weights_and_keeps_masked_keys_at_zero():
    model = hfa.patch(tiny_model("llama", "eager"), clipped_softmax=(-0.1, 1.0))
    inputs = sample_inputs("llama")
    with torch.no_grad():
        weights = model(**inputs, output_attentions=True).attentions[0]  # (B, H, T, T)
    visible = torch.ones(11, 11, dtype=torch.bool).tril() & inputs["attention_mask"].bool()[:, None, None, :]
    rows = inputs["attention_mask"].bool()[:, None, :, None]
    assert torch.equal(weights.masked_select(~visible), torch.zeros_like(weights.masked_select(~visible)))
    kept = weights.masked_select(visible & rows)
    assert (kept == 0).any(), "gamma = -0.1 zeroes no weight: the clip does nothing here"
    assert (kept >= 0).all() and (kept <= 1).all()


def test_learnable_bounds_get_the_references_gradients():
    options = {"scale": "logn", "train_length": 2, "clipped_softmax": "learnable"}
    patched, reference, states, refs = patched_and_reference("llama", "sdpa", options)
    inputs = sample_inputs("llama")
    rows = inputs["attention_mask"].bool()
    weight = torch.randn(model_output(reference, **inputs).shape, generator=torch.Generator().manual_seed(0))
    for model in (patched, reference):
        model.train()
        (model_output(model, **inputs)[rows] * weight[rows]).sum().backward()
    for state, ref in zip(states, refs, strict=True):
        for mine, theirs in ((state.clip_gamma, ref.clip[0]), (state.clip_zeta, ref.clip[1])):
            assert theirs.grad.abs().max() > 0
            atol = 1e-5 * theirs.grad.abs().max()
            torch.testing.assert_close(mine.grad, theirs.grad, atol=atol, rtol=1e-4)


def test_learnable_bounds_survive_save_and_reload(tmp_path):
    model = hfa.patch(tiny_model("llama"), clipped_softmax="learnable")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("clip_gamma"):
                p.fill_(-0.07)
    model.save_pretrained(tmp_path)
    loaded = hfa.from_pretrained(type(model), tmp_path)
    gammas = [p for n, p in loaded.named_parameters() if n.endswith("clip_gamma")]
    assert len(gammas) == 2 and all(torch.equal(g, torch.full_like(g, -0.07)) for g in gammas)
    inputs = sample_inputs("llama")
    with torch.no_grad():
        torch.testing.assert_close(model_output(loaded, **inputs), model_output(model, **inputs))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ((0.1, 1.0), "gamma <= 0 and zeta >= 1"),
        ((-0.1, 0.9), "gamma <= 0 and zeta >= 1"),
        ((-0.1,), "gamma <= 0 and zeta >= 1"),
        ("big", "gamma <= 0 and zeta >= 1"),
        ((float("nan"), 1.0), "finite"),
    ],
)
def test_bad_bounds_are_refused_in_one_line(value, message):
    with pytest.raises(ValueError, match=message) as raised:
        hfa.AttnScaleConfig(clipped_softmax=value)
    assert "\n" not in str(raised.value)


def test_an_exit_beside_clipping_is_refused():
    with pytest.raises(ValueError, match="cannot be combined with zero_kv / sink_logit"):
        hfa.patch(tiny_model("llama"), clipped_softmax=(-0.03, 1.0), zero_kv=True)
