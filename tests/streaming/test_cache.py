"""SinkCache (StreamingLLM with pos-shift) against hand-written references that share no code with it.

Reference 1 (`_step_reference`): one attention step written from the definition: the sinks plus the last
``window`` tokens, rotated by a hand-written RoPE at positions ``0..n-1``, softmax, output projection.
Reference 2 (`_manual_stream_logits`): a whole Llama, token by token, with Python lists as its KV cache.
The tiny models get large random weights so that attention is sharp and every position error shows.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import BEAM_SEARCH, DECODERS, GREEDY, SHARP_VOCAB, sharp_model, stream_logits, tiny_config
from transformers import AutoModelForCausalLM, DynamicCache

import hf_attnscale as hfa


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    """Rotate-half RoPE written from the formula; x (..., n, D), positions (n,)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angle = positions.double()[:, None] * inv_freq
    cos, sin = angle.cos().float(), angle.sin().float()
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def _pre_rope_qkv(attn, h: torch.Tensor):
    """Un-rotated q (B,H,T,D), k, v (B,Hkv,T,D) of an attention module, family by family."""
    batch, length, _ = h.shape
    d = attn.head_dim
    if hasattr(attn, "qkv_proj"):  # phi3
        qkv = attn.qkv_proj(h)
        heads = attn.config.num_attention_heads * d
        kv = attn.config.num_key_value_heads * d
        q, k, v = qkv[..., :heads], qkv[..., heads : heads + kv], qkv[..., heads + kv :]
    else:
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    q, k, v = (t.view(batch, length, -1, d) for t in (q, k, v))
    if hasattr(attn, "q_norm"):  # qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _rotary_dim(config) -> int:
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(d * getattr(config, "partial_rotary_factor", 1.0))


def _step_reference(attn, h, t, sinks, window, *, logn_length=None, zero_kv=False):
    """Output of the attention module for token t, computed over its sinks and window at positions 0..n-1."""
    config = attn.config
    theta = config.rope_parameters["rope_theta"]
    q, k, v = _pre_rope_qkv(attn, h[:, : t + 1])
    visible = sorted(set(range(min(sinks, t + 1))) | set(range(max(0, t - window + 1), t + 1)))
    n = len(visible)
    keys = _rope(k[:, :, visible], torch.arange(n), theta, _rotary_dim(config))
    query = _rope(q[:, :, t : t + 1], torch.tensor([n - 1]), theta, _rotary_dim(config))
    groups = q.shape[1] // k.shape[1]
    keys = keys.repeat_interleave(groups, 1)
    values = v[:, :, visible].repeat_interleave(groups, 1)
    scores = query @ keys.transpose(-1, -2) * attn.scaling
    if logn_length is not None:
        scores = scores * max(1.0, math.log(n) / math.log(logn_length))
    if zero_kv:  # a zero key (logit 0) with a zero value
        scores = torch.cat([scores, torch.zeros_like(scores[..., :1])], dim=-1)
        values = torch.cat([values, torch.zeros_like(values[:, :, :1])], dim=2)
    out = torch.softmax(scores, dim=-1) @ values  # (B, H, 1, D)
    return attn.o_proj(out.transpose(1, 2).reshape(h.shape[0], 1, -1))


def _rms(x, norm):
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def _manual_stream_logits(
    model, ids: torch.Tensor, sinks: int, window: int, *, evict_after: bool = False
) -> torch.Tensor:
    """A Llama streamed token by token with list caches of pre-RoPE keys: logits (T, V) of one row.

    By default the cache holds ``sinks + window`` tokens, the new one included. With ``evict_after`` it is
    mit-han-lab's StartRecentKVCache(start_size=sinks, recent_size=window) instead: the cache holds at most
    ``sinks + window`` earlier tokens, the new token is added for its own step, and eviction comes after.
    """
    config = model.config
    theta = config.rope_parameters["rope_theta"]
    layers = model.model.layers
    caches = [([], []) for _ in layers]
    logits = []
    for t in range(ids.shape[0]):
        x = model.model.embed_tokens(ids[t : t + 1])[None]  # (1, 1, hidden)
        for layer, (keys, values) in zip(layers, caches, strict=True):
            attn = layer.self_attn
            q, k, v = _pre_rope_qkv(attn, _rms(x, layer.input_layernorm))
            keys.append(k)
            values.append(v)
            if not evict_after and len(keys) > sinks + window:  # evict the oldest token that is not a sink
                del keys[sinks], values[sinks]
            n = len(keys)
            rotated = _rope(torch.cat(keys, 2), torch.arange(n), theta, attn.head_dim)
            query = _rope(q, torch.tensor([n - 1]), theta, attn.head_dim)
            groups = q.shape[1] // k.shape[1]
            scores = query @ rotated.repeat_interleave(groups, 1).transpose(-1, -2) * attn.scaling
            out = torch.softmax(scores, -1) @ torch.cat(values, 2).repeat_interleave(groups, 1)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(1, 1, -1))
            x = x + layer.mlp(_rms(x, layer.post_attention_layernorm))
            if evict_after and len(keys) > sinks + window:
                del keys[sinks], values[sinks]
        logits.append(model.lm_head(_rms(x, model.model.norm))[0, 0])
    return torch.stack(logits)


