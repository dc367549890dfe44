"""What ``demo`` and ``eval`` share: a sweep whose table is printed a row at a time as each variant finishes,
then written to ``results.json`` and ``ppl_vs_length.png``."""

from __future__ import annotations

import argparse
import shlex
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hf_attnscale.evaluation.corpus import Document
    from hf_attnscale.evaluation.report import SweepResult, SweepRow
    from hf_attnscale.evaluation.sweep import OnVariant
    from hf_attnscale.evaluation.variants import Variant


def run_sweep(
    args: argparse.Namespace,
    model,
    tokenizer,
    documents: Sequence[Document],
    lengths: list[int],
    variants: list[Variant],
    *,
    train_length: int | None,
    max_documents: int | None,
) -> SweepResult:
    """`hf_attnscale.evaluation.sweep.sweep` on the documents, its rows printed as they come."""
    from hf_attnscale.evaluation.corpus import tokenize_documents
    from hf_attnscale.evaluation.sweep import sweep

    # A tokenizer that opens every text with BOS: the model saw BOS first, so each segment is read behind it.
    bos_id = tokenizer.bos_token_id if reads_behind_bos(tokenizer) else None
    return sweep(
        model,
        tokenize_documents(tokenizer, documents),
        lengths,
        variants,
        names=[doc.name for doc in documents],
        max_documents=max_documents,
        train_length=train_length,
        chunk_size=args.chunk_size,
        bos_id=bos_id,
        progress=args.progress,
        on_variant=row_printer(lengths, train_length, "perplexity"),
    )


def reads_behind_bos(tokenizer) -> bool:
    """Whether the tokenizer opens every text with its BOS token (then segments are read behind BOS too)."""
    ids = tokenizer("a")["input_ids"]
    return tokenizer.bos_token_id is not None and bool(ids) and ids[0] == tokenizer.bos_token_id


def row_printer(lengths: Sequence[int], train_length: int | None, measure: str) -> OnVariant:
    """An ``on_variant`` callback that prints the table's header, then each variant's row as soon as it is
    done (flushed, so that it shows when piped too)."""
    from hf_attnscale.evaluation.report import DEFINITIONS, has_accuracy, table_header, table_row

    lengths = sorted(set(lengths))
    printed_header = False

    def print_row(variant: Variant, rows: list[SweepRow], seconds: float) -> None:
        nonlocal printed_header
        if not printed_header:
            what = "Perplexity" if measure == "perplexity" else "Pseudo-perplexity and MLM accuracy"
            header = table_header(lengths, train_length, has_accuracy(rows))
            print(
                f"\n{what} by evaluation length, {rows[0].documents} documents ({DEFINITIONS[measure]}):"
                f"\n\n{header}",
                flush=True,
            )
            printed_header = True
        print(table_row(rows, seconds), flush=True)

    return print_row


def write_results(
    args: argparse.Namespace, result: SweepResult, started: float, *, title: str | None = None, **info: Any
) -> int:
    """Record the run in the result (``info``, the command, the wall time), write its JSON and plot."""
    seconds = time.perf_counter() - started
    result.info.update(info, command=shlex.join(["hf-attnscale", *args.argv]), wall_seconds=seconds)
    json_path = result.write_json(args.out / "results.json")
    png_path = result.plot(args.out / "ppl_vs_length.png", title=title)
    print(f"\nwrote {json_path} and {png_path} in {seconds:.0f} s")
    return 0
