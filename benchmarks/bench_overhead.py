"""Overhead of the patch: forward and forward+backward time and peak memory, patched vs unpatched.

A Llama-shaped model with random weights (`SHAPES`: by default 8 layers, d_model 512, 8 heads, GQA 2:1),
batch 1. Timings of all variants are interleaved in one process (same weights, same inputs) and the median of
several runs is reported; each variant's peak memory is measured in a fresh subprocess (peak RSS above the
loaded model on CPU, peak allocated on CUDA) so that earlier allocations do not hide it.

    python benchmarks/bench_overhead.py --lengths 512,2048,8192 --device cpu
    python benchmarks/bench_overhead.py --shape llama-3.2-1b --dtype bfloat16 --device cuda \
        --lengths 4096,16384,32768 --repeats 7,5,3          # issue #12 (also --attn flash_attention_2 / flex_attention)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_attnscale as hfa

VARIANTS = {
    "unpatched": None,
    "logn": {"scale": "logn", "train_length": 512},
    "logn+zero_kv": {"scale": "logn", "train_length": 512, "zero_kv": True},
}


SHAPES = {
    "llama-8x512": {
        "vocab_size": 1024,
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 16384,
    },
    "llama-3.2-1b": {  # meta-llama/Llama-3.2-1B's config.json, random weights
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
    },
}
"""Model shapes: the CPU benchmark's small Llama, and Llama-3.2-1B's for the GPU (issue #12)."""


def build_model(
    device: str, dtype: torch.dtype, shape: str = "llama-8x512", attn: str = "sdpa"
) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape])
    return LlamaForCausalLM._from_config(config, attn_implementation=attn, dtype=dtype).to(device)


def apply_variant(model: LlamaForCausalLM, name: str) -> None:
    hfa.unpatch(model)
    if VARIANTS[name] is not None:
        hfa.patch(model, **VARIANTS[name])


def run_once(model, ids, backward: bool) -> float:
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    model.zero_grad(set_to_none=True)
    sync()
    start = time.perf_counter()
    if backward:
        model(input_ids=ids, labels=ids).loss.backward()
    else:
        with torch.no_grad():
            model(input_ids=ids)
    sync()
    return time.perf_counter() - start


def time_variants(model, length: int, backward: bool, repeats: int, device: str) -> dict[str, float]:
    ids = torch.randint(0, 1024, (1, length), device=device)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for name in VARIANTS:  # warm-up
        apply_variant(model, name)
        run_once(model, ids, backward)
    for _ in range(repeats):
        for name in VARIANTS:
            apply_variant(model, name)
            times[name].append(run_once(model, ids, backward))
    return {name: statistics.median(ts) for name, ts in times.items()}


def peak_memory_worker(args, variant: str, length: int, backward: bool) -> None:
    """Run one pass and print the peak memory in MiB above the loaded model (runs in a subprocess)."""
    device = args.device
    model = build_model(device, getattr(torch, args.dtype), args.shape, args.attn)
    apply_variant(model, variant)
    ids = torch.randint(0, 1024, (1, length), device=device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run_once(model, ids, backward)
        print(json.dumps((torch.cuda.max_memory_allocated() - base) / 2**20))
    else:
        # Reset the kernel's peak-RSS mark (Linux), so model construction does not hide the run's peak.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _status_kib("VmRSS")
        run_once(model, ids, backward)
        print(json.dumps((_status_kib("VmHWM") - base) / 1024))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_memory(args, variant: str, length: int, backward: bool) -> float:
    cmd = [sys.executable, __file__, "--worker", variant, "--lengths", str(length), "--device", args.device]
    cmd += ["--dtype", args.dtype, "--shape", args.shape, "--attn", args.attn]
    cmd += ["--backward-only"] if backward else []
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--shape", choices=SHAPES, default="llama-8x512", help="the model's shape")
    parser.add_argument(
        "--attn", default="sdpa", help="attention backend (sdpa, flash_attention_2, flex_attention)"
    )
    parser.add_argument("--repeats", default="7,5,3", help="timed runs per length (median reported)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: torch's default)")
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument(
        "--backward-max-length", type=int, default=None, help="forward only above this length"
    )
    parser.add_argument("--backward-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.worker:
        peak_memory_worker(args, args.worker, lengths[0], args.backward_only)
        return
    repeats = [int(x) for x in args.repeats.split(",")]
    model = build_model(args.device, getattr(torch, args.dtype), args.shape, args.attn)
    rows = []
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(
        f"shape={args.shape} attn={args.attn} device={args.device} ({name}) dtype={args.dtype} "
        f"threads={torch.get_num_threads()} torch={torch.__version__} cuda={torch.version.cuda}"
    )
    print("| length | pass | variant | median time (s) | ratio | peak mem (MiB) | ratio |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for length, reps in zip(lengths, repeats + repeats[-1:] * len(lengths)):
        skip_backward = args.no_backward or (args.backward_max_length or length) < length
        for backward in [False] if skip_backward else [False, True]:
            times = time_variants(model, length, backward, reps, args.device)
            mems = {v: peak_memory(args, v, length, backward) for v in VARIANTS}
            for v in VARIANTS:
                row = {
                    "length": length,
                    "pass": "fwd+bwd" if backward else "fwd",
                    "variant": v,
                    "time_s": times[v],
                    "time_ratio": times[v] / times["unpatched"],
                    "peak_mib": mems[v],
                    "mem_ratio": mems[v] / mems["unpatched"],
                    "repeats": reps,
                }
                rows.append(row)
                print(
                    f"| {length} | {row['pass']} | {v} | {row['time_s']:.4f} | {row['time_ratio']:.3f} | "
                    f"{row['peak_mib']:.0f} | {row['mem_ratio']:.3f} |",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