# ---------------------------------------------------------------------------------------------------------
# Arguments and errors


@pytest.mark.parametrize(
    ("sinks", "window"), [(-1, 8), (0, 0), (2, -3), (True, 8), (2, 1.5), (None, 8), (2, "8")]
)
def test_bad_arguments_raise(sinks, window):
    with pytest.raises(ValueError, match=r"sink_tokens|window"):
        hfa.SinkCache(sinks, window)


def test_unpatched_model_raises():
    model = sharp_model()
    ids = torch.randint(2, SHARP_VOCAB, (1, 6))
    with pytest.raises(ValueError, match=r"hfa\.patch"):
        model(ids, past_key_values=hfa.SinkCache(2, 4))
    hfa.patch(model)
    model(ids, past_key_values=hfa.SinkCache(2, 4))
    hfa.unpatch(model)
    with pytest.raises(ValueError, match=r"hfa\.patch"):
        model(ids, past_key_values=hfa.SinkCache(2, 4))


def test_non_rope_model_raises():
    # A BERT used as a decoder does call cache.update(); it has no RoPE, so it must refuse.
    config = tiny_config("bert", is_decoder=True)
    model = hfa.patch(AutoModelForCausalLM.from_config(config).eval())
    with pytest.raises(ValueError, match="RoPE"):
        model(torch.randint(2, SHARP_VOCAB, (1, 6)), past_key_values=hfa.SinkCache(2, 4), use_cache=True)


# ---------------------------------------------------------------------------------------------------------
# The attention step against the definition


