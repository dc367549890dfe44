"""``hf-attnscale lm-eval``: lm-eval's own command line, with the ``hf-attnscale`` model type registered."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

NAME = "lm-eval"


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The ``lm-eval`` subparser, for the commands' list and help only: `run` takes the arguments as they are."""
    commands.add_parser(
        NAME,
        help="lm-eval's CLI with the hf-attnscale model type registered",
        description="Runs lm-eval's own CLI (all its arguments) after registering --model hf-attnscale.",
    )


def run(argv: Sequence[str]) -> int:
    """Run lm-eval's CLI on ``argv`` (everything after ``lm-eval``, ``--help`` included)."""
    try:
        from hf_attnscale.integrations.lm_eval_launcher import main  # optional: needs lm-eval
    except ImportError as err:
        print(
            f"hf-attnscale lm-eval: error: {err}. Install it with: pip install 'hf_attnscale[eval]'",
            file=sys.stderr,
        )
        return 2
    return main(list(argv))
