"""RoPE rescaling on a loaded model (``rope_parameters``) against the checkpoint loaded with those parameters by
transformers itself, alone and with logn and ReRoPE; unpatch, re-patching and save/reload."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from conftest import GREEDY, SHARP_VOCAB, assert_unchanged, sharp_inputs, sharp_model
from model_zoo import EAGER_ONLY, LOGIT_TOLERANCE, family_types, head_of, zoo_model
from reference import make_reference
from transformers import AutoModelForCausalLM

import hf_attnscale as hfa
from hf_attnscale.core.compat import nested_rope_keys
from hf_attnscale.core.install.families import attention_modules
from hf_attnscale.core.install.rescaling import KEPT

TRAINED = 16
RESCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.5, 2.0, 2.5],
        "long_factor": [2.0, 3.0, 4.0, 5.0],
    },
}


def _ids(length=40):
    return torch.randint(3, SHARP_VOCAB, (2, length), generator=torch.Generator().manual_seed(3))


def _loaded_with(model, rope_parameters, folder):
    """``model`` saved and loaded back by transformers with ``rope_parameters`` (and its own rope_theta)."""
    model.save_pretrained(folder)
    theta = model.config.rope_parameters["rope_theta"]
    return AutoModelForCausalLM.from_pretrained(
        folder, rope_parameters={**rope_parameters, "rope_theta": theta}
    ).eval()


@pytest.mark.parametrize("name", list(RESCALINGS))
def test_equals_the_checkpoint_loaded_with_them(name, tmp_path):
    model = sharp_model("llama", max_position_embeddings=TRAINED)
    loaded = _loaded_with(model, RESCALINGS[name], tmp_path)
    ids = _ids()
    with torch.no_grad():
        before = model(ids).logits
        hfa.patch(model, rope_parameters=RESCALINGS[name])
        got, want = model(ids).logits, loaded(ids).logits
        assert (got - before).abs().max() > 1e-3, "the rescaling changed nothing"
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        hfa.unpatch(model)
        assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("dynamic", {"scale": "logn", "train_length": TRAINED}),  # Qwen's dynamic NTK + logn
        ("yarn", {"scale": "logn", "train_length": TRAINED, "rerope_window": 8}),  # YaRN + ReRoPE + logn
    ],
)
def test_composes_with_logn_and_rerope(tmp_path, name, options):
    """The checkpoint loaded with the rescaling, then patched with the other options (and its reference), equals
    the model patched with all of them at once; unpatch gives the model back exactly."""
    model = sharp_model("llama", max_position_embeddings=TRAINED)
    loaded = _loaded_with(model, RESCALINGS[name], tmp_path)
    with torch.no_grad():
        before = model(_ids()).logits
        hfa.patch(model, rope_parameters=RESCALINGS[name], **options)
        reference = copy.deepcopy(loaded)
        make_reference(reference, {type(m).__name__ for m in attention_modules(reference)}, **options)
        got = model(_ids()).logits
        torch.testing.assert_close(got, reference(_ids()).logits, atol=1e-5, rtol=1e-5)
        hfa.patch(loaded, **options)
        torch.testing.assert_close(got, loaded(_ids()).logits, atol=1e-6, rtol=1e-6)
        hfa.unpatch(model)
        assert torch.equal(model(_ids()).logits, before)


@pytest.mark.parametrize("name", ["yarn", "dynamic", "longrope"])
def test_decoding_with_logn_and_rerope_equals_the_checkpoint_loaded_with_them(tmp_path, name):
    """generate() on one unpadded row, past the trained length: each step's query has no mask, so the law's
    number and ReRoPE's window cos/sin are made once per step (or per rotary frequencies). It equals the
    checkpoint loaded with the rescaling and patched alike, under inference mode too, where dynamic NTK and
    LongRoPE make their frequencies as inference tensors; a training forward runs after it."""
    options = {"scale": "logn", "train_length": TRAINED, "rerope_window": 8}
    model = sharp_model("llama", max_position_embeddings=TRAINED)
    loaded = hfa.patch(_loaded_with(model, RESCALINGS[name], tmp_path), **options)
    hfa.patch(model, rope_parameters=RESCALINGS[name], **options)
    ids = _ids(length=12)[:1]
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            got = model.generate(input_ids=ids, max_new_tokens=12, **GREEDY)
            want = loaded.generate(input_ids=ids, max_new_tokens=12, **GREEDY)
        torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-5, rtol=1e-5)
    model.train()
    model(got.sequences.clone()).logits.sum().backward()  # a normal tensor: the ids came from inference mode
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_by_layer_type_on_a_model_with_several(tmp_path):
    """Gemma-3's local and global layers each have their own RoPE: a rescaling given for the global layers
    alone equals the checkpoint loaded with it there (the local layers' own kept); one not given by layer type
    is refused in one line, naming the types."""
    from model_zoo import zoo_model

    model = zoo_model("gemma3_text", layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    own = model.config.rope_parameters
    given = {"full_attention": {"rope_type": "linear", "factor": 4.0}}
    model.save_pretrained(tmp_path)
    full = {**given["full_attention"], "rope_theta": own["full_attention"]["rope_theta"]}
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, rope_parameters={**own, "full_attention": full}
    ).eval()
    ids = _ids() % model.config.vocab_size
    with torch.no_grad():
        before = model(ids).logits
        hfa.patch(model, rope_parameters=given)
        got = model(ids).logits
        assert (got - before).abs().max() > 1e-3, "the rescaling changed nothing"
        torch.testing.assert_close(got, loaded(ids).logits, atol=1e-6, rtol=1e-6)
        hfa.unpatch(model)
        assert torch.equal(model(ids).logits, before)
    with pytest.raises(
        ValueError, match=r"set per layer type \(sliding_attention, full_attention\); give"
    ) as error:
        hfa.patch(model, rope_parameters=RESCALINGS["yarn"])
    assert "\n" not in str(error.value) and hfa.get_config(model) is None


def test_keeps_the_models_rotary_share(tmp_path):
    """A model that rotates part of each head (GPT-NeoX, a quarter) keeps that share under a rescaling that
    does not give its own: the checkpoint loaded with YaRN and its own share."""
    from model_zoo import zoo_model

    model = zoo_model("gpt_neox", max_position_embeddings=TRAINED)
    share = model.config.rope_parameters["partial_rotary_factor"]
    assert share < 1
    loaded = _loaded_with(model, {**RESCALINGS["yarn"], "partial_rotary_factor": share}, tmp_path)
    ids = _ids() % model.config.vocab_size
    with torch.no_grad():
        hfa.patch(model, rope_parameters=RESCALINGS["yarn"])
        torch.testing.assert_close(model(ids).logits, loaded(ids).logits, atol=1e-6, rtol=1e-6)


def test_patching_again_replaces_it(tmp_path):
    model = sharp_model("llama", max_position_embeddings=TRAINED)
    loaded = _loaded_with(model, RESCALINGS["dynamic"], tmp_path)
    hfa.patch(model, rope_parameters=RESCALINGS["yarn"])
    hfa.patch(model, rope_parameters=RESCALINGS["dynamic"])  # from the model's own RoPE, not YaRN's
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()).logits, loaded(_ids()).logits, atol=1e-6, rtol=1e-6)
    hfa.patch(model, scale="logn", train_length=TRAINED)  # no rescaling: the model's own RoPE again
    assert hfa.get_config(model).rope_parameters is None
    rotary = model.model.rotary_emb
    assert rotary.rope_type == "default" and not hasattr(rotary, "_hfa_original_rotary")


def test_leaves_a_dynamic_rotary_as_it_was_grown():
    """Patching asks the rotaries it builds and the model's own for their cos/sin dims: on copies, so a dynamic
    rotary grown by a long read keeps its frequencies through patch and unpatch."""
    model = sharp_model(
        "llama",
        max_position_embeddings=TRAINED,
        rope_parameters={**RESCALINGS["dynamic"], "rope_theta": 10000.0},
    )
    with torch.no_grad():
        model(_ids(length=3 * TRAINED))  # past the trained length: the dynamic rotary grows its base
    rotary = model.model.rotary_emb
    grown, cached = rotary.inv_freq.clone(), rotary.max_seq_len_cached
    assert not torch.equal(grown, rotary.original_inv_freq)
    hfa.patch(model, rope_parameters=RESCALINGS["yarn"])
    hfa.unpatch(model)
    assert model.model.rotary_emb is rotary
    assert torch.equal(rotary.inv_freq, grown) and rotary.max_seq_len_cached == cached


def test_survives_save_and_reload(tmp_path):
    model = hfa.patch(
        sharp_model("llama", max_position_embeddings=TRAINED), rope_parameters=RESCALINGS["yarn"]
    )
    model.save_pretrained(tmp_path)
    reloaded = hfa.patch(AutoModelForCausalLM.from_pretrained(tmp_path).eval())
    assert hfa.get_config(reloaded).rope_parameters == RESCALINGS["yarn"]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(_ids()).logits, model(_ids()).logits, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("rope_parameters", "message"),
    [
        (
            {"rope_type": "cubic", "factor": 2.0},
            "unknown rope_type 'cubic'; transformers' are default, linear",
        ),
        (
            {"rope_type": "llama3", "factor": 4.0},
            r"rope_parameters \{.*\}: Missing required keys in `rope_parameters` for 'rope_type'='llama3': "
            r"\{'(high|low)_freq_factor', '(high|low)_freq_factor'\}$",
        ),
        ("yarn", "rope_parameters must be transformers' rope_parameters dict"),
    ],
)
def test_bad_parameters_are_one_line_and_leave_the_model(rope_parameters, message):
    model = sharp_model("llama", max_position_embeddings=TRAINED)
    rotary = model.model.rotary_emb
    with pytest.raises(ValueError, match=message) as error:
        hfa.patch(model, rope_parameters=rope_parameters)
    assert "\n" not in str(error.value)
    assert model.model.rotary_emb is rotary and hfa.get_config(model) is None


@pytest.mark.parametrize("model_type", ["gpt2", "opt"])
def test_a_model_without_a_rotary_embedding_is_refused_in_one_line(model_type):
    """GPT-2 (learned positions) and OPT: nothing to rescale, so the option is refused, not accepted as a no-op."""
    config = transformers.AutoConfig.for_model(
        model_type,
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        ffn_dim=64,
        n_embd=32,
        n_layer=1,
        n_head=4,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match=r"^rope_parameters: \w+ has no rotary embedding module") as error:
        hfa.patch(model, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    assert "\n" not in str(error.value) and hfa.get_config(model) is None


YARN = {"rope_type": "yarn", "factor": 4.0}
ROTARY_LAYERS = {"flint": {"layer_types": ["sliding_attention", "full_attention"]}}
"""Layers that use RoPE, where the tiny model's have none (Flint rotates its sliding-window layers only)."""


def _built_with(plain: torch.nn.Module, given: dict, attn: str) -> torch.nn.Module:
    """``plain`` built again by transformers from its config with ``given`` in place of its RoPE parameters (its
    base and rotary share kept; by layer type where it has several), with ``plain``'s weights: transformers' own
    wiring of the rescaled RoPE, whatever module computes it. Every module but the rotary embeddings reads the
    model's own config, as under the patch (Ministral-3's attention reads its scaling law's beta there)."""
    config = copy.deepcopy(plain.config)
    text = config.get_text_config()
    own = copy.deepcopy(text.rope_parameters)
    kept = lambda params: {k: v for k, v in params.items() if k in KEPT}  # noqa: E731
    if nested_rope_keys(text, own):
        text.rope_parameters = {
            kind: {**kept(own[kind]), **given[kind]} if kind in given else own[kind] for kind in own
        }
    else:
        text.rope_parameters = {**kept(own), **given}
    config._attn_implementation = attn
    model = type(plain)(config)
    model.load_state_dict(plain.state_dict())
    originals = {id(config): plain.config, id(text): plain.config.get_text_config()}
    for module in model.modules():
        if not hasattr(module, "rope_type") and id(getattr(module, "config", None)) in originals:
            module.config = originals[id(module.config)]
    return model.eval()


DEFAULT_SUITE = ("llama", "ministral3", "flint", "gemma4_text", "mimo_v2_flash", "recurrent_gemma", "lfm3")
"""Served (with a scaling law read from the config; with rotary layers of one type only) and refused (a RoPE of
its own; transformers' own refusal; no RoPE to rebuild) in the default suite; every decoder under -m slow."""


@pytest.mark.parametrize(
    "model_type",
    [
        t if t in DEFAULT_SUITE else pytest.param(t, marks=pytest.mark.slow)
        for t in family_types()
        if head_of(t) == "causal"
    ],
)
def test_every_decoder_equals_transformers_built_with_them_or_is_refused_in_one_line(model_type):
    """YaRN (factor 4) on each decoder type the package supports equals the same model built by transformers
    with those parameters, or the patch refuses it in one line, the model unchanged (no rotary embedding module
    to rebuild, say). docs/SUPPORT.md's column."""
    attn = "eager" if model_type in EAGER_ONLY else "sdpa"
    model = zoo_model(model_type, attn, **ROTARY_LAYERS.get(model_type, {}))
    before = copy.deepcopy(model)
    text = model.config.get_text_config()
    nested = nested_rope_keys(text, getattr(text, "rope_parameters", None) or {})
    given = {kind: YARN for kind in nested} if nested else YARN
    try:
        hfa.patch(model, rope_parameters=given)
    except ValueError as error:
        assert str(error).startswith("rope_parameters") and "\n" not in str(error), error
        assert_unchanged(model, before)
        pytest.skip(
            f"rope_parameters refused: {error}"
        )  # scripts/support_matrix.py reads the reason from here
    reference = _built_with(before, given, attn)
    inputs = sharp_inputs(vocab=min(text.vocab_size, 100))
    rows = inputs["attention_mask"].bool()
    with torch.no_grad():
        got, want, unchanged = (
            each(**inputs, use_cache=False).logits[rows] for each in (model, reference, before)
        )
    torch.testing.assert_close(got, want, atol=LOGIT_TOLERANCE.get(model_type, 1e-4), rtol=1e-4)
    assert (unchanged - got).abs().max() > 1e-3, "YaRN changed nothing"
