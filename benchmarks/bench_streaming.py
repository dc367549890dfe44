"""StreamingLLM benchmarks (issues #3, #12): throughput, memory, and generate() latency of `SinkCache`.

The model is Llama-shaped and randomly initialised (speed and memory do not depend on the weights): by default
8 layers, d_model 512, 8 heads of 64, MLP 1408, vocabulary 32000, float32, sdpa; ``--shape llama-3.2-1b``
takes Llama-3.2-1B's (bench_overhead.py's `SHAPES`). It is patched with ``hfa.patch(model)`` (identity). The
cache is ``SinkCache(4, 1020)``: 1024 tokens per layer. ``--device cuda --dtype bfloat16`` runs on a GPU, where
memory is CUDA's peak allocation instead of the process's resident set:

    python benchmarks/bench_streaming.py throughput --device cuda --dtype bfloat16 --shape llama-3.2-1b \
        --tokens 16384 --no-token-by-token --recompute-tokens 0
    python benchmarks/bench_streaming.py memory --device cuda --dtype bfloat16 --shape llama-3.2-1b \
        --short 16384 --long 262144
    python benchmarks/bench_streaming.py latency --device cuda --dtype bfloat16 --shape llama-3.2-1b \
        --positions 1024 65536

On the CPU (the defaults):

    python benchmarks/bench_streaming.py throughput   # fast chunked path vs token-by-token reference
    python benchmarks/bench_streaming.py memory       # peak RSS of a 64k-token stream vs an 8k one
    python benchmarks/bench_streaming.py latency      # generate() step time at 1k vs 16k, Sink vs Dynamic
    python benchmarks/bench_streaming.py quality      # the four methods on real text (shipped tiny model)
    python benchmarks/bench_streaming.py local        # Gemma-3-270M at 4+2044 vs 4+508: local layers' memory

On the real SmolLM2-135M (``--shape smollm2-135m`` also runs the commands above on it), issue #45's three numbers,
each code version in fresh processes, interleaved: decode per token with ``SinkCache(4, 1020)`` past 8k tokens
against a ``DynamicCache`` holding 1,024; chunked streaming perplexity over 16k tokens; and that stream against
one dense forward of the same tokens. ``--code`` names each version's source folder (a ``git worktree``):

    git worktree add /tmp/hfa-old 17ec512    # the streaming code before issue #45
    python benchmarks/bench_streaming.py checkpoint --repeats 5 --code old=/tmp/hfa-old --code new=.

and what storing keys un-rotated would add to each decode step (``rotate-on-read``): rotating every layer's 1,024
keys on each read, timed beside a decode step of a ``DynamicCache`` holding 1,024 keys:

    python benchmarks/bench_streaming.py rotate-on-read

Issue #56's numbers: the compiled decode step (generate()'s own compile, inductor) against a compiled
`StaticCache` of 1,024 slots, and the chunked stream against the same tokens read as dense 1,024-token segments;
then where the time goes (self CPU time by the pipeline's function, from torch.profiler's stacks):

    OMP_NUM_THREADS=1 python benchmarks/bench_streaming.py checkpoint --tokens 8192 --decode-at 8192 \
        --repeats 3 --parts decode compiled stream segments
    OMP_NUM_THREADS=1 python benchmarks/bench_streaming.py profile

The report gives each later version against the first (``new / old``); ``--tokens``, ``--decode-at``,
``--dynamic-at``, ``--steps`` and ``--rounds`` change the sizes (a smoke run: ``--tokens 64 --decode-at 80
--dynamic-at 32 --steps 2 --rounds 1 --repeats 1``).

Each prints a Markdown block for benchmarks/RESULTS.md. Threads: ``--threads`` (default 1, so that numbers
are stable on a shared 2-core machine). Every ratio compares numbers measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from bench_overhead import REAL, SHAPES, build_model as build_shape
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, StoppingCriteria

import hf_attnscale as hfa

SINKS, WINDOW = 4, 1020
VOCAB = 32000


def build_model(args, seed: int = 0) -> torch.nn.Module:
    """The benchmark's model, on ``args.device`` in ``args.dtype``, patched with the identity."""
    dtype = getattr(torch, args.dtype)
    if args.shape != "default":
        return hfa.patch(build_shape(args.device, dtype, args.shape).eval())
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=VOCAB,
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=1408,
        max_position_embeddings=2048,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=1,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).eval()
    return hfa.patch(model.to(args.device))


def stream_ids(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def setup(args) -> str:
    """The benchmark model's shape and dtype, and the machine."""
    return f"model {args.shape}, {args.dtype}; {environment(args)}"


def environment(args) -> str:
    """The machine: versions, and the GPU or the CPU and its threads."""
    if args.device.startswith("cuda"):
        return (
            f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
            f"{torch.cuda.get_device_name()}"
        )
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"torch {torch.__version__}, transformers {transformers.__version__}, {cpu} "
        f"({torch.backends.cpu.get_cpu_capability()}), torch.set_num_threads({args.threads})"
    )


