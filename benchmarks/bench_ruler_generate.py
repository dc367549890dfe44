"""One RULER prompt as a ``generate_until`` request through the ``hf-attnscale`` model type (issue 84): its time and
the process's peak memory, with a patch or without:

    python benchmarks/bench_ruler_generate.py --tokens 32768 --model_args rerope_window=2048,scale=logn,train_length=8192
    python benchmarks/bench_ruler_generate.py --tokens 32768          # unpatched

lm-eval's ``simple_evaluate`` runs RULER's ``niah_single_1`` with ``--limit 1`` (its first sample, drawn once and
kept: `hf_attnscale.integrations.lm_eval_ruler`) on SmolLM2-135M-Instruct, float32, the CPU, ``batch_size=1``,
greedy, RULER's 128 tokens to generate. Time: the ``generate_until`` call alone (prefill and every step); memory:
the process's peak resident set over its whole life (VmHWM), model included. Run each in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

import hf_attnscale as hfa
from hf_attnscale.integrations.lm_eval_model import HFAttnScaleLM
from hf_attnscale.integrations.lm_eval_ruler import offline_and_cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument(
        "--model_args", default="", help="patch options, comma-separated, as lm-eval takes them"
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    timed: list[float] = []
    generate = HFAttnScaleLM.generate_until

    def generate_until(self, requests, disable_tqdm: bool = False):
        started = time.perf_counter()
        try:
            return generate(self, requests, disable_tqdm)
        finally:
            timed.append(time.perf_counter() - started)

    HFAttnScaleLM.generate_until = generate_until
    path = str(hfa.fetch("smollm2-135m"))
    model_args = f"pretrained={path},dtype=float32,max_length={args.tokens + 512}" + (
        f",{args.model_args}" if args.model_args else ""
    )
    with offline_and_cached():
        results = simple_evaluate(
            model="hf-attnscale",
            model_args=model_args,
            tasks=["niah_single_1"],
            task_manager=TaskManager(metadata={"tokenizer": path, "max_seq_lengths": [args.tokens]}),
            limit=1,
            batch_size=1,
            device="cpu",
            bootstrap_iters=0,
            log_samples=True,
        )
    sample = results["samples"]["niah_single_1"][0]
    report = {
        "tokens": args.tokens,
        "model_args": args.model_args,
        "generate_s": timed[0],
        "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "score": sample[str(args.tokens)],
        "answer": sample["filtered_resps"][0],
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
