"""The patch's command-line flags, shared by ``hf-attnscale`` and the trainers: one definition, and the
`hfa.patch` options they ask for."""

from __future__ import annotations

import argparse
from typing import Any

from hf_attnscale.core.config import GATES, SCALES, AttnScaleConfig


def add_patch_arguments(
    parser: argparse.ArgumentParser,
    title: str,
    *,
    length_flag: str = "--train-length",
    length_help: str = "L, the length the model was trained at",
    exits: bool = True,
) -> argparse._ArgumentGroup:
    """Add ``--scale``, the length flag, ``--clamp``, ``--beta`` and (with ``exits``) ``--zero-kv``, ``--sink-logit``,
    ``--clipped-softmax`` and ``--gate``.

    The length flag, whatever it is called, is stored as ``scale_length``. Returns the group of the flags.
    """
    group = parser.add_argument_group(title)
    group.add_argument("--scale", choices=SCALES, default="none", help="query scale law (default none)")
    group.add_argument(length_flag, dest="scale_length", type=int, metavar="N", help=length_help)
    group.add_argument(
        "--clamp", action=argparse.BooleanOptionalAction, default=None, help="clamp the scale to >= 1"
    )
    group.add_argument("--beta", type=float, help="beta of --scale llama4 / ministral3 (default 0.1)")
    if exits:
        group.add_argument("--zero-kv", action="store_true", help="add a zero key/value (softmax-off-by-one)")
        group.add_argument("--sink-logit", type=_sink_logit, help="a fixed sink logit, or 'learnable'")
        group.add_argument(
            "--clipped-softmax",
            type=_clipped_softmax,
            metavar="GAMMA,ZETA",
            help="clip((zeta - gamma) * softmax + gamma, 0, 1), e.g. -0.03,1; or 'learnable'",
        )
        group.add_argument("--gate", choices=GATES, help="a learnable sigmoid gate on each head's output")
    return group


def patch_options(args: argparse.Namespace, default_length: int | None = None) -> dict[str, Any]:
    """The `hfa.patch` options that the flags of `add_patch_arguments` ask for (empty: none), validated.

    Args:
        args: the parsed flags.
        default_length: L of a scale whose length flag was not given (None: it must be given).

    Raises:
        ValueError: flags that make no patch together (e.g. ``--clamp`` without a scale).
    """
    scale = None if args.scale == "none" else args.scale
    given = {
        "scale": scale,
        "train_length": default_length if scale and args.scale_length is None else args.scale_length,
        "clamp": args.clamp,
        "beta": args.beta,
        "zero_kv": vars(args).get("zero_kv") or None,
        "sink_logit": vars(args).get("sink_logit"),
        "clipped_softmax": vars(args).get("clipped_softmax"),
        "gate": vars(args).get("gate"),
    }
    options = {name: value for name, value in given.items() if value is not None}
    AttnScaleConfig(**options)  # its own errors, before any model is built
    return options


def _clipped_softmax(text: str) -> tuple[float, float] | str:
    if text == "learnable":
        return text
    try:
        gamma, zeta = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected GAMMA,ZETA (e.g. -0.03,1) or 'learnable', got {text!r}"
        ) from None
    return gamma, zeta


def _sink_logit(text: str) -> float | str:
    if text == "learnable":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'learnable', got {text!r}") from None