# ---------------------------------------------------------------------------------------------------------
def throughput(args) -> str:
    """Tokens/s of the exact chunked streaming path against the token-by-token reference and a dense forward."""
    model = build_model(args)
    ids = stream_ids(args.tokens).to(args.device)
    runs: dict[str, list[float]] = {"fast": [], "dense": [], "token": []}
    diffs = []
    for run in range(args.repeats):  # interleaved, so that load from other jobs hits all alike
        fast = hfa.perplexity(model, ids, cache=hfa.SinkCache(SINKS, WINDOW), chunk_size=args.chunk_size)
        dense = hfa.perplexity(model, ids, method="dense", chunk_size=args.tokens)  # one plain forward
        runs["fast"].append(fast.tokens_per_second)
        runs["dense"].append(dense.tokens_per_second)
        line = f"run {run}: fast {runs['fast'][-1]:.1f} tok/s, dense forward {runs['dense'][-1]:.1f} tok/s"
        if args.token_by_token:
            ref = hfa.perplexity(model, ids, cache=hfa.SinkCache(SINKS, WINDOW), chunk_size=1)
            runs["token"].append(ref.tokens_per_second)
            diffs.append((fast.nll - ref.nll).abs().max().item())
            line += f", token-by-token {runs['token'][-1]:.1f} tok/s, max |dNLL| {diffs[-1]:.2e}"
        print(line, flush=True)
    fast, dense = statistics.median(runs["fast"]), statistics.median(runs["dense"])
    ref = statistics.median(runs["token"]) if args.token_by_token else None

    def speedup(tokens_per_second: float) -> str:
        return f"{tokens_per_second / ref:.1f}x" if ref else "-"

    lines = [
        f"Stream of {args.tokens} tokens, `SinkCache({SINKS}, {WINDOW})`; median of {args.repeats} interleaved "
        f"runs. {setup(args)}.",
        "",
        "| method | tokens/s | vs token-by-token | time / dense forward's |",
        "|---|---|---|---|",
        f"| fast chunked path (chunk_size={args.chunk_size}) | {fast:.1f} | **{speedup(fast)}** | "
        f"**{dense / fast:.2f}** |",
        f"| dense forward of the same tokens (one pass, no cache) | {dense:.1f} | {speedup(dense)} | 1.00 |",
    ]
    notes = []
    if ref:
        lines.append(f"| token-by-token reference (chunk_size=1) | {ref:.1f} | 1.0x | {dense / ref:.2f} |")
    if args.recompute_tokens:
        # Sliding window with re-computation: steady-state cost per token (one window re-encoded per token),
        # from the difference of two runs so that the one-off scoring of the first window cancels out.
        window = SINKS + WINDOW
        timed = []
        for extra in (0, args.recompute_tokens):
            start = time.perf_counter()
            hfa.perplexity(model, ids, method="recompute", window=window, max_length=window + 1 + extra)
            timed.append(time.perf_counter() - start)
        recompute = args.recompute_tokens / (timed[1] - timed[0])
        lines.append(
            f"| sliding window with re-computation (window {window}, steady state over "
            f"{args.recompute_tokens} tokens) | {recompute:.2f} | {speedup(recompute)} | {dense / recompute:.1f} |"
        )
        notes.append(f"Fast path vs re-computation: {fast / recompute:.0f}x.")
    if diffs:
        notes.append(
            f"Fast path vs token-by-token, same text: max |NLL difference| {max(diffs):.1e} nats/token "
            f"(all runs: {', '.join(f'{d:.1e}' for d in diffs)})."
        )
    notes.append(
        f"Runs (tok/s): {'; '.join(f'{k} ' + ', '.join(f'{x:.1f}' for x in v) for k, v in runs.items() if v)}."
    )
    return "\n".join([*lines, "", " ".join(notes)])


