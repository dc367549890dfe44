"""The patched models against the eager reference in tests/reference.py, for every family and feature."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from conftest import (
    DECODERS,
    ENCODERS,
    FEATURES,
    GREEDY,
    VOCAB,
    model_output,
    patched_and_reference,
    patched_beside_reference,
    sample_inputs,
    sharp_inputs,
    sharp_model,
    tiny_model,
)
from reference import make_reference, reference_attention

import hf_attnscale as hfa
from hf_attnscale.core.call import scaled

# Every feature on one model of each kind (incl. sliding windows); the combined features on every family.
FULL_MATRIX = ["llama", "mistral", "bert", "modernbert"]
COMBINED = ["logn+zero_kv", "ssmax+sink_learnable"]
CASES = [(t, f) for t in FULL_MATRIX for f in FEATURES] + [
    (t, f) for t in [*DECODERS, *ENCODERS] if t not in FULL_MATRIX and t != "roformer" for f in COMBINED
]


def _valid_rows(model_type: str, inputs: dict) -> torch.Tensor:
    """Positions whose output is defined: decoders' left-padding query rows are garbage in every backend."""
    return inputs["attention_mask"].bool()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize(("model_type", "feature"), CASES)
@pytest.mark.parametrize("padded", [False, True])
def test_matches_reference(model_type, feature, attn, padded):
    patched, reference, _, _ = patched_and_reference(model_type, attn, FEATURES[feature])
    inputs = sample_inputs(model_type, padded=padded)
    with torch.no_grad():
        got, want = model_output(patched, **inputs), model_output(reference, **inputs)
    rows = _valid_rows(model_type, inputs)
    assert got[rows].shape == want[rows].shape
    torch.testing.assert_close(got[rows], want[rows], atol=1e-5, rtol=1e-5)
    baseline = tiny_model(model_type, attn)
    with torch.no_grad():
        assert (model_output(baseline, **inputs)[rows] - got[rows]).abs().max() > 2e-5, (
            "the patch changed nothing"
        )


@pytest.mark.parametrize("feature", ["logn", "zero_kv", "sink_fixed", "ssmax", "logn+zero_kv"])
def test_roformer_matches_reference(feature):
    patched = tiny_model("roformer")
    reference = copy.deepcopy(patched)
    hfa.patch(patched, **FEATURES[feature])
    refs = make_reference(reference, ("RoFormerSelfAttention",), **FEATURES[feature])

    def ref_forward(self, hidden_states, attention_mask=None, sinusoidal_pos=None, *args, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
        q = self.query(hidden_states).view(shape).transpose(1, 2)
        k = self.key(hidden_states).view(shape).transpose(1, 2)
        v = self.value(hidden_states).view(shape).transpose(1, 2)
        q, k = self.apply_rotary_position_embeddings(sinusoidal_pos, q, k)
        visible = attention_mask > torch.finfo(attention_mask.dtype).min / 2
        r = self.hfa_ref
        out = reference_attention(
            q,
            k,
            v,
            visible,
            self.attention_head_size**-0.5,
            scale=r.scale,
            train_length=r.train_length,
            clamp=r.clamp,
            slope=r.slope,
            sink=r.sink,
        )
        return out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1), None

    for module in reference.modules():
        if hasattr(module, "hfa_ref"):
            module.forward = types.MethodType(ref_forward, module)
    assert len(refs) == 2
    inputs = sample_inputs("roformer")
    with torch.no_grad():
        got, want = model_output(patched, **inputs), model_output(reference, **inputs)
    rows = inputs["attention_mask"].bool()
    torch.testing.assert_close(got[rows], want[rows], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("feature", COMBINED)
@pytest.mark.parametrize("model_type", list(DECODERS))
def test_batched_generate_left_padding_dynamic_cache(model_type, feature, attn):
    patched, reference, _, _ = patched_and_reference(model_type, attn, FEATURES[feature])
    inputs = sample_inputs(model_type, length=7)
    kwargs = {
        "max_new_tokens": 6,
        "do_sample": False,
        "output_logits": True,
        "return_dict_in_generate": True,
        "pad_token_id": 0,
    }
    got = patched.generate(**inputs, **kwargs)
    want = reference.generate(**inputs, **kwargs)
    assert got.sequences.shape == (3, 13)
    torch.testing.assert_close(got.sequences, want.sequences, atol=0, rtol=0)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "options", [{"scale": "logn", "train_length": 2}, {"scale": "llama4", "train_length": 3, "beta": 0.5}]
)
@pytest.mark.parametrize(("model_type", "overrides"), [("llama", {}), ("mistral", {"sliding_window": 64})])
def test_unmasked_decoding_steps_scale_by_one_number_per_step(model_type, overrides, options):
    """One unpadded row under sdpa: each decoding step passes no mask, and the law's number, the same in every
    layer, is made once per step (`scaled._step_multiplier`); every step's logits against the reference."""
    patched, reference = patched_beside_reference(sharp_model(model_type, "sdpa", **overrides), options)
    ids = sharp_inputs(batch=1, padded=False)["input_ids"][:, :6]
    scaled._step_multiplier.cache_clear()
    out = patched.generate(input_ids=ids, max_new_tokens=10, **GREEDY)
    made = scaled._step_multiplier.cache_info()
    assert made.misses == 10 - 1 and made.hits == made.misses * (patched.config.num_hidden_layers - 1)
    with torch.no_grad():
        whole = reference(input_ids=out.sequences).logits
    torch.testing.assert_close(torch.stack(out.logits, 1), whole[:, 5:-1], atol=1e-5, rtol=1e-5)
    with torch.inference_mode():  # the number kept from an inference-mode step serves one with gradients
        patched(input_ids=ids[:, :1])
    patched(input_ids=ids[:, :1]).logits.sum().backward()
    assert scaled._step_multiplier.cache_info().hits > made.hits


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "bert", "modernbert"])
def test_gradients_match_reference(model_type, attn):
    options = {"scale": "ssmax", "train_length": 2, "sink_logit": "learnable"}
    patched, reference, states, refs = patched_and_reference(model_type, attn, options)
    inputs = sample_inputs(model_type)
    rows = inputs["attention_mask"].bool()
    weight = torch.randn(model_output(reference, **inputs).shape)
    for model in (patched, reference):
        model.train()
        (model_output(model, **inputs)[rows] * weight[rows]).sum().backward()
    ref_params = dict(reference.named_parameters())
    assert len(ref_params) > 10
    for name, p in patched.named_parameters():
        if ".hfa." in name:
            continue
        r = ref_params.pop(name)
        assert (p.grad is None) == (r.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, r.grad, atol=1e-4, rtol=1e-4, msg=name)
    assert not ref_params
    for state, ref in zip(states, refs, strict=True):
        assert state.sink.grad.abs().max() > 0 and state.ssmax.grad.abs().max() > 0
        torch.testing.assert_close(state.sink.grad, ref.sink.grad, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(state.ssmax.grad, ref.slope.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "bert", "modernbert", "roformer"])
