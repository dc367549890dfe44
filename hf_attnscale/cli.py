"""The ``hf-attnscale`` command: ``demo``, ``eval`` and ``lm-eval``.

    hf-attnscale demo                      # shipped model, built-in corpus, six variants, 256..4096 tokens
    hf-attnscale eval --model PATH_OR_HUB_ID --scale logn --train-length 4096 \\
        --sink-tokens 4 --window 1020 --data FILE_OR_BUILTIN --lengths 1k,2k,4k,8k --device cuda
    hf-attnscale lm-eval <lm-eval arguments>   # lm-eval's CLI with --model hf-attnscale available

``demo`` and ``eval`` print a Markdown table and write ``results.json`` and ``ppl_vs_length.png``. What
"perplexity at length L" means is defined in `hf_attnscale.evaluate`.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .evaluation.corpus import tokenize_documents
from .evaluation.documents import DEFAULT_DATA, load_documents
from .evaluation.models import DEFAULT_MODEL, load_default_model, load_model
from .evaluation.report import SweepResult
from .evaluation.sweep import Variant, demo_variants, sweep

DTYPES = {
    "auto": "auto",
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
DEMO_MULTIPLES = (1, 2, 4, 8, 16)
DEMO_DOCUMENTS = 4
# The shipped model is tiny: a second thread gains little, and when the cores are shared torch's OpenMP
# threads wait on each other (the demo measured 6x slower with 2 threads than 1 on a busy 2-core machine).
DEMO_THREADS = 1


class CommandError(Exception):
    """A user error the CLI reports in one line, without a traceback."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-attnscale`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lm-eval"]:
        # Everything after the subcommand belongs to lm-eval's parser, --help included.
        try:
            from .integrations.lm_eval_harness import main as lm_eval_main  # optional: needs lm-eval
        except ImportError as err:
            print(
                f"hf-attnscale lm-eval: error: {err}. Install it with: pip install 'hf_attnscale[eval]'",
                file=sys.stderr,
            )
            return 2
        return lm_eval_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return args.run(args)
    except (CommandError, ValueError, FileNotFoundError) as err:
        print(f"hf-attnscale {args.command}: error: {err}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-attnscale",
        description="Long-context perplexity for models patched by hf_attnscale.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="shipped model and corpus: attention variants at 1x..16x the trained length",
        description="Evaluate the shipped tiny Llama (trained at 256 tokens) on the built-in held-out corpus "
        "at 1x, 2x, 4x, 8x and 16x its trained length: unpatched, logn, window-only and sink+window "
        "streaming with a cache of the trained length, and sink+window and streaming+logn with twice that. "
        "Needs no arguments and no network; about two minutes on two CPU cores.",
    )
    demo.add_argument("--out", type=Path, default=Path("hf-attnscale-demo"), help="output directory")
    demo.add_argument(
        "--documents",
        type=int,
        default=DEMO_DOCUMENTS,
        help=f"held-out documents to evaluate (default {DEMO_DOCUMENTS}; more is slower and steadier)",
    )
    demo.add_argument("--lengths", type=_lengths, help="override the lengths, e.g. 256,512,1k")
    _add_runtime_options(demo, threads=DEMO_THREADS)
    demo.set_defaults(run=run_demo)

    ev = commands.add_parser(
        "eval",
        help="perplexity of a model, patched or not, at several lengths",
        description="Evaluate perplexity at several lengths for one configuration of a model "
        "(and, with --baseline, the unpatched model too).",
    )
    ev.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"local directory or Hugging Face Hub id (default: the shipped {DEFAULT_MODEL})",
    )
    ev.add_argument(
        "--data",
        default=DEFAULT_DATA,
        help=f"a .jsonl file (one object per line), a text file (one document), or a built-in corpus "
        f"(default {DEFAULT_DATA})",
    )
    ev.add_argument("--text-field", default="text", help="field holding the text in a .jsonl file")
    ev.add_argument(
        "--lengths",
        type=_lengths,
        required=True,
        help="evaluation lengths in tokens, each dividing the longest, e.g. 1k,2k,4k,8k",
    )
    patch_group = ev.add_argument_group("patch options (hf_attnscale.patch)")
    patch_group.add_argument("--scale", choices=("none", "logn", "ssmax", "gradmax"), help="query scale law")
    patch_group.add_argument("--train-length", type=int, help="the length the model was trained at")
    patch_group.add_argument(
        "--clamp", action=argparse.BooleanOptionalAction, default=None, help="clamp the scale to >= 1"
    )
    patch_group.add_argument(
        "--zero-kv", action="store_true", help="add a zero key/value (softmax-off-by-one)"
    )
    patch_group.add_argument("--sink-logit", type=_sink_logit, help="a fixed sink logit, or 'learnable'")
    stream_group = ev.add_argument_group("streaming (StreamingLLM SinkCache)")
    stream_group.add_argument("--window", type=int, help="stream with a window of this many recent tokens")
    stream_group.add_argument("--sink-tokens", type=int, help="sink tokens kept (default 4 with --window)")
    ev.add_argument("--baseline", action="store_true", help="also evaluate the unpatched model")
    ev.add_argument("--name", help="label of the configuration in the table and plot")
    ev.add_argument("--max-documents", type=int, help="evaluate at most this many documents")
    ev.add_argument("--attn-implementation", default="sdpa", help="attention backend to load (default sdpa)")
    ev.add_argument("--out", type=Path, default=Path("hf-attnscale-eval"), help="output directory")
    _add_runtime_options(ev)
    ev.set_defaults(run=run_eval)

    commands.add_parser(
        "lm-eval",
        help="lm-eval's CLI with the hf-attnscale model type registered",
        description="Runs lm-eval's own CLI (all its arguments) after registering --model hf-attnscale.",
    )
    return parser