# ---------------------------------------------------------------------------------------------------------
def _memory_child(args) -> None:
    """In a fresh process: the peak memory of streaming ``args.tokens`` tokens, after a 2k-token warm-up.

    On CPU the process's peak resident set (ru_maxrss); on CUDA the peak allocation of the device.
    """
    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    model = build_model(args)
    warm_up = stream_ids(2048, seed=7).to(args.device)
    hfa.perplexity(
        model, warm_up, cache=hfa.SinkCache(SINKS, WINDOW), chunk_size=args.chunk_size, progress=False
    )
    warm_kb = peak_kib(cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    result = hfa.perplexity(
        model,
        stream_ids(args.tokens).to(args.device),
        cache=hfa.SinkCache(SINKS, WINDOW),
        chunk_size=args.chunk_size,
        progress=False,
    )
    peak_kb = peak_kib(cuda)
    print(
        json.dumps({"tokens": args.tokens, "warm_kb": warm_kb, "peak_kb": peak_kb, "seconds": result.seconds})
    )


def peak_kib(cuda: bool) -> float:
    """The peak so far: CUDA's allocation on a GPU, else the process's resident set (ru_maxrss), in KiB."""
    if cuda:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def memory(args) -> str:
    rows = {}
    for tokens in (args.short, args.long):
        command = [
            sys.executable,
            __file__,
            "_memory_child",
            "--tokens",
            str(tokens),
            "--threads",
            str(args.threads),
            "--chunk-size",
            str(args.chunk_size),
            "--device",
            args.device,
            "--dtype",
            args.dtype,
            "--shape",
            args.shape,
        ]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        rows[tokens] = json.loads(out.strip().splitlines()[-1])
        print(rows[tokens], flush=True)
    short, long = rows[args.short], rows[args.long]
    mib = lambda kb: kb / 1024  # noqa: E731
    measure = "Peak CUDA allocation" if args.device.startswith("cuda") else "Peak resident memory (ru_maxrss)"
    return "\n".join(
        [
            f"{measure} of a process that streams the text through `hfa.perplexity` with "
            f"`SinkCache({SINKS}, {WINDOW})`, chunk_size={args.chunk_size}; one fresh process per length, after a "
            f"2k-token warm-up stream. {setup(args)}.",
            "",
            "| stream | peak (MiB) | growth over the warm-up peak (MiB) | seconds |",
            "|---|---|---|---|",
            *(
                f"| {t:,} tokens | {mib(r['peak_kb']):.1f} | {mib(r['peak_kb'] - r['warm_kb']):.1f} | "
                f"{r['seconds']:.0f} |"
                for t, r in rows.items()
            ),
            "",
            f"Peak ratio {args.long // 1024}k / {args.short // 1024}k: **{long['peak_kb'] / short['peak_kb']:.3f}** "
            f"(goal <= 1.1).",
        ]
    )


# ---------------------------------------------------------------------------------------------------------
class _StepClock(StoppingCriteria):
    """Records the time at which generate() finishes each step."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _greedy(new_tokens: int) -> dict:
    return {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 0}


def latency(args) -> str:
    """Median generate() step time at two stream positions, for SinkCache and DynamicCache.

    Each stream is first brought to its position by a prompt (prefill), so that 16k is reached in minutes;
    a SinkCache is in the same state whether its tokens came by prefill or by decoding. Then rounds of
    ``--steps`` greedy steps alternate between the positions (each round continues its own stream with the
    same cache, like a multi-turn chat), so that load from other jobs on the machine hits both alike.
    """
    model = build_model(args)
    low, high = args.positions
    table: dict[tuple[str, int], float] = {}
    for name in ("SinkCache", "DynamicCache"):
        streams = {}
        for position in (low, high):
            cache = hfa.SinkCache(SINKS, WINDOW) if name == "SinkCache" else DynamicCache(config=model.config)
            prompt = stream_ids(position - 1)[None].to(args.device)
            streams[position] = [cache, model.generate(prompt, past_key_values=cache, **_greedy(1))]
        gaps: dict[int, list[float]] = {low: [], high: []}
        for _ in range(args.rounds):
            for position in (low, high):
                cache, sequence = streams[position]
                clock = _StepClock()
                streams[position][1] = model.generate(
                    sequence, past_key_values=cache, stopping_criteria=[clock], **_greedy(args.steps + 1)
                )
                gaps[position] += [b - a for a, b in zip(clock.times, clock.times[1:])]  # decoding steps only
        for position in (low, high):
            table[name, position] = 1000 * statistics.median(gaps[position])
            print(f"{name} at {position}: {table[name, position]:.2f} ms/token", flush=True)
    lines = [
        f"generate() per-token latency: median of {args.rounds} x {args.steps} greedy decoding steps per cell. "
        f"Each stream is brought to its position by a prompt, then rounds of {args.steps} steps alternate "
        f"between the two positions, each continuing its stream with its cache. {setup(args)}.",
        "",
        f"| cache | ms/token at {low:,} | ms/token at {high:,} | ratio |",
        "|---|---|---|---|",
    ]
    for name in ("SinkCache", "DynamicCache"):
        ratio = f"{table[name, high] / table[name, low]:.3f}"
        label = f"`SinkCache({SINKS}, {WINDOW})`" if name == "SinkCache" else "`DynamicCache` (grows)"
        ratio = f"**{ratio}**" if name == "SinkCache" else ratio
        lines.append(f"| {label} | {table[name, low]:.2f} | {table[name, high]:.2f} | {ratio} |")
    same_size = table["SinkCache", high] / table["DynamicCache", low]
    lines += [
        "",
        "Goal for SinkCache: ratio <= 1.15.",
        "",
        f"Decode against a plain cache of the same size: `SinkCache({SINKS}, {WINDOW})` at {high:,} (full, "
        f"evicting every step) / `DynamicCache` holding {low:,} tokens = **{same_size:.3f}** (goal <= 1.05).",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
def quality(args) -> str:
    """The four methods on real text: the shipped tiny Llama (at its trained length), held-out documents."""
    from hf_attnscale.checkpoints.models import load_default_model
    from hf_attnscale.evaluation.corpus import long_documents

    model, tokenizer = load_default_model()
    hfa.patch(model.to(args.device))
    trained = model.config.max_position_embeddings
    sinks, window = 4, trained - 4
    documents = long_documents("heldout", args.tokens, tokenizer)[: args.documents]
    methods = {
        "dense (all tokens)": {"chunk_size": 512},
        f"window only, `SinkCache(0, {trained})`": {"cache": lambda: hfa.SinkCache(0, trained)},
        f"StreamingLLM, `SinkCache({sinks}, {window})`": {"cache": lambda: hfa.SinkCache(sinks, window)},
        f"re-computation, window {trained}": {"method": "recompute", "window": trained},
    }
    edges = [0, trained, 4 * trained, args.tokens - 1]
    nll = {name: [] for name in methods}
    speed = {name: [] for name in methods}
    for doc in documents:
        ids = torch.tensor(tokenizer(doc.text)["input_ids"][: args.tokens], device=args.device)
        for name, options in methods.items():
            options = {k: (v() if k == "cache" else v) for k, v in options.items()}
            result = hfa.perplexity(model, ids, **options)
            nll[name].append(result.nll)
            speed[name].append(result.tokens_per_second)
        summary = ", ".join(f"{torch.stack(v).mean().exp():.2f}" for v in nll.values())
        print(f"{doc.name}: perplexity {summary}", flush=True)
    spans = [f"{a + 1:,}-{b:,}" for a, b in itertools.pairwise(edges)]
    lines = [
        f"Perplexity of the shipped tiny Llama (4 layers, d 256, trained at {trained} tokens) on the first "
        f"{args.tokens} tokens of each of {len(documents)} held-out stdlib documents "
        f"({', '.join(d.name for d in documents)}), by predicted-token position. {environment(args)}.",
        "",
        "| method | " + " | ".join(f"ppl @ {s}" for s in spans) + " | tokens/s |",
        "|---|" + "---|" * (len(spans) + 1),
    ]
    for name in methods:
        stacked = torch.stack(nll[name])  # (documents, T-1)
        cells = [f"{stacked[:, a:b].mean().exp():.2f}" for a, b in itertools.pairwise(edges)]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {statistics.median(speed[name]):.0f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
def local(args) -> str:
    """Gemma-3-270M (the real checkpoint; 15 of its 18 layers slide over 512 tokens) streaming a held-out text
    through ``SinkCache(4, W)`` for each ``W`` of ``--windows``: tokens/s of the chunked path, and the bytes the
    cache holds, against what it would hold if every layer kept the whole cache."""
    from transformers import AutoTokenizer

    from hf_attnscale.evaluation.corpus import long_documents

    folder = hfa.fetch("gemma3-270m")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = hfa.patch(hfa.from_pretrained(AutoModelForCausalLM, str(folder)).eval()).to(args.device)
    document = long_documents("heldout", args.tokens, tokenizer)[0]
    ids = torch.tensor(tokenizer(document.text)["input_ids"][: args.tokens], device=args.device)
    speed: dict[int, list[float]] = {w: [] for w in args.windows}
    held: dict[int, tuple[list[int], int, float]] = {}
    for run in range(args.repeats):  # the caches alternate within each repeat
        for window in args.windows:
            cache = hfa.SinkCache(SINKS, window)
            result = hfa.perplexity(model, ids, cache=cache, chunk_size=args.chunk_size)
            speed[window].append(result.tokens_per_second)
            slots = [layer.keys.shape[-2] for layer in cache.layers]
            tensors = [t for layer in cache.layers for t in (layer.keys, layer.values, layer.sink_keys)]
            held[window] = (slots, sum(t.numel() * t.element_size() for t in tensors), result.ppl)
            print(
                f"run {run}, 4+{window}: {speed[window][-1]:.1f} tok/s, slots {sorted(set(slots))}",
                flush=True,
            )
    lines = [
        f"Gemma-3-270M (18 layers: 15 slide over 512 tokens, 3 are global; 1 KV head of 256), float32, on the "
        f"first {ids.numel():,} tokens of the held-out `{document.name}`, chunks of {args.chunk_size}; median of "
        f"{args.repeats} runs, the caches alternating. {environment(args)}.",
        "",
        "| cache | tokens/s | slots per global / local layer | cache held (MiB) | every layer holding the whole "
        "cache (MiB) | perplexity |",
        "|---|---|---|---|---|---|",
    ]
    for window in args.windows:
        slots, nbytes, ppl = held[window]
        whole = nbytes / sum(slots) * len(slots) * max(slots)
        lines.append(
            f"| `SinkCache(4, {window})` | {statistics.median(speed[window]):.1f} | {max(slots)} / {min(slots)} | "
            f"{nbytes / 2**20:.1f} | {whole / 2**20:.1f} | {ppl:.3f} |"
        )
    first, last = args.windows[0], args.windows[-1]
    ratio = statistics.median(speed[last]) / statistics.median(speed[first])
    lines += [
        "",
        f"tokens/s at 4+{last} / 4+{first}: **{ratio:.3f}**; cache held: **{held[last][1] / held[first][1]:.2f}x** "
        f"for a {(last + SINKS) / (first + SINKS):.0f}x larger cache.",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
def _checkpoint_child(args) -> None:
    """In a fresh process, with the code version on PYTHONPATH: one part of `checkpoint`, printed as JSON."""
    torch.set_num_threads(args.threads)
    model = build_model(args)
    ids = torch.load(args.ids).to(args.device)
    if args.part == "decode":  # interleaved rounds of greedy steps; the DynamicCache is cut back after each
        caches = {"sink": (hfa.SinkCache(SINKS, WINDOW), args.decode_at), "dynamic": (None, args.dynamic_at)}
        streams, gaps = {}, {name: [] for name in caches}
        for name, (cache, position) in caches.items():
            cache = DynamicCache(config=model.config) if cache is None else cache  # an empty cache is falsy
            streams[name] = [
                cache,
                model.generate(ids[None, : position - 1], past_key_values=cache, **_greedy(1)),
            ]
        for _ in range(args.rounds):
            for name, (_, position) in caches.items():
                cache, sequence = streams[name]
                clock = _StepClock()
                sequence = model.generate(
                    sequence, past_key_values=cache, stopping_criteria=[clock], **_greedy(args.steps + 1)
                )
                gaps[name] += [b - a for a, b in itertools.pairwise(clock.times)]
                if name == "dynamic":
                    cache.crop(position - 1 - cache.get_seq_length())  # negative: the tokens to drop
                    sequence = sequence[:, :position]
                streams[name][1] = sequence
        result = {f"{name}_ms": 1000 * statistics.median(gaps[name]) for name in caches}
        held = {f"{name}_keys": streams[name][0].layers[0].keys.shape[-2] for name in caches}
        if held["sink_keys"] > SINKS + WINDOW:  # the check that the column named SinkCache is one
            raise RuntimeError(f"the SinkCache holds {held['sink_keys']} keys, more than {SINKS + WINDOW}")
        result |= held
    elif args.part == "compiled":  # both caches at fixed shapes, their steps compiled by generate() itself
        result = _compiled_decode(model, ids, args)
    elif args.part == "segments":  # the stream's limit: the same tokens read as dense segments of its size
        segment, seconds, nll = SINKS + WINDOW, 0.0, 0.0
        for start in range(0, args.tokens, segment):
            part = ids[start : min(start + segment, args.tokens) + 1]
            out = hfa.perplexity(model, part, method="dense", chunk_size=segment, progress=False)
            seconds, nll = seconds + out.seconds, nll + float(out.nll.sum())
        result = {"seconds": seconds, "nll": nll / args.tokens}
    else:
        stream = args.part == "stream"
        options = {"cache": hfa.SinkCache(SINKS, WINDOW)} if stream else {"method": "dense"}
        chunk = args.chunk_size if stream else args.tokens  # dense: one forward of every token
        out = hfa.perplexity(model, ids[: args.tokens + 1], chunk_size=chunk, progress=False, **options)
        result = {"seconds": out.seconds, "nll": float(out.nll.mean())}
    print(json.dumps(result))


def _compiled_decode(model, ids: torch.Tensor, args) -> dict:
    """Per-token decode time with each cache's step compiled by generate() itself (inductor, fullgraph; asked
    for on the CPU by compile_config): `SinkCache(4, 1020)` continuing a stream past ``--decode-at`` against a
    `StaticCache` of 1,024 slots (as many as the SinkCache holds; a fresh one each round, its prompt leaving room
    for the round's steps). Interleaved rounds; the first one, which compiles, is left out."""
    from transformers import CompileConfig, StaticCache

    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True  # transformers' switch for compiling generate's step on the CPU
    size, gaps = SINKS + WINDOW, {"sink": [], "static": []}
    sink = hfa.SinkCache(SINKS, WINDOW)
    sequence = model.generate(ids[None, : args.decode_at - 1], past_key_values=sink, **_greedy(1))
    for round_ in range(args.rounds + 1):
        for name in gaps:
            clock = _StepClock()
            if name == "sink":
                prompt, cache = sequence, sink
            else:
                prompt = ids[None, : size - args.steps - 2]
                cache = StaticCache(config=model.config, max_cache_len=size)
            out = model.generate(
                prompt,
                past_key_values=cache,
                stopping_criteria=[clock],
                compile_config=config,
                **_greedy(args.steps + 1),
            )
            sequence = out if name == "sink" else sequence
            if round_:
                gaps[name] += [b - a for a, b in itertools.pairwise(clock.times)]
    if sink.layers[0].keys.shape[-2] != size:
        raise RuntimeError(f"the SinkCache holds {sink.layers[0].keys.shape[-2]} slots, not {size}")
    return {f"{name}_compiled_ms": 1000 * statistics.median(gaps[name]) for name in gaps}


def checkpoint(args) -> str:
    """Issue #45's numbers on a real checkpoint, for each ``--code`` version, in fresh processes, interleaved."""
    from transformers import AutoTokenizer

    from hf_attnscale.evaluation.corpus import builtin_documents
    from hf_attnscale.evaluation.long_texts import joined_documents

    tokenizer = AutoTokenizer.from_pretrained(hfa.fetch(args.shape))
    need = max(args.tokens + 1, args.decode_at, SINKS + WINDOW)
    text = joined_documents(builtin_documents("heldout"), tokenizer, need)[0].text
    ids = torch.tensor(tokenizer(text)["input_ids"][:need])
    codes = dict(code.split("=", 1) for code in args.code)
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as folder:
        torch.save(ids, Path(folder) / "ids.pt")

        def child(label: str, part: str) -> dict:
            env = {
                **os.environ,
                "PYTHONPATH": str(Path(codes[label]).resolve()),
                "OMP_NUM_THREADS": str(args.threads),
            }
            flags = ["--part", part, "--ids", str(Path(folder) / "ids.pt"), "--shape", args.shape]
            flags += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in CHILD_FLAGS]
            command = [sys.executable, __file__, "_checkpoint_child", *flags]
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            if done.returncode:
                raise RuntimeError(f"{label} {part} failed:\n{done.stderr[-3000:]}")
            out = done.stdout
            runs.setdefault((label, part), []).append(json.loads(out.strip().splitlines()[-1]))
            print(f"{label} {part}: {runs[label, part][-1]}", flush=True)
            return runs[label, part][-1]

        for _ in range(args.repeats):
            for label in codes:
                for part in [p for p in ("decode", "compiled", "stream") if p in args.parts]:
                    child(label, part)
            for part in [p for p in ("segments", "dense") if p in args.parts]:
                child(next(iter(codes)), part)  # dense reads no streaming code

    def median(label: str, part: str, key: str) -> float:  # nan where the part was not run
        values = [r[key] for r in runs.get((label, part), [])]
        return statistics.median(values) if values else math.nan

    first, *others = codes
    dense = median(first, "dense", "seconds")
    lines = [
        f"{args.shape}, `SinkCache({SINKS}, {WINDOW})`, medians of {args.repeats} runs, each in a fresh process, the "
        f"versions interleaved; {len(ids):,} tokens of held-out stdlib text. {setup(args)}.",
        "",
        f"| code | decode ms/token: Sink at {args.decode_at:,} | DynamicCache at {args.dynamic_at:,} | ratio (goal <= "
        f"1.05) | stream of {args.tokens:,} in chunks of {args.chunk_size} (s) | / dense forward ({dense:.1f} s; "
        "goal < 1) | mean NLL |",
        "|---|---|---|---|---|---|---|",
    ]
    medians: dict[str, dict[str, float]] = {}
    for label in codes:
        medians[label] = {k: median(label, "decode", f"{k}_ms") for k in ("sink", "dynamic")}
        medians[label]["stream"] = median(label, "stream", "seconds")
        ratios = [r["sink_ms"] / r["dynamic_ms"] for r in runs.get((label, "decode"), [])]  # each run's own
        ratio = statistics.median(ratios) if ratios else math.nan
        lines.append(
            f"| {label} (`{codes[label]}`) | {medians[label]['sink']:.2f} | {medians[label]['dynamic']:.2f} | "
            f"**{ratio:.3f}** | {medians[label]['stream']:.1f} | **{medians[label]['stream'] / dense:.3f}** | "
            f"{median(label, 'stream', 'nll'):.4f} |"
        )
    lines += [
        f"\n{label} / {first}: decode with SinkCache **{medians[label]['sink'] / medians[first]['sink']:.3f}**, "
        f"chunked stream **{medians[label]['stream'] / medians[first]['stream']:.3f}** (goal: within 5%)."
        for label in others
    ]
    for label in codes:
        compiled = runs.get((label, "compiled"), [])
        if compiled:
            ratios = [r["sink_compiled_ms"] / r["static_compiled_ms"] for r in compiled]
            lines.append(
                f"\n{label}: compiled decode ms/token (generate's own compile, inductor): SinkCache at "
                f"{args.decode_at:,} {median(label, 'compiled', 'sink_compiled_ms'):.2f}, StaticCache of "
                f"{SINKS + WINDOW:,} {median(label, 'compiled', 'static_compiled_ms'):.2f}: "
                f"**{statistics.median(ratios):.3f}** (goal <= 1.05; each run's own: "
                + ", ".join(f"{r:.3f}" for r in ratios)
                + ")"
            )
        segments = median(first, "segments", "seconds")
        if not math.isnan(segments):
            lines.append(
                f"\n{label}: the stream of {args.tokens:,} in chunks of {args.chunk_size} against the same tokens "
                f"read as dense segments of {SINKS + WINDOW:,} ({segments:.1f} s): "
                f"**{medians[label]['stream'] / segments:.3f}** (goal <= 1.3)"
            )
    lines += ["", "Runs: " + "; ".join(f"{label} {part} {values}" for (label, part), values in runs.items())]
    return "\n".join(lines)


