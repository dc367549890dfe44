"""``hf-attnscale diagnose``: attention and activation diagnostics of a model on text, per layer."""

from __future__ import annotations

import argparse
import json
import shlex
import time

from hf_attnscale.core.options.flags import add_patch_arguments

from .options import (
    PATCH_TITLE,
    CommandError,
    add_data_arguments,
    add_model_arguments,
    add_output_arguments,
    count_type,
    device,
    documents,
    given_patch,
    length_type,
    load_model,
    model_name,
)

SKIPPED_QUERIES = 16
"""The first queries see few keys; the table's means leave them out."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The ``diagnose`` subparser."""
    parser = commands.add_parser(
        "diagnose",
        help="attention entropy, sink mass, softmax gradients and activation outliers of a model",
        description="Run a model (with its saved patch, or the patch options given) on text and report, per "
        "layer: attention entropy against the number of visible keys, the attention mass on the first tokens "
        "(attention sinks), the softmax gradient size, the exit's mass, and the kurtosis and largest "
        "magnitude of the attention outputs and hidden states. Writes plots and diagnostics.json.",
    )
    add_model_arguments(parser)
    add_data_arguments(parser)
    parser.add_argument(
        "--length", type=length_type, default=512, help="tokens per document read (default 512)"
    )
    parser.add_argument("--documents", type=count_type(1), default=4, help="documents read (default 4)")
    parser.add_argument(
        "--sink-tokens", type=count_type(0), default=1, help="first tokens counted as the sink (default 1)"
    )
    add_patch_arguments(parser, PATCH_TITLE)
    add_output_arguments(parser, "hf-attnscale-diagnose")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the diagnostics; returns the exit status."""
    import torch

    from hf_attnscale.core.install.installed import get_config
    from hf_attnscale.core.install.patching import patched
    from hf_attnscale.core.options.config import AttnScaleConfig
    from hf_attnscale.diagnostics import activation_outliers, attention_statistics, layer_table
    from hf_attnscale.evaluation.corpus import tokenize_documents

    started = time.perf_counter()
    docs = documents(args.data, args.text_field)
    model, tokenizer, _ = load_model(args, device(args))
    options = given_patch(args, model)
    ids = [d[: args.length] for d in tokenize_documents(tokenizer, docs) if d.numel() >= args.length]
    if not ids:
        raise CommandError(f"No document has {args.length} tokens; pass a smaller --length or longer data.")
    batch = torch.stack(ids[: args.documents])
    config = AttnScaleConfig(**options) if options else get_config(model)
    with patched(model, config):
        attention = attention_statistics(model, batch, sink_tokens=args.sink_tokens)
        outliers = activation_outliers(model, batch)
    skip = min(SKIPPED_QUERIES, args.length - 1)
    label = model_name(args)
    print(
        f"\n{label} ({'patch: ' + str(config) if config else 'unpatched'}), {batch.shape[0]} documents "
        f"of {args.length} tokens; per layer, mean over heads and over queries past the {SKIPPED_QUERIES}th:\n"
    )
    print(layer_table(attention, outliers, skip))
    args.out.mkdir(parents=True, exist_ok=True)
    attention.plot(args.out / "attention.png", title=f"{label}: attention by layer")
    outliers.plot(args.out / "outliers.png", title=f"{label}: activation outliers")
    record = {
        "command": shlex.join(["hf-attnscale", *args.argv]),
        "model": label,
        "patch": None if config is None else config.to_dict(),
        "length": args.length,
        "documents": batch.shape[0],
        "per_layer_head": {name: value.tolist() for name, value in attention.summary(skip=skip).items()},
        "entropy_by_query": attention.entropy.mean(1).tolist(),
        "outliers": {k: v.tolist() for k, v in vars(outliers).items()},
        "wall_seconds": time.perf_counter() - started,
    }
    (args.out / "diagnostics.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {args.out / 'attention.png'}, {args.out / 'outliers.png'} and diagnostics.json")
    return 0
