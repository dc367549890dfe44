"""A `SinkCache` chunk's attention as key parts (issue 71, item 5): what the parts engine would give it.

One layer's attention over one chunk of ``--chunk`` queries in a `SinkCache(S, W)`, at SmolLM2-135M's heads (9
query heads over 3 key heads, 64 channels), float32, random tensors (time does not depend on the values):

* ``today``: what the cache runs (`hf_attnscale.streaming.plan`, a plan with sink channels): one sdpa call over
  the sinks, the window, the chunk and the sinks' one-hot copies, on D + S channels, under a dense mask;
* ``today, no mask``: the same call unmasked (not the definition: what the mask costs);
* ``key parts``: the engine's CPU path (`key_parts.fused_parts`): the sinks scored by queries turned to their
  sink distance (unmasked), the window's keys that every query sees (unmasked), its first ``chunk + 1`` keys
  (masked: the queries leave them one by one) and the chunk itself (causal), merged by log-sum-exp;
* ``key parts, two``: the sinks, and the window and the chunk as one band under its mask;
* ``dense segment``: a causal call over ``S + W`` tokens, what reading the same tokens as dense segments runs
  (its queries see half as many keys on average).

Medians over ``--repeats`` interleaved rounds of 5 calls each, in ms per call:

    python benchmarks/bench_sink_chunk.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hf_attnscale.core.parts.key_parts import KeyPart, fused_parts, plain_parts

HEADS, KV_HEADS, DIM = 9, 3, 64


def cases(sinks: int, window: int, chunk: int) -> dict:
    """The calls to time, by name, and the definition's output of each that computes it (``today, no mask`` and
    ``dense segment`` compute something else)."""
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(1, *shape, generator=generator)

    query, at_sinks = rand(HEADS, chunk, DIM), rand(HEADS, chunk, DIM)  # the latter: turned to the sinks
    key_s, key_w, key_c = rand(KV_HEADS, sinks, DIM), rand(KV_HEADS, window, DIM), rand(KV_HEADS, chunk, DIM)
    val_s, val_w, val_c = rand(KV_HEADS, sinks, DIM), rand(KV_HEADS, window, DIM), rand(KV_HEADS, chunk, DIM)
    t = torch.arange(chunk)[:, None]  # query t sees window keys t + 1 .. window − 1 and chunk keys 0 .. t
    keys, values = torch.cat([key_w, key_c], 2), torch.cat([val_w, val_c], 2)
    j = torch.arange(window + chunk)[None]
    band = (j >= t + 1) & (j <= window + t)
    # today's: [sinks at their true distance (hidden here: every query sees its copy) | window | chunk | copies]
    eye = torch.eye(sinks).expand(1, KV_HEADS, -1, -1)
    one_hot = torch.cat([torch.zeros(1, KV_HEADS, sinks, DIM), eye], -1)
    wide_keys = torch.cat([F.pad(torch.cat([key_s, keys], 2), (0, sinks)), one_hot], 2)
    wide_values = F.pad(torch.cat([val_s, values, val_s], 2), (0, sinks))
    sink_logits = at_sinks @ key_s.repeat_interleave(HEADS // KV_HEADS, 1).transpose(-1, -2)
    wide_query = torch.cat([query, sink_logits], -1)  # each copy's score: the sink's, at the sink distance
    hidden, shown = torch.zeros(chunk, sinks, dtype=torch.bool), torch.ones(chunk, sinks, dtype=torch.bool)
    visible = torch.cat([hidden, band, shown], 1)
    mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
    scale = DIM**-0.5
    edge = chunk + 1
    span = sinks + window
    segment = rand(HEADS, span, DIM), rand(KV_HEADS, span, DIM), rand(KV_HEADS, span, DIM)
    as_parts = [
        KeyPart(at_sinks, key_s, val_s, None),
        KeyPart(query, key_w[:, :, :edge], val_w[:, :, :edge], band[None, None, :, :edge]),
        KeyPart(query, key_w[:, :, edge:], val_w[:, :, edge:], None),
        KeyPart(query, key_c, val_c, torch.ones(chunk, chunk, dtype=torch.bool).tril()[None, None]),
    ]
    two = [KeyPart(at_sinks, key_s, val_s, None), KeyPart(query, keys, values, band[None, None])]
    calls = {
        "today": lambda: F.scaled_dot_product_attention(
            wide_query, wide_keys, wide_values, attn_mask=mask, scale=scale, enable_gqa=True
        )[..., :DIM].transpose(1, 2),
        "today, no mask": lambda: F.scaled_dot_product_attention(
            wide_query, wide_keys, wide_values, scale=scale, enable_gqa=True
        ),
        "key parts": lambda: fused_parts(as_parts, None, None),
        "key parts, two": lambda: fused_parts(two, None, None),
        "dense segment": lambda: F.scaled_dot_product_attention(*segment, is_causal=True, enable_gqa=True),
    }
    return calls, plain_parts(as_parts, None, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=1020)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    calls, definition = cases(args.sinks, args.window, args.chunk)
    times = {name: [] for name in calls}
    with torch.no_grad():
        for name in ("today", "key parts", "key parts, two"):  # each computes the definition
            torch.testing.assert_close(calls[name](), definition, atol=1e-5, rtol=1e-5, msg=name)
        for _ in range(args.repeats):
            for name, call in calls.items():
                started = time.perf_counter()
                for _ in range(5):
                    call()
                times[name].append((time.perf_counter() - started) / 5 * 1000)
    base = statistics.median(times["today"])
    print(
        f"S={args.sinks} W={args.window} chunk={args.chunk}, {args.threads} thread(s), ms per call (median)"
    )
    for name, measured in times.items():
        print(
            f"{name:>15}: {statistics.median(measured):7.2f} ms  {statistics.median(measured) / base:.2f}x today"
        )


if __name__ == "__main__":
    main()
