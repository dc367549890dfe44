"""The patch's command-line flags, shared by ``hf-attnscale`` and the trainers: one definition, and the
`hfa.patch` options they ask for."""

from __future__ import annotations

import argparse
from typing import Any

from hf_attnscale.core.options.config import OPTIONS, AttnScaleConfig
from hf_attnscale.core.options.text import read_bool

LENGTH_OPTION = "train_length"
"""The option whose flag a caller may rename (the trainers' ``--scale-length``); it is stored as ``scale_length``."""


def add_patch_arguments(
    parser: argparse.ArgumentParser,
    title: str,
    *,
    length_flag: str = "--train-length",
    length_help: str | None = None,
    exits: bool = True,
) -> argparse._ArgumentGroup:
    """Add a flag for each patch option (`hf_attnscale.core.options.config.OPTIONS`: ``--scale``, the length flag,
    ``--clamp``, ...), read as the option reads text; ``exits=False`` leaves out the options that act on what a
    head may output (exit, clipped softmax, gate).

    The length flag, whatever it is called, is stored as ``scale_length``. Returns the group of the flags.
    """
    group = parser.add_argument_group(title)
    for name, option in OPTIONS.items():
        meta = option.metadata
        if meta["head"] and not exits:
            continue
        flag, spec = f"--{name.replace('_', '-')}", {"help": meta["help"], "default": option.default}
        if name == LENGTH_OPTION:
            flag, spec["dest"], spec["help"] = length_flag, "scale_length", length_help or meta["help"]
        if meta["choices"] is not None:
            spec["choices"] = meta["choices"]
        elif meta["parse"] is read_bool:
            spec["action"] = "store_true" if option.default is False else argparse.BooleanOptionalAction
        else:
            spec["type"], spec["metavar"] = _flag_type(meta["parse"]), meta["metavar"]
        group.add_argument(flag, **spec)
    return group


def patch_options(args: argparse.Namespace, default_length: int | None = None) -> dict[str, Any]:
    """The `hfa.patch` options that the flags of `add_patch_arguments` ask for (empty: none), validated.

    Args:
        args: the parsed flags.
        default_length: L of a scale whose length flag was not given (None: it must be given).

    Raises:
        ValueError: flags that make no patch together (e.g. ``--clamp`` without a scale).
    """
    values = vars(args)
    given = {name: values.get("scale_length" if name == LENGTH_OPTION else name) for name in OPTIONS}
    if given["scale"] == "none":
        given["scale"] = None
    elif given[LENGTH_OPTION] is None:
        given[LENGTH_OPTION] = default_length
    unset = {
        name for name, value in given.items() if value is None or value is OPTIONS[name].default is False
    }
    options = {name: value for name, value in given.items() if name not in unset}
    AttnScaleConfig(**options)  # its own errors, before any model is built
    return options


def _flag_type(parse):
    """``parse`` as an argparse ``type``: its ValueError becomes argparse's one-line usage error (int and float
    keep argparse's own)."""
    if parse in (int, float, str):
        return parse

    def read(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    read.__name__ = parse.__name__.strip("_")
    return read