def _add_runtime_options(parser: argparse.ArgumentParser, threads: int | None = None) -> None:
    parser.add_argument(
        "--device", default="auto", help="cpu, cuda, cuda:1, mps... (default: cuda if available)"
    )
    parser.add_argument(
        "--dtype", default="float32", choices=sorted(DTYPES), help="weights dtype (default float32)"
    )
    parser.add_argument("--chunk-size", type=int, default=512, help="tokens per model call (memory only)")
    parser.add_argument(
        "--threads",
        type=int,
        default=threads,
        help=f"CPU threads for torch (default: {threads or 'torch default'})",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bars (default: on a terminal)",
    )


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


def _lengths(text: str) -> list[int]:
    try:
        return parse_lengths(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _sink_logit(text: str) -> float | str:
    if text == "learnable":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'learnable', got {text!r}") from None


def run_demo(args: argparse.Namespace) -> int:
    """``hf-attnscale demo``: the shipped model on the built-in held-out corpus, five variants."""
    started = time.perf_counter()
    device = _device(args.device)
    _set_threads(args.threads)
    model, tokenizer = load_default_model(device=device, dtype=_dtype(args.dtype, default=torch.float32))
    train_length = model.config.max_position_embeddings
    lengths = args.lengths or [train_length * m for m in DEMO_MULTIPLES]
    result = _run_sweep(
        args,
        model,
        tokenizer,
        DEFAULT_DATA,
        lengths,
        demo_variants(train_length),
        train_length=train_length,
        max_documents=args.documents,
    )
    return _report(
        args,
        result,
        started,
        model=DEFAULT_MODEL,
        data=DEFAULT_DATA,
        device=str(device),
        title=f"{DEFAULT_MODEL} (trained at {train_length} tokens), held-out stdlib sources",
    )


def run_eval(args: argparse.Namespace) -> int:
    """``hf-attnscale eval``: one configuration (plus, optionally, the unpatched baseline) at several lengths."""
    started = time.perf_counter()
    variant = _variant_from_args(args)
    variants = [Variant("unpatched"), variant] if args.baseline and variant.patch is not None else [variant]
    # Data errors are cheaper to find than a model download.
    documents = load_documents(args.data, text_field=args.text_field)
    device = _device(args.device)
    _set_threads(args.threads)
    model, tokenizer = load_model(args.model, device, _dtype(args.dtype), args.attn_implementation)
    train_length = args.train_length or getattr(model.config, "max_position_embeddings", None)
    result = _run_sweep(
        args,
        model,
        tokenizer,
        args.data,
        args.lengths,
        variants,
        train_length=train_length,
        max_documents=args.max_documents,
        documents=documents,
    )
    return _report(args, result, started, model=args.model, data=args.data, device=str(device))


def _variant_from_args(args: argparse.Namespace) -> Variant:
    options: dict[str, Any] = {}
    if args.scale not in (None, "none"):
        if args.train_length is None:
            raise CommandError(
                f"--scale {args.scale} needs --train-length N, the context the model was trained at."
            )
        options.update(scale=args.scale, train_length=args.train_length)
    if args.clamp is not None:
        options["clamp"] = args.clamp
    if args.zero_kv:
        options["zero_kv"] = True
    if args.sink_logit is not None:
        options["sink_logit"] = args.sink_logit
    if args.sink_tokens is not None and args.window is None:
        raise CommandError("--sink-tokens needs --window W (the streaming cache holds sink tokens + W).")
    sink_tokens = 0 if args.window is None else (4 if args.sink_tokens is None else args.sink_tokens)
    name = args.name or describe(options, sink_tokens, args.window)
    return Variant(name, patch=options or None, sink_tokens=sink_tokens, window=args.window)


def describe(options: dict[str, Any], sink_tokens: int, window: int | None) -> str:
    """A short label for a configuration, e.g. ``logn(L=4096) + sink+window (4+1020)``."""
    parts = []
    if options.get("scale"):
        parts.append(f"{options['scale']}(L={options['train_length']})")
    if options.get("zero_kv"):
        parts.append("zero-kv")
    if options.get("sink_logit") is not None:
        parts.append(f"sink-logit={options['sink_logit']}")
    if window is not None:
        parts.append(f"sink+window ({sink_tokens}+{window})" if sink_tokens else f"window-only ({window})")
    return " + ".join(parts) or "unpatched"


def _run_sweep(
    args: argparse.Namespace,
    model,
    tokenizer,
    data: str,
    lengths: list[int],
    variants: list[Variant],
    *,
    train_length: int | None,
    max_documents: int | None,
    documents=None,
) -> SweepResult:
    documents = documents if documents is not None else load_documents(data)
    token_ids = tokenize_documents(tokenizer, documents)
    return sweep(
        model,
        token_ids,
        lengths,
        variants,
        names=[doc.name for doc in documents],
        max_documents=max_documents,
        train_length=train_length,
        chunk_size=args.chunk_size,
        progress=args.progress,
    )


def _report(
    args: argparse.Namespace, result: SweepResult, started: float, *, title: str | None = None, **info
) -> int:
    seconds = time.perf_counter() - started
    result.info.update(info, command=shlex.join(["hf-attnscale", *args.argv]), wall_seconds=seconds)
    json_path = result.write_json(args.out / "results.json")
    png_path = result.plot(args.out / "ppl_vs_length.png", title=title)
    print(
        f"\nPerplexity by evaluation length ({len(result.documents)} documents of >= {result.lengths[-1]} tokens, "
        f"each cut into non-overlapping L-token segments read from scratch):\n"
    )
    print(result.table())
    print(f"\nwrote {json_path} and {png_path} in {seconds:.0f} s")
    return 0


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise CommandError(f"Unknown device {name!r} ({err}); use cpu, cuda, cuda:N or mps.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CommandError(f"--device {name}, but torch sees no CUDA GPU; use --device cpu.")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise CommandError(f"--device {name}, but torch sees only {torch.cuda.device_count()} CUDA GPU(s).")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise CommandError(f"--device {name}, but MPS is not available; use --device cpu.")
    return device


def _dtype(name: str, default: Any = None) -> Any:
    dtype = DTYPES[name]
    return default if dtype == "auto" and default is not None else dtype


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise CommandError(f"--threads must be at least 1, got {threads}.")
        torch.set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(main())
