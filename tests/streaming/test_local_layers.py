"""Streaming models with sliding-window layers of their own (Gemma-2/3, Mistral, Cohere-2) at any cache size.

The definition (`tests/reference.py`'s `rerotated_stream_logits`): at every step the tokens a SinkCache keeps are
re-rotated into a plain DynamicCache at positions 0..n-1 and the model builds its own masks, so a local layer sees
only what its own window lets it see there. The stream, token by token and in chunks, must equal it with the
local window inside the cache's window (the layer keeps its own window only), between the window and the
capacity (some sinks hidden), and wider than the capacity (the layer sees what a global one does).
"""

from __future__ import annotations

import pytest
import torch
from conftest import BEAM_SEARCH, GREEDY, SHARP_VOCAB, stream_logits
from reference import rerotated_stream_logits
from tiny import build, sharpen
from transformers import AutoConfig, AutoModelForCausalLM

import hf_attnscale as hfa
from hf_attnscale.streaming.plan import LayerGeometry, layer_geometry

SINKS, WINDOW = 2, 8
OWN_WINDOWS = {"inside": 5, "between": 9, "wider": 12}  # against the window (8) and the capacity (10)
LENGTH = 40
ATOL = 1e-4
_COMMON = {
    "vocab_size": SHARP_VOCAB,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 64,
    "max_position_embeddings": 512,
    "attention_dropout": 0.0,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": None,
}
FAMILIES: dict[str, dict] = {
    # local, local, global; the two layer types rotate with different bases
    "gemma3_text": {
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
        "query_pre_attn_scalar": 8,
    },
    "gemma2": {"num_hidden_layers": 2, "rope_theta": 100.0, "query_pre_attn_scalar": 8},  # local, global
    "mistral": {"num_hidden_layers": 2, "rope_theta": 100.0},  # every layer local
    "cohere2": {  # local layers with RoPE, a global one without
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_theta": 100.0,
    },
}
ATTN = {"gemma2": "eager"}  # Gemma-2 soft-caps its scores on eager only
OPTIONS = {"plain": {}, "logn+zero_kv": {"scale": "logn", "train_length": 4, "zero_kv": True}}


def local_model(family: str, own_window: int, **options) -> torch.nn.Module:
    """A sharp tiny model of ``family`` whose local layers have a sliding window of ``own_window``, patched."""
    config = AutoConfig.for_model(family, **_COMMON, **FAMILIES[family], sliding_window=own_window)
    model = build(AutoModelForCausalLM, config, ATTN.get(family, "sdpa"))
    return hfa.patch(sharpen(model, None, embeddings=True), **options)


def rotates(attention) -> bool:
    """Cohere-2's global layers use no RoPE."""
    return not (type(attention).__name__.startswith("Cohere2") and attention.sliding_window is None)


