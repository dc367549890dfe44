"""The parts engine's cost on SmolLM2-135M (issues 55, 71): one forward over ``--tokens`` tokens and a decode step
after it, patched with ReRoPE, Self-Extend, DCA or STRING (+ logn) against the unpatched model, each variant in a fresh process, interleaved, medians
of ``--repeats`` runs:

    python benchmarks/bench_rerope.py --tokens 16384 --repeats 3
    python benchmarks/bench_rerope.py --device cuda --shape smollm2-135m-shape --variants "ReRoPE + logn"

Per process: the model is loaded (``--dtype``, default float32; sdpa), ``--tokens`` tokens go through one
forward with the model's own ``DynamicCache`` (``logits_to_keep=1``: the vocabulary's logits are not what is
measured), then ``--steps`` greedy decode steps through that cache (with ``--compile``, steps of the model
compiled with dynamic shapes, as users run them on a GPU). ``--shape smollm2-135m`` (the default) is
the real checkpoint on held-out stdlib text; ``smollm2-135m-shape`` is its shape with random weights and
random tokens, for a machine that cannot fetch it (time does not depend on the weights). Time is wall time; on
CUDA or compiled, of a second pass after a first that warms the kernels up (and compiles), synchronised on CUDA. Memory: on the CPU the
process's peak resident set during the forward (Linux's VmHWM, reset just before it), less its resident set
before it; on CUDA ``torch.cuda.max_memory_allocated`` during the forward, less what was allocated before it.
Ops: the ATen operators that compute (not views) in one more decode step, eager, on the path a GPU takes (the
kept and turned keys joined, where a CPU scores them in place); each is a kernel launch on a GPU, where a small
model's eager step waits on launches. Threads: ``--threads`` (default 1). A smoke run: ``--tokens 256 --window 64 --steps 2 --repeats 1``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

LOGN = {"scale": "logn", "train_length": 8192}
REROPE_LOGN = {"rerope_window": 1024, **LOGN}
VARIANTS = {  # name: (patch options, environment)
    "unpatched": ({}, {}),
    "ReRoPE + logn": (REROPE_LOGN, {}),
    "leaky ReRoPE + logn": ({**REROPE_LOGN, "rerope_leak": 16.0}, {}),
    "ReRoPE + logn, public formulation": (
        REROPE_LOGN,
        {"HF_ATTNSCALE_FUSED_PARTS": "0", "HF_ATTNSCALE_FLEX_PARTS": "0"},
    ),
    # compare's defaults for a model trained at 8k read to 32k (RESULTS section 11's)
    "Self-Extend + logn": ({"self_extend_group": 5, "self_extend_window": 2048, **LOGN}, {}),
    "DCA + logn": ({"dual_chunk_size": 6144, "dual_chunk_local": 512, **LOGN}, {}),
    # STRING at 16k with every far distance inside 8k: S = 16,384 - 8,192 + 128 (RESULTS section 11b's)
    "STRING + logn": ({"string_shift": 8320, "string_local": 128, **LOGN}, {}),
}
"""The default ReRoPE takes the device's fast path: the CPU's fused key parts (`hf_attnscale.core.parts.key_parts`),
CUDA's flex key bands (`hf_attnscale.core.parts.flex_parts`); the public formulation, doubled channels through
public sdpa, is what other devices run."""


OPTIONS = ("tokens", "window", "steps", "threads", "shape", "device", "dtype", "compile")
"""The options a child process takes, by name."""


def child(
    variant: str,
    tokens: int,
    window: int,
    steps: int,
    threads: int,
    shape: str,
    device: str,
    dtype: str,
    compile: bool,
) -> dict:
    """One measurement, in this fresh process."""
    torch.set_num_threads(threads)
    from bench_overhead import build_model
    from transformers import AutoTokenizer

    import hf_attnscale as hfa
    from hf_attnscale.evaluation.corpus import builtin_documents

    model = build_model(device, getattr(torch, dtype), shape).eval()
    options = {k: (window if k == "rerope_window" else v) for k, v in VARIANTS[variant][0].items()}
    if options:
        hfa.patch(model, **options)
    if shape == "smollm2-135m":
        tokenizer = AutoTokenizer.from_pretrained(hfa.fetch(shape))
        text = "\n".join(doc.text for doc in builtin_documents("heldout"))
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
        assert ids.shape[1] == tokens, f"the held-out text has only {ids.shape[1]} tokens"
    else:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(3, model.config.vocab_size, (1, tokens), generator=generator)
    ids, cuda = ids.to(device), device.startswith("cuda")
    step = torch.compile(model, dynamic=True) if compile else model  # the decode steps, as users compile them
    measures = [
        measure(model, step, ids, steps, cuda) for _ in range(2 if cuda or compile else 1)
    ]  # warmed up
    return measures[-1]


def measure(model, step, ids: torch.Tensor, steps: int, cuda: bool) -> dict:
    """One forward of ``model`` over ``ids`` through a fresh cache, then ``steps`` greedy decode steps of
    ``step`` (the model, or the model compiled)."""
    from transformers import DynamicCache

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated() / 2**10
    else:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: the peak resident set (VmHWM) starts again
        resident = _status_kib("VmRSS")
    with torch.no_grad():
        sync()
        started = time.perf_counter()
        out = model(input_ids=ids, past_key_values=DynamicCache(config=model.config), logits_to_keep=1)
        sync()
        forward = time.perf_counter() - started
        peak = torch.cuda.max_memory_allocated() / 2**10 if cuda else _status_kib("VmHWM")
        cache, token, step_times = out.past_key_values, out.logits[:, -1:].argmax(-1), []
        for _ in range(steps):
            sync()
            started = time.perf_counter()
            out = step(input_ids=token, past_key_values=cache, logits_to_keep=1)
            token = out.logits[:, -1:].argmax(-1)
            sync()
            step_times.append(time.perf_counter() - started)
        with CountOps() as counted, gpu_path():  # one more step, eager and untimed
            model(input_ids=token, past_key_values=cache, logits_to_keep=1)
    return {
        "forward_s": forward,
        "decode_ms": 1000 * statistics.median(step_times),
        "forward_peak_gib": (peak - resident) / 2**20,
        "decode_ops": counted.ops,
    }


@contextlib.contextmanager
def gpu_path():
    """The decoding step a GPU takes, on any device: the kept and turned keys joined, one call (a CPU scores
    them where they lie, `decode.scores_in_place`, which launches more operators and copies no key)."""
    from hf_attnscale.core.parts import decode

    where = decode.scores_in_place
    decode.scores_in_place = lambda run, query: False
    try:
        yield
    finally:
        decode.scores_in_place = where


class CountOps(TorchDispatchMode):
    """The ATen operators that compute (views left out) in its block: each is at least one kernel launch on a
    GPU, where an eager decoding step of a small model waits on launches more than on arithmetic."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


