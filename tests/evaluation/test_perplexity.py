"""hfa.perplexity: the fast chunked stream equals the token-by-token stream; baselines equal plain loops."""

from __future__ import annotations

import importlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import DECODERS, SHARP_VOCAB, sharp_model, stream_logits, tiny_model
from transformers import DynamicCache

import hf_attnscale as hfa


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, reduction="none")


OPTIONS = {
    "plain": {},
    "logn+zero_kv": {"scale": "logn", "train_length": 4, "zero_kv": True},
    "sink_logit": {"sink_logit": 1.5},
}


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("model_type", list(DECODERS))
def test_chunked_stream_equals_token_by_token(model_type, options):
    """Over 15 windows (sinks 2, window 8, 120 tokens), chunks of any size give the token-by-token NLL."""
    model = hfa.patch(sharp_model(model_type), **OPTIONS[options])
    ids = torch.randint(2, SHARP_VOCAB, (120,))
    reference = hfa.perplexity(model, ids, cache=hfa.SinkCache(2, 8), chunk_size=1, progress=False)
    assert reference.nll.shape == (119,)
    for chunk in (5, 8, 37, 200):
        fast = hfa.perplexity(model, ids, cache=hfa.SinkCache(2, 8), chunk_size=chunk, progress=False)
        assert (fast.nll - reference.nll).abs().max().item() <= 1e-4, chunk
    # The stream did evict: it differs from the dense model, which sees everything.
    dense = hfa.perplexity(model, ids, chunk_size=64, progress=False)
    assert (dense.nll - reference.nll).abs().max().item() > 1e-2


def test_eager_and_window_only_streams_are_exact():
    model = hfa.patch(sharp_model("llama", "eager"), scale="logn", train_length=4)
    ids = torch.randint(2, SHARP_VOCAB, (90,))
    for sinks in (0, 3):
        ref = hfa.perplexity(model, ids, cache=hfa.SinkCache(sinks, 6), chunk_size=1, progress=False)
        fast = hfa.perplexity(model, ids, cache=hfa.SinkCache(sinks, 6), chunk_size=16, progress=False)
        assert (fast.nll - ref.nll).abs().max().item() <= 1e-4


