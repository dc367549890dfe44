"""Overhead of the patch: forward and forward+backward time and peak memory, patched vs unpatched.

A Llama-shaped model with random weights (`SHAPES`: by default 8 layers, d_model 512, 8 heads, GQA 2:1),
batch 1. Timings of all variants are interleaved in one process (same weights, same inputs) and the median of
several runs is reported. Peak memory above the loaded model: on CUDA in this process
(``torch.cuda.max_memory_allocated`` after a reset); on the CPU in a fresh subprocess per cell (peak RSS), since
freed host memory would hide a later variant's peak. ``--padded`` left-pads the row by 8 tokens, so the model
builds a 4D mask (the exit then adds one visible column to it).

    python benchmarks/bench_overhead.py --lengths 512,2048,8192 --device cpu
    python benchmarks/bench_overhead.py --lengths 16384 --padded --no-backward --variants unpatched,logn+sink
    python benchmarks/bench_overhead.py --shape llama-3.2-1b --dtype bfloat16 --device cuda \
        --lengths 4096,16384,32768 --repeats 7,5,3          # also --attn flash_attention_2 / flex_attention
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_attnscale as hfa
from hf_attnscale.core.call import fused_exit
from hf_attnscale.core.parts import flex_parts, key_parts

VARIANTS = {
    "unpatched": None,
    "logn": {"scale": "logn", "train_length": 512},
    "logn+zero_kv": {"scale": "logn", "train_length": 512, "zero_kv": True},
    "logn+sink": {"scale": "logn", "train_length": 512, "sink_logit": "learnable"},
    "logn+zero_kv public": {"scale": "logn", "train_length": 512, "zero_kv": True},
    "rerope+logn": {"rerope_window": 1024, "scale": "logn", "train_length": 512},
    "rerope+logn public": {"rerope_window": 1024, "scale": "logn", "train_length": 512},
}
PUBLIC = {"logn+zero_kv public", "rerope+logn public"}
"""Variants that take the public formulation, every fast path switched off (the CPU's fused exit and key parts,
CUDA's flex key bands); the others take what a user gets on this device."""
FAST_PATHS = (fused_exit.ENV_SWITCH, key_parts.ENV_SWITCH, flex_parts.ENV_SWITCH)


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
    "smollm2-135m-shape": {  # HuggingFaceTB/SmolLM2-135M's config.json, random weights (no download)
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
    },
}
"""Model shapes: the CPU benchmark's small Llama, Llama-3.2-1B's for the GPU (issue #12), and SmolLM2-135M's
for ReRoPE's cost on a machine that cannot fetch the checkpoint (`bench_rerope.py --shape`)."""


REAL = ("smollm2-135m",)
"""Real checkpoints `--shape` also takes (fetched with `hfa.fetch` on first use)."""


def build_model(
    device: str, dtype: torch.dtype, shape: str = "llama-8x512", attn: str = "sdpa"
) -> LlamaForCausalLM:
    if shape in REAL:
        from transformers import AutoModelForCausalLM

        path = str(hfa.fetch(shape))
        return hfa.from_pretrained(AutoModelForCausalLM, path, dtype=dtype, attn_implementation=attn).to(
            device
        )
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape])
    return LlamaForCausalLM._from_config(config, attn_implementation=attn, dtype=dtype).to(device)


def apply_variant(model: LlamaForCausalLM, name: str) -> None:
    hfa.unpatch(model)
    for switch in FAST_PATHS:
        os.environ[switch] = "0" if name in PUBLIC else "1"
    if VARIANTS[name] is not None:
        hfa.patch(model, **VARIANTS[name])


