"""Self-Extend and Dual Chunk Attention, run by the key parts' engine (`hf_attnscale.core.parts`), against the
plain per-pair reference in tests/reference.py (`method_logits`: each pair's score from q and k rotated at the
positions the paper gives that pair, pair by pair); and the declarations themselves. ReRoPE, the engine's first
method, has tests/core/test_rerope.py."""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
import transformers
from conftest import (
    ATTNS,
    DECODERS,
    FORWARD_ATTNS,
    GREEDY,
    OWN_FAMILIES,
    ROPE_TYPES,
    SHARP_VOCAB,
    assert_gradients_match,
    assert_logits_match,
    assert_unchanged,
    patched_beside_reference,
    sharp_inputs,
    sharp_model,
    stream_logits,
    tiny_model,
    watch_fused_parts,
)
from model_zoo import EAGER_ONLY, LOGIT_TOLERANCE, family_types, head_of, reference_of, zoo_model
from reference import method_positions

import hf_attnscale as hfa
from hf_attnscale.core.call.rope import RotaryFrequencies
from hf_attnscale.core.options.methods import dual_chunk, method_of, rerope, self_extend, string
from hf_attnscale.core.parts import engine, key_parts, prefill

SE = {"self_extend_group": 2, "self_extend_window": 4}
DCA = {"dual_chunk_size": 6, "dual_chunk_local": 2}  # chunks of 4: the 16 tokens reach 3 chunks back
STRING = {"string_shift": 6, "string_local": 2}  # far distances 6..15 scored at 2..11, cos/sin × 1 + 0.1 ln 2
METHODS = {"self_extend": SE, "dca": DCA, "string": STRING}
OPTIONS = {  # the methods with the other options on top
    "self_extend+logn": {**SE, "scale": "logn", "train_length": 2},
    "dca+logn+zero_kv": {**DCA, "scale": "logn", "train_length": 2, "zero_kv": True},
    "dca+sink_fixed": {**DCA, "sink_logit": 1.5},
    "self_extend+clipped": {**SE, "clipped_softmax": (-0.03, 1.02)},
    "dca+ssmax+gate": {**DCA, "scale": "ssmax", "train_length": 2, "gate": "head"},
    # L = 4: under log_2 n the factor's sharper scores part from the float64 reference by 1.5e-5 (rounding)
    "string+logn+zero_kv": {**STRING, "scale": "logn", "train_length": 4, "zero_kv": True},
    "string+sink_learnable": {**STRING, "sink_logit": "learnable"},
    "string, no factor": {**STRING, "string_factor": 1.0},
}
DECLARED = {
    "rerope": rerope(4),
    "leaky": rerope(4, 3.0),
    "self_extend": self_extend(2, 4),
    "self_extend, G > w": self_extend(5, 3),
    "dca": dual_chunk(6, 2),
    "dca, l > c": dual_chunk(7, 4),  # min(2c − 1, s) = s
    "string": string(6, 2),
    "string, W = 0": string(5, 0),
}


@pytest.mark.parametrize("name", list(DECLARED))
def test_each_declaration_covers_every_causal_pair_once(name):
    i, j = torch.arange(40)[:, None], torch.arange(40)[None]
    covered = sum(part.covers(i, j).long() for part in DECLARED[name].parts)
    assert torch.equal(covered, (j <= i).long())


def _first_changed_distance(method, positions: int = 60) -> int | None:
    """The least distance that some pair of ``method`` is scored at otherwise (its parts' query angle less key angle),
    over positions below ``positions``; None where none is."""
    i, j = torch.arange(positions)[:, None], torch.arange(positions)[None]
    scored = torch.zeros(positions, positions, dtype=torch.float64)
    for part in method.parts:
        angles = part.query.angle(i.expand(-1, positions)) - part.key.angle(j.expand(positions, -1))
        scored = torch.where(part.covers(i, j), angles, scored)
    changed = (j <= i) & ~torch.isclose(scored, (i - j).double(), rtol=0, atol=1e-9)
    return int((i - j)[changed].min()) if changed.any() else None


