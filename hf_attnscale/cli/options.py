"""The flags the commands share (data, patch, runtime, lengths), and what they turn into.

Only argparse and the patch's options are imported here; torch and the rest load when a command runs.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_attnscale.core.options.config import default_train_length
from hf_attnscale.core.options.flags import patch_options

if TYPE_CHECKING:
    import torch

    from hf_attnscale.evaluation.corpus import Document
    from hf_attnscale.evaluation.lengths import LengthMark

DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
DEFAULT_DATA = "builtin:stdlib-heldout"
PATCH_TITLE = "patch options (hf_attnscale.patch; they replace a saved patch)"


class CommandError(Exception):
    """A user error the CLI reports in one line, without a traceback."""


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """``--data`` and ``--text-field``."""
    parser.add_argument(
        "--data",
        default=DEFAULT_DATA,
        help=f"a .jsonl file (one object per line), a text file (one document), or a built-in corpus "
        f"(default {DEFAULT_DATA})",
    )
    parser.add_argument("--text-field", default="text", help="field holding the text in a .jsonl file")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--gguf-file``, ``--attn-implementation`` and ``--peft``."""
    parser.add_argument(
        "--model",
        help="local directory, Hugging Face Hub id, .gguf file, or a real checkpoint's name (smollm2-135m, "
        "gemma3-270m, minilm-l6: fetched on first use; see hf-attnscale fetch) (default: the shipped tiny "
        "Llama, builtin:tiny-llama-stdlib)",
    )
    parser.add_argument(
        "--gguf-file",
        metavar="FILE",
        help="a GGUF file: a path, or a file name in --model's folder or Hub repo (de-quantised to float32; "
        "needs the gguf package)",
    )
    parser.add_argument(
        "--attn-implementation", default="sdpa", help="attention backend to load (default sdpa)"
    )
    parser.add_argument(
        "--peft",
        metavar="ADAPTER",
        help="a PEFT adapter (folder or Hub id) to load onto --model with the patch it was trained under, then "
        "merge (hfa.load_adapter; needs the [peft] extra)",
    )


def add_output_arguments(parser: argparse.ArgumentParser, out: str) -> None:
    """``--out`` (default ``out``), then ``--device``, ``--dtype``, ``--chunk-size``, ``--threads`` and
    ``--progress``."""
    parser.add_argument("--out", type=Path, default=Path(out), help="output directory")
    parser.add_argument(
        "--device", default="auto", help="cpu, cuda, cuda:1, mps... (default: cuda if available)"
    )
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="weights dtype (default float32)")
    parser.add_argument(
        "--chunk-size", type=count_type(1), default=512, help="tokens per model call (memory only)"
    )
    parser.add_argument(
        "--threads", type=count_type(1), help="CPU threads for torch (default: torch's, one per core)"
    )
    add_progress_argument(parser)


PASSKEY_DEPTHS = (0.0, 0.5, 1.0)
"""Where the passkey is stated, by default: first, middle, last."""


def add_recall_arguments(parser: argparse.ArgumentParser) -> None:
    """The passkey flags of ``compare`` and ``eval`` (causal LMs)."""
    recall = parser.add_argument_group(
        "recall (causal LMs: a passkey prompt per length and depth, for each variant)"
    )
    recall.add_argument(
        "--passkey-depths",
        type=depths_type,
        default=PASSKEY_DEPTHS,
        metavar="D,...",
        help="where the key is stated, fractions of the haystack (default 0,0.5,1)",
    )
    recall.add_argument("--no-passkeys", action="store_true", help="leave recall out")


def add_progress_argument(parser: argparse.ArgumentParser, default: bool | None = None) -> None:
    """``--progress`` / ``--no-progress``: progress bars on stderr, by default on a terminal only (None)."""
    when = "on a terminal" if default is None else "on" if default else "off"
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=default,
        help=f"progress bars on stderr (default: {when})",
    )


def show_progress(args: argparse.Namespace) -> bool:
    """Whether ``--progress`` asks for progress bars: as given, else only where stderr is a terminal."""
    progress = getattr(args, "progress", None)
    return sys.stderr.isatty() if progress is None else progress


def parse_lengths(text: str) -> list[int]:
    """``"256,512,1k,2k"`` -> ``[256, 512, 1024, 2048]`` (``k`` is 1024)."""
    lengths = []
    for item in filter(None, (part.strip().lower() for part in text.split(","))):
        match = re.fullmatch(r"(\d+)(k?)", item)
        if match is None:
            raise ValueError(f"Bad length {item!r} in {text!r}; write token counts such as 512,1k,2k,4k.")
        lengths.append(int(match[1]) * (1024 if match[2] else 1))
    if not lengths:
        raise ValueError(f"No lengths in {text!r}; write token counts such as 512,1k,2k,4k.")
    return lengths


