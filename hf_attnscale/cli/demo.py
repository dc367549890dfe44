"""``hf-attnscale demo``: the shipped model on the built-in held-out corpus, seven variants, 1x..16x its length."""

from __future__ import annotations

import argparse
import time

from .options import (
    DEFAULT_DATA,
    add_output_arguments,
    count_type,
    device,
    documents,
    dtype,
    length_marks,
    lengths_type,
)
from .results import run_sweep, tokenized, write_results

MULTIPLES = (1, 2, 4, 8, 16)
DOCUMENTS = 4


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The ``demo`` subparser."""
    parser = commands.add_parser(
        "demo",
        help="shipped model and corpus: attention variants at 1x..16x the trained length",
        description="Evaluate the shipped tiny Llama (trained at 128 tokens, a BOS token opening every "
        "window) on the built-in held-out corpus at 1x, 2x, 4x, 8x and 16x its trained length: unpatched, "
        "logn, ReRoPE + logn (window 32), window-only and sink+window streaming with a cache of the trained "
        "length, and sink+window and streaming+logn with twice that. The model's heads lean on BOS "
        "(attention sinks), so the window-only cache falls behind sink+window. Needs no arguments and no "
        "network; under a minute on two idle CPU cores. The same comparison on another model: hf-attnscale "
        "compare --model NAME.",
    )
    parser.add_argument(
        "--documents",
        type=count_type(1),
        default=DOCUMENTS,
        help=f"held-out documents to evaluate (default {DOCUMENTS}; more is slower and steadier)",
    )
    parser.add_argument("--lengths", type=lengths_type, help="override the lengths, e.g. 128,256,1k")
    add_output_arguments(parser, "hf-attnscale-demo")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status."""
    from hf_attnscale.checkpoints import models
    from hf_attnscale.evaluation.variants import demo_variants

    started = time.perf_counter()
    on = device(args)
    model, tokenizer = models.load_default_model(device=on, dtype=dtype(args.dtype, default="float32"))
    train_length = model.config.max_position_embeddings
    texts = tokenized(tokenizer, documents(DEFAULT_DATA))
    result = run_sweep(
        args,
        model,
        texts,
        args.lengths or [train_length * m for m in MULTIPLES],
        demo_variants(train_length, bos=texts.bos_id is not None),
        train_length=train_length,
        max_documents=args.documents,
    )
    return write_results(
        args,
        result,
        started,
        marks=length_marks(args, model),
        model=models.DEFAULT_MODEL,
        data=DEFAULT_DATA,
        device=str(on),
        title=f"{models.DEFAULT_MODEL} (trained at {train_length} tokens), held-out stdlib sources",
    )