def _in_range(function, label: str):
    """``function``, run inside a profiler range called ``label`` (the benchmark's own, the library unchanged)."""

    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(label):
            return function(*args, **kwargs)

    return wrapped


SINK_CHANNELS = "sink channels: each query's logits against the sinks"


def profile(args) -> str:
    """Where the time of a chunked stream and of eager decoding steps goes: each stage of the pipeline timed
    inside a profiler range (inclusive), the attention kernel by its op, the rest the model's own ops."""
    from transformers import AutoTokenizer

    from hf_attnscale.evaluation.corpus import builtin_documents
    from hf_attnscale.evaluation.long_texts import joined_documents
    from hf_attnscale.streaming import cache as cache_module, plan as plan_module, step as step_module

    stages = {
        "plan: positions, visibility, mask, eviction": [
            (step_module, "build_plan"),
            (step_module, "decode_plan"),
        ],
        "RoPE: cos/sin of the call's positions and moves": [(plan_module.StepPlan, "rotations")],
        "cache update: stores, sinks rotated, compaction copies, sink copies": [
            (cache_module.SinkCacheLayer, "update")
        ],
    }
    for label, places in stages.items():
        for owner, name in places:
            setattr(owner, name, _in_range(getattr(owner, name), label))
    channel_hooks = step_module._sink_channel_hooks

    def timed_hooks(*arguments):  # the sink channels' query logits
        hooks = channel_hooks(*arguments)
        return dataclasses.replace(hooks, query=_in_range(hooks.query, SINK_CHANNELS))

    step_module._sink_channel_hooks = timed_hooks
    model = build_model(args)
    tokenizer = AutoTokenizer.from_pretrained(hfa.fetch(args.shape))
    text = joined_documents(builtin_documents("heldout"), tokenizer, args.tokens + args.steps + 1)[0].text
    ids = torch.tensor(tokenizer(text)["input_ids"][: args.tokens + args.steps + 1])
    tables = []
    for label in ("chunked stream", "eager decoding steps"):
        cache = hfa.SinkCache(SINKS, WINDOW)
        with torch.no_grad():
            if label != "chunked stream":
                model(ids[None, : args.tokens], past_key_values=cache)
            started = time.perf_counter()
            with torch.profiler.profile() as prof:
                if label == "chunked stream":
                    for start in range(0, args.tokens, args.chunk_size):
                        model(ids[None, start : start + args.chunk_size], past_key_values=cache)
                else:
                    for t in range(args.tokens, args.tokens + args.steps):
                        model(ids[None, t : t + 1], past_key_values=cache)
            total = time.perf_counter() - started
        events = prof.key_averages()
        parts = {e.key: e.cpu_time_total / 1e6 for e in events if e.key in {*stages, SINK_CHANNELS}}
        parts["attention kernel (sdpa)"] = (
            sum(
                e.cpu_time_total
                for e in events
                if e.key.startswith("aten::_scaled_dot_product") and "for_cpu" in e.key
            )
            / 1e6
        )
        parts["the model's own ops (projections, MLP, norms, logits) and the rest"] = total - sum(
            parts.values()
        )
        what = (
            f"{args.tokens:,} tokens in chunks of {args.chunk_size}"
            if label == "chunked stream"
            else f"{args.steps} steps past {args.tokens:,}"
        )
        rows = [f"| {name} | {seconds:.2f} | {seconds / total:.1%} |" for name, seconds in parts.items()]
        tables.append(
            f"{label} ({what}; {total:.1f} s under the profiler)\n\n| where | s | share |\n|---|---|---|\n"
            + "\n".join(rows)
        )
    return f"{args.shape}, `SinkCache({SINKS}, {WINDOW})`. {setup(args)}.\n\n" + "\n\n".join(tables)