def lengths_type(text: str) -> list[int]:
    """`parse_lengths` as an argparse ``type``."""
    try:
        return parse_lengths(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def length_type(text: str) -> int:
    """One length (``512``, ``2k``) as an argparse ``type``."""
    lengths = lengths_type(text)
    if len(lengths) != 1:
        raise argparse.ArgumentTypeError(f"expected one length, got {text!r}")
    return lengths[0]


def depths_type(text: str) -> tuple[float, ...]:
    """Passkey depths as an argparse ``type``: fractions of the haystack from 0 to 1, comma-separated."""
    try:
        depths = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected fractions from 0 to 1, e.g. 0,0.5,1; got {text!r}"
        ) from None
    if not depths or not all(0 <= d <= 1 for d in depths):
        raise argparse.ArgumentTypeError(f"depths are fractions from 0 to 1, e.g. 0,0.5,1; got {text!r}")
    return depths


def count_type(minimum: int):
    """An argparse ``type``: an int of at least ``minimum`` (errors then name the user's own flag)."""

    def read(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return read


def trained_length(args: argparse.Namespace, model: Any) -> int | None:
    """The trained length by the one rule (`hf_attnscale.core.options.config.default_train_length`, which the lm-eval
    model type follows too): ``--train-length`` if given, else the model config's ``max_position_embeddings``
    (None where it has none)."""
    return default_train_length(_given_length(args), model.config)


def length_marks(args: argparse.Namespace, model: Any) -> list[LengthMark]:
    """What the plot marks (`hf_attnscale.evaluation.lengths.length_marks`): the config's
    ``max_position_embeddings`` as the trained length where it has one, and a ``--train-length`` that differs
    from it as the patch's L (the trained length where the config has none)."""
    from hf_attnscale.evaluation.lengths import length_marks

    return length_marks(getattr(model.config, "max_position_embeddings", None), _given_length(args))


def _given_length(args: argparse.Namespace) -> int | None:
    """``--train-length``: stored as ``scale_length`` by the patch's flags, as ``train_length`` by compare's."""
    return getattr(args, "scale_length", None) or getattr(args, "train_length", None)


def given_patch(args: argparse.Namespace, model: Any) -> dict[str, Any]:
    """The patch options given on the command line (validated), as `hfa.patch` keywords; a ``--scale`` without
    ``--train-length`` takes `trained_length`."""
    length = trained_length(args, model)
    if args.scale != "none" and length is None:
        raise CommandError(
            f"--scale {args.scale} needs --train-length N, the model's trained length (its config "
            "gives no max_position_embeddings)."
        )
    return patch_options(args, default_length=length)


def device(args: argparse.Namespace) -> torch.device:
    """The torch device named by ``--device``, with ``--threads`` applied."""
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    name = args.device
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        named = torch.device(name)
    except RuntimeError as err:
        raise CommandError(f"Unknown device {name!r} ({err}); use cpu, cuda, cuda:N or mps.") from None
    if named.type == "cuda" and not torch.cuda.is_available():
        raise CommandError(f"--device {name}, but torch sees no CUDA GPU; use --device cpu.")
    if named.type == "cuda" and (named.index or 0) >= torch.cuda.device_count():
        raise CommandError(f"--device {name}, but torch sees only {torch.cuda.device_count()} CUDA GPU(s).")
    if named.type == "mps" and not torch.backends.mps.is_available():
        raise CommandError(f"--device {name}, but MPS is not available; use --device cpu.")
    return named


def dtype(name: str, default: str | None = None) -> Any:
    """The torch dtype named by ``--dtype``; ``auto`` is ``default`` if given, else the checkpoint's own."""
    import torch

    if name == "auto":
        return getattr(torch, default) if default is not None else "auto"
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(name) or getattr(
        torch, name
    )


def load_model(args: argparse.Namespace, on: torch.device) -> tuple[Any, Any, str]:
    """The model named by ``--model`` (and ``--gguf-file``), loaded on ``on`` with ``--dtype`` and
    ``--attn-implementation``, with ``--peft``'s adapter loaded and merged: ``(model, tokenizer, kind)`` (see
    `hf_attnscale.checkpoints.models.load_model`)."""
    from hf_attnscale.checkpoints import models
    from hf_attnscale.integrations.peft_adapters import check_adapter_path, load_adapter

    progress = show_progress(args)
    adapter = getattr(args, "peft", None)
    check_adapter_path(adapter)
    model, tokenizer, kind = models.load_model(
        model_source(args),
        on,
        dtype(args.dtype),
        args.attn_implementation,
        gguf_file=args.gguf_file,
        progress=progress,
    )
    if adapter is not None:
        model = load_adapter(model, adapter).merge_and_unload().eval()  # the merged model stays patched
    return model, tokenizer, kind


def model_source(args: argparse.Namespace) -> str:
    """``--model``, else the shipped model (`hf_attnscale.checkpoints.models.DEFAULT_MODEL`)."""
    from hf_attnscale.checkpoints.models import DEFAULT_MODEL

    return args.model or DEFAULT_MODEL


def model_name(args: argparse.Namespace) -> str:
    """The model as given, for titles and records: `model_source`, with ``--gguf-file`` if one is given."""
    if args.gguf_file is None:
        return model_source(args)
    from hf_attnscale.checkpoints.models import split_gguf

    return "/".join(split_gguf(model_source(args), args.gguf_file))


def documents(data: str, text_field: str = "text") -> list[Document]:
    """The documents named by ``--data`` (see `hf_attnscale.evaluation.documents.load_documents`)."""
    from hf_attnscale.evaluation.documents import load_documents

    return load_documents(data, text_field=text_field)
