"""The anchor side of `bench_anchors.py`: mit-han-lab/streaming-llm's token-by-token perplexity loop.

Runs in a separate, benchmark-only venv with the anchor's own stack (transformers 4.33) and imports nothing
of hf_attnscale. It follows the method of the anchor's ``examples/eval_long_ppl.py``: one token per call,
``enable_streaming_llm(model, start_size, recent_size)`` for pos-shift attention and its ``StartRecentKVCache``
applied after every step. Only the loop is timed (not the process start or the model load).

    ANCHOR=/path/to/streaming-llm   # a checkout of mit-han-lab/streaming-llm (its streaming_llm/ package)
    PYTHONPATH=$ANCHOR /path/to/anchor-venv/bin/python benchmarks/anchor_streaming_llm.py \
        --model DIR --ids ids.json --start-size 4 --recent-size 124 --out nll.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers
from streaming_llm.enable_streaming_llm import enable_streaming_llm
from transformers import AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--ids", required=True, help="JSON list of token ids (one stream)")
    parser.add_argument("--start-size", type=int, required=True)
    parser.add_argument("--recent-size", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    with open(args.ids) as f:
        ids = torch.tensor(json.load(f)).unsqueeze(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    kv_cache = enable_streaming_llm(model, start_size=args.start_size, recent_size=args.recent_size)
    loss_fn = torch.nn.CrossEntropyLoss(reduction="none")

    nlls = []
    past = None
    start = time.perf_counter()
    with torch.no_grad():
        for idx in range(ids.size(1) - 1):
            out = model(ids[:, idx : idx + 1], past_key_values=past, use_cache=True)
            logits = out.logits.view(-1, model.config.vocab_size)
            nlls.append(loss_fn(logits, ids[:, idx + 1]).item())
            past = kv_cache(out.past_key_values)
    seconds = time.perf_counter() - start
    result = {
        "nll": nlls,
        "seconds": seconds,
        "tokens_per_second": len(nlls) / seconds,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
