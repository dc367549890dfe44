"""StreamingLLM over a million tokens (slow): exact against a hand-written reference past position 2**20.

The model has one layer, so the keys and values a token leaves in the cache depend on its id alone; the
reference can then compute any position of the stream from scratch (the first S tokens and the last W, at
positions 0..n-1, the query last), with RoPE in float64.

    python -m pytest -q -m slow tests/streaming/test_long_streams.py
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import SHARP_VOCAB, sharp_model

import hf_attnscale as hfa

pytestmark = pytest.mark.slow
SINKS, WINDOW = 4, 60
PAST = 2**20


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE in float64; x (..., n, D) with positions (n,)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angle = positions.double()[:, None] * inv_freq
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., : dim // 2].double(), x[..., dim // 2 :].double()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).float()


def _rms(x, norm):
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


@torch.no_grad()
def _reference_nll(model, ids: torch.Tensor, positions: range) -> torch.Tensor:
    """NLL of ids[t + 1] for t in ``positions`` (all past S + W), each position computed from scratch."""
    layer, attn = model.model.layers[0], model.model.layers[0].self_attn
    theta = model.config.rope_parameters["rope_theta"]
    heads, kv_heads, dim = model.config.num_attention_heads, model.config.num_key_value_heads, attn.head_dim
    slots = torch.arange(SINKS + WINDOW)
    out = []
    for start in range(positions.start, positions.stop, 4096):
        t = torch.arange(start, min(start + 4096, positions.stop))
        visible = torch.cat(
            [torch.arange(SINKS).expand(len(t), SINKS), t[:, None] - WINDOW + 1 + torch.arange(WINDOW)], 1
        )
        h = _rms(model.model.embed_tokens(ids[visible]), layer.input_layernorm)  # (T, S+W, hidden)
        q = attn.q_proj(h[:, -1]).view(len(t), heads, 1, dim)
        k = attn.k_proj(h).view(len(t), SINKS + WINDOW, kv_heads, dim).transpose(1, 2)
        v = attn.v_proj(h).view(len(t), SINKS + WINDOW, kv_heads, dim).transpose(1, 2)
        q = _rope(q, slots[-1:], theta)
        k = _rope(k, slots, theta).repeat_interleave(heads // kv_heads, 1)
        probs = torch.softmax(q @ k.transpose(-1, -2) * attn.scaling, -1)
        mixed = (probs @ v.repeat_interleave(heads // kv_heads, 1)).transpose(1, 2).reshape(len(t), -1)
        x = model.model.embed_tokens(ids[t]) + attn.o_proj(mixed)
        x = x + layer.mlp(_rms(x, layer.post_attention_layernorm))
        logits = model.lm_head(_rms(x, model.model.norm))
        out.append(F.cross_entropy(logits.float(), ids[t + 1], reduction="none"))
    return torch.cat(out)


def test_a_million_tokens_stay_exact_and_bounded():
    torch.manual_seed(0)
    model = hfa.patch(sharp_model("llama", num_hidden_layers=1))
    ids = torch.randint(2, SHARP_VOCAB, (PAST + 50_002,), generator=torch.Generator().manual_seed(3))
    cache = hfa.SinkCache(SINKS, WINDOW)
    streamed = hfa.perplexity(model, ids, cache=cache, chunk_size=4096, progress=False).nll
    assert all(layer.keys.shape[-2] <= SINKS + WINDOW for layer in cache.layers)  # memory stays flat
    window = range(PAST - 50_000, PAST + 50_000)  # 100k positions across 2**20
    reference = _reference_nll(model, ids, window)
    difference = (streamed[window.start : window.stop] - reference).abs()
    assert float(difference.max()) < 1e-4, float(difference.max())
    assert math.isfinite(float(streamed.mean()))


def test_token_by_token_past_two_to_the_twentieth():
    """Decoding one token at a time from position 2**20 - 5000 (rebases included) equals the reference."""
    torch.manual_seed(0)
    model = hfa.patch(sharp_model("llama", num_hidden_layers=1))
    ids = torch.randint(2, SHARP_VOCAB, (PAST + 5_002,), generator=torch.Generator().manual_seed(4))
    cache = hfa.SinkCache(SINKS, WINDOW)
    first = PAST - 5_000
    nll = []
    with torch.no_grad():
        for start in range(0, first, 8192):  # prefill in chunks up to the start of the comparison
            model(input_ids=ids[None, start : min(start + 8192, first)], past_key_values=cache)
        for t in range(first, PAST + 5_000):
            logits = model(input_ids=ids[None, t : t + 1], past_key_values=cache).logits[0, -1]
            nll.append(F.cross_entropy(logits[None].float(), ids[t + 1 : t + 2]))
    reference = _reference_nll(model, ids, range(first, PAST + 5_000))
    assert float((torch.stack(nll) - reference).abs().max()) < 1e-4


def test_token_by_token_equals_chunked_over_100k_tokens():
    torch.manual_seed(0)
    model = hfa.patch(sharp_model("llama", num_hidden_layers=2))
    ids = torch.randint(2, SHARP_VOCAB, (100_001,), generator=torch.Generator().manual_seed(5))
    chunked = hfa.perplexity(model, ids, cache=hfa.SinkCache(SINKS, WINDOW), chunk_size=2048, progress=False)
    stepped = hfa.perplexity(model, ids, cache=hfa.SinkCache(SINKS, WINDOW), chunk_size=1, progress=False)
    assert float((chunked.nll - stepped.nll).abs().max()) < 1e-4