@pytest.mark.parametrize("name", list(DECLARED))
def test_each_declarations_exact_below_is_the_first_distance_it_changes(name):
    """`Method.exact_below`, which leaves layers of narrower sliding windows as the model has them: every pair
    nearer is scored at its own distance, and a pair that far is not."""
    method = DECLARED[name]
    assert _first_changed_distance(method) == method.exact_below


@pytest.mark.parametrize("name", list(DECLARED))
def test_each_parts_reach_bounds_the_keys_it_covers(name):
    """`Part.reach`, the engine's blocks of keys: query i's keys in a part run from L(i) to R(i), neither of which
    decreases with i; negative positions too (where positions lag the cache's places)."""
    j = torch.arange(-12, 40)
    for part in DECLARED[name].parts:
        bounds = [part.reach(i) for i in range(-12, 40)]
        for i, (low, high) in zip(range(-12, 40), bounds):
            shown = (j <= high) & (j >= (j[0] if low is None else low))
            assert torch.equal(shown, part.covers(torch.tensor(i), j)), (part, i)
        for (low, high), (next_low, next_high) in itertools.pairwise(bounds):
            assert high <= next_high and (low is None or low <= next_low)


@pytest.mark.parametrize(
    "name", ["self_extend", "self_extend, G > w", "dca", "dca, l > c", "string", "string, W = 0"]
)
def test_the_declarations_place_each_pair_as_the_paper_does(name):
    """Each part's positions for the pairs it covers, against the papers' definitions (tests/reference.py)."""
    method = DECLARED[name]
    args = {
        "self_extend": (2, 4),
        "self_extend, G > w": (5, 3),
        "dca": (6, 2),
        "dca, l > c": (7, 4),
        "string": (6, 2),
        "string, W = 0": (5, 0),
    }[name]
    i, j = torch.arange(40)[:, None], torch.arange(40)[None]
    kind = name.split(",")[0]
    want_q, want_k = method_positions((kind, *args), i.double(), j.double())
    for part in method.parts:
        covers = part.covers(i, j)
        got_q, got_k = part.query.angle(i).expand(40, 40), part.key.angle(j).expand(40, 40)
        assert torch.equal(got_q[covers], want_q[covers]) and torch.equal(got_k[covers], want_k[covers])


def _generate_positions(mask: torch.Tensor) -> torch.Tensor:
    """generate()'s positions for a left-padded batch: each row's tokens from 0, a pad's 1."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("model_type", [t for t in family_types() if head_of(t) == "causal"])
def test_every_decoder_is_served_exactly_or_refused_in_one_line(model_type, method):
    """Each decoder type the package supports: the method equals the reference, or the patch refuses it in one
    line that starts with the method's option, the model unchanged (as ReRoPE, tests/core/test_rerope.py)."""
    attn = "eager" if model_type in EAGER_ONLY else "sdpa"
    model = zoo_model(model_type, attn)
    before = copy.deepcopy(model)
    try:
        hfa.patch(model, **METHODS[method])
    except ValueError as error:
        assert str(error).startswith(next(iter(METHODS[method]))) and "\n" not in str(error), error
        assert_unchanged(model, before)
        pytest.skip(f"{method} refused: {error}")  # scripts/support_matrix.py reads the reason from here
    reference = reference_of(before, attn, **METHODS[method])
    inputs = sharp_inputs(vocab=min(model.config.get_text_config().vocab_size, 100))
    rows = inputs["attention_mask"].bool()
    with torch.no_grad():
        got, want = (each(**inputs, use_cache=False).logits[rows] for each in (model, reference))
    atol = LOGIT_TOLERANCE.get(model_type, 1e-4)
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("attn", FORWARD_ATTNS, indirect=True)
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("model_type", list(DECODERS))
def test_matches_reference(model_type, method, attn):
    """Row 1 is left-padded, at generate()'s positions: its chunks and groups are its own tokens'."""
    model = sharp_model(model_type, attn)
    plain = copy.deepcopy(model)
    patched, reference = patched_beside_reference(model, METHODS[method])
    inputs = sharp_inputs()
    inputs["position_ids"] = _generate_positions(inputs["attention_mask"])
    got = assert_logits_match(patched, reference, inputs)
    with torch.no_grad():
        unchanged = plain(**inputs).logits[inputs["attention_mask"].bool()]
    assert (unchanged - got).abs().max() > 1e-3, "the method changed nothing"


