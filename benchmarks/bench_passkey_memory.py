"""One passkey prompt through lm-eval on SmolLM2-135M (issue 70): stock ``HFLM``, which computes logits at every
position of the prompt and log-softmaxes them whole, against the ``hf-attnscale`` model type, which computes them
at the key's positions only. Each run is a fresh process; the two interleave; medians of ``--repeats``:

    python benchmarks/bench_passkey_memory.py --tokens 8192 16384 --repeats 3
    python benchmarks/bench_passkey_memory.py --tokens 32768 65536 --repeats 1 --paths hf-attnscale

Per process: the real checkpoint is loaded (float32, sdpa, the CPU, ``--threads``), one version-2 passkey prompt
of ``--tokens`` tokens is built (depth 100%, seed 0: the needle one filler unit before the question), and its
loglikelihood request is scored with ``batch_size=1`` and ``max_length`` above the prompt (nothing cut). Time:
wall time of the request alone. Memory: the process's peak resident set over its whole life (Linux's VmHWM),
model and tokenizer included, as the experiments' cells report it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time

import torch

PATHS = ("stock HFLM", "hf-attnscale")


def child(path: str, tokens: int, threads: int) -> dict:
    """Score one prompt in this process: its time and the process's peak resident memory."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    import hf_attnscale as hfa
    from hf_attnscale.evaluation.passkey import passkey_prompts
    from hf_attnscale.integrations.lm_eval_model import HFAttnScaleLM

    torch.set_num_threads(threads)
    folder = str(hfa.fetch("smollm2-135m"))
    kind = HFLM if path == "stock HFLM" else HFAttnScaleLM
    lm = kind(pretrained=folder, dtype="float32", device="cpu", batch_size=1, max_length=2 * tokens)
    prompt = passkey_prompts(lm.tokenizer, [tokens], [1.0], seed=0)[0]
    request = Instance("loglikelihood", {}, (prompt.context, " " + prompt.key), 0)
    started = time.perf_counter()
    ((loglikelihood, found),) = lm.loglikelihood([request], disable_tqdm=True)
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "peak_gib": peak_resident_gib(),
        "loglikelihood": loglikelihood,
        "found": found,
    }


def peak_resident_gib() -> float:
    """This process's peak resident set (VmHWM), in GiB."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens[0], args.threads)))
        return
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {args.threads} threads")
    runs: dict[tuple[str, int], list[dict]] = {}
    for tokens in args.tokens:
        for repeat in range(args.repeats):
            for path in args.paths:  # interleaved: path A, path B, path A, ...
                command = [sys.executable, __file__, "--child", path, "--tokens", str(tokens)]
                command += ["--threads", str(args.threads)]
                result = json.loads(
                    subprocess.run(command, capture_output=True, text=True, check=True).stdout
                )
                runs.setdefault((path, tokens), []).append(result)
                print(f"{tokens} tokens, {path}, run {repeat + 1}: {json.dumps(result)}", flush=True)
    print("\n| tokens | path | time (median) | peak memory (median) | key log-likelihood | found |")
    print("|---|---|---|---|---|---|")
    for (path, tokens), results in runs.items():
        seconds = statistics.median(r["seconds"] for r in results)
        peak = statistics.median(r["peak_gib"] for r in results)
        print(
            f"| {tokens:,} | {path} | {seconds:.1f} s | {peak:.2f} GiB | {results[0]['loglikelihood']:.4f} | "
            f"{results[0]['found']} |"
        )


if __name__ == "__main__":
    main()
