"""Many streams on one model: threads, and conversations interleaved, each with its own `SinkCache`.

A server loads one model and serves many conversations, each with a cache of its own, often from several
threads at once. Each stream must get exactly what it gets alone. Before per-call state moved into the call
(`hf_attnscale.core.call.hooks`), a SinkCache set its rotation on the shared attention modules for the length of a
call: with four threads, 11 of 12 `generate()` calls differed from the sequential ones or crashed ("The size of
tensor a (27) must match the size of tensor b (34)"), and `hfa.perplexity` in four threads crashed in two and
was off by 34-40 in the other two. These tests failed in every run of them before the fix.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import SHARP_VOCAB, sharp_model

import hf_attnscale as hfa

ROUNDS = 3
OPTIONS = {
    "plain": {},
    "logn+exit": {"scale": "logn", "train_length": 16, "zero_kv": True},
    "sink_logit": {"sink_logit": 1.5},
}
# (prompt length, sink tokens, window) of each concurrent stream: different shapes, evicting from the start.
STREAMS = [(5, 4, 8), (17, 2, 12), (26, 4, 20), (9, 0, 6)]


def _model(options: dict):
    return hfa.patch(sharp_model("llama", seed=3), **options)


def _prompt(length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, SHARP_VOCAB, (1, length), generator=generator)


def _generate(model, stream: int, beams: int = 1) -> torch.Tensor:
    length, sinks, window = STREAMS[stream]
    return model.generate(
        _prompt(length, stream),
        past_key_values=hfa.SinkCache(sinks, window),
        max_new_tokens=24,
        min_new_tokens=24,
        do_sample=False,
        num_beams=beams,
        pad_token_id=0,
    )


def _in_threads(work, count: int) -> list:
    """``work(i)`` for i < count, all threads released at once; any thread's exception is raised."""
    results: list = [None] * count
    errors: list[BaseException] = []
    start = threading.Barrier(count)

    def run(i: int) -> None:
        try:
            start.wait()
            results[i] = work(i)
        except BaseException as err:  # reported below, not lost in the thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("beams", [1, 2])
def test_threads_generating_equal_the_sequential_runs(name, beams):
    model = _model(OPTIONS[name])
    sequential = [_generate(model, i, beams) for i in range(len(STREAMS))]
    for _ in range(ROUNDS):
        concurrent = _in_threads(lambda i: _generate(model, i, beams), len(STREAMS))
        for i, (got, want) in enumerate(zip(concurrent, sequential)):
            assert torch.equal(got, want), f"stream {i} differs when run beside the others"


@pytest.mark.parametrize("name", list(OPTIONS))
def test_threads_measuring_perplexity_equal_the_sequential_runs(name):
    model = _model(OPTIONS[name])
    ids = [_prompt(70 + 9 * i, 10 + i) for i in range(len(STREAMS))]

    def measure(i: int) -> torch.Tensor:
        _, sinks, window = STREAMS[i]
        return hfa.perplexity(model, ids[i], cache=hfa.SinkCache(sinks, window), chunk_size=7).nll

    sequential = [measure(i) for i in range(len(STREAMS))]
    for _ in range(ROUNDS):
        for i, (got, want) in enumerate(zip(_in_threads(measure, len(STREAMS)), sequential)):
            assert torch.equal(got, want), f"stream {i} differs when measured beside the others"


@pytest.mark.parametrize("name", list(OPTIONS))
def test_conversations_interleaved_step_by_step_equal_each_alone(name):
    model = _model(OPTIONS[name])
    ids = [_prompt(40, 20), _prompt(40, 21)]
    chunks = [[1], [3, 1, 5]]  # one decodes token by token while the other takes chunks

    def feed(stream: int, cache, start: int, size: int) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids[stream][:, start : start + size], past_key_values=cache).logits

    def alone(stream: int) -> torch.Tensor:
        cache, out, start, step = hfa.SinkCache(2, 9 + 4 * stream), [], 0, 0
        while start < 40:
            size = chunks[stream][step % len(chunks[stream])]
            out.append(feed(stream, cache, start, size))
            start, step = start + size, step + 1
        return torch.cat(out, dim=1)

    caches = [hfa.SinkCache(2, 9), hfa.SinkCache(2, 13)]
    outs: list[list[torch.Tensor]] = [[], []]
    starts, steps = [0, 0], [0, 0]
    while min(starts) < 40:
        for stream in (0, 1):
            if starts[stream] < 40:
                size = chunks[stream][steps[stream] % len(chunks[stream])]
                outs[stream].append(feed(stream, caches[stream], starts[stream], size))
                starts[stream] += size
                steps[stream] += 1
    for stream in (0, 1):
        assert torch.equal(torch.cat(outs[stream], dim=1), alone(stream))
