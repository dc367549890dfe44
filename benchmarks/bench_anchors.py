"""hf_attnscale's streaming perplexity against mit-han-lab/streaming-llm's, on the same model and tokens (#14).

The anchor runs in its own benchmark-only venv (transformers 4.33, as its README pins) through
`anchor_streaming_llm.py`; this side runs `hfa.perplexity` with ``SinkCache.from_start_recent(S, R)`` (the
anchor's ``start_size=S, recent_size=R``), token by token (``chunk_size=1``, the anchor's method) and chunked
(the default). Both load the shipped tiny Llama from its folder and score the first ``--tokens`` tokens of a
held-out stdlib document. Every run is a fresh process, as the anchor's is, and times only its loop; runs are
interleaved (anchor, token by token, chunked, transformers' own plain-cache loop) for each repeat; the table
gives the median tokens/s and the per-token NLL difference.

Setting up the anchor (once; nothing of it is committed):

    python -m venv /tmp/anchor-venv
    /tmp/anchor-venv/bin/pip install torch==2.13.0 transformers==4.33.0 "numpy<2" accelerate==0.24.1
    git clone https://github.com/mit-han-lab/streaming-llm /tmp/streaming-llm   # or any copy of it

    python benchmarks/bench_anchors.py --anchor-python /tmp/anchor-venv/bin/python \
        --anchor-src /tmp/streaming-llm
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

import hf_attnscale as hfa
from hf_attnscale.checkpoints.models import default_model_path, load_default_model
from hf_attnscale.evaluation.corpus import long_documents

ANCHOR_LOOP = Path(__file__).with_name("anchor_streaming_llm.py")
STOCK = "transformers v5 floor (unpatched, plain cache)"
PATHS = {"token by token": 1, "chunked": 512}  # hfa.perplexity's chunk_size for each path


@torch.no_grad()
def stock_loop(model, ids: torch.Tensor, size: int) -> float:
    """tokens/s of the unpatched model's own token loop with a DynamicCache cut to its last ``size`` tokens
    after every step: transformers v5's per-call cost at the anchor's cache size, without pos-shift (its
    numbers are not the anchor's; only its speed is compared)."""
    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    for t in range(len(ids) - 1):
        logits = model(input_ids=ids[None, t : t + 1], past_key_values=cache, use_cache=True).logits
        torch.nn.functional.cross_entropy(logits[0], ids[t + 1 : t + 2])
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, -size:], layer.values[:, :, -size:]
    return (len(ids) - 1) / (time.perf_counter() - start)


def worker(path: str, ids_file: str, start: int, recent: int, threads: int) -> dict:
    """One timed run of one path of this side, in a fresh process as the anchor's is (only the loop timed)."""
    torch.set_num_threads(threads)
    ids = torch.tensor(json.loads(Path(ids_file).read_text()))
    model, _ = load_default_model()
    if path == STOCK:
        return {"tokens_per_second": stock_loop(model, ids, start + recent + 1), "nll": None}
    hfa.patch(model)
    cache = hfa.SinkCache.from_start_recent(start, recent)
    result = hfa.perplexity(model, ids, cache=cache, chunk_size=PATHS[path], progress=False)
    return {"tokens_per_second": result.tokens_per_second, "nll": result.nll.tolist()}


