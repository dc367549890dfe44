"""What PoSE and S²-Attn cost a fine-tuning step (issue 86), on the real SmolLM2, in one run.

One step = forward, backward and AdamW step of LoRA+ (`hfa.lora_config(model, long_context=True)`: LoRA on the
attention, embeddings and norms trained) on one window of ``--window`` tokens. Variants, each a copy of the same
weights on the same tokens: a plain step; PoSE (the same step with `hfa.pose_position_ids` toward
``--target``: only the position ids differ); S²-Attn (`shifted_sparse_group` of a quarter of the window). The
variants are interleaved step by step, so load from other jobs hits them alike; reported: each one's median step
and the median of its per-round ratios to the plain step.

    python benchmarks/bench_long_context_step.py --window 1024 --repeats 5 --threads 2
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time

import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM

import hf_attnscale as hfa


def variants(window: int, rank: int) -> dict[str, torch.nn.Module]:
    """The plain model for the plain and PoSE steps, and the same patched with S²-Attn, each under LoRA+."""
    base = hfa.from_pretrained(AutoModelForCausalLM, str(hfa.fetch("smollm2-135m")), dtype=torch.float32)
    built = {}
    for name in ("plain", "PoSE", "S²-Attn"):
        model = copy.deepcopy(base)
        if name == "S²-Attn":
            hfa.patch(model, shifted_sparse_group=window // 4)
        torch.manual_seed(0)
        built[name] = get_peft_model(model, hfa.lora_config(model, r=rank, long_context=True)).train()
    return built


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids, positions) -> float:
    start = time.perf_counter()
    model(input_ids=ids, labels=ids, position_ids=positions, use_cache=False).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--target", type=int, default=32768)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    models = variants(args.window, args.rank)
    optimizers = {
        name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-5)
        for name, m in models.items()
    }
    vocab = models["plain"].get_base_model().config.vocab_size
    ids = torch.randint(4, vocab, (1, args.window), generator=torch.Generator().manual_seed(0))
    running = torch.arange(args.window)[None]
    skipped = hfa.pose_position_ids(args.window, args.target, 2, torch.Generator().manual_seed(0))[None]
    positions = {"plain": running, "PoSE": skipped, "S²-Attn": running}
    times: dict[str, list[float]] = {name: [] for name in models}
    for round_ in range(args.warmup + args.repeats):
        for name, model in models.items():
            seconds = step(model, optimizers[name], ids, positions[name])
            if round_ >= args.warmup:
                times[name].append(seconds)
    plain = times["plain"]
    results = {
        name: {
            "median_s": statistics.median(ts),
            "median_paired_ratio": statistics.median(t / p for t, p in zip(ts, plain)),
        }
        for name, ts in times.items()
    }
    setup = {
        "model": "smollm2-135m",
        "window": args.window,
        "target": args.target,
        "group": args.window // 4,
        "lora_rank": args.rank,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": platform.processor() or platform.machine(),
    }
    print(json.dumps(setup))
    print(f"{'variant':<12}{'median step (s)':>16}{'paired ratio':>14}")
    for name, r in results.items():
        print(f"{name:<12}{r['median_s']:16.2f}{r['median_paired_ratio']:14.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": setup, "results": results, "times": times}, f, indent=2)


if __name__ == "__main__":
    main()