@pytest.mark.parametrize("attn", ["sdpa+fused", "eager", "sdpa+flex"], indirect=True)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_with_the_other_options(option, attn):
    patched, reference = patched_beside_reference(sharp_model("llama", attn), OPTIONS[option])
    assert_logits_match(patched, reference, sharp_inputs())


EVERY_METHOD = {"rerope": {"rerope_window": 4}, "leaky": {"rerope_window": 4, "rerope_leak": 3.0}, **METHODS}


@pytest.mark.parametrize("method", list(EVERY_METHOD))
@pytest.mark.parametrize("rope_type", list(ROPE_TYPES))
def test_the_models_own_rope_types(rope_type, method):
    """At each part's positions, the model's own RoPE: its rope type's frequencies and attention scaling."""
    model = sharp_model("llama", max_position_embeddings=8, rope_parameters=ROPE_TYPES[rope_type])
    patched, reference = patched_beside_reference(model, EVERY_METHOD[method])
    assert_logits_match(patched, reference, sharp_inputs(length=12))  # past 8: YaRN, llama3, dynamic NTK act


@pytest.mark.parametrize("method", list(EVERY_METHOD))
@pytest.mark.parametrize("model_type", list(OWN_FAMILIES))
def test_local_layers_partial_rotary_and_nope_layers(model_type, method):
    """Gemma-3's local and global layers (each its own RoPE), GPT-NeoX's partial rotary, SmolLM3's NoPE layer; in
    float64, where their sharp logits amplify float32's rounding past 1e-5 (by 2e-5 at most)."""
    model = zoo_model(model_type, "sdpa", **OWN_FAMILIES[model_type]).to(torch.float64)
    plain = copy.deepcopy(model)
    options = {**EVERY_METHOD[method], "scale": "logn", "train_length": 2}
    patched, reference = patched_beside_reference(model, options)
    inputs = sharp_inputs(vocab=min(patched.config.get_text_config().vocab_size, 100))
    got = assert_logits_match(patched, reference, inputs)
    with torch.no_grad():
        unchanged = plain(**inputs).logits[inputs["attention_mask"].bool()]
    assert (unchanged - got).abs().max() > 1e-3, "the method changed nothing"


@pytest.mark.parametrize("attn", ATTNS, indirect=True)
@pytest.mark.parametrize("method", list(METHODS))
def test_gradients_match_reference(method, attn):
    options = {**METHODS[method], "sink_logit": "learnable"}
    patched, reference = patched_beside_reference(sharp_model("llama", attn), options)
    assert_gradients_match(patched, reference, sharp_inputs())