def _status_kib(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in KiB."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1])


def where(args) -> str:
    """The device the numbers come from, in words."""
    if args.device.startswith("cuda"):
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"{args.threads} thread(s), {platform.processor() or platform.machine()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shape", choices=["smollm2-135m", "smollm2-135m-shape"], default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--variants", nargs="*", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument(
        "--compile",
        action="store_true",
        help="decode through torch.compile(model, dynamic=True), as users compile their steps (a first pass "
        "compiles and is not timed)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, **{k: getattr(args, k) for k in OPTIONS})))
        return
    runs: dict[str, list[dict]] = {name: [] for name in ["unpatched", *args.variants]}
    for repeat in range(args.repeats):
        for name in runs:  # interleaved: each repeat runs every variant once, in a fresh process
            command = [sys.executable, __file__, "--child", name]
            command += [f"--{k}={getattr(args, k)}" for k in OPTIONS if k != "compile"]
            command += ["--compile"] if args.compile else []
            environment = {**os.environ, **VARIANTS[name][1]}
            done = subprocess.run(command, capture_output=True, text=True, check=True, env=environment)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"repeat {repeat + 1}/{args.repeats} {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    median = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    base = median["unpatched"]
    print(
        f"{args.shape}, {args.tokens} tokens, ReRoPE w={args.window}, {args.dtype}, sdpa, {where(args)}"
        f"{', decode steps compiled' if args.compile else ''}; "
        f"medians of {args.repeats} interleaved fresh-process runs\n"
    )
    print(
        "| variant | forward (s) | x unpatched | forward peak (GiB) | x unpatched | decode step (ms) | x unpatched "
        "| ops per decode step | x unpatched |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, m in median.items():
        print(
            f"| {name} | {m['forward_s']:.3f} | {m['forward_s'] / base['forward_s']:.2f} | "
            f"{m['forward_peak_gib']:.2f} | {m['forward_peak_gib'] / base['forward_peak_gib']:.2f} | "
            f"{m['decode_ms']:.1f} | {m['decode_ms'] / base['decode_ms']:.2f} | "
            f"{m['decode_ops']:.0f} | {m['decode_ops'] / base['decode_ops']:.2f} |"
        )


if __name__ == "__main__":
    main()