def ids_of(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, SHARP_VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("regime", list(OWN_WINDOWS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_local_layers_stream_as_defined(family, regime, options):
    """Token by token = the re-rotating reference; chunks = token by token; each layer holds its geometry."""
    own = OWN_WINDOWS[regime]
    model = local_model(family, own, **OPTIONS[options])
    ids = ids_of(LENGTH)
    want = rerotated_stream_logits(model, ids, SINKS, WINDOW, rotates)
    cache = hfa.SinkCache(SINKS, WINDOW)
    with torch.no_grad():
        one = stream_logits(model, ids, cache, [1])[0]
        chunked = [
            stream_logits(model, ids, hfa.SinkCache(SINKS, WINDOW), c)[0] for c in ([7], [3, 1, 1, 12])
        ]
    torch.testing.assert_close(one, want, atol=ATOL, rtol=0)
    for got in chunked:
        torch.testing.assert_close(got, one, atol=ATOL, rtol=0)
    types = getattr(model.config, "layer_types", None) or ["sliding_attention"] * len(
        cache.layers
    )  # Mistral: every layer local
    for kind, layer in zip(types, cache.layers, strict=True):
        local = own if kind == "sliding_attention" else None
        geometry = layer_geometry(LayerGeometry(SINKS, WINDOW), local)
        assert layer.geometry == geometry
        assert layer.keys.shape[-2] <= geometry.capacity
        if local is not None and local <= WINDOW:  # the local layer keeps its own window, not the cache's
            assert layer.keys.shape[-2] <= local


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_local_window_changes_the_stream_only_where_it_is_narrower(family):
    """The same weights with a local window wider than the cache stream as if every layer were global; narrower,
    they stream differently (so the tests above see the local windows at all)."""
    ids = ids_of(LENGTH)
    streams = {}
    for own in (OWN_WINDOWS["inside"], OWN_WINDOWS["between"], OWN_WINDOWS["wider"], 4096):
        with torch.no_grad():
            streams[own] = stream_logits(local_model(family, own), ids, hfa.SinkCache(SINKS, WINDOW), [5])
    torch.testing.assert_close(streams[OWN_WINDOWS["wider"]], streams[4096], atol=ATOL, rtol=0)
    for own in (OWN_WINDOWS["inside"], OWN_WINDOWS["between"]):
        assert (streams[own] - streams[4096]).abs().max() > 100 * ATOL, own


@pytest.mark.parametrize("family", list(FAMILIES))
def test_without_eviction_local_layers_equal_the_models_own_forward(family):
    """While the cache holds every token, the stream is the model's own forward with its sliding masks, even
    though the local layers already evict (they keep only their own window)."""
    model = local_model(family, OWN_WINDOWS["inside"])
    ids = torch.cat([ids_of(30), ids_of(30, seed=2)])
    with torch.no_grad():
        want = model(ids).logits
        got = stream_logits(model, ids, hfa.SinkCache(4, 60), [11, 1, 1, 5, 12])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_beam_search_scores_its_own_beams_as_defined():
    """Beam search reorders every layer's cache (local ones hold fewer slots): each returned beam's score is its
    log-probability under the re-rotating reference."""
    model = local_model("gemma3_text", OWN_WINDOWS["inside"])
    prompt = ids_of(12)
    out = model.generate(
        prompt,
        past_key_values=hfa.SinkCache(SINKS, WINDOW),
        max_new_tokens=10,
        **BEAM_SEARCH,
    )
    for sequence, score in zip(out.sequences, out.sequences_scores, strict=True):
        logp = torch.log_softmax(rerotated_stream_logits(model, sequence[None], SINKS, WINDOW), -1)
        torch.testing.assert_close(score, logp[11:-1].gather(1, sequence[12:, None]).sum(), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "own, want",
    [
        (None, LayerGeometry(4, 1020)),
        (4096, LayerGeometry(4, 1020)),
        (1024, LayerGeometry(4, 1020)),
        (512, LayerGeometry(0, 512)),
        (1020, LayerGeometry(0, 1020)),
        (1022, LayerGeometry(4, 1020, local=1022)),
    ],
)
def test_layer_geometry(own, want):
    assert layer_geometry(LayerGeometry(4, 1020), own) == want


@pytest.mark.parametrize("regime", ["inside", "between"])
def test_left_padded_batch_over_two_turns_as_defined(regime):
    """Each row of a left-padded batch, over two generate() calls sharing the cache, gets the logits of its own
    stream by the definition: local layers count each row's own real tokens."""
    model = local_model("gemma3_text", OWN_WINDOWS[regime])
    lengths = [9, 20]
    prompt, mask = torch.zeros(2, 20, dtype=torch.long), torch.zeros(2, 20, dtype=torch.long)
    for row, length in enumerate(lengths):
        prompt[row, 20 - length :] = ids_of(length, seed=row + 5)[0]
        mask[row, 20 - length :] = 1
    cache = hfa.SinkCache(SINKS, WINDOW)
    first = model.generate(prompt, attention_mask=mask, past_key_values=cache, max_new_tokens=7, **GREEDY)
    turn = torch.cat([first.sequences, ids_of(5, seed=9).expand(2, -1)], dim=1)
    turn_mask = torch.cat([mask, torch.ones(2, turn.shape[1] - 20, dtype=torch.long)], dim=1)
    second = model.generate(turn, attention_mask=turn_mask, past_key_values=cache, max_new_tokens=6, **GREEDY)
    for row, length in enumerate(lengths):
        stream = second.sequences[row][turn_mask[row].bool().tolist() + [True] * 6]
        want = rerotated_stream_logits(model, stream[None], SINKS, WINDOW)
        got_first = torch.stack(first.logits, dim=1)[row]
        got_second = torch.stack(second.logits, dim=1)[row]
        turn_two = length + 7 + 5
        torch.testing.assert_close(got_first, want[length - 1 : length + 6], atol=ATOL, rtol=0)
        torch.testing.assert_close(got_second, want[turn_two - 1 : turn_two + 5], atol=ATOL, rtol=0)
