"""Regenerate every table and figure of ``experiments/RESULTS.md`` from the trained checkpoints.

    python experiments/evidence.py --runs runs --out experiments/out        # all sections
    python experiments/evidence.py --runs runs --out experiments/out --only sinks streaming

The checkpoints are trained by ``experiments/train.sh`` (one directory per run under ``--runs``). Each
section reads the runs it needs, prints its Markdown table and writes ``<out>/<section>.md``, ``.json`` and
``.png``. A section whose runs are missing says which and is skipped. Data: the built-in corpus's held-out
files (Python standard library sources, split by path), never seen in training.

Sections (one module each in ``experiments/sections/``):
  sinks      attention mass on token 0 (the BOS token) over training, per layer, for the three LM runs;
  streaming  per-position NLL over a 32x stream: dense, window-only and sink+window caches (0/1/2/4 sinks);
  decoder    Su's table for a decoder: O, O + inference-time logn / dynamic NTK / YaRN / streaming, and E;
  targets    where the unpatched decoders' heads attend (BOS, own token, previous token, start of line) and
             what evicting BOS costs them, for each recipe tried to grow sinks (weight decay, learning
             rate, depth, length);
  rates      the same recipe at peak learning rates 2e-3, 4e-3 and 6e-3: sink heads over training, and the
             32x stream of `streaming` for each;
  outliers   kurtosis and max |activation| of the three LM runs, and their perplexity under W8A8;
  mlm        Su's table for an encoder: MLM accuracy of O and E at 64..1024 tokens, mean and spread of seeds.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from sections import decoder, mlm, outliers, rates, sinks, streaming, targets
from sections.runs import MissingRuns

SECTIONS: dict[str, Callable[[Path, Path], str]] = {
    "sinks": sinks.run,
    "streaming": streaming.run,
    "decoder": decoder.run,
    "targets": targets.run,
    "rates": rates.run,
    "outliers": outliers.run,
    "mlm": mlm.run,
}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, required=True, help="directory holding the trained runs")
    parser.add_argument("--out", type=Path, required=True, help="where tables, JSON and figures go")
    parser.add_argument("--only", nargs="*", choices=SECTIONS, help="sections to run (default: all)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.only or SECTIONS:
        try:
            table = SECTIONS[name](args.runs, args.out)
        except MissingRuns as err:
            print(f"## {name}: skipped ({err})\n")
            continue
        (args.out / f"{name}.md").write_text(table + "\n")
        print(f"## {name}\n\n{table}\n")


if __name__ == "__main__":
    main()
