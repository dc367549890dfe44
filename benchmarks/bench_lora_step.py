"""Step time of LoRA fine-tuning on a patched model against the same model unpatched, in one run.

One training step = forward, backward and AdamW step of a PEFT LoRA model (r=8 on the attention
projections; the patch's sink logits trained alongside when it has them). Every variant is a copy of the same
base weights, trained on the same batch. The variants are interleaved step by step, so load from other jobs
hits them alike, and the median over the steps is reported, with the median of the per-round ratios to the
unpatched step (a paired ratio, the more robust of the two).

    python benchmarks/bench_lora_step.py --model shipped --length 512 --batch-size 4 --repeats 15 --threads 1
    python benchmarks/bench_lora_step.py --model llama-3.2-1b --device cuda --dtype bfloat16 --length 8192 \
        --batch-size 1 --repeats 15                      # issue #12
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time

import torch
from bench_overhead import SHAPES, build_model  # the same Llama shapes (scripts run from benchmarks/)
from peft import get_peft_model

import hf_attnscale as hfa

VARIANTS: dict[str, dict | None] = {
    "unpatched": None,
    "logn+sink(learnable)": {"scale": "logn", "sink_logit": "learnable"},
    "logn+zero_kv": {"scale": "logn", "zero_kv": True},
}


def base_model(name: str, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, int]:
    """(model, trained length): the shipped checkpoint, or one of bench_overhead.py's Llama shapes."""
    if name == "shipped":
        from hf_attnscale.checkpoints.models import load_default_model

        model, _ = load_default_model()
        return model.to(device, dtype), model.config.max_position_embeddings
    return build_model(device, dtype, name), 512


def build_variants(
    name: str, rank: int, device: str, dtype: torch.dtype
) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
    base, trained = base_model(name, device, dtype)
    built = {}
    for variant, options in VARIANTS.items():
        model = copy.deepcopy(base)
        if options is not None:
            hfa.patch(model, train_length=trained, **options)
        torch.manual_seed(0)
        peft_model = get_peft_model(model, hfa.lora_config(model, r=rank, lora_alpha=2 * rank))
        optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-4)
        built[variant] = (peft_model.train(), optimizer)
    return built


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["shipped", *SHAPES], default="shipped")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help="the base weights' dtype (LoRA trains in it too)")
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    variants = build_variants(args.model, args.rank, args.device, getattr(torch, args.dtype))
    vocab = next(iter(variants.values()))[0].get_base_model().config.vocab_size
    ids = torch.randint(4, vocab, (args.batch_size, args.length), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.warmup):
        for model, optimizer in variants.values():
            step(model, optimizer, ids)
    for _ in range(args.repeats):
        for name, (model, optimizer) in variants.items():
            times[name].append(step(model, optimizer, ids))

    base = times["unpatched"]
    results = {
        name: {
            "median_s": statistics.median(ts),
            "ratio_of_medians": statistics.median(ts) / statistics.median(base),
            "median_paired_ratio": statistics.median(t / b for t, b in zip(ts, base)),
        }
        for name, ts in times.items()
    }
    setup = {
        "model": args.model,
        "batch": args.batch_size,
        "length": args.length,
        "lora_rank": args.rank,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if ids.is_cuda else platform.processor() or platform.machine(),
        "cuda": torch.version.cuda,
    }
    print(json.dumps(setup))
    print(f"{'variant':<24}{'median step (s)':>16}{'ratio of medians':>18}{'paired ratio':>14}")
    for name, r in results.items():
        print(f"{name:<24}{r['median_s']:16.3f}{r['ratio_of_medians']:18.3f}{r['median_paired_ratio']:14.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": setup, "results": results, "times": times}, f, indent=2)


if __name__ == "__main__":
    main()
