"""ReRoPE (``rerope_window``, ``rerope_leak``) against the plain reference in tests/reference.py: scores from the
raw q and k, rotated pair by pair by the clamped distance; on every main family, the model's rope types, partial
rotary, local layers and NoPE layers, with the other options, forward and backward."""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import warnings

import pytest
import torch
import transformers
from conftest import (
    ATTNS,
    DECODERS,
    FORWARD_ATTNS,
    GREEDY,
    ROPE_TYPES,
    SHARP_VOCAB,
    OperatorCount,
    assert_gradients_match,
    assert_logits_match,
    assert_unchanged,
    patched_beside_reference,
    sharp_inputs,
    sharp_model,
    stream_logits,
    tiny_model,
    watch_flex_bands,
)
from model_zoo import EAGER_ONLY, LOGIT_TOLERANCE, family_types, head_of, reference_of, zoo_model

import hf_attnscale as hfa
from hf_attnscale.core.call import rope
from hf_attnscale.core.options.methods import rerope
from hf_attnscale.core.parts import decode, prefill

WINDOW, LEAK, LENGTH = 4, 3.0, 16
OPTIONS = {
    "rerope": {"rerope_window": WINDOW},
    "leaky": {"rerope_window": WINDOW, "rerope_leak": LEAK},
    "rerope+logn": {"rerope_window": WINDOW, "scale": "logn", "train_length": 2},
    "leaky+zero_kv": {"rerope_window": WINDOW, "rerope_leak": LEAK, "zero_kv": True},
    "rerope+sink_fixed": {"rerope_window": WINDOW, "sink_logit": 1.5},
    "rerope+clipped": {"rerope_window": WINDOW, "clipped_softmax": (-0.03, 1.02)},
    "rerope+ssmax+gate": {"rerope_window": WINDOW, "scale": "ssmax", "train_length": 2, "gate": "head"},
}
BY_DISTANCE = {**OPTIONS, "string": {"string_shift": 6, "string_local": 2}}
"""With STRING, the other method that counts distances in the cache."""


@pytest.mark.parametrize("attn", FORWARD_ATTNS, indirect=True)
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("model_type", list(DECODERS))
def test_matches_reference(model_type, option, attn):
    patched, reference = patched_beside_reference(sharp_model(model_type, attn), OPTIONS[option])
    got = assert_logits_match(patched, reference, sharp_inputs())
    hfa.unpatch(patched)
    with torch.no_grad():
        plain = patched(**sharp_inputs()).logits[sharp_inputs()["attention_mask"].bool()]
    assert (plain - got).abs().max() > 1e-3, "ReRoPE changed nothing"


@pytest.mark.parametrize("model_type", [t for t in family_types() if head_of(t) == "causal"])
def test_every_decoder_is_served_exactly_or_refused_in_one_line(model_type):
    """Each decoder type the package supports: ReRoPE + logn equals the reference and changes the logits, or
    the patch refuses it in one line, the model unchanged (no RoPE, latent attention, a rotation of its own)."""
    attn = "eager" if model_type in EAGER_ONLY else "sdpa"
    model = zoo_model(model_type, attn)
    before = copy.deepcopy(model)
    try:
        hfa.patch(model, **OPTIONS["rerope+logn"])
    except ValueError as error:
        assert str(error).startswith("rerope_window") and "\n" not in str(error), error
        assert_unchanged(model, before)
        pytest.skip(f"rerope refused: {error}")  # scripts/support_matrix.py reads the reason from here
    # sdpa ignores a family's logit soft-cap (Gemma-2 and VaultGemma under transformers 5.13), so must the reference
    reference = reference_of(before, attn, **OPTIONS["rerope+logn"])
    inputs = sharp_inputs(vocab=min(model.config.get_text_config().vocab_size, 100))
    rows = inputs["attention_mask"].bool()
    with torch.no_grad():  # no cache: transformers 5.13's LFM2 of attention layers only cannot make one
        got, want, unchanged = (
            each(**inputs, use_cache=False).logits[rows] for each in (model, reference, before)
        )
    atol = LOGIT_TOLERANCE.get(model_type, 1e-4)  # logits, as the family tests compare them
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)
    assert (unchanged - got).abs().max() > 1e-3, "ReRoPE changed nothing"