@pytest.mark.parametrize(
    "options", [{}, {"scale": "logn", "train_length": 4, "zero_kv": True}], ids=["plain", "logn+zero_kv"]
)
@pytest.mark.parametrize("model_type", list(DECODERS))
def test_attention_step_matches_hand_written_reference(model_type, options):
    """Every decoding step: the module's output equals attention over sinks + window at positions 0..S+W-1."""
    sinks, window, length = 2, 5, 16
    model = hfa.patch(sharp_model(model_type), **options)
    attn = model.model.layers[0].self_attn
    h = torch.randn(1, length, model.config.hidden_size)
    dummy = model.model.rotary_emb(h, torch.arange(length)[None])  # replaced by the streaming forward
    cache = hfa.SinkCache(sinks, window)
    with torch.no_grad():
        for t in range(length):
            out = attn(
                hidden_states=h[:, t : t + 1],
                position_embeddings=tuple(x[:, t : t + 1] for x in dummy),
                attention_mask=None,
                past_key_values=cache,
            )[0]
            ref = _step_reference(
                attn, h, t, sinks, window, logn_length=options.get("train_length"), zero_kv=bool(options)
            )
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
            assert cache.layers[0].keys.shape[-2] <= sinks + window


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("chunks", [[1], [7], [3, 1, 1, 12]], ids=["token", "chunk7", "mixed"])
def test_model_stream_matches_manual_reference(sinks, chunks):
    """The whole model, token by token or in chunks, equals a hand-written streaming Llama."""
    model = hfa.patch(sharp_model("llama"))
    ids = torch.randint(2, SHARP_VOCAB, (1, 60))
    with torch.no_grad():
        ref = _manual_stream_logits(model, ids[0], sinks, 6)
        out = stream_logits(model, ids, hfa.SinkCache(sinks, 6), chunks)[0]
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("chunks", [[1], [9], [2, 1, 13]], ids=["token", "chunk9", "mixed"])
def test_anchor_semantics_from_start_recent(chunks):
    """StreamingLLM's own terms: each query sees start_size + recent_size earlier tokens, and itself."""
    start, recent = 2, 5
    model = hfa.patch(sharp_model("llama"))
    ids = torch.randint(2, SHARP_VOCAB, (1, 50))
    cache = hfa.SinkCache.from_start_recent(start, recent)
    assert (cache.sink_tokens, cache.window, cache.capacity) == (2, 6, 8)
    with torch.no_grad():
        ref = _manual_stream_logits(model, ids[0], start, recent, evict_after=True)
        out = stream_logits(model, ids, cache, chunks)[0]
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    with torch.no_grad():  # the other reading (the query inside the window) differs once eviction starts
        other = _manual_stream_logits(model, ids[0], start, recent)
    assert (other[start + recent + 1 :] - ref[start + recent + 1 :]).abs().max() > 1e-2


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", list(DECODERS))
def test_without_eviction_equals_the_plain_model(model_type, attn):
    """While everything fits, streaming changes nothing: prefill plus decode equal one dense forward."""
    model = sharp_model(model_type, attn)
    ids = torch.randint(2, SHARP_VOCAB, (2, 30))
    with torch.no_grad():
        ref = model(ids).logits
        hfa.patch(model)
        out = stream_logits(model, ids, hfa.SinkCache(4, 60), [11, 1, 1, 5])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_memory_is_bounded():
    """The cache's tensors never hold more than sink_tokens + window tokens per layer, whatever the stream."""
    model = hfa.patch(sharp_model())
    cache = hfa.SinkCache(3, 7)
    ids = torch.randint(2, SHARP_VOCAB, (1, 200))
    sizes = [1, 5, 1, 1, 13, 2, 40, 1]
    start, i = 0, 0
    with torch.no_grad():
        while start < ids.shape[1]:
            model(input_ids=ids[:, start : start + sizes[i % len(sizes)]], past_key_values=cache)
            start, i = start + sizes[i % len(sizes)], i + 1
            for layer in cache.layers:
                assert layer.keys.shape[-2] <= cache.capacity and layer.values.shape[-2] <= cache.capacity
                assert int((layer.token_index >= 0).sum()) <= cache.capacity
    assert cache.get_seq_length() == 200