def make_inputs(length: int, padded: bool, device: str) -> dict[str, torch.Tensor]:
    """One row of ``length`` random tokens; ``padded``: its first 8 are padding (the model builds a 4D mask)."""
    ids = torch.randint(0, 1024, (1, length), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    if padded:
        mask[:, :8] = 0
    return {"input_ids": ids, "attention_mask": mask}


def run_once(model, inputs, backward: bool) -> float:
    sync = torch.cuda.synchronize if inputs["input_ids"].is_cuda else (lambda: None)
    model.zero_grad(set_to_none=True)
    sync()
    start = time.perf_counter()
    if backward:
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
    else:
        with torch.no_grad():
            model(**inputs)
    sync()
    return time.perf_counter() - start


def time_variants(model, inputs, backward: bool, repeats: int, variants: list[str]) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in variants}
    for name in variants:  # warm-up
        apply_variant(model, name)
        run_once(model, inputs, backward)
    for _ in range(repeats):
        for name in variants:
            apply_variant(model, name)
            times[name].append(run_once(model, inputs, backward))
    return {name: statistics.median(ts) for name, ts in times.items()}


def cuda_peak_memory(model, variant: str, inputs, backward: bool) -> float:
    """Peak CUDA memory in MiB above what is allocated before the pass, in this process."""
    apply_variant(model, variant)
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run_once(model, inputs, backward)
    model.zero_grad(set_to_none=True)
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def peak_memory_worker(args, variant: str, length: int, backward: bool) -> None:
    """Run one pass and print the peak RSS in MiB above the loaded model (a CPU subprocess)."""
    model = build_model(args.device, getattr(torch, args.dtype), args.shape, args.attn)
    apply_variant(model, variant)
    inputs = make_inputs(length, args.padded, args.device)
    # Reset the kernel's peak-RSS mark (Linux), so model construction does not hide the run's peak.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kib("VmRSS")
    run_once(model, inputs, backward)
    print(json.dumps((_status_kib("VmHWM") - base) / 1024))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_memory(args, variant: str, length: int, backward: bool) -> float:
    cmd = [sys.executable, __file__, "--worker", variant, "--lengths", str(length), "--device", args.device]
    cmd += ["--dtype", args.dtype, "--shape", args.shape, "--attn", args.attn]
    cmd += ["--backward-only"] if backward else []
    cmd += ["--padded"] if args.padded else []
    # A fixed mmap threshold: glibc's default one rises as large blocks are freed, after which freed tensors stay
    # in the heap and the peak RSS reflects the allocator's history more than the live tensors (+-50% at 2k).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--shape",
        choices=[*SHAPES, *REAL],
        default="llama-8x512",
        help="the model's shape, or a real checkpoint",
    )
    parser.add_argument(
        "--attn", default="sdpa", help="attention backend (sdpa, flash_attention_2, flex_attention)"
    )
    parser.add_argument("--repeats", default="7,5,3", help="timed runs per length (median reported)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: torch's default)")
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument("--padded", action="store_true", help="left-pad the row by 8 tokens (a 4D mask)")
    parser.add_argument("--memory-only", action="store_true", help="measure memory, not time")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
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
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or variants[0] != "unpatched":
        parser.error(
            f"--variants: 'unpatched' first, then any of {', '.join(VARIANTS)} (got {args.variants})"
        )
    model = build_model(args.device, getattr(torch, args.dtype), args.shape, args.attn)
    rows = []
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(
        f"shape={args.shape} attn={args.attn} device={args.device} ({name}) dtype={args.dtype} padded={args.padded} "
        f"threads={torch.get_num_threads()} torch={torch.__version__} cuda={torch.version.cuda}"
    )
    print("| length | pass | variant | median time (s) | ratio | peak mem (MiB) | ratio |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for length, reps in zip(lengths, repeats + repeats[-1:] * len(lengths)):
        skip_backward = args.no_backward or (args.backward_max_length or length) < length
        inputs = make_inputs(length, args.padded, args.device)
        for backward in [False] if skip_backward else [False, True]:
            times = (
                dict.fromkeys(variants, float("nan"))
                if args.memory_only
                else time_variants(model, inputs, backward, reps, variants)
            )
            if args.device.startswith("cuda"):
                mems = {v: cuda_peak_memory(model, v, inputs, backward) for v in variants}
            else:
                mems = {v: peak_memory(args, v, length, backward) for v in variants}
            for v in variants:
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