def test_every_method_runs_without_deprecation_warnings():
    """The cache goes in under the name the installed transformers takes (``cache`` from 5.24 on, where
    ``past_key_values`` warns): the user sees no FutureWarning from the package's own calls."""
    model = hfa.patch(sharp_model("llama"))
    ids = torch.randint(2, SHARP_VOCAB, (30,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        hfa.perplexity(model, ids, cache=hfa.SinkCache(2, 6), chunk_size=8, progress=False)
        hfa.perplexity(model, ids, chunk_size=8, progress=False)
        hfa.perplexity(model, ids, method="recompute", window=8, progress=False)


def test_dense_and_recompute_match_plain_loops():
    model = hfa.patch(sharp_model("llama"))
    ids = torch.randint(2, SHARP_VOCAB, (40,))
    with torch.no_grad():
        full = _nll(model(ids[None]).logits[0, :-1], ids[1:])
        window = 7
        loop = torch.stack(
            [  # token t+1 predicted from the window ending at token t, positions 0..window-1
                _nll(model(ids[None, max(0, t - window + 1) : t + 1]).logits[0, -1:], ids[t + 1 : t + 2])[0]
                for t in range(39)
            ]
        )
    dense = hfa.perplexity(model, ids, chunk_size=9, progress=False)
    torch.testing.assert_close(dense.nll, full, atol=1e-5, rtol=0)
    recompute = hfa.perplexity(model, ids, method="recompute", window=window, progress=False)
    torch.testing.assert_close(recompute.nll, loop, atol=1e-5, rtol=0)
    limited = hfa.perplexity(model, ids, max_length=25, progress=False)
    torch.testing.assert_close(limited.nll, full[:24], atol=1e-5, rtol=0)


def test_greedy_flags_are_the_argmax_of_the_logits_that_predicted_each_token(monkeypatch):
    """``PerplexityResult.greedy`` (lm-eval's is_greedy, token by token), every method, against plain calls."""
    model = hfa.patch(sharp_model("llama"))
    ids = torch.randint(2, SHARP_VOCAB, (20,))
    window = 7
    with torch.no_grad():
        for _ in range(20):  # then 20 tokens decoded greedily: the flags take both values
            ids = torch.cat([ids, model(ids[None]).logits[0, -1].argmax().view(1)])
        dense = model(ids[None]).logits[0, :-1].argmax(-1) == ids[1:]
        streamed = stream_logits(model, ids[None, :-1], hfa.SinkCache(2, 8), [1])[0].argmax(-1) == ids[1:]
        recomputed = torch.stack(
            [
                model(ids[None, max(0, t - window + 1) : t + 1]).logits[0, -1].argmax() == ids[t + 1]
                for t in range(39)
            ]
        )
    assert dense[19:].all() and not dense.all()
    assert not torch.equal(streamed, dense)  # the stream evicted: other tokens are its top choices
    monkeypatch.setattr(importlib.import_module("hf_attnscale.evaluation.perplexity"), "LOSS_ROWS", 4)
    assert torch.equal(hfa.perplexity(model, ids, chunk_size=9, progress=False).greedy, dense)
    stream = hfa.perplexity(model, ids, cache=hfa.SinkCache(2, 8), chunk_size=5, progress=False)
    assert torch.equal(stream.greedy, streamed)
    recompute = hfa.perplexity(model, ids, method="recompute", window=window, progress=False)
    assert torch.equal(recompute.greedy, recomputed)


def test_result_summaries():
    nll = torch.tensor([1.0, 2.0, 3.0, 2.0])
    result = hfa.PerplexityResult(nll=nll, method="stream", seconds=2.0)
    assert result.ppl == pytest.approx(math.exp(2.0))
    torch.testing.assert_close(result.running_ppl, torch.tensor([1.0, 1.5, 2.0, 2.0]).exp())
    assert result.tokens_per_second == pytest.approx(2.0)
    model = hfa.patch(sharp_model())
    res = hfa.perplexity(
        model, torch.randint(2, SHARP_VOCAB, (1, 30)), cache=hfa.SinkCache(2, 6), progress=False
    )
    assert res.details == {"sink_tokens": 2, "window": 6, "chunk_size": 512}
    assert res.running_ppl[-1].item() == pytest.approx(res.ppl, rel=1e-5)


def test_bad_arguments_raise():
    model = hfa.patch(sharp_model())
    ids = torch.randint(2, SHARP_VOCAB, (20,))
    cases = [
        {"cache": hfa.SinkCache(2, 4), "chunk_size": 0},
        {"method": "streaming"},
        {"method": "stream"},
        {"method": "recompute"},
        {"method": "dense", "cache": hfa.SinkCache(2, 4)},
        {"max_length": 1},
        {"score_last": 0},
    ]
    for kwargs in cases:
        with pytest.raises(ValueError):
            hfa.perplexity(model, ids, progress=False, **kwargs)
    with pytest.raises(ValueError, match="one stream"):
        hfa.perplexity(model, ids.view(2, 10), progress=False)
    used = hfa.SinkCache(2, 4)
    hfa.perplexity(model, ids, cache=used, progress=False)
    with pytest.raises(ValueError, match="fresh"):
        hfa.perplexity(model, ids, cache=used, progress=False)
    with pytest.raises(ValueError, match=r"hfa\.patch"):
        hfa.perplexity(sharp_model(), ids, cache=hfa.SinkCache(2, 4), progress=False)


def test_sink_cache_on_an_encoder_raises():
    model = hfa.patch(tiny_model("bert"))
    with pytest.raises(ValueError, match="encoder"):
        hfa.perplexity(model, torch.randint(2, SHARP_VOCAB, (20,)), cache=hfa.SinkCache(2, 4), progress=False)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 100.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 100.0},
        {
            "rope_type": "longrope",
            "short_factor": [1.0] * 4,
            "long_factor": [1.0, 2.0, 4.0, 8.0],
            "original_max_position_embeddings": 16,
            "rope_theta": 100.0,
        },
    ],
    ids=["dynamic NTK", "YaRN", "LongRoPE"],
)
def test_dense_equals_one_call_whatever_the_rope(rope):
    """Dense perplexity is one forward over the stream, read in chunks. Dynamic NTK rescales its frequencies with
    the length read, so in plain chunks through a cache its early keys would keep a shorter read's: its chunks
    are read at the whole stream's frequencies. YaRN's frequencies are fixed, so its plain chunks agree too."""
    model = sharp_model("llama", max_position_embeddings=16, rope_parameters=rope)
    ids = torch.randint(2, SHARP_VOCAB, (1, 96))
    with torch.no_grad():
        want = _nll(model(input_ids=ids[:, :-1]).logits[0], ids[0, 1:])  # the last token is only a target
        cache, chunks = DynamicCache(config=model.config), []
        for first in range(0, 95, 8):
            logits = model(input_ids=ids[:, first : min(first + 8, 95)], past_key_values=cache).logits[0]
            chunks.append(_nll(logits, ids[0, first + 1 : first + 1 + logits.shape[0]]))
        chunked = torch.cat(chunks)
    got = hfa.perplexity(model, ids, chunk_size=8, progress=False).nll
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    moved = (chunked - want).abs().max().item()
    assert moved > 1e-2 if rope["rope_type"] in ("dynamic", "longrope") else moved < 1e-5


@pytest.mark.parametrize(
    "method", ["dense", "dense, dynamic NTK", "stream", "recompute"], ids=lambda m: m.replace(" ", "-")
)
def test_the_last_tokens_alone_score_as_in_the_whole_read_with_logits_only_where_they_are_read(method):
    """``score_last=N`` (a passkey, a loglikelihood request): the last N tokens' NLL and greedy flags as the read
    of every token gives them, N crossing a chunk boundary, while the output layer computes logits only at
    positions that predict them (and one row per chunk before): never every position of a chunk."""
    rope = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 100.0} if "dynamic" in method else None
    overrides = {"max_position_embeddings": 16, "rope_parameters": rope} if rope else {}
    model = sharp_model("llama", **overrides)
    if method == "stream":
        hfa.patch(model)
    ids = torch.randint(2, SHARP_VOCAB, (1, 70))
    options = {
        "dense": {"chunk_size": 16},
        "dense, dynamic NTK": {"chunk_size": 16},
        "stream": {"cache": hfa.SinkCache(2, 10), "chunk_size": 16},
        "recompute": {"method": "recompute", "window": 12},
    }[method]
    whole = hfa.perplexity(model, ids, progress=False, **options)
    if "cache" in options:
        options["cache"] = hfa.SinkCache(2, 10)
    rows: list[int] = []
    model.lm_head.register_forward_hook(lambda m, args, out: rows.append(out.shape[-2]))
    last = hfa.perplexity(model, ids, progress=False, score_last=20, **options)
    torch.testing.assert_close(last.nll, whole.nll[-20:], atol=1e-5, rtol=0)
    assert torch.equal(last.greedy, whole.greedy[-20:]) and last.nll.shape == (20,)
    if method == "recompute":  # a window's last row each; the first window's own rows: all scored
        assert max(rows[1:]) == 1
    else:  # chunks of 16 over 69 positions: 1, 1, 1 (before the 20), 4 of the fourth chunk, all 5 of the last
        assert rows == [1, 1, 1, 15, 5]
