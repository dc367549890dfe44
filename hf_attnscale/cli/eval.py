"""``hf-attnscale eval``: one configuration of a model (plus, optionally, the unpatched baseline) at several
lengths: perplexity and recall (passkeys, as ``compare`` reads them) for a causal LM, MLM accuracy and
pseudo-perplexity for a masked LM."""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import TYPE_CHECKING, Any

from hf_attnscale.core.options.config import METHOD_NAMES, OPTION_NAMES, AttnScaleConfig, replaced_patch_note
from hf_attnscale.core.options.flags import add_patch_arguments
from hf_attnscale.core.options.methods import label_of

from .options import (
    PATCH_TITLE,
    CommandError,
    add_data_arguments,
    add_model_arguments,
    add_output_arguments,
    add_recall_arguments,
    count_type,
    device,
    documents,
    given_patch,
    length_marks,
    lengths_type,
    load_model,
    model_name,
    trained_length,
)
from .results import recall, row_printer, run_sweep, tokenized, write_results

if TYPE_CHECKING:
    from torch import nn

    from hf_attnscale.evaluation.corpus import Document
    from hf_attnscale.evaluation.report import SweepResult
    from hf_attnscale.evaluation.variants import Variant


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The ``eval`` subparser."""
    parser = commands.add_parser(
        "eval",
        help="a model, patched or not, at several lengths (perplexity; MLM measures for encoders)",
        description="Evaluate one configuration of a model at several lengths: perplexity and recall "
        "(passkeys) for a causal LM; MLM accuracy and pseudo-perplexity for a masked LM (an encoder). A model "
        "saved with a patch runs with it; patch options given here replace it. --baseline adds the unpatched "
        "model.",
    )
    add_model_arguments(parser)
    add_data_arguments(parser)
    parser.add_argument(
        "--lengths",
        type=lengths_type,
        required=True,
        help="evaluation lengths in tokens, each dividing the longest, e.g. 1k,2k,4k,8k",
    )
    parser.add_argument(
        "--position-buckets",
        type=lengths_type,
        help="edges of the position buckets for perplexity by position within the longest segments, e.g. "
        "2k,4k (default: the shorter lengths)",
    )
    add_patch_arguments(parser, PATCH_TITLE)
    stream_group = parser.add_argument_group("streaming (StreamingLLM SinkCache)")
    stream_group.add_argument(
        "--window",
        type=count_type(1),
        help="stream through a SinkCache that keeps this many recent tokens (its window)",
    )
    stream_group.add_argument(
        "--sink-tokens",
        type=count_type(0),
        help="sink tokens kept (default with --window: SinkCache's, StreamingLLM's choice)",
    )
    add_recall_arguments(parser)
    parser.add_argument("--baseline", action="store_true", help="also evaluate the unpatched model")
    parser.add_argument("--name", help="label of the configuration in the table and plot")
    parser.add_argument("--max-documents", type=count_type(1), help="evaluate at most this many documents")
    parser.add_argument(
        "--measure",
        choices=("auto", "perplexity", "mlm"),
        default="auto",
        help="perplexity (causal LMs) or mlm (masked LMs: accuracy and pseudo-perplexity); default: by model",
    )
    add_output_arguments(parser, "hf-attnscale-eval")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the evaluation; returns the exit status."""
    from hf_attnscale.evaluation.processes import join_processes, process_share
    from hf_attnscale.evaluation.variants import Variant

    started = time.perf_counter()
    settings = _stream_settings(args)
    positions = _position_edges(args)
    docs = documents(args.data, args.text_field)  # data errors are cheaper to find than a download
    join_processes()  # under torchrun / accelerate launch: each process reads its share of the documents
    rank, world = process_share()
    if rank:  # one table, one progress bar, one results.json: rank 0's
        args.progress = False
    on = device(args)
    model, tokenizer, kind = load_model(args, on)
    options = given_patch(args, model)
    measure = {"auto": "mlm" if kind == "masked" else "perplexity"}.get(args.measure, args.measure)
    if measure == "mlm" and world > 1:
        raise CommandError("The MLM measures run in one process; launch hf-attnscale eval without torchrun.")
    if measure == "perplexity" and kind == "masked":
        raise CommandError(
            f"{model_name(args)} is a masked LM (an encoder): causal perplexity means nothing for it. Its measures "
            "are MLM accuracy and pseudo-perplexity: pass --measure mlm (or leave --measure auto)."
        )
    if measure == "mlm" and kind == "causal":
        raise CommandError(f"{model_name(args)} is a causal LM; --measure mlm is for masked LMs (encoders).")
    from hf_attnscale.checkpoints.models import has_lm_head

    if not has_lm_head(model.config):
        raise CommandError(
            f"{model_name(args)} was saved without its language-model head ({', '.join(model.config.architectures)}: "
            "a bare encoder, such as a sentence encoder), so its MLM measures would come from a head initialised "
            "at random. hf-attnscale diagnose reads it: attention and activation statistics need no head."
        )
    variant = _variant(args, model, options, settings)
    variants = [Variant("unpatched"), variant] if args.baseline and variant.patch is not None else [variant]
    train_length = trained_length(args, model)
    if measure == "mlm":
        if args.position_buckets:
            raise CommandError("--position-buckets is for perplexity (causal LMs); MLM measures have none.")
        result = _run_mlm_sweep(args, model, tokenizer, docs, variants, train_length)
    else:
        result = run_sweep(
            args,
            model,
            tokenized(tokenizer, docs),
            args.lengths,
            variants,
            train_length=train_length,
            max_documents=args.max_documents,
            on_variant=(lambda *_: None) if rank else None,
            positions=positions,
        )
    if rank:
        return 0
    passkeys, notes = None, []
    if measure == "perplexity":
        passkeys, note = recall(args, model, tokenizer, variants, sorted(set(args.lengths)), train_length)
        notes.append(note)
    return write_results(
        args,
        result,
        started,
        marks=length_marks(args, model),
        model=model_name(args),
        data=args.data,
        device=str(on),
        passkeys=passkeys,
        notes=notes,
    )


