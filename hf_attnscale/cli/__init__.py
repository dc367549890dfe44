"""The ``hf-attnscale`` command: ``demo``, ``eval``, ``diagnose`` and ``lm-eval``.

    hf-attnscale demo                      # shipped model, built-in corpus, six variants, 1x..16x its length
    hf-attnscale eval --model PATH_OR_HUB_ID --scale logn --train-length 4096 \\
        --sink-tokens 4 --window 1020 --data FILE_OR_BUILTIN --lengths 1k,2k,4k,8k --device cuda
    hf-attnscale diagnose --model PATH_OR_HUB_ID --length 2k   # entropy, sinks, gradients, outliers
    hf-attnscale lm-eval <lm-eval arguments>   # lm-eval's CLI with --model hf-attnscale available

``demo`` and ``eval`` print a Markdown table, a line per variant as it finishes, and write ``results.json``
and ``ppl_vs_length.png``. What "perplexity at length L" means is defined in `hf_attnscale.evaluation.sweep`.

Each command imports torch, transformers and the rest of the package when it runs, so that ``--help``
answers at once.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
DEMO_MULTIPLES = (1, 2, 4, 8, 16)
DEMO_DOCUMENTS = 4
DEFAULT_DATA = "builtin:stdlib-heldout"
DEFAULT_MODEL = "builtin:tiny-llama-stdlib"
PATCH_OPTIONS = ("scale", "train_length", "clamp", "zero_kv", "sink_logit")


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
        description="Long-context evaluation and diagnostics for models patched by hf_attnscale.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="shipped model and corpus: attention variants at 1x..16x the trained length",
        description="Evaluate the shipped tiny Llama (trained at 128 tokens, a BOS token opening every "
        "window) on the built-in held-out corpus at 1x, 2x, 4x, 8x and 16x its trained length: unpatched, "
        "logn, window-only and sink+window streaming with a cache of the trained length, and sink+window "
        "and streaming+logn with twice that. The model's heads lean on BOS (attention sinks), so the "
        "window-only cache falls behind sink+window. Needs no arguments and no network; under a minute on "
        "two idle CPU cores.",
    )
    demo.add_argument("--out", type=Path, default=Path("hf-attnscale-demo"), help="output directory")
    demo.add_argument(
        "--documents",
        type=int,
        default=DEMO_DOCUMENTS,
        help=f"held-out documents to evaluate (default {DEMO_DOCUMENTS}; more is slower and steadier)",
    )
    demo.add_argument("--lengths", type=_lengths, help="override the lengths, e.g. 128,256,1k")
    _add_runtime_options(demo)
    demo.set_defaults(run=run_demo)

    ev = commands.add_parser(
        "eval",
        help="a model, patched or not, at several lengths (perplexity; MLM measures for encoders)",
        description="Evaluate one configuration of a model at several lengths: perplexity for a causal LM; "
        "MLM accuracy and pseudo-perplexity for a masked LM (an encoder). A model saved with a patch runs "
        "with it; patch options given here replace it. --baseline adds the unpatched model.",
    )
    ev.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"local directory or Hugging Face Hub id (default: the shipped {DEFAULT_MODEL})",
    )
    _add_data_options(ev)
    ev.add_argument(
        "--lengths",
        type=_lengths,
        required=True,
        help="evaluation lengths in tokens, each dividing the longest, e.g. 1k,2k,4k,8k",
    )
    _add_patch_options(ev)
    stream_group = ev.add_argument_group("streaming (StreamingLLM SinkCache)")
    stream_group.add_argument("--window", type=int, help="stream with a window of this many recent tokens")
    stream_group.add_argument("--sink-tokens", type=int, help="sink tokens kept (default 4 with --window)")
    ev.add_argument("--baseline", action="store_true", help="also evaluate the unpatched model")
    ev.add_argument("--name", help="label of the configuration in the table and plot")
    ev.add_argument("--max-documents", type=int, help="evaluate at most this many documents")
    ev.add_argument(
        "--measure",
        choices=("auto", "perplexity", "mlm"),
        default="auto",
        help="perplexity (causal LMs) or mlm (masked LMs: accuracy and pseudo-perplexity); default: by model",
    )
    ev.add_argument("--attn-implementation", default="sdpa", help="attention backend to load (default sdpa)")
    ev.add_argument("--out", type=Path, default=Path("hf-attnscale-eval"), help="output directory")
    _add_runtime_options(ev)
    ev.set_defaults(run=run_eval)

    diag = commands.add_parser(
        "diagnose",
        help="attention entropy, sink mass, softmax gradients and activation outliers of a model",
        description="Run a model (with its saved patch, or the patch options given) on text and report, per "
        "layer: attention entropy against the number of visible keys, the attention mass on the first tokens "
        "(attention sinks), the softmax gradient size, the exit's mass, and the kurtosis and largest "
        "magnitude of the attention outputs and hidden states. Writes plots and diagnostics.json.",
    )
    diag.add_argument("--model", default=DEFAULT_MODEL, help="local directory or Hub id (default: shipped)")
    _add_data_options(diag)
    diag.add_argument("--length", type=_length, default=512, help="tokens per document read (default 512)")
    diag.add_argument("--documents", type=int, default=4, help="documents read (default 4)")
    diag.add_argument(
        "--sink-tokens", type=int, default=1, help="first tokens counted as the sink (default 1)"
    )
    _add_patch_options(diag)
    diag.add_argument(
        "--attn-implementation", default="sdpa", help="attention backend to load (default sdpa)"
    )
    diag.add_argument("--out", type=Path, default=Path("hf-attnscale-diagnose"), help="output directory")
    _add_runtime_options(diag)
    diag.set_defaults(run=run_diagnose)

    commands.add_parser(
        "lm-eval",
        help="lm-eval's CLI with the hf-attnscale model type registered",
        description="Runs lm-eval's own CLI (all its arguments) after registering --model hf-attnscale.",
    )
    return parser


def _add_data_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data",
        default=DEFAULT_DATA,
        help=f"a .jsonl file (one object per line), a text file (one document), or a built-in corpus "
        f"(default {DEFAULT_DATA})",
    )
    parser.add_argument("--text-field", default="text", help="field holding the text in a .jsonl file")


def _add_patch_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("patch options (hf_attnscale.patch; they replace a saved patch)")
    group.add_argument("--scale", choices=("none", "logn", "ssmax", "gradmax"), help="query scale law")
    group.add_argument("--train-length", type=int, help="the length the model was trained at")
    group.add_argument(
        "--clamp", action=argparse.BooleanOptionalAction, default=None, help="clamp the scale to >= 1"
    )
    group.add_argument(
        "--zero-kv", action="store_true", default=None, help="add a zero key/value (softmax-off-by-one)"
    )
    group.add_argument("--sink-logit", type=_sink_logit, help="a fixed sink logit, or 'learnable'")


def _add_runtime_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default="auto", help="cpu, cuda, cuda:1, mps... (default: cuda if available)"
    )
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="weights dtype (default float32)")
    parser.add_argument("--chunk-size", type=int, default=512, help="tokens per model call (memory only)")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's, one per core)")
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


def _length(text: str) -> int:
    lengths = _lengths(text)
    if len(lengths) != 1:
        raise argparse.ArgumentTypeError(f"expected one length, got {text!r}")
    return lengths[0]


def _sink_logit(text: str) -> float | str:
    if text == "learnable":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'learnable', got {text!r}") from None


def run_demo(args: argparse.Namespace) -> int:
    """``hf-attnscale demo``: the shipped model on the built-in held-out corpus, six variants."""
    from .evaluation.models import load_default_model
    from .evaluation.sweep import demo_variants

    started = time.perf_counter()
    device = _setup(args)
    model, tokenizer = load_default_model(device=device, dtype=_dtype(args.dtype, default="float32"))
    train_length = model.config.max_position_embeddings
    lengths = args.lengths or [train_length * m for m in DEMO_MULTIPLES]
    documents = _documents(DEFAULT_DATA)
    result = _run_sweep(
        args,
        model,
        tokenizer,
        documents,
        lengths,
        demo_variants(train_length, bos=_reads_behind_bos(tokenizer)),
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
    from .evaluation.models import load_model

    started = time.perf_counter()
    options = _patch_options(args)
    settings = _stream_settings(args)
    documents = _documents(args.data, args.text_field)  # data errors are cheaper to find than a download
    device = _setup(args)
    model, tokenizer, kind = load_model(args.model, device, _dtype(args.dtype), args.attn_implementation)
    measure = {"auto": "mlm" if kind == "masked" else "perplexity"}.get(args.measure, args.measure)
    if measure == "perplexity" and kind == "masked":
        raise CommandError(
            f"{args.model} is a masked LM (an encoder): causal perplexity means nothing for it. Its measures "
            "are MLM accuracy and pseudo-perplexity: pass --measure mlm (or leave --measure auto)."
        )
    if measure == "mlm" and kind == "causal":
        raise CommandError(f"{args.model} is a causal LM; --measure mlm is for masked LMs (encoders).")
    variant = _variant(args, model, options, settings)
    variants = [_unpatched(), variant] if args.baseline and variant.patch is not None else [variant]
    train_length = args.train_length or getattr(model.config, "max_position_embeddings", None)
    if measure == "mlm":
        result = _run_mlm_sweep(args, model, tokenizer, documents, variants, train_length)
    else:
        result = _run_sweep(
            args,
            model,
            tokenizer,
            documents,
            args.lengths,
            variants,
            train_length=train_length,
            max_documents=args.max_documents,
        )
    return _report(args, result, started, model=args.model, data=args.data, device=str(device))


def run_diagnose(args: argparse.Namespace) -> int:
    """``hf-attnscale diagnose``: attention and activation diagnostics of a model on text."""
    import torch

    from .core.config import AttnScaleConfig
    from .core.patching import patched
    from .core.state import get_config
    from .diagnostics import activation_outliers, attention_statistics
    from .evaluation.corpus import tokenize_documents
    from .evaluation.models import load_model

    started = time.perf_counter()
    options = _patch_options(args)
    documents = _documents(args.data, args.text_field)
    device = _setup(args)
    model, tokenizer, _ = load_model(args.model, device, _dtype(args.dtype), args.attn_implementation)
    ids = [d[: args.length] for d in tokenize_documents(tokenizer, documents) if d.numel() >= args.length]
    if not ids:
        raise CommandError(f"No document has {args.length} tokens; pass a smaller --length or longer data.")
    batch = torch.stack(ids[: args.documents])
    config = AttnScaleConfig(**options) if options else get_config(model)
    with patched(model, config):
        attention = attention_statistics(model, batch, sink_tokens=args.sink_tokens)
        outliers = activation_outliers(model, batch)
    summary = attention.summary(skip=min(16, args.length - 1))
    print(
        f"\n{args.model} ({'patch: ' + str(config) if config else 'unpatched'}), {batch.shape[0]} documents "
        f"of {args.length} tokens; per layer, mean over heads and over queries past the 16th:\n"
    )
    print(
        "| layer | entropy | entropy at n=L | ln L | sink mass | gradient | exit mass | kurtosis (attn / hidden) "
        "| max abs (attn / hidden) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for layer in range(attention.entropy.shape[0]):
        print(
            f"| {layer} | {summary['entropy'][layer].mean():.3f} | {attention.entropy[layer, :, -1].mean():.3f} "
            f"| {torch.log(attention.visible[layer, -1]):.3f} | {summary['sink_mass'][layer].mean():.3f} "
            f"| {summary['gradient'][layer].mean():.3f} | {summary['exit_mass'][layer].mean():.3f} "
            f"| {outliers.attention_kurtosis[layer]:.1f} / {outliers.hidden_kurtosis[layer]:.1f} "
            f"| {outliers.attention_max_abs[layer]:.1f} / {outliers.hidden_max_abs[layer]:.1f} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    attention.plot(args.out / "attention.png", title=f"{args.model}: attention by layer")
    outliers.plot(args.out / "outliers.png", title=f"{args.model}: activation outliers")
    record = {
        "command": shlex.join(["hf-attnscale", *args.argv]),
        "model": args.model,
        "patch": None if config is None else config.to_dict(),
        "length": args.length,
        "documents": batch.shape[0],
        "per_layer_head": {name: value.tolist() for name, value in summary.items()},
        "entropy_by_query": attention.entropy.mean(1).tolist(),
        "outliers": {k: v.tolist() for k, v in vars(outliers).items()},
        "wall_seconds": time.perf_counter() - started,
    }
    (args.out / "diagnostics.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {args.out / 'attention.png'}, {args.out / 'outliers.png'} and diagnostics.json")
    return 0


def _patch_options(args: argparse.Namespace) -> dict[str, Any]:
    """The patch options given on the command line (validated), as `hfa.patch` keywords."""
    from .core.config import AttnScaleConfig

    options = {k: getattr(args, k) for k in PATCH_OPTIONS if getattr(args, k) is not None}
    if options.get("scale") == "none":
        del options["scale"]
    if "scale" in options and "train_length" not in options:
        raise CommandError(
            f"--scale {options['scale']} needs --train-length N, the context the model was trained at."
        )
    AttnScaleConfig.from_options(**options)  # its own errors, before any model loads
    return options


def _stream_settings(args: argparse.Namespace) -> tuple[int, int] | None:
    from .streaming.cache import cache_settings

    if args.sink_tokens is not None and args.window is None:
        raise CommandError("--sink-tokens needs --window W (the streaming cache holds sink tokens + W).")
    return cache_settings(args.sink_tokens, args.window)


def _variant(args: argparse.Namespace, model, options: dict[str, Any], settings: tuple[int, int] | None):
    """The configuration to evaluate: the options given, else the patch the model was saved with."""
    from .core.state import get_config
    from .evaluation.variants import Variant

    saved = get_config(model)
    sink_tokens, window = settings if settings is not None else (0, None)
    if options:
        if saved is not None and not saved.is_identity:
            print(
                f"note: the patch options given replace the patch saved with the model ({saved}).", flush=True
            )
        name = args.name or describe(options, sink_tokens, window)
        return Variant(name, patch=options, sink_tokens=sink_tokens, window=window)
    if saved is not None and not saved.is_identity:
        patch = {k: v for k, v in saved.to_dict().items() if k in PATCH_OPTIONS}
        name = args.name or "saved: " + describe(patch, sink_tokens, window)
        return Variant(name, patch=patch, sink_tokens=sink_tokens, window=window)
    return Variant(args.name or describe({}, sink_tokens, window), sink_tokens=sink_tokens, window=window)


def _unpatched():
    from .evaluation.variants import Variant

    return Variant("unpatched")


def describe(options: dict[str, Any], sink_tokens: int, window: int | None) -> str:
    """A short label for a configuration, e.g. ``logn(L=4096) + sink+window (4+1020)``."""
    parts = []
    if options.get("scale") and options["scale"] != "none":
        parts.append(f"{options['scale']}(L={options['train_length']})")
    if options.get("zero_kv"):
        parts.append("zero-kv")
    if options.get("sink_logit") is not None:
        parts.append(f"sink-logit={options['sink_logit']}")
    if window is not None:
        parts.append(f"sink+window ({sink_tokens}+{window})" if sink_tokens else f"window-only ({window})")
    return " + ".join(parts) or "unpatched"


def _documents(data: str, text_field: str = "text"):
    from .evaluation.documents import load_documents

    return load_documents(data, text_field=text_field)


def _run_sweep(args, model, tokenizer, documents, lengths, variants, *, train_length, max_documents):
    from .evaluation.corpus import tokenize_documents
    from .evaluation.sweep import sweep

    token_ids = tokenize_documents(tokenizer, documents)
    # A tokenizer that opens every text with BOS: the model saw BOS first, so each segment is read behind it.
    bos_id = tokenizer.bos_token_id if _reads_behind_bos(tokenizer) else None
    printer = _RowPrinter(lengths, train_length, "perplexity", len(documents))
    return sweep(
        model,
        token_ids,
        lengths,
        variants,
        names=[doc.name for doc in documents],
        max_documents=max_documents,
        train_length=train_length,
        chunk_size=args.chunk_size,
        bos_id=bos_id,
        progress=args.progress,
        on_variant=printer,
    )


def _run_mlm_sweep(args, model, tokenizer, documents, variants, train_length):
    from .evaluation.corpus import tokenize_documents
    from .evaluation.mlm import mlm_sweep

    if tokenizer.mask_token_id is None:
        raise CommandError(f"The tokenizer of {args.model} has no mask token; MLM measures need one.")
    printer = _RowPrinter(args.lengths, train_length, "pseudo-perplexity", len(documents))
    return mlm_sweep(
        model,
        tokenize_documents(tokenizer, documents),
        args.lengths,
        variants,
        tokenizer.mask_token_id,
        names=[doc.name for doc in documents],
        max_documents=args.max_documents,
        train_length=train_length,
        on_variant=printer,
    )


def _reads_behind_bos(tokenizer) -> bool:
    """Whether the tokenizer opens every text with its BOS token (then segments are read behind BOS too)."""
    ids = tokenizer("a")["input_ids"]
    return tokenizer.bos_token_id is not None and bool(ids) and ids[0] == tokenizer.bos_token_id


class _RowPrinter:
    """Prints the table's header, then each variant's row as soon as it is done (also when piped)."""

    def __init__(self, lengths: list[int], train_length: int | None, measure: str, documents: int) -> None:
        self.lengths, self.train_length, self.measure, self.documents = (
            sorted(set(lengths)),
            train_length,
            measure,
            documents,
        )
        self.printed_header = False

    def __call__(self, variant, rows, seconds: float) -> None:
        from .evaluation.report import SweepResult

        partial = SweepResult(
            rows=rows,
            variants=[variant],
            lengths=self.lengths,
            documents=[],
            train_length=self.train_length,
            seconds={variant.name: seconds},
            measure=self.measure,
        )
        if not self.printed_header:
            what = "Perplexity" if self.measure == "perplexity" else "Pseudo-perplexity and MLM accuracy"
            print(
                f"\n{what} by evaluation length ({rows[0].documents} documents of >= {self.lengths[-1]} tokens, "
                f"each cut into non-overlapping L-token segments read from scratch):\n\n{partial.header()}",
                flush=True,
            )
            self.printed_header = True
        print(partial.row(variant.name), flush=True)


def _report(args: argparse.Namespace, result, started: float, *, title: str | None = None, **info) -> int:
    seconds = time.perf_counter() - started
    result.info.update(info, command=shlex.join(["hf-attnscale", *args.argv]), wall_seconds=seconds)
    json_path = result.write_json(args.out / "results.json")
    png_path = result.plot(args.out / "ppl_vs_length.png", title=title)
    print(f"\nwrote {json_path} and {png_path} in {seconds:.0f} s")
    return 0


def _setup(args: argparse.Namespace):
    """The torch device named by ``--device``, with ``--threads`` applied."""
    import torch

    if args.threads is not None:
        if args.threads < 1:
            raise CommandError(f"--threads must be at least 1, got {args.threads}.")
        torch.set_num_threads(args.threads)
    name = args.device
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


def _dtype(name: str, default: str | None = None) -> Any:
    import torch

    if name == "auto":
        return getattr(torch, default) if default is not None else "auto"
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(name) or getattr(
        torch, name
    )


if __name__ == "__main__":
    sys.exit(main())
