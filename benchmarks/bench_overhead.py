"""Overhead of the patch: forward and forward+backward time and peak memory, patched vs unpatched.

A Llama-shaped model (8 layers, d_model 512, 8 heads, GQA 2:1) with random weights, batch 1. Timings of all
variants are interleaved in one process (same weights, same inputs) and the median of several runs is
reported; each variant's peak memory is measured in a fresh subprocess (peak RSS above the loaded model on CPU,
peak allocated on CUDA) so that earlier allocations do not hide it.

    python benchmarks/bench_overhead.py --lengths 512,2048,8192 --device cpu
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


def build_model(device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=16384,
    )
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=dtype).to(device)


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


def peak_memory_worker(variant: str, length: int, backward: bool, device: str, dtype: str) -> None:
    """Run one pass and print the peak memory in MiB above the loaded model (runs in a subprocess)."""
    model = build_model(device, getattr(torch, dtype))
    apply_variant(model, variant)
    ids = torch.randint(0, 1024, (1, length), device=device)
    if device == "cuda":
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


def peak_memory(variant: str, length: int, backward: bool, device: str, dtype: str) -> float:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        variant,
        "--lengths",
        str(length),
        "--device",
        device,
        "--dtype",
        dtype,
    ] + (["--backward-only"] if backward else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
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
        peak_memory_worker(args.worker, lengths[0], args.backward_only, args.device, args.dtype)
        return
    repeats = [int(x) for x in args.repeats.split(",")]
    model = build_model(args.device, getattr(torch, args.dtype))
    rows = []
    print(
        f"device={args.device} dtype={args.dtype} threads={torch.get_num_threads()} torch={torch.__version__}"
    )
    print("| length | pass | variant | median time (s) | ratio | peak mem (MiB) | ratio |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for length, reps in zip(lengths, repeats + repeats[-1:] * len(lengths)):
        skip_backward = args.no_backward or (args.backward_max_length or length) < length
        for backward in [False] if skip_backward else [False, True]:
            times = time_variants(model, length, backward, reps, args.device)
            mems = {v: peak_memory(v, length, backward, args.device, args.dtype) for v in VARIANTS}
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