@pytest.mark.parametrize("attn", FORWARD_ATTNS, indirect=True)
@pytest.mark.parametrize("method", list(METHODS))
def test_generate_through_the_models_cache_equals_the_whole_forward(method, attn):
    """Decoding steps across chunk and group boundaries, row 1 left-padded: each step's logits are the whole
    sequence's at that step (read at generate()'s positions), which equal the reference's."""
    patched, reference = patched_beside_reference(sharp_model("llama", attn), METHODS[method])
    inputs = sharp_inputs(length=6)
    out = patched.generate(**inputs, max_new_tokens=12, **GREEDY)
    mask = torch.cat([inputs["attention_mask"], torch.ones(2, 12, dtype=torch.long)], dim=1)
    whole = {"input_ids": out.sequences, "attention_mask": mask, "position_ids": _generate_positions(mask)}
    with torch.no_grad():
        got, want = patched(**whole).logits, reference(**whole).logits
    torch.testing.assert_close(torch.stack(out.logits, 1), got[:, 5:-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=1e-5)


LOCAL_AND_GLOBAL = {  # a local layer and a global one, its window (7) past every method's `exact_below` (6 at most)
    # each its own RoPE, the local layer's cache the window's (fewer keys than the global one's)
    "gemma3, window 7": ("gemma3_text", {"sliding_window": 7}),
    # each its own RoPE, a window past the sequence: as many keys in both
    "gemma3, window 64": ("gemma3_text", {"sliding_window": 64}),
    # one RoPE for both, the local layer's cache the window's
    "qwen2, window 7": ("qwen2", {"use_sliding_window": True, "sliding_window": 7}),
}


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("model", list(LOCAL_AND_GLOBAL))
def test_decoding_through_layers_of_other_keys_or_frequencies_equals_the_whole_forward(model, method):
    """A forward's layers share the step's cos/sin (`memo.shared_by_layers`) only where they have the same
    frequencies and as many keys: each step of a left-padded batch equals the whole sequence's logits, which equal
    the reference's; in float64, where the sharp logits amplify float32's rounding."""
    model_type, overrides = LOCAL_AND_GLOBAL[model]
    plain = zoo_model(model_type, layer_types=["sliding_attention", "full_attention"], **overrides)
    patched, reference = patched_beside_reference(plain.to(torch.float64), METHODS[method])
    inputs = sharp_inputs(length=6, vocab=min(patched.config.vocab_size, 100))
    out = patched.generate(**inputs, max_new_tokens=12, **GREEDY)
    mask = torch.cat([inputs["attention_mask"], torch.ones(2, 12, dtype=torch.long)], dim=1)
    whole = {"input_ids": out.sequences, "attention_mask": mask, "position_ids": _generate_positions(mask)}
    with torch.no_grad():
        got, want = patched(**whole).logits, reference(**whole).logits
    steps = torch.stack(out.logits, 1)  # generate() hands them in float32
    torch.testing.assert_close(steps, got[:, 5:-1].float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-9, rtol=1e-9)


NEAR_PARTS_PAST_4 = {  # every method leaving the distances below 7 as they are (`Method.exact_below`)
    "rerope": {"rerope_window": 8},
    "leaky": {"rerope_window": 8, "rerope_leak": 3.0},
    "self_extend": {"self_extend_group": 2, "self_extend_window": 8},
    "dca": {"dual_chunk_size": 12, "dual_chunk_local": 6},
    "string": {"string_shift": 8, "string_local": 2},
}


@pytest.mark.parametrize("window", [4, 16])
@pytest.mark.parametrize("method", list(NEAR_PARTS_PAST_4))
def test_a_local_layer_that_sees_nothing_the_method_changes_runs_as_the_model_has_it(
    method, window, monkeypatch
):
    """Gemma-3's local layers under a method whose near part is wider than their window (ReRoPE w8192 over 512
    keys): the local layer's output is the unchanged model's, bitwise (STRING's factor is not put on it), and only
    the global layer goes through the engine; with a window wider than the near part, both do. The logits equal the
    reference's either way, over 24 tokens, past every near part."""
    layers, call = [], engine.PartsCall.__call__

    def counted(self, *args, **kwargs):
        layers.append(self.layer)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(engine.PartsCall, "__call__", counted)
    plain = zoo_model(
        "gemma3_text", layer_types=["sliding_attention", "full_attention"], sliding_window=window
    )
    unchanged = copy.deepcopy(plain)
    patched, reference = patched_beside_reference(plain, NEAR_PARTS_PAST_4[method])
    ids = sharp_inputs(length=24, padded=False, vocab=min(patched.config.vocab_size, 100))["input_ids"]
    with torch.no_grad():
        got = patched(ids, output_hidden_states=True)
        own = unchanged(ids, output_hidden_states=True).hidden_states[1]
        torch.testing.assert_close(got.logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.hidden_states[1], own) == (window == 4)
    assert set(layers) == ({1} if window == 4 else {0, 1})


@pytest.mark.parametrize("method", list(METHODS))
def test_a_step_reads_no_cos_sin_made_in_another_forward(method):
    """Steps of the same length through one ``position_ids`` tensor, rewritten in place for each: two batches
    padded apart, then the model's RoPE frequencies changed in place, then another model of other frequencies;
    under inference mode, where no tensor counts its changes. Each step equals its whole forward: a forward's
    cos/sin serve its own later layers only (`memo.shared_by_layers`)."""
    models = [hfa.patch(sharp_model("llama", rope_theta=theta), **METHODS[method]) for theta in (100.0, 37.0)]
    first, other = models
    token = torch.tensor([[5], [7]])
    with torch.inference_mode():
        positions = torch.zeros(2, 1, dtype=torch.long)  # an inference tensor: no version counter
        for model, pad in [(first, 3), (first, 1), ("change", 1), (first, 1), (other, 1)]:
            if model == "change":
                first.model.rotary_emb.inv_freq.mul_(0.7)  # in place: the same tensor
                continue
            inputs = sharp_inputs(length=10)
            inputs["attention_mask"][1] = 1
            inputs["attention_mask"][1, :pad] = 0
            mask = torch.cat([inputs["attention_mask"], torch.ones_like(token)], dim=1)
            every = _generate_positions(mask)
            cache = transformers.DynamicCache(config=model.config)
            model(**inputs, position_ids=every[:, :-1], past_key_values=cache)
            positions.copy_(every[:, -1:])
            step = model(input_ids=token, attention_mask=mask, position_ids=positions, past_key_values=cache)
            ids = torch.cat([inputs["input_ids"], token], dim=1)
            whole = model(input_ids=ids, attention_mask=mask, position_ids=every).logits[:, -1]
            torch.testing.assert_close(step.logits[:, -1], whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", list(METHODS))
def test_a_decoding_step_makes_its_cos_sin_once_not_in_every_layer(method, monkeypatch):
    """Self-Extend's and DCA's steps turn keys by cos/sin of the step's positions alone, and rotate the new token
    at the store by others: the first layer makes them, the later layers read them (`memo.shared_by_layers`),
    so that a step of 4 layers computes as many as a step of 1."""
    made = []
    cos_sin = RotaryFrequencies.cos_sin

    def counted(self, *args, **kwargs):
        made.append(1)
        return cos_sin(self, *args, **kwargs)

    monkeypatch.setattr(RotaryFrequencies, "cos_sin", counted)
    per_step = {}
    for layers in (1, 4):
        model = hfa.patch(sharp_model("llama", num_hidden_layers=layers), **METHODS[method])
        inputs = sharp_inputs(length=10)
        mask = inputs["attention_mask"]
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(**inputs, position_ids=_generate_positions(mask), past_key_values=cache)
            made.clear()
            for token in range(3, 6):
                mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
                positions = _generate_positions(mask)[:, -1:]
                ids = torch.full((2, 1), token)
                model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
        per_step[layers] = len(made) / 3
    assert per_step[4] == per_step[1] > 0, per_step


@pytest.mark.parametrize("option", list(OPTIONS))
def test_decoding_with_the_other_options_equals_the_reference(option):
    """Each method with other options on top, decoding a left-padded batch under sdpa (DCA's steps by the
    definition, with the exit's column, the scale law's queries and the gate): each step's logits are the
    reference's whole sequence's at that step."""
    patched, reference = patched_beside_reference(sharp_model("llama", "sdpa"), OPTIONS[option])
    inputs = sharp_inputs(length=6)
    out = patched.generate(**inputs, max_new_tokens=12, **GREEDY)
    mask = torch.cat([inputs["attention_mask"], torch.ones(2, 12, dtype=torch.long)], dim=1)
    whole = {"input_ids": out.sequences, "attention_mask": mask, "position_ids": _generate_positions(mask)}
    with torch.no_grad():
        want = reference(**whole).logits
    torch.testing.assert_close(torch.stack(out.logits, 1), want[:, 5:-1], atol=1e-4, rtol=1e-4)


def test_a_dca_step_turns_no_key_and_copies_none(monkeypatch):
    """Under sdpa, DCA's decoding step scores the cache's keys where they lie, each by the query turned to its
    own part's place (`PartsCall._decode_in_parts`): the keys it reads are the cache's own tensor, and each
    layer's step meets all three parts (its steps equal the whole forward: the generate() tests above)."""
    scored = []
    by_key = key_parts.rows_by_key
    monkeypatch.setattr(
        key_parts,
        "rows_by_key",
        lambda rows, part_of, key, *rest: scored.append((part_of, key)) or by_key(rows, part_of, key, *rest),
    )
    model = hfa.patch(sharp_model("llama"), **DCA)
    ids = sharp_inputs(batch=1, padded=False)["input_ids"]
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :14], past_key_values=cache)  # chunks of 4: the 15th token's step meets 3 of them
        scored.clear()
        model(ids[:, 14:15], past_key_values=cache)
    assert [key is layer.keys for (_, key), layer in zip(scored, cache.layers, strict=True)] == [True] * len(
        cache.layers
    )
    # keys 0-7 two chunks back or more, 8-11 in the last chunk, 12-14 in the query's own
    assert all(part_of.tolist() == [[2] * 8 + [1] * 4 + [0] * 3] for part_of, _ in scored)