def describe(options: dict[str, Any], sink_tokens: int, window: int | None) -> str:
    """A short label for a configuration, e.g. ``ReRoPE(w=2048) + logn(L=8192) + sink+window (4+1020)``: every
    option that differs from its default (a saved patch lists them all), the common ones by a short name, any
    other as ``name=value``."""
    defaults = {field.name: field.default for field in dataclasses.fields(AttnScaleConfig)}
    rest = {k: v for k, v in options.items() if v != defaults.get(k)}
    parts = []
    rope = rest.pop("rope_parameters", None)
    if rope is not None:
        flat = "rope_type" in rope and "factor" in rope
        parts.append(f"{rope['rope_type']}(x{rope['factor']:g})" if flat else f"rope_parameters={rope}")
    method = label_of(rest)
    if method is not None:
        parts.append(method)
        for name in METHOD_NAMES:
            rest.pop(name, None)
    scale, train_length, beta = (
        rest.pop("scale", "none"),
        rest.pop("train_length", None),
        rest.pop("beta", None),
    )
    if scale != "none":
        parts.append(f"{scale}(L={train_length}{'' if beta is None else f', beta={beta}'})")
        if rest.get("clamp") == AttnScaleConfig(scale=scale, train_length=train_length, beta=beta).clamp:
            del rest["clamp"]  # the law's own default, resolved in a saved patch
    if rest.pop("zero_kv", None):
        parts.append("zero-kv")
    short = {"sink_logit": "sink-logit", "clipped_softmax": "clipped", "gate": "gate"}
    parts += [f"{short.get(name, name.replace('_', '-'))}={value}" for name, value in rest.items()]
    if window is not None:
        from hf_attnscale.evaluation.variants import cache_label

        parts.append(cache_label(sink_tokens, window))
    return " + ".join(parts) or "unpatched"


def _position_edges(args: argparse.Namespace) -> list[int] | None:
    """The position buckets' edges: ``--position-buckets``, else the lengths below the longest (None: one
    length, nothing to split)."""
    edges = args.position_buckets or sorted(set(args.lengths))[:-1]
    if edges and max(edges) >= max(args.lengths):
        raise CommandError(
            f"--position-buckets must lie below the longest length ({max(args.lengths)}); got {max(edges)}."
        )
    return edges or None


def _stream_settings(args: argparse.Namespace) -> tuple[int, int] | None:
    from hf_attnscale.streaming.cache import cache_settings

    if args.sink_tokens is not None and args.window is None:
        raise CommandError("--sink-tokens needs --window W (the streaming cache holds sink tokens + W).")
    return cache_settings(args.sink_tokens, args.window)


def _variant(
    args: argparse.Namespace, model: nn.Module, options: dict[str, Any], settings: tuple[int, int] | None
) -> Variant:
    """The configuration to evaluate: the options given, else the patch the model was saved with."""
    from hf_attnscale.core.install.installed import get_config
    from hf_attnscale.evaluation.variants import Variant

    saved = get_config(model)
    sink_tokens, window = settings if settings is not None else (0, None)
    if options:
        name = args.name or describe(options, sink_tokens, window)
        variant = Variant(name, patch=options, sink_tokens=sink_tokens, window=window)
        note = replaced_patch_note(saved, variant.config)
        if note is not None:
            print(note, flush=True)
        return variant
    if saved is not None and not saved.is_identity:
        patch = {k: v for k, v in saved.to_dict().items() if k in OPTION_NAMES}
        name = args.name or "saved: " + describe(patch, sink_tokens, window)
        return Variant(name, patch=patch, sink_tokens=sink_tokens, window=window)
    return Variant(args.name or describe({}, sink_tokens, window), sink_tokens=sink_tokens, window=window)


def _run_mlm_sweep(
    args: argparse.Namespace,
    model: nn.Module,
    tokenizer,
    docs: list[Document],
    variants: list[Variant],
    train_length: int | None,
) -> SweepResult:
    from hf_attnscale.evaluation.corpus import tokenize_documents
    from hf_attnscale.evaluation.mlm import mlm_sweep

    if tokenizer.mask_token_id is None:
        raise CommandError(f"The tokenizer of {model_name(args)} has no mask token; MLM measures need one.")
    return mlm_sweep(
        model,
        tokenize_documents(tokenizer, docs),
        args.lengths,
        variants,
        tokenizer.mask_token_id,
        names=[doc.name for doc in docs],
        max_documents=args.max_documents,
        train_length=train_length,
        on_variant=row_printer(args.lengths, train_length, "pseudo-perplexity"),
    )
