"""StreamingLLM on every supported RoPE decoder (tests/model_zoo.py), with sharp weights so that every position
error shows: without eviction the stream equals the model's own dense forward; with eviction, chunked equals
token by token, and generate() follows the greedy tokens of the token-by-token stream. A decoder streaming
cannot serve must say so (and then every family whose attention takes RoPE embeddings is listed here).
"""

from __future__ import annotations

import pytest
import torch
from model_zoo import EAGER_ONLY, family_types, head_of, zoo_model
from transformers import AutoConfig

import hf_attnscale as hfa
from hf_attnscale.core.install.families import attention_modules, takes_position_embeddings
from hf_attnscale.streaming.spec import check_streaming_model

DECODERS = [t for t in family_types() if head_of(t) == "causal"]


_IDS = torch.randint(3, 120, (1, 40), generator=torch.Generator().manual_seed(2))


def _streaming_decoder(model_type: str, **overrides):
    """The tiny ``model_type`` (config ``overrides``), patched; the test skips, saying why, unless it is a RoPE
    decoder that a SinkCache streams (a refusal must name SinkCache)."""
    model = zoo_model(model_type, "eager" if model_type in EAGER_ONLY else "sdpa", **overrides)
    if not all(takes_position_embeddings(m) for m in attention_modules(model)):
        pytest.skip("not a RoPE decoder: its attention takes no position_embeddings")
    model = hfa.patch(model)
    try:
        check_streaming_model(model)
        _stream(model, _IDS[:, :4], hfa.SinkCache(2, 6), 4)
    except ValueError as err:  # refused: it must say why
        assert "SinkCache" in str(err), err
        pytest.skip(f"streaming refused: {err}")
    return model


def _stream(model, ids, cache, chunk: int) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            out.append(model(input_ids=ids[:, start : start + chunk], past_key_values=cache).logits)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("model_type", DECODERS)
def test_streaming_every_rope_decoder(model_type):
    model = _streaming_decoder(model_type)
    ids = _IDS
    model.generation_config.eos_token_id = None  # generate() must not stop early at a random EOS
    # No eviction: the stream (prefill, then single tokens) is the model's own dense forward.
    with torch.no_grad():
        dense = model(input_ids=ids[:, :24]).logits
    streamed = torch.cat(
        [_stream(model, ids[:, :16], hfa.SinkCache(4, 60), 16)[:, :16], _stream_continue(model, ids[:, :24])],
        1,
    )
    torch.testing.assert_close(streamed, dense, atol=1e-4, rtol=1e-4)
    # Eviction: chunks of 7 equal token by token, to 1e-4 nats per token.
    chunked = hfa.perplexity(model, ids[0], cache=hfa.SinkCache(2, 6), chunk_size=7, progress=False).nll
    stepped = hfa.perplexity(model, ids[0], cache=hfa.SinkCache(2, 6), chunk_size=1, progress=False).nll
    assert float((chunked - stepped).abs().max()) < 1e-4
    # generate() with eviction follows the token-by-token stream's greedy tokens.
    prompt = ids[:, :10]
    generated = model.generate(
        prompt, past_key_values=hfa.SinkCache(2, 6), max_new_tokens=12, do_sample=False, pad_token_id=0
    )[0, 10:]
    cache, tokens, logits = hfa.SinkCache(2, 6), prompt, None
    with torch.no_grad():
        for _ in range(12):
            logits = model(
                input_ids=tokens if logits is None else tokens[:, -1:], past_key_values=cache
            ).logits
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, tokens[0, 10:]), (generated, tokens[0, 10:])


def _stream_continue(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of ids[16:] fed one token at a time after a 16-token prefill (no eviction: cache of 64)."""
    cache = hfa.SinkCache(4, 60)
    with torch.no_grad():
        model(input_ids=ids[:, :16], past_key_values=cache)
        return torch.cat(
            [model(input_ids=ids[:, t : t + 1], past_key_values=cache).logits for t in range(16, 24)], 1
        )


LOCAL_WINDOW = 3


def _has_sliding_window(model_type: str) -> bool:
    return bool(AutoConfig.for_model(model_type).to_dict().get("sliding_window"))


@pytest.mark.parametrize("model_type", [t for t in DECODERS if _has_sliding_window(t)])
def test_streaming_every_decoder_with_local_layers(model_type):
    """Every decoder whose config has a sliding window, narrowed to 3: while a SinkCache holds every token the
    stream is the model's own forward (its local layers keep only their own window and must read it as the model
    does; a family whose layers are all global, as dots1's default, must not get a window from the config), and
    with eviction chunks equal token by token."""
    model = _streaming_decoder(model_type, sliding_window=LOCAL_WINDOW)
    ids = _IDS
    with torch.no_grad():
        dense = model(input_ids=ids[:, :24]).logits
    streamed = _stream(model, ids[:, :24], hfa.SinkCache(4, 60), 5)
    torch.testing.assert_close(streamed, dense, atol=1e-4, rtol=1e-4)
    chunked = hfa.perplexity(model, ids[0], cache=hfa.SinkCache(2, 6), chunk_size=7, progress=False).nll
    stepped = hfa.perplexity(model, ids[0], cache=hfa.SinkCache(2, 6), chunk_size=1, progress=False).nll
    assert float((chunked - stepped).abs().max()) < 1e-4


def test_a_rope_encoder_is_refused_as_an_encoder():
    """RoFormer's attention says ``is_decoder``, not ``is_causal``: still an encoder, refused as one."""
    model = hfa.patch(zoo_model("roformer", "eager"))
    with pytest.raises(ValueError, match=r"SinkCache needs a RoPE decoder; RoFormer\w* .* is an encoder\.$"):
        check_streaming_model(model)