@pytest.mark.parametrize("attn", ATTNS, indirect=True)
@pytest.mark.parametrize("model_type", list(DECODERS))
def test_gradients_match_reference(model_type, attn):
    options = {"rerope_window": WINDOW, "rerope_leak": LEAK, "sink_logit": "learnable"}
    patched, reference = patched_beside_reference(sharp_model(model_type, attn), options)
    assert_gradients_match(patched, reference, sharp_inputs())
    sink = next(m.hfa.sink for m in patched.modules() if hasattr(m, "hfa"))
    assert sink.grad is not None and sink.grad.abs().sum() > 0


@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma"])
def test_a_window_past_the_input_is_the_unpatched_model(model_type):
    model = sharp_model(model_type)
    plain = copy.deepcopy(model)
    hfa.patch(model, rerope_window=LENGTH)
    inputs = sharp_inputs()
    rows = inputs["attention_mask"].bool()
    with torch.no_grad():
        torch.testing.assert_close(
            model(**inputs).logits[rows], plain(**inputs).logits[rows], atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("option", ["rerope", "leaky+zero_kv"])
@pytest.mark.parametrize("attn", FORWARD_ATTNS, indirect=True)
def test_generate_through_the_models_cache_equals_the_whole_forward(attn, option):
    """Each decoding step reads the raw keys its cache holds; its logits are the whole sequence's at that step."""
    model = hfa.patch(sharp_model("llama", attn), **OPTIONS[option])
    inputs = sharp_inputs(length=6)
    out = model.generate(**inputs, max_new_tokens=12, **GREEDY)
    mask = torch.cat([inputs["attention_mask"], torch.ones(2, 12, dtype=torch.long)], dim=1)
    with torch.no_grad():
        whole = model(input_ids=out.sequences, attention_mask=mask).logits
    torch.testing.assert_close(torch.stack(out.logits, 1), whole[:, 5:-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("option", ["rerope", "leaky"])
def test_decoding_with_yarns_attention_scaling_and_no_mask(option):
    """A decoding step turns the query to the window and the near keys only; under YaRN, whose attention scaling
    s rides on cos/sin, every score still carries s², the far keys' s on the query. No attention mask: the step
    builds none."""
    model = sharp_model("llama", max_position_embeddings=8, rope_parameters=ROPE_TYPES["yarn"])
    hfa.patch(model, **OPTIONS[option])
    ids = sharp_inputs(batch=1, padded=False)["input_ids"][:, :6]
    out = model.generate(input_ids=ids, max_new_tokens=12, **GREEDY)
    with torch.no_grad():
        whole = model(input_ids=out.sequences).logits
    torch.testing.assert_close(torch.stack(out.logits, 1), whole[:, 5:-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "option, made",
    [
        ("rerope", [(1, WINDOW + 1)]),  # the prefill's own cos/sin, then the window's table
        # the prefill's store of its keys (at j/k), then the turns from there of the near queries and keys (one)
        # and of the far queries; at each of the 9 steps the new token's store, the query's turn and the
        # window's keys': the far keys stay as stored. Each once for both layers
        ("leaky", [(1, 6)] * 3 + [(1, 1), (1, 1), (1, WINDOW)] * 9),
    ],
)
def test_the_steps_cos_sin_are_computed_once_and_follow_the_rotary(monkeypatch, option, made):
    """Every layer of every decoding step turns the query and the near keys by the same distances: ReRoPE's
    cos/sin are computed once for a whole generate(), leaky ReRoPE's once a step (its keys are stored at j/k,
    so the far ones never turn). Changed in place, or gone with their model, the rotary's
    frequencies are read again (each time against the reference)."""
    tables = []
    original = rope.RotaryFrequencies.cos_sin
    monkeypatch.setattr(
        rope.RotaryFrequencies, "cos_sin", lambda *a, **k: tables.append(a[1].shape) or original(*a, **k)
    )
    model, reference = patched_beside_reference(sharp_model("llama"), OPTIONS[option])
    frequencies = id(model.model.rotary_emb.inv_freq)
    ids = sharp_inputs(batch=1, padded=False)["input_ids"][:, :6]
    for factor in (1.0, 0.7):
        for each in (model, reference):
            each.model.rotary_emb.inv_freq.mul_(factor)
        tables.clear()
        out = model.generate(input_ids=ids, max_new_tokens=10, **GREEDY)
        assert tables == made
        with torch.no_grad():
            whole = reference(input_ids=out.sequences).logits
        torch.testing.assert_close(torch.stack(out.logits, 1), whole[:, 5:-1], atol=1e-4, rtol=1e-4)
    assert (frequencies in rope._TABLES) == (option == "rerope")  # leaky ReRoPE's steps keep no table
    del model, out
    gc.collect()
    assert frequencies not in rope._TABLES


@pytest.mark.parametrize("family, halves", [("llama", True), ("cohere", False), ("gemma3n", None)])
def test_the_family_rotation_turns_one_tensor_as_the_family_does(family, halves):
    """ReRoPE and a SinkCache turn one tensor at a time: as transformers' usual halves RoPE where the family's
    pair function gives exactly its bits (no stand-in query to turn beside it); Cohere's interleaved pairs
    through its own function, beside a one-head stand-in; Gemma-3n's one-tensor function as it is. Each gives
    the family's own bits, over the rotary part of a partial rotary head."""
    own = importlib.import_module(f"transformers.models.{family}.modeling_{family}").apply_rotary_pos_emb
    keys, (cos, sin) = torch.randn(2, 3, 5, 12), (torch.randn(2, 5, 8) for _ in range(2))
    got = rope.family_rotation(own, 8)(keys, cos, sin)
    want = (
        own(keys[..., :8], cos, sin)
        if halves is None
        else own(keys[:, :1, :, :8], keys[..., :8], cos, sin)[1]
    )
    assert torch.equal(got[..., :8], want) and torch.equal(got[..., 8:], keys[..., 8:])
    if halves is not None:
        assert rope._computes_halves(own, 8) is halves


def one_step(model, watch: OperatorCount | None = None) -> torch.Tensor:
    """The sharp inputs (one row) through a fresh cache, then one decoding step of their first token, under
    ``watch`` where given; the step's logits, float32."""
    ids = sharp_inputs(batch=1, padded=False)["input_ids"]
    with torch.no_grad():
        cache = transformers.DynamicCache(config=model.config)
        model(input_ids=ids, past_key_values=cache)
        with watch or contextlib.nullcontext():
            return model(input_ids=ids[:, :1], past_key_values=cache, logits_to_keep=1).logits.float()


@pytest.mark.parametrize("option, per_layer", [("rerope", 11), ("leaky", 16)])
def test_a_decoding_step_adds_few_operators_per_layer(option, per_layer, monkeypatch):
    """A GPU runs every operator of an eager decoding step as one launch at least, and a small model's step waits
    on launches. ReRoPE's step adds, per layer, the turns of the query and of the near keys (5 each) and the
    keys' concatenation (1); leaky ReRoPE turns the far keys too (5), by cos/sin kept across steps (37 when each
    layer computed them). Counted on the path a GPU takes: the segments joined (`decode.scores_in_place`)."""
    monkeypatch.setattr(decode, "scores_in_place", lambda run, query: False)

    def step_operators(layers: int, **options) -> int:
        model = sharp_model("llama", num_hidden_layers=layers)
        if options:
            hfa.patch(model, **options)
        one_step(model, counted := OperatorCount())
        return counted.operators

    added = [step_operators(layers, **OPTIONS[option]) - step_operators(layers) for layers in (1, 2)]
    assert added[1] - added[0] <= per_layer, added


class CatCount(OperatorCount):
    """The concatenations in its block, by the length of their third dim (a cache's keys: its length)."""

    def __init__(self) -> None:
        super().__init__()
        self.lengths = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.cat.default and out.dim() == 4:
            self.lengths.append(out.shape[2])
        return out


@pytest.mark.parametrize("option", ["rerope", "leaky", "self_extend"])
def test_a_cpu_step_scores_the_keys_where_they_lie(option):
    """On the CPU under sdpa a decoding step scores the keys it keeps as stored and those it turns as two slices
    of the cache, by the definition: it makes no tensor as long as the cache, where joining them copied every key
    in every layer (each step's logits equal the whole forward's: the generate() tests). The step meets both
    parts: 16 keys, a window of 4."""
    options = OPTIONS.get(option) or {"self_extend_group": 2, "self_extend_window": WINDOW}
    model = hfa.patch(sharp_model("llama", "sdpa"), **options)
    one_step(model, counted := CatCount())
    # the cache's own update appends each layer's new key and value: nothing else is as long
    layers = model.config.num_hidden_layers
    assert counted.lengths.count(LENGTH + 1) == 2 * layers, counted.lengths


@pytest.mark.parametrize("option", ["rerope+logn", "leaky"])
def test_a_bfloat16_step_in_place_is_as_near_float32_as_the_joined_one(option, monkeypatch):
    """In bfloat16, the CPU's step scored in place (the definition, its softmax in float32) and the joined step
    (sdpa's kernel) are each within bfloat16's error of the float32 step: here 2-5% of the largest logit either
    way, where a step that drops its near keys is 16% off (and a window one wider 80%)."""
    model = hfa.patch(sharp_model("llama", "sdpa"), **OPTIONS[option])

    def step(in_place: bool) -> torch.Tensor:
        monkeypatch.setattr(decode, "scores_in_place", lambda run, query: in_place)
        return one_step(model)

    want = step(False)  # float32, sdpa's kernel (the float32 step in place equals it: the generate() tests)
    model.to(torch.bfloat16)
    for in_place in (True, False):
        error = (step(in_place) - want).abs().max() / want.abs().max()
        assert error < 0.08, (in_place, error)


def test_a_table_made_under_inference_mode_serves_training():
    model = hfa.patch(sharp_model("llama"), **OPTIONS["rerope"])
    inputs = sharp_inputs()
    with torch.inference_mode():
        model(**inputs)
    model(**inputs).logits.sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("attn", "sliding"), [*[(a, 6) for a in FORWARD_ATTNS], ("sdpa", 3), ("eager", 3)], indirect=["attn"]
)
def test_a_sliding_window_within_the_input(attn, sliding):
    """Mistral's sliding window (6 keys, or 3: within ReRoPE's window of 4, so no key is ever far and the layers
    run as the model has them, no fast path; both shorter than the 16 tokens), on unpadded rows: the whole
    forward and each decoding step against the reference."""
    model = sharp_model("mistral", attn, sliding_window=sliding)
    patched, reference = patched_beside_reference(model, OPTIONS["rerope"])
    inputs = sharp_inputs(padded=False)
    assert_logits_match(patched, reference, inputs)
    out = patched.generate(input_ids=inputs["input_ids"][:, :8], max_new_tokens=8, **GREEDY)
    with torch.no_grad():
        whole = reference(input_ids=out.sequences).logits
    torch.testing.assert_close(torch.stack(out.logits, 1), whole[:, 7:-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attn", FORWARD_ATTNS, indirect=True)
def test_a_left_padded_batch_equals_each_prompt_alone(attn):
    model = hfa.patch(sharp_model("qwen2", attn), **OPTIONS["leaky"])
    inputs = sharp_inputs()
    with torch.no_grad():
        batch = model(**inputs).logits
        alone = model(input_ids=inputs["input_ids"][1:, 3:]).logits
    torch.testing.assert_close(batch[1, 3:], alone[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("option", ["rerope", "leaky", "string"])
@pytest.mark.parametrize("attn", FORWARD_ATTNS, indirect=True)
def test_packed_sequences_equal_each_alone(attn, option, monkeypatch):
    """Packed rows, as padding-free training makes them (positions restart, no mask, no cache): transformers
    masks each sequence from the others, so distances counted in the cache are each sequence's own. Their
    positions are checked once per forward, not in every layer."""
    model = hfa.patch(sharp_model("llama", attn), **BY_DISTANCE[option])
    first, second = torch.randint(3, SHARP_VOCAB, (1, 9)), torch.randint(3, SHARP_VOCAB, (1, 7))
    positions = torch.cat([torch.arange(9), torch.arange(7)])[None]
    checked = []
    jumps = prefill._jumps
    monkeypatch.setattr(prefill, "_jumps", lambda *args: checked.append(args) or jumps(*args))
    with torch.no_grad():
        packed = model(torch.cat([first, second], 1), position_ids=positions, use_cache=False).logits
        alone = torch.cat([model(first).logits, model(second).logits], 1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    assert model.config.num_hidden_layers > 1 and len(checked) == 3  # one for each of the three forwards


def _left_padded(ids: torch.Tensor, pads: int) -> dict:
    """``ids`` after ``pads`` pad tokens, with generate()'s positions (a pad's is 1)."""
    mask = torch.cat([torch.zeros(1, pads, dtype=torch.long), torch.ones_like(ids)], 1)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    return {
        "input_ids": torch.cat([torch.zeros_like(mask[:, :pads]), ids], 1),
        "attention_mask": mask,
        "position_ids": positions,
    }


POSITIONS = {  # (inputs for 16 tokens, whether ReRoPE serves them)
    "restart, no cache": (lambda ids: {"position_ids": torch.arange(16) % 9, "use_cache": False}, True),
    "left padded": (lambda ids: _left_padded(ids[:, 3:], 3), True),
    "right padded, pads at 0": (  # as TRL's collator pads a row's positions
        lambda ids: {
            "position_ids": torch.arange(16) * (torch.arange(16) < 12),
            "attention_mask": (torch.arange(16) < 12).long()[None],
        },
        True,
    ),
    "offset by 5": (lambda ids: {"position_ids": torch.arange(16) + 5}, True),
    "restart onto a cache": (lambda ids: {"position_ids": torch.arange(16) % 9}, False),
    "a jump": (lambda ids: {"position_ids": torch.arange(16) + 4 * (torch.arange(16) > 7)}, False),
    "a jump under a mask, no cache": (  # PoSE's: each pair at its positions (tests/integrations/test_pose.py)
        lambda ids: {
            "position_ids": torch.arange(16) * 2,
            "attention_mask": torch.ones_like(ids),
            "use_cache": False,
        },
        True,
    ),
}


@pytest.mark.parametrize("option", ["rerope", "string"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"], indirect=True)
@pytest.mark.parametrize("case", list(POSITIONS))
def test_positions_that_do_not_run_on_by_one_are_refused_in_one_line(case, attn, option):
    """ReRoPE (and STRING) count distances in the cache: where a query's visible keys' positions jump or restart
    (and transformers does not mask them apart), the model would score other distances, so the call is refused."""
    make, served = POSITIONS[case]
    model = hfa.patch(sharp_model("llama", attn), **BY_DISTANCE[option])
    ids = torch.randint(3, SHARP_VOCAB, (1, 16))
    inputs = {"input_ids": ids, **make(ids)}
    inputs["position_ids"] = inputs["position_ids"].view(1, -1)
    if served:
        with torch.no_grad():
            model(**inputs)
        return
    with pytest.raises(
        ValueError, match=f"{next(iter(BY_DISTANCE[option]))}: position_ids (jump|go back)"
    ) as error:
        model(**inputs)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("jump", [False, True])
def test_a_one_row_mask_with_more_columns_than_keys(jump):
    """A 4D mask of one row for every query (a user's own), wider than the call's keys: its columns after the
    cache's 2 keys are the chunk's own."""
    positions = (torch.arange(5) + 2 + 3 * jump * (torch.arange(5) > 2))[None]
    mask = torch.ones(1, 1, 1, 2 + 5 + 1, dtype=torch.bool)
    if not jump:
        prefill.check_positions(rerope(4), positions, mask, past=2)
        return
    with pytest.raises(ValueError, match="position_ids jump and go back"):  # the one row shows later keys too
        prefill.check_positions(rerope(4), positions, mask, past=2)


def test_a_forwards_positions_are_checked_once_per_mask(monkeypatch):
    """Gemma-3's local and global layers take two masks, alternating: the positions are checked once for each."""
    types = ["sliding_attention", "full_attention"] * 2
    model = zoo_model("gemma3_text", "sdpa", num_hidden_layers=4, layer_types=types, sliding_window=6)
    hfa.patch(model, **OPTIONS["rerope"])
    checked = []
    jumps = prefill._jumps
    monkeypatch.setattr(prefill, "_jumps", lambda *args: checked.append(args) or jumps(*args))
    with torch.no_grad():
        model(**sharp_inputs(vocab=min(model.config.vocab_size, 100)))
    assert len(checked) == 2


@pytest.mark.parametrize("jump", [False, True])
def test_a_chunk_onto_the_cache_under_a_mask_is_checked_against_its_own_keys(jump):
    """A left-padded batch read in two calls with generate()'s positions; in the second, row 1's positions jump
    after its third token: refused. Only the chunk's own keys (after the cache's) show it."""
    model = hfa.patch(sharp_model("llama", "eager"), **OPTIONS["rerope"])
    inputs = sharp_inputs()
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    cache = transformers.DynamicCache(config=model.config)
    chunk = positions[:, 10:].clone()
    chunk[1, 3:] += 3 * jump
    with torch.no_grad():
        model(
            input_ids=ids[:, :10],
            attention_mask=mask[:, :10],
            position_ids=positions[:, :10],
            past_key_values=cache,
        )
        second = dict(input_ids=ids[:, 10:], attention_mask=mask, position_ids=chunk, past_key_values=cache)
        if not jump:
            model(**second)
            return
        with pytest.raises(
            ValueError, match="rerope_window: position_ids jump in a call onto or into a cache"
        ):
            model(**second)


@pytest.mark.parametrize("onto_a_cache", [False, True])
def test_flex_past_its_recompile_limit_takes_the_chunks(monkeypatch, onto_a_cache):
    """Where torch.compile will compile flex no more (its limit hit, fullgraph), the call takes the chunked
    formulation, with the same result and one warning, rather than flex uncompiled (every score held): for a
    prefill, and for chunks onto a cache, whose near keys the bands counted from the first."""
    from transformers import DynamicCache

    from hf_attnscale.core.parts import flex_parts

    served, refused = watch_flex_bands(monkeypatch), []

    def at_the_limit(*args):
        refused.append(1)
        raise flex_parts._RECOMPILE_LIMIT("Hard failure due to fullgraph=True")

    monkeypatch.setattr(flex_parts, "_kernel", lambda device_type: at_the_limit)
    patched, reference = patched_beside_reference(sharp_model("qwen2", "sdpa"), OPTIONS["leaky+zero_kv"])
    with pytest.warns(RuntimeWarning, match="recompile limit"):
        if onto_a_cache:
            ids = sharp_inputs(padded=False)["input_ids"]
            with torch.no_grad():
                chunked = stream_logits(patched, ids, DynamicCache(config=patched.config), [5, 7, 4])
                torch.testing.assert_close(chunked, reference(ids).logits, atol=1e-5, rtol=1e-5)
        else:
            assert_logits_match(patched, reference, sharp_inputs())
    assert refused and not served


@pytest.mark.parametrize("attn", ["sdpa", "sdpa+fused"], indirect=True)
def test_long_input_runs_in_query_chunks(monkeypatch, attn):
    """Where the mask bounds a chunk to fewer queries than the window, the queries run in those pieces (3, and
    1 last), with the same result."""
    patched, reference = patched_beside_reference(sharp_model("llama", attn), OPTIONS["leaky"])
    monkeypatch.setattr(prefill, "MASK_CHUNK", 3 * (LENGTH + WINDOW))
    chunks = []
    part = prefill.KeyPart
    monkeypatch.setattr(prefill, "KeyPart", lambda q, *rest: chunks.append(q.shape[2]) or part(q, *rest))
    assert_logits_match(patched, reference, sharp_inputs())
    assert set(chunks) == {3, 1}, chunks  # 16 queries: five chunks of 3, then 1 (unbounded: 4, the window)


@pytest.mark.parametrize("option", ["rerope", "leaky+zero_kv"])
@pytest.mark.parametrize("attn", FORWARD_ATTNS, indirect=True)
def test_chunks_onto_the_models_cache_equal_the_whole_forward(attn, option):
    """Several tokens a call onto keys already in the cache (as perplexity reads a long document): each chunk's
    near and far keys reach back into the cache, so its logits are the whole forward's."""
    from transformers import DynamicCache

    model = hfa.patch(sharp_model("llama", attn), **OPTIONS[option])
    ids = sharp_inputs(padded=False)["input_ids"]
    with torch.no_grad():
        whole = model(ids).logits
        chunked = stream_logits(model, ids, DynamicCache(config=model.config), [5, 7, 4])
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rerope_window": 0}, "rerope_window must be an int >= 1"),
        ({"rerope_window": 8, "rerope_leak": 1.0}, "rerope_leak must be a finite float > 1"),
        ({"rerope_leak": 16.0}, "rerope_leak only applies with rerope_window"),
    ],
)
def test_invalid_options_are_one_line(options, message):
    model = sharp_model()
    before = copy.deepcopy(model)
    with pytest.raises(ValueError, match=message) as error:
        hfa.patch(model, **options)
    assert "\n" not in str(error.value)
    assert hfa.get_config(model) is None
    assert_unchanged(model, before)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: tiny_model("bert"), "is an encoder"),
        (lambda: tiny_model("modernbert"), "is an encoder"),
        (lambda: tiny_model("roformer"), "is an encoder"),
        (lambda: zoo_model("gpt2"), "has no RoPE"),
        (lambda: zoo_model("cohere2"), "does not compute cos/sin from inv_freq in the usual layout"),
        (lambda: sharp_model(attn="flex_attention"), "ReRoPE .* needs eager or sdpa attention"),
    ],
)
def test_models_it_cannot_serve_are_refused(build, message):
    model = build()
    before = copy.deepcopy(model)
    with pytest.raises(ValueError, match=message) as error:
        hfa.patch(model, rerope_window=8)
    assert "\n" not in str(error.value)
    assert hfa.get_config(model) is None
    assert_unchanged(model, before)


def test_a_family_failing_on_the_probe_token_is_refused_in_one_line(monkeypatch):
    """The patch runs each layer's rotary and the layer itself on a probe token to find its RoPE: where the family's
    code raises (Gemma-4's layers want their shared keys), any error, in one line, the model unchanged."""
    model = sharp_model()
    before = copy.deepcopy(model)

    def fails(*args, **kwargs):
        raise ValueError("a family's own check\nover two lines")

    monkeypatch.setattr(model.model.rotary_emb, "forward", fails)
    with pytest.raises(
        ValueError, match=r"could not be run on a probe token .*a family's own check"
    ) as error:
        hfa.patch(model, rerope_window=8)
    assert "\n" not in str(error.value)
    monkeypatch.undo()
    assert_unchanged(model, before)


def test_a_sink_cache_refuses_rerope():
    model = hfa.patch(sharp_model(), rerope_window=8)
    with pytest.raises(ValueError, match="already keeps every distance") as error:
        model(torch.randint(3, SHARP_VOCAB, (1, 6)), past_key_values=hfa.SinkCache(2, 4))
    assert "\n" not in str(error.value)


def test_a_static_cache_or_a_backend_switched_to_after_the_patch_is_refused():
    """A static cache hands attention its whole buffer, padding slots included, and flex or flash take no dense
    mask of near and far keys: each call says so in one line (a backend may be switched after the patch)."""
    from transformers import StaticCache

    model = hfa.patch(sharp_model(), rerope_window=8)
    ids = torch.randint(3, SHARP_VOCAB, (1, 6))
    with pytest.raises(ValueError, match="rerope_window: a static cache") as error:
        model(ids, past_key_values=StaticCache(config=model.config, max_cache_len=16))
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="rerope_window: a static cache"):
        model.generate(ids, max_new_tokens=2, cache_implementation="static", **GREEDY)
    model.set_attn_implementation("flex_attention")
    with pytest.raises(ValueError, match=r"ReRoPE .* needs eager or sdpa attention") as error:
        model(ids)
    assert "\n" not in str(error.value)


def test_unpatch_restores_the_model():
    model = sharp_model()
    plain = copy.deepcopy(model)
    inputs = sharp_inputs()
    hfa.patch(model, **OPTIONS["leaky"])
    hfa.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, plain(**inputs).logits)


@pytest.mark.parametrize("option, flex", [("rerope+logn", False), ("rerope+logn", True), ("leaky", False)])
def test_torch_compile_takes_rerope_whole(monkeypatch, option, flex):
    """No graph break in a ReRoPE forward or decoding step (torch._dynamo.explain counts them; leaky ReRoPE's step
    turns from its store); where CUDA's flex bands would serve (``flex``, here on the CPU), a model compiled whole
    takes the chunks instead."""
    from transformers import DynamicCache

    calls = watch_flex_bands(monkeypatch) if flex else []
    model = hfa.patch(sharp_model("llama"), **OPTIONS[option])
    ids = sharp_inputs(batch=1, padded=False)["input_ids"]
    torch._dynamo.reset()
    torch._dynamo.utils.warn_once_cache.clear()  # dynamo warns once per message and process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch._dynamo.explain(lambda x: model(x).logits)(ids).graph_break_count == 0
        assert not calls
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(ids, past_key_values=cache)
            torch._dynamo.reset()
            step = torch._dynamo.explain(lambda x: model(x, past_key_values=cache).logits)(ids[:, :1])
    assert step.graph_break_count == 0, [b.reason for b in step.break_reasons]
    # a functools.cache'd helper traced under compile makes dynamo warn of silent incorrectness (core/call/memo)
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message) for w in caught]
    assert len(calls) == (2 if flex else 0)  # the uncompiled prefill's two layers