@pytest.mark.parametrize("attn", FORWARD_ATTNS, indirect=True)
@pytest.mark.parametrize("method", list(METHODS))
def test_chunks_onto_the_models_cache_equal_the_whole_forward(method, attn):
    model = hfa.patch(sharp_model("llama", attn), **METHODS[method])
    ids = sharp_inputs(padded=False)["input_ids"]
    with torch.no_grad():
        whole = model(ids).logits
        chunked = stream_logits(model, ids, transformers.DynamicCache(config=model.config), [5, 7, 4])
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [512, 3])
@pytest.mark.parametrize("method", list(EVERY_METHOD))
@pytest.mark.parametrize("attn", ["sdpa+fused"], indirect=True)
def test_the_fused_blocks_without_a_mask_equal_the_reference(attn, method, rows, monkeypatch):
    """No mask from the model (two unpadded rows): each chunk's parts go to the fused kernel in blocks (the keys
    every query meets unmasked, a masked block at either side). Chunks of the span (4: the window, DCA's
    cells) or of 3, which divides neither; a whole forward, chunks onto the model's cache, and positions that
    start at 3 (DCA's cells then fall elsewhere in the cache), each against the per-pair reference."""
    monkeypatch.setattr(prefill, "SPLIT_ROWS", rows)
    patched, reference = patched_beside_reference(sharp_model("llama", attn), EVERY_METHOD[method])
    ids = sharp_inputs(length=24, padded=False)["input_ids"]
    later = {"position_ids": torch.arange(3, 27)[None]}
    with torch.no_grad():
        want = reference(ids).logits
        torch.testing.assert_close(patched(ids).logits, want, atol=1e-5, rtol=1e-5)
        chunked = stream_logits(patched, ids, transformers.DynamicCache(config=patched.config), [5, 7, 4])
        torch.testing.assert_close(chunked, want, atol=1e-5, rtol=1e-5)
        got = patched(ids, **later).logits
        torch.testing.assert_close(got, reference(ids, **later).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", list(EVERY_METHOD))
@pytest.mark.parametrize("attn", ["sdpa+fused"], indirect=True)
def test_the_fused_blocks_gradients_match_the_reference(attn, method, monkeypatch):
    """Backward through the blocks (chunks of 3, with a learnable exit), every weight's gradient."""
    monkeypatch.setattr(prefill, "SPLIT_ROWS", 3)
    options = {**EVERY_METHOD[method], "sink_logit": "learnable"}
    patched, reference = patched_beside_reference(sharp_model("llama", attn), options)
    assert_gradients_match(patched, reference, sharp_inputs(length=24, padded=False))


@pytest.mark.parametrize("method", list(EVERY_METHOD))
@pytest.mark.parametrize("attn", ["sdpa+fused"], indirect=True)
def test_the_fused_blocks_within_a_sliding_window(attn, method, monkeypatch):
    """Mistral's sliding window (7 keys, past every method's near part: a narrower one never reaches the engine)
    with its mask dropped, as a model that passes only ``sliding_window`` would call: the blocks end where the
    window does."""
    sliding = 7
    windows, call = [], engine.PartsCall.__call__

    def unmasked(self, run, query, key, value, mask, **kwargs):
        windows.append(kwargs.get("sliding_window"))
        return call(self, run, query, key, value, None, **kwargs)

    monkeypatch.setattr(engine.PartsCall, "__call__", unmasked)
    model = sharp_model("mistral", attn, sliding_window=sliding)
    patched, reference = patched_beside_reference(model, EVERY_METHOD[method])
    ids = sharp_inputs(length=24, padded=False)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
    assert set(windows) == {sliding}


WIDER = {  # windows and cells of 8, over 40 tokens
    "rerope": {"rerope_window": 8},
    "leaky": {"rerope_window": 8, "rerope_leak": 3.0},
    "self_extend": {"self_extend_group": 2, "self_extend_window": 8},
    "dca": {"dual_chunk_size": 10, "dual_chunk_local": 2},
}


@pytest.mark.parametrize("method", list(WIDER))
def test_without_a_mask_the_fused_kernel_gets_masks_a_chunk_wide(method, monkeypatch):
    """Where the model passes no mask, only the keys that some of a chunk's queries meet and others not are
    masked, at most as many as the chunk's queries (its span: 8); the rest go unmasked, the far keys whole."""
    calls = watch_fused_parts(monkeypatch, True)
    seen = []
    attention = key_parts.attention
    monkeypatch.setattr(
        key_parts, "attention", lambda run, parts: seen.append(parts) or attention(run, parts)
    )
    model = hfa.patch(sharp_model("llama"), **WIDER[method])
    with torch.no_grad():
        model(torch.randint(3, SHARP_VOCAB, (1, 40), generator=torch.Generator().manual_seed(0)))
    parts = [part for chunk in seen for part in chunk]
    assert calls and all(key_parts.CHECK.verdicts.values())
    assert all(part.query.shape[2] <= 8 for part in parts)
    masked = [part.visible.shape[-1] for part in parts if part.visible is not None]
    unmasked = [part.key.shape[2] for part in parts if part.visible is None]
    assert masked and max(masked) <= 8, masked
    assert unmasked and max(unmasked) >= 24, unmasked


@pytest.mark.parametrize("method", list(METHODS))
def test_a_left_padded_batch_equals_each_prompt_alone(method):
    model = hfa.patch(sharp_model("qwen2"), **METHODS[method])
    inputs = sharp_inputs()
    with torch.no_grad():
        batch = model(**inputs, position_ids=_generate_positions(inputs["attention_mask"])).logits
        alone = model(input_ids=inputs["input_ids"][1:, 3:]).logits
    torch.testing.assert_close(batch[1, 3:], alone[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "options", [{"self_extend_group": 1, "self_extend_window": 4}, {**DCA, "dual_chunk_size": 22}]
)
def test_what_reaches_no_far_pair_is_the_unpatched_model(options):
    """A group of 1 places every pair where the model does; a chunk longer than the input holds it whole."""
    model = sharp_model()
    plain = copy.deepcopy(model)
    hfa.patch(model, **options)
    inputs = sharp_inputs()
    rows = inputs["attention_mask"].bool()
    with torch.no_grad():
        torch.testing.assert_close(
            model(**inputs).logits[rows], plain(**inputs).logits[rows], atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"self_extend_group": 4}, "self_extend_group needs self_extend_window too"),
        ({"self_extend_window": 4}, "self_extend_window needs self_extend_group too"),
        ({"self_extend_group": 4, "self_extend_window": 0}, "self_extend_window must be an int >= 1"),
        ({"dual_chunk_size": 8}, "dual_chunk_size needs dual_chunk_local too"),
        ({"dual_chunk_size": 8, "dual_chunk_local": 8}, "dual_chunk_local must be below dual_chunk_size"),
        ({**SE, "rerope_window": 8}, "rerope_window and self_extend_group contradict each other"),
        ({**SE, **DCA}, "self_extend_group and dual_chunk_size contradict each other"),
        ({"string_shift": 4, "string_local": 4}, "string_shift must exceed string_local"),
        ({"string_shift": 100}, "string_shift must exceed string_local \\(128\\)"),
        ({"string_shift": 6, "string_local": -1}, "string_local must be an int >= 0"),
        (
            {"string_shift": 6, "string_local": 2, "string_factor": 0.0},
            "string_factor must be a finite float > 0",
        ),
        (
            {"string_shift": 6, "string_local": 2, "string_factor": float("nan")},
            "string_factor must be a finite",
        ),
        ({"string_local": 2}, "string_local needs string_shift too"),
        ({**STRING, **DCA}, "dual_chunk_size and string_shift contradict each other"),
    ],
)
def test_invalid_options_are_one_line(options, message):
    model = sharp_model()
    before = copy.deepcopy(model)
    with pytest.raises(ValueError, match=message) as error:
        hfa.patch(model, **options)
    assert "\n" not in str(error.value)
    assert_unchanged(model, before)


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: tiny_model("bert"), "is an encoder"),
        (
            lambda: sharp_model(attn="flex_attention"),
            r"(Self-Extend|Dual Chunk Attention|STRING) .* needs eager or sdpa",
        ),
    ],
)
def test_models_it_cannot_serve_are_refused(build, message, method):
    model = build()
    before = copy.deepcopy(model)
    with pytest.raises(ValueError, match=message) as error:
        hfa.patch(model, **METHODS[method])
    assert "\n" not in str(error.value) and str(error.value).startswith(next(iter(METHODS[method])))
    assert_unchanged(model, before)