def test_unpatch_is_bitwise_identical(model_type):
    model = tiny_model(model_type)
    pristine = copy.deepcopy(model)
    inputs = sample_inputs(model_type)
    hfa.patch(model, scale="ssmax", train_length=4, sink_logit="learnable")
    hfa.patch(model, scale="logn", train_length=4, zero_kv=True)  # reconfigure, never stack
    assert hfa.get_config(model).zero_kv and model_output(model, **inputs).shape
    hfa.unpatch(model)
    assert hfa.get_config(model) is None
    assert not any(".hfa." in name for name in model.state_dict())
    with torch.no_grad():
        assert torch.equal(model_output(model, **inputs), model_output(pristine, **inputs))


def test_two_models_behave_by_their_own_config():
    shared = tiny_model("llama").config  # the same config object passed to three models
    torch.manual_seed(0)
    models = [type(tiny_model("llama"))(shared).eval() for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    inputs = sample_inputs("llama")
    with torch.no_grad():
        plain = model_output(models[0], **inputs)
        hfa.patch(models[1], scale="logn", train_length=2)
        hfa.patch(models[2], zero_kv=True)
        out = [model_output(m, **inputs) for m in models]
    assert torch.equal(out[0], plain)
    assert hfa.get_config(models[0]) is None and shared._attn_implementation == "sdpa"
    assert hfa.get_config(models[1]).scale == "logn" and hfa.get_config(models[2]).zero_kv
    assert (out[1] - out[2]).abs().max() > 1e-3 and (out[1] - plain).abs().max() > 1e-3
    hfa.unpatch(models[1])
    with torch.no_grad():
        torch.testing.assert_close(model_output(models[2], **inputs), out[2], atol=0, rtol=0)
        torch.testing.assert_close(model_output(models[1], **inputs), plain, atol=0, rtol=0)


@pytest.mark.parametrize("model_type", ["llama", "bert"])
def test_save_pretrained_round_trip(model_type, tmp_path):
    model = tiny_model(model_type)
    hfa.patch(model, scale="ssmax", train_length=4, sink_logit="learnable")
    with torch.no_grad():
        for m in model.modules():
            if isinstance(getattr(m, "hfa", None), torch.nn.Module):
                m.hfa.sink.normal_()
                m.hfa.ssmax.mul_(1.5)
    inputs = sample_inputs(model_type)
    with torch.no_grad():
        want = model_output(model, **inputs)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    assert hfa.get_config(loaded) is None  # loading does not patch by itself
    hfa.patch(loaded)
    assert hfa.get_config(loaded) == hfa.get_config(model)
    with torch.no_grad():
        torch.testing.assert_close(model_output(loaded, **inputs), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_half_precision_long_sequence_is_finite(dtype, attn):
    model = tiny_model("llama", attn, dtype=dtype, num_hidden_layers=1)
    hfa.patch(model, scale="logn", train_length=64, zero_kv=True)
    ids = torch.randint(3, VOCAB, (1, 4096))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all()


def test_scaled_long_context_matches_reference_at_4k():
    """logn's multiplier keeps growing past the trained length: check it at n up to 4096 against the reference."""
    patched, reference, _, _ = patched_and_reference(
        "llama", "sdpa", {"scale": "logn", "train_length": 16, "zero_kv": True}
    )
    ids = torch.randint(3, VOCAB, (1, 1024))
    with torch.no_grad():
        torch.testing.assert_close(
            patched(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-5, rtol=1e-5
        )


def test_roformer_decoder_reads_through_its_cache():
    """A patched RoFormer decoder, fed one token at a time through a cache, gives one forward's logits: the
    patched forward takes the cache under either name transformers has passed it by."""
    from model_zoo import zoo_config
    from tiny import build, sharpen
    from transformers import DynamicCache, RoFormerForCausalLM

    config = zoo_config("roformer", "eager", is_decoder=True)
    model = sharpen(build(RoFormerForCausalLM, config, "eager"))
    hfa.patch(model, **FEATURES["logn+zero_kv"])
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    cache = DynamicCache(config=config)
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        steps = [
            model(input_ids=ids[:, i : i + 1], past_key_values=cache).logits for i in range(ids.shape[1])
        ]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=1e-5)
