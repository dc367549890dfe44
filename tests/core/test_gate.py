"""Gated attention (`hf_attnscale.core.call.gate`): the start is the pretrained model, the gate is the reference's
forward and backward, it trains and saves with PEFT, streams, and leaves nothing behind. (The reference matrix of
test_attention.py and test_families.py holds perturbed gates to tests/reference.py on every family.)"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (
    VOCAB,
    model_output,
    patched_and_reference,
    sample_inputs,
    sharp_model,
    stream_logits,
    tiny_model,
)

import hf_attnscale as hfa
from hf_attnscale.core.call.state import AttnScaleState


@pytest.mark.parametrize("gate", ["head", "element"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", ["llama", "bert", "gemma"])
def test_a_new_gate_leaves_the_model_as_it_was(model_type, attn, gate):
    plain = tiny_model(model_type, attn)
    patched = hfa.patch(copy.deepcopy(plain), gate=gate)
    inputs = sample_inputs(model_type)
    with torch.no_grad():
        assert torch.equal(model_output(patched, **inputs), model_output(plain, **inputs))


@pytest.mark.parametrize("gate", ["head", "element"])
def test_gate_gradients_match_reference(gate):
    options = {"scale": "logn", "train_length": 2, "gate": gate}
    patched, reference, states, refs = patched_and_reference("llama", "sdpa", options)
    inputs = sample_inputs("llama")
    rows = inputs["attention_mask"].bool()
    weight = torch.randn(model_output(reference, **inputs).shape, generator=torch.Generator().manual_seed(0))
    for model in (patched, reference):
        model.train()
        (model_output(model, **inputs)[rows] * weight[rows]).sum().backward()
    want = dict(reference.named_parameters())
    for name, p in patched.named_parameters():
        if ".hfa." not in name:
            scale = want[name].grad.abs().max()
            torch.testing.assert_close(p.grad, want[name].grad, atol=1e-5 * scale, rtol=1e-4, msg=name)
    for state, ref in zip(states, refs, strict=True):
        for mine, theirs in (
            (state.output_gate.weight, ref.gate_weight),
            (state.output_gate.bias, ref.gate_bias),
        ):
            assert theirs.grad.abs().max() > 0
            atol = 1e-5 * theirs.grad.abs().max()
            torch.testing.assert_close(mine.grad, theirs.grad, atol=atol, rtol=1e-4)


def test_gate_trains_with_peft_and_round_trips_through_an_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    base = tiny_model("llama")
    hfa.patch(base, gate="element")
    model = peft.get_peft_model(base, hfa.lora_config(base, r=2))
    names = [n for n, p in model.named_parameters() if p.requires_grad and "output_gate" in n]
    assert names, "the gate is not trained by the LoRA config"
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = torch.randint(3, VOCAB, (2, 12))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    trained = dict(model.named_parameters())[names[0]].detach().clone()
    assert trained.abs().max() > 0, "the gate did not move"
    with torch.no_grad():
        want = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    fresh = hfa.patch(tiny_model("llama"), gate="element")
    loaded = hfa.load_adapter(fresh, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, atol=1e-6, rtol=1e-6)


def test_a_gated_model_streams_in_chunks_as_token_by_token():
    model = hfa.patch(sharp_model("llama"), gate="head")
    gen = torch.Generator().manual_seed(3)
    for module in model.modules():
        if isinstance(module, AttnScaleState):
            with torch.no_grad():
                module.output_gate.bias.copy_(torch.randn(module.output_gate.bias.shape, generator=gen))
    ids = torch.randint(2, 90, (1, 150), generator=gen)
    fresh = copy.deepcopy(
        model
    )  # its first stream starts with a chunk (a layer's RoPE probe then sees 2 of 64)
    with torch.no_grad():
        nll = hfa.perplexity(fresh, ids[0], cache=hfa.SinkCache(4, 40), chunk_size=64, progress=False).nll
        token_by_token = stream_logits(model, ids, hfa.SinkCache(4, 40), [1])
        chunked = stream_logits(model, ids, hfa.SinkCache(4, 40), [64, 7, 1, 100])
        ungated = stream_logits(hfa.patch(hfa.unpatch(copy.deepcopy(model))), ids, hfa.SinkCache(4, 40), [64])
    torch.testing.assert_close(chunked, token_by_token, atol=1e-4, rtol=0)
    assert (chunked - ungated).abs().max() > 1e-2, "the gate did nothing while streaming"
    want = torch.nn.functional.cross_entropy(token_by_token[0, :-1], ids[0, 1:], reduction="none")
    torch.testing.assert_close(nll, want, atol=1e-4, rtol=0)


def test_unpatch_takes_the_hooks_off():
    model = tiny_model("llama")
    pristine = copy.deepcopy(model)
    hfa.patch(model, gate="head")
    copied = copy.deepcopy(model)
    for gated in (model, copied):
        hfa.unpatch(gated)
        for module in gated.modules():
            assert not module._forward_pre_hooks and not module._forward_hooks
    inputs = sample_inputs("llama")
    with torch.no_grad():
        assert torch.equal(model_output(copied, **inputs), model_output(pristine, **inputs))


def test_a_bad_gate_is_refused_in_one_line():
    with pytest.raises(ValueError, match="gate must be 'head' or 'element' or None, got 'channel'"):
        hfa.patch(tiny_model("llama"), gate="channel")