@pytest.mark.parametrize("method", list(METHODS))
def test_calls_it_cannot_serve_are_refused_in_one_line(method):
    """A SinkCache, a static cache, packed sequences (a method of positions needs one sequence a row)."""
    model = hfa.patch(sharp_model(), **METHODS[method])
    ids = torch.randint(3, SHARP_VOCAB, (1, 16))
    name = next(iter(METHODS[method]))
    refused = {
        "already keeps every distance": {"past_key_values": hfa.SinkCache(2, 4)},
        "a static cache": {
            "past_key_values": transformers.StaticCache(config=model.config, max_cache_len=32)
        },
        "position_ids go back or restart": {"position_ids": (torch.arange(16) % 9)[None], "use_cache": False},
    }
    if method_of(hfa.get_config(model)).by_distance:  # STRING counts distances in the cache, as ReRoPE does:
        del refused["position_ids go back or restart"]  # packed sequences pass (tests/core/test_rerope.py)
    for message, arguments in refused.items():
        with pytest.raises(ValueError, match=message) as error:
            model(ids, **arguments)
        assert "\n" not in str(error.value) and name in str(error.value)


QWEN_1M = {  # Qwen2.5-7B-Instruct-1M's, at tiny sizes
    "chunk_size": 6,
    "local_size": 2,
    "original_max_position_embeddings": 8,
    "sparse_attention_config": None,
    "sparse_attention_enabled": True,
    "sparse_attention_threshold": 32768,
}