def run_json(command: list[str], env: dict | None = None) -> dict:
    """Run ``command --out FILE`` (one timed run, in a fresh process) and return the JSON it writes."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([*command, "--out", out.name], env=env, check=True, capture_output=True)
        return json.loads(Path(out.name).read_text())


def run_worker(args, path: str, ids_file: str, start: int, recent: int) -> dict:
    """One run of one path of this side (see `worker`)."""
    return run_json([
        sys.executable, __file__, "--worker", path, "--ids", ids_file, "--start-recent", f"{start}+{recent}",
        "--threads", str(args.threads),
    ])  # fmt: skip


def run_anchor(args, ids_file: str, start: int, recent: int) -> dict:
    """One run of the anchor's loop in its venv; returns its NLLs and tokens/s."""
    env = {**os.environ, "PYTHONPATH": str(args.anchor_src), "TOKENIZERS_PARALLELISM": "false"}
    return run_json([
        args.anchor_python, str(ANCHOR_LOOP), "--model", str(default_model_path()), "--ids", ids_file,
        "--start-size", str(start), "--recent-size", str(recent), "--threads", str(args.threads),
    ], env)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--anchor-python", required=True, help="python of the venv with transformers 4.33")
    parser.add_argument("--anchor-src", required=True, type=Path, help="a copy of mit-han-lab/streaming-llm")
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--configs", nargs="+", default=["4+124", "4+60"], help="start_size+recent_size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    if "--worker" in (argv if argv is not None else sys.argv[1:]):  # internal: one timed run, see `worker`
        internal = argparse.ArgumentParser()
        for name in ("--worker", "--ids", "--start-recent", "--out"):
            internal.add_argument(name, required=True)
        internal.add_argument("--threads", type=int, default=1)
        job = internal.parse_args(argv)
        start, recent = (int(x) for x in job.start_recent.split("+"))
        Path(job.out).write_text(json.dumps(worker(job.worker, job.ids, start, recent, job.threads)))
        return
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    _, tokenizer = load_default_model()
    document = long_documents("heldout", args.tokens, tokenizer)[0]
    ids = torch.tensor(tokenizer(document.text)["input_ids"][: args.tokens])
    rows = []
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids.tolist(), f)
    try:
        for config in args.configs:
            start, recent = (int(x) for x in config.split("+"))
            speed = {"anchor": [], "token by token": [], "chunked": [], STOCK: []}
            for repeat in range(args.repeats):
                anchor = run_anchor(args, f.name, start, recent)
                anchor_nll = torch.tensor(anchor["nll"])
                speed["anchor"].append(anchor["tokens_per_second"])
                for name in (*PATHS, STOCK):
                    result = run_worker(args, name, f.name, start, recent)
                    speed[name].append(result["tokens_per_second"])
                    if repeat == 0 and result["nll"] is not None:
                        diff = (torch.tensor(result["nll"]) - anchor_nll).abs()
                        rows.append((config, name, diff.max().item(), diff.mean().item(), speed[name]))
                print(config, {k: f"{v[-1]:.1f}" for k, v in speed.items()}, flush=True)
            rows.append((config, "anchor", 0.0, 0.0, speed["anchor"]))
            rows.append((config, STOCK, None, None, speed[STOCK]))
            anchor_versions = f"transformers {anchor['transformers']}, torch {anchor['torch']}"
    finally:
        os.unlink(f.name)

    command = "python benchmarks/bench_anchors.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"\n`{command}`\n")
    print(
        f"Shipped tiny Llama, the first {args.tokens} tokens of held-out `{document.name}`; "
        f"{platform.processor() or platform.machine()}, {args.threads} thread(s); hf_attnscale on transformers "
        f"{transformers.__version__}, torch {torch.__version__}; the anchor (mit-han-lab/streaming-llm) on "
        f"{anchor_versions}. Median of {args.repeats} interleaved runs.\n"
    )
    print(
        "| start+recent | path | tokens/s (median) | vs anchor | runs | max abs NLL diff | mean abs NLL diff |"
    )
    print("|---|---|---|---|---|---|---|")
    medians = {(c, n): statistics.median(s) for c, n, *_, s in rows}
    for config, name, max_diff, mean_diff, runs in sorted(rows, key=lambda r: (r[0], r[1] != "anchor")):
        ratio = medians[config, name] / medians[config, "anchor"]
        cells = ", ".join(f"{s:.1f}" for s in runs)
        diffs = "- | -" if max_diff is None or name == "anchor" else f"{max_diff:.1e} | {mean_diff:.1e}"
        print(f"| {config} | {name} | {medians[config, name]:.1f} | {ratio:.2f}x | {cells} | {diffs} |")


if __name__ == "__main__":
    main()