@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 3}], ids=["global", "local layers"])
def test_a_saved_stream_continues_exactly(tmp_path, overrides):
    """A stream saved mid-way (torch.save of its state_dict, read back with weights_only=True) continues in a fresh
    cache bitwise as the uninterrupted one, local layers (Mistral's window of 3: they hold 3 keys) included."""
    model = hfa.patch(sharp_model("mistral" if overrides else "llama", **overrides))
    ids = torch.randint(2, SHARP_VOCAB, (2, 50), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole = stream_logits(model, ids, hfa.SinkCache(2, 6), [7])
        cache = hfa.SinkCache(2, 6)
        first = stream_logits(model, ids[:, :21], cache, [7])
        torch.save(cache.state_dict(), tmp_path / "stream.pt")
        resumed = hfa.SinkCache(2, 6)
        resumed.load_state_dict(torch.load(tmp_path / "stream.pt", weights_only=True))
        rest = stream_logits(model, ids[:, 21:], resumed, [7])
    assert torch.equal(torch.cat([first, rest], dim=1), whole)
    assert resumed.get_seq_length() == 50
    with pytest.raises(ValueError, match=r"SinkCache\(2, 6\).*same size"):
        hfa.SinkCache(4, 6).load_state_dict(cache.state_dict())


def test_copies_reset_and_repr():
    model = hfa.patch(sharp_model())
    ids = torch.randint(2, SHARP_VOCAB, (1, 40))
    cache = hfa.SinkCache(2, 6)
    with torch.no_grad():
        first = stream_logits(model, ids, cache, [9])
        cache.reset()
        assert cache.get_seq_length() == 0
        again = stream_logits(model, ids, cache, [9])
        twin = copy.deepcopy(model)  # the copy streams with its own rotary module
        other = stream_logits(twin, ids, hfa.SinkCache(2, 6), [9])
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    torch.testing.assert_close(other, first, atol=1e-6, rtol=0)
    assert "sink_tokens=2" in repr(cache)


# ---------------------------------------------------------------------------------------------------------
# generate()


def _generated_logits(out) -> torch.Tensor:
    return torch.stack(out.logits, dim=1)  # (B, new, V)


def test_generate_fits_like_dynamic_cache():
    """Greedy, sampling and beam search equal DynamicCache while nothing is evicted."""
    model = hfa.patch(sharp_model())
    ids = torch.randint(2, SHARP_VOCAB, (1, 9))
    a = model.generate(ids, past_key_values=hfa.SinkCache(4, 40), max_new_tokens=15, **GREEDY)
    b = model.generate(ids, past_key_values=DynamicCache(config=model.config), max_new_tokens=15, **GREEDY)
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(_generated_logits(a), _generated_logits(b), atol=1e-5, rtol=0)
    sampled = []
    for cache in (hfa.SinkCache(4, 40), DynamicCache(config=model.config)):
        torch.manual_seed(3)
        sampled.append(
            model.generate(
                ids, past_key_values=cache, max_new_tokens=15, do_sample=True, top_k=0, pad_token_id=0
            )
        )
    assert torch.equal(*sampled)
    beams = [
        model.generate(
            ids, past_key_values=cache, max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0
        )
        for cache in (hfa.SinkCache(4, 40), DynamicCache(config=model.config))
    ]
    assert torch.equal(*beams)


def test_generate_long_prompt_matches_reference():
    """A prompt longer than the window: the sinks stay the real first tokens, logits equal the reference."""
    model = hfa.patch(sharp_model())
    sinks, window = 2, 6
    ids = torch.randint(2, SHARP_VOCAB, (1, 25))
    cache = hfa.SinkCache(sinks, window)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=20, **GREEDY)
    with torch.no_grad():
        ref = _manual_stream_logits(model, out.sequences[0], sinks, window)
    torch.testing.assert_close(_generated_logits(out)[0], ref[24:-1], atol=1e-4, rtol=0)
    assert all(layer.keys.shape[-2] <= sinks + window for layer in cache.layers)
    assert cache.get_seq_length() == out.sequences.shape[1] - 1


def test_generate_batch_with_left_padding_and_multi_turn():
    """Each row of a left-padded batch, over two generate calls sharing the cache, equals its own stream."""
    model = hfa.patch(sharp_model())
    sinks, window = 2, 6
    lengths = [9, 20]
    prompt = torch.zeros(2, 20, dtype=torch.long)
    mask = torch.zeros(2, 20, dtype=torch.long)
    for row, length in enumerate(lengths):
        prompt[row, 20 - length :] = torch.randint(2, SHARP_VOCAB, (length,))
        mask[row, 20 - length :] = 1
    cache = hfa.SinkCache(sinks, window)
    first = model.generate(prompt, attention_mask=mask, past_key_values=cache, max_new_tokens=7, **GREEDY)
    user = torch.randint(2, SHARP_VOCAB, (2, 5))
    turn = torch.cat([first.sequences, user], dim=1)
    turn_mask = torch.cat([mask, torch.ones(2, turn.shape[1] - 20, dtype=torch.long)], dim=1)
    second = model.generate(turn, attention_mask=turn_mask, past_key_values=cache, max_new_tokens=6, **GREEDY)
    for row in range(2):
        stream = second.sequences[row][turn_mask[row].bool().tolist() + [True] * 6]
        with torch.no_grad():
            ref = _manual_stream_logits(model, stream, sinks, window)
        n1, n2 = lengths[row], lengths[row] + 7 + 5
        torch.testing.assert_close(_generated_logits(first)[row], ref[n1 - 1 : n1 + 6], atol=1e-4, rtol=0)
        torch.testing.assert_close(_generated_logits(second)[row], ref[n2 - 1 : n2 + 5], atol=1e-4, rtol=0)