def test_a_checkpoints_dual_chunk_config_is_honoured_explicit_options_replace_it_and_unpatch_restores():
    model = sharp_model("qwen2", dual_chunk_attention_config=QWEN_1M)
    plain = copy.deepcopy(model)
    inputs = sharp_inputs()
    rows = inputs["attention_mask"].bool()
    with pytest.warns(UserWarning, match="asks for Dual Chunk Attention") as caught:
        hfa.patch(model)
    note = str(caught[0].message)
    assert "\n" not in note and all(
        key in note for key in QWEN_1M if key not in ("chunk_size", "local_size")
    ), note
    assert hfa.get_config(model) == hfa.AttnScaleConfig(**DCA)
    explicit = hfa.patch(copy.deepcopy(plain), **DCA)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits[rows], explicit(**inputs).logits[rows])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hfa.patch(model, **SE)  # explicit: the checkpoint's DCA replaced, with no note
    assert hfa.get_config(model) == hfa.AttnScaleConfig(**SE)
    hfa.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, plain(**inputs).logits)


@pytest.mark.parametrize("method", [pytest.param("self_extend", marks=pytest.mark.slow), "dca"])
def test_torch_compile_takes_the_method_whole(method):
    """No graph break in a forward or a decoding step (as ReRoPE's, tests/core/test_rerope.py); Self-Extend's
    step takes the same path as DCA's (from the store), under -m slow."""
    model = hfa.patch(sharp_model("llama"), **METHODS[method])
    ids = sharp_inputs(batch=1, padded=False)["input_ids"]
    torch._dynamo.reset()
    assert torch._dynamo.explain(lambda x: model(x).logits)(ids).graph_break_count == 0
    with torch.no_grad():
        cache = transformers.DynamicCache(config=model.config)
        model(ids, past_key_values=cache)
        torch._dynamo.reset()
        step = torch._dynamo.explain(lambda x: model(x, past_key_values=cache).logits)(ids[:, :1])
    assert step.graph_break_count == 0, [b.reason for b in step.break_reasons]