def rotate_on_read(args) -> str:
    """The least that storing keys un-rotated would add to a decode step: each layer's keys rotated on read."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = build_model(args)
    config, slots = model.config, SINKS + WINDOW
    keys = torch.randn(1, config.num_key_value_heads, slots, config.head_dim)
    # a table of cos and sin, read at the stored keys' positions as a cache would
    table = model.model.rotary_emb(keys, torch.arange(2 * slots)[None])
    positions = torch.randperm(2 * slots)[:slots]
    ids = stream_ids(slots - 1)[None]

    def rotation_ms() -> float:
        """All layers' reads: gather cos and sin, rotate the keys with the family's own function (no query)."""
        times = []
        for _ in range(200):
            start = time.perf_counter()
            cos, sin = (t[:, positions] for t in table)
            apply_rotary_pos_emb(keys[:, :0], keys, cos, sin)
            times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times) * config.num_hidden_layers

    def decode_ms() -> float:
        clock = _StepClock()
        model.generate(
            ids, past_key_values=DynamicCache(config=config), stopping_criteria=[clock], **_greedy(33)
        )
        return 1000 * statistics.median(b - a for a, b in itertools.pairwise(clock.times))

    rotation, decode = [], []
    for _ in range(args.rounds):
        rotation.append(rotation_ms())
        decode.append(decode_ms())
    extra = statistics.median(r / d for r, d in zip(rotation, decode))
    return (
        f"{args.shape}: rotating the {slots:,} stored keys of all {config.num_hidden_layers} layers on every read "
        f"(`apply_rotary_pos_emb` after gathering cos and sin from a table) against a decode step through a "
        f"`DynamicCache` holding {slots - 1:,}; medians of {args.rounds} interleaved rounds. {setup(args)}.\n\n"
        "| rotation per token (ms) | decode per token (ms) | rotation / decode |\n|---|---|---|\n"
        f"| {statistics.median(rotation):.2f} | {statistics.median(decode):.2f} | **{extra:.3f}** |"
    )


CHILD_FLAGS = (
    "threads",
    "device",
    "dtype",
    "tokens",
    "chunk_size",
    "decode_at",
    "dynamic_at",
    "steps",
    "rounds",
)
"""The `checkpoint` settings its child processes take."""


# ---------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in (
        "throughput",
        "memory",
        "latency",
        "quality",
        "local",
        "checkpoint",
        "rotate-on-read",
        "profile",
        "_memory_child",
        "_checkpoint_child",
    ):
        p = sub.add_parser(name)
        p.add_argument("--threads", type=int, default=1)
        p.add_argument("--chunk-size", type=int, default=512)
        p.add_argument("--device", default="cpu")
        if name not in ("quality", "local"):  # they read real checkpoints as they are
            p.add_argument("--dtype", default="float32")
            real = name in ("checkpoint", "rotate-on-read", "profile", "_checkpoint_child")
            p.add_argument(
                "--shape",
                choices=[*REAL] if real else ["default", *SHAPES, *REAL],
                default=REAL[0] if real else "default",
            )
    sub.choices["throughput"].add_argument("--tokens", type=int, default=3072)
    sub.choices["throughput"].add_argument("--repeats", type=int, default=3)
    sub.choices["throughput"].add_argument(
        "--recompute-tokens", type=int, default=16, help="0: leave re-computation out"
    )
    sub.choices["throughput"].add_argument(
        "--token-by-token",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the token-by-token reference (slow on long streams)",
    )
    sub.choices["quality"].add_argument("--tokens", type=int, default=2048)
    sub.choices["local"].add_argument("--tokens", type=int, default=4096)
    sub.choices["local"].add_argument("--windows", type=int, nargs="+", default=[508, 2044])
    sub.choices["local"].add_argument("--repeats", type=int, default=3)
    sub.choices["quality"].add_argument("--documents", type=int, default=3)
    sub.choices["memory"].add_argument("--short", type=int, default=8192)
    sub.choices["memory"].add_argument("--long", type=int, default=65536)
    sub.choices["_memory_child"].add_argument("--tokens", type=int, required=True)
    sub.choices["latency"].add_argument("--positions", type=int, nargs=2, default=[1024, 16384])
    sub.choices["latency"].add_argument("--steps", type=int, default=32)
    sub.choices["latency"].add_argument("--rounds", type=int, default=8)
    for name in ("checkpoint", "_checkpoint_child"):
        p = sub.choices[name]
        p.add_argument("--tokens", type=int, default=16384, help="the stream and the dense forward")
        p.add_argument("--decode-at", type=int, default=8192, help="where SinkCache decodes")
        p.add_argument("--dynamic-at", type=int, default=1024, help="the tokens DynamicCache holds")
        p.add_argument("--steps", type=int, default=32, help="greedy steps per round")
        p.add_argument("--rounds", type=int, default=4, help="rounds per run, the caches alternating")
    sub.choices["checkpoint"].add_argument("--repeats", type=int, default=5)
    sub.choices["rotate-on-read"].add_argument("--rounds", type=int, default=5)
    sub.choices["profile"].add_argument("--tokens", type=int, default=8192)
    sub.choices["profile"].add_argument("--steps", type=int, default=32)
    sub.choices["checkpoint"].add_argument(
        "--parts",
        nargs="+",
        choices=["decode", "compiled", "stream", "segments", "dense"],
        default=["decode", "stream", "dense"],
    )
    sub.choices["checkpoint"].add_argument(
        "--code", action="append", help="LABEL=FOLDER of a version's source (default: this checkout)"
    )
    sub.choices["_checkpoint_child"].add_argument(
        "--part", choices=["decode", "compiled", "stream", "segments", "dense"], required=True
    )
    sub.choices["_checkpoint_child"].add_argument("--ids", required=True)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()  # generate() warns once a stream passes max_position_embeddings
    if args.command in ("_memory_child", "_checkpoint_child"):
        (_memory_child if args.command == "_memory_child" else _checkpoint_child)(args)
        return
    if args.command == "checkpoint" and not args.code:
        args.code = [f"this checkout={Path(__file__).resolve().parents[1]}"]
    start = time.perf_counter()
    commands = {
        "throughput": throughput,
        "memory": memory,
        "latency": latency,
        "quality": quality,
        "local": local,
        "checkpoint": checkpoint,
        "rotate-on-read": rotate_on_read,
        "profile": profile,
    }
    report = commands[args.command](args)
    command = "python benchmarks/bench_streaming.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"\n### {args.command}\n\n`{command.strip()}` ({time.perf_counter() - start:.0f} s)\n\n{report}\n")


if __name__ == "__main__":
    main()