def test_beam_search_with_eviction_scores_its_own_beams():
    """Beam search reorders the cache: each returned beam's score equals its log-probability, streamed."""
    model = hfa.patch(sharp_model())
    sinks, window = 2, 6
    ids = torch.randint(2, SHARP_VOCAB, (1, 12))
    cache = hfa.SinkCache(sinks, window)
    out = model.generate(
        ids,
        past_key_values=cache,
        max_new_tokens=10,
        **BEAM_SEARCH,
    )
    for seq, score in zip(out.sequences, out.sequences_scores, strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(_manual_stream_logits(model, seq, sinks, window), -1)
        expected = logp[11:-1].gather(1, seq[12:, None]).sum()
        torch.testing.assert_close(score, expected, atol=1e-4, rtol=0)
    assert all(layer.keys.shape[-2] <= sinks + window for layer in cache.layers)


def test_assisted_decoding_raises_clearly():
    model = hfa.patch(sharp_model())
    ids = torch.randint(2, SHARP_VOCAB, (1, 8))
    with pytest.raises(ValueError, match="be cropped"):  # ours; transformers 5.24 checks is_croppable first
        model.generate(
            ids,
            past_key_values=hfa.SinkCache(2, 6),
            assistant_model=copy.deepcopy(model),
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=0,
        )


def test_long_prompt_is_processed_in_pieces(monkeypatch):
    """A call longer than PIECE_TOKENS runs each layer in pieces: same logits, same cache, as one piece."""
    from hf_attnscale.streaming import step as streaming

    model = hfa.patch(sharp_model())
    ids = torch.randint(2, SHARP_VOCAB, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[0, :11] = 0
    results = []
    for piece in (1024, 7):
        monkeypatch.setattr(streaming, "PIECE_TOKENS", piece)
        cache = hfa.SinkCache(2, 6)
        with torch.no_grad():
            first = model(ids, attention_mask=mask, past_key_values=cache).logits
            step_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
            step = model(ids[:, -1:], attention_mask=step_mask, past_key_values=cache).logits
        results.append((first, step))
    torch.testing.assert_close(results[1][0][mask.bool()], results[0][0][mask.bool()], atol=1e-5, rtol=0)
    torch.testing.assert_close(results[1][1], results[0][1], atol=1e-5, rtol=0)


def test_mask_of_new_tokens_only_raises():
    """transformers' convention: with a cache, the 2D mask covers past + new tokens; a short one is refused."""
    model = hfa.patch(sharp_model())
    cache = hfa.SinkCache(2, 6)
    ids = torch.randint(2, SHARP_VOCAB, (1, 12))
    model(ids[:, :8], attention_mask=torch.ones(1, 8, dtype=torch.long), past_key_values=cache)
    with pytest.raises(ValueError, match="past \\+ new"):
        model(ids[:, 8:], attention_mask=torch.ones(1, 4, dtype=torch.long), past_key_values=cache)


def test_backend_without_dense_masks_raises():
    """flex (and flash) cannot take the band mask; the error says which backends stream."""
    model = hfa.patch(sharp_model(attn="flex_attention"))
    with pytest.raises(ValueError, match="eager or sdpa"):
        model(torch.randint(2, SHARP_VOCAB, (1, 6)), past_key_values=hfa.SinkCache(2, 4))
    with pytest.raises(ValueError, match="eager or sdpa"):
        hfa.perplexity(model, torch.randint(2, SHARP_VOCAB, (20,)), cache=hfa.SinkCache(2, 4), progress=False)


def test_streaming_then_unpatch_leaves_nothing_on_the_modules():
    """What streaming finds about a layer (whether it rotates) is kept by streaming, not written onto the modules
    that core owns: after a stream and unpatch, every module's attributes are the pristine model's."""
    model = sharp_model()
    before = {name: set(vars(module)) for name, module in model.named_modules()}
    hfa.patch(model)
    ids = torch.randint(0, SHARP_VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stream_logits(model, ids, hfa.SinkCache(2, 6), [5, 1, 3])
    hfa.unpatch(model)
    after = {name: set(vars(module)) for name, module in model.named_modules()}
    assert after == before


def test_streaming_writes_nothing_onto_the_patched_modules():
    """What a stream finds about its model (each layer's rotation, RoPE table, geometry) stays in its cache: the
    patched modules' attributes, children and buffers are the same before and after streams of every shape."""
    model = hfa.patch(sharp_model())

    def attributes() -> dict:
        return {n: (set(vars(m)), set(m._modules), set(m._buffers)) for n, m in model.named_modules()}

    before = attributes()
    ids = torch.randint(0, SHARP_VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        stream_logits(model, ids, hfa.SinkCache(2, 6), [7, 1, 1, 13])
    model.generate(ids[:, :5], past_key_values=hfa.SinkCache(2, 6), max_new_tokens=12, **GREEDY)
    assert attributes() == before
