"""A `SinkCache` decoding step under torch.compile: whole (no graph break, no recompile), equal to the eager step
over long streams, and through generate()'s own compile path. The patched forward's exit breaks no graph either."""

from __future__ import annotations

import pytest
import torch
from conftest import GREEDY, SHARP_VOCAB, sharp_model
from model_zoo import zoo_model
from torch._dynamo.utils import counters
from transformers import CompileConfig

import hf_attnscale as hfa

MODELS = {
    "llama": lambda: zoo_model("llama"),
    "qwen2": lambda: zoo_model("qwen2"),
    "gemma3 local layers": lambda: zoo_model("gemma3_text", sliding_window=4),
    "sharp llama": lambda: sharp_model("llama"),
}


def _breaks(function, *args) -> list[str]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(function)(*args)
    return [b.reason.splitlines()[0] for b in explained.break_reasons]


@pytest.mark.parametrize(
    "options", [{}, {"scale": "logn", "zero_kv": True, "train_length": 8}], ids=["", "logn+exit"]
)
def test_a_decoding_step_and_a_patched_forward_break_no_graph(options):
    """torch._dynamo.explain counts the breaks: 0 in a decoding step through a SinkCache (23 when the step read
    numbers off the device) and in a patched forward with the exit (16 when the fused exit's check ran inside)."""
    model = hfa.patch(zoo_model("llama"), **options)
    ids = torch.randint(2, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    assert _breaks(lambda x: model(x).logits, ids) == []
    cache = hfa.SinkCache(2, 6)
    with torch.no_grad():
        model(ids, past_key_values=cache)
        assert _breaks(lambda x: model(x, past_key_values=cache).logits, ids[:, :1]) == []


@pytest.mark.parametrize("name", MODELS)
def test_compiled_decoding_equals_eager_over_a_long_stream(name):
    """torch.compile(fullgraph=True) takes the step whole, once (no recompile), and gives the eager step's logits
    to 1e-5 over 130 steps past the window, around a chunk (the general path) whose rebase moves the base."""
    model = hfa.patch(MODELS[name]())
    vocab = min(model.config.vocab_size, SHARP_VOCAB)
    ids = torch.randint(2, vocab, (2, 160), generator=torch.Generator().manual_seed(1))

    def stream(step) -> tuple[torch.Tensor, hfa.SinkCache]:
        cache, logits = hfa.SinkCache(2, 6), []
        with torch.no_grad():
            model(ids[:, :10], past_key_values=cache)
            for t in range(10, 150):
                if t == 80:
                    logits.append(model(ids[:, 80:83], past_key_values=cache).logits[:, -1])
                elif not 80 < t < 83:
                    logits.append(step(ids[:, t : t + 1], cache))
        return torch.stack(logits), cache

    eager, _ = stream(lambda x, cache: model(x, past_key_values=cache).logits[:, -1])
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(
        lambda x, cache: model(x, past_key_values=cache).logits[:, -1], fullgraph=True, backend="eager"
    )
    compiled, cache = stream(step)
    assert counters["stats"]["unique_graphs"] == 1
    assert all(bool((layer.slots.base > 0).all()) for layer in cache.layers)  # the chunk rebased
    assert cache.get_seq_length() == 150
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=0)


def test_generate_compiles_the_sink_cache_step_itself():
    """A SinkCache says it is compileable, so generate() compiles the decoding step through transformers' own
    path (asked for on the CPU by compile_config); left padding included, it gives eager generation's tokens and
    logits to 1e-5."""
    model = hfa.patch(zoo_model("llama"))
    ids = torch.randint(2, 50, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    arguments = {"attention_mask": mask, "max_new_tokens": 40, **GREEDY}
    assert hfa.SinkCache(2, 6).is_compileable
    eager = model.generate(ids, past_key_values=hfa.SinkCache(2, 6), disable_compile=True, **arguments)
    config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    config._compile_all_devices = True  # transformers' own switch for compiling on the CPU
    torch._dynamo.reset()
    counters.clear()
    compiled = model.generate(ids, past_key_values=hfa.SinkCache(2, 6), compile_config=config, **arguments)
    assert counters["stats"]["unique_graphs"] == 1
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(eager.logits), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_generate_compiles_with_inductor():
    """The same through inductor, as a GPU user's generate() compiles it (about half a minute on the CPU)."""
    model = hfa.patch(sharp_model("llama"))
    ids = torch.randint(2, SHARP_VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    arguments = {"max_new_tokens": 30, **GREEDY}
    eager = model.generate(ids, past_key_values=hfa.SinkCache(2, 6), disable_compile=True, **arguments)
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True
    torch._dynamo.reset()
    compiled = model.generate(ids, past_key_values=hfa.SinkCache(2, 6), compile_config=config, **arguments)
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(eager.logits), atol=1e-5, rtol=0)


def test_a_stream_whose_rope_the_table_cannot_compute_is_not_compileable():
    """Cohere's interleaved RoPE keeps the general path (its positions are rebased there): once the stream
    has met the model, its cache says it is not compileable, so a later generate() leaves the step eager (the
    first one asks before the cache knows the model)."""
    for model_type, compileable in (("cohere", False), ("llama", True)):
        model, cache = hfa.patch(zoo_model(model_type)), hfa.SinkCache(2, 6)
        assert cache.is_compileable  # before it meets a model, as generate() first asks
        with torch.no_grad():
            model(torch.randint(2, 50, (1, 9)), past_key_values=cache)
        assert cache.is_compileable == compileable, model_type
