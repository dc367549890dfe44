"""What ``demo``, ``eval`` and ``compare`` share: a sweep whose table is printed a row at a time as each variant
finishes, then written to ``results.json`` and ``ppl_vs_length.png``; recall (passkeys) beside it."""

from __future__ import annotations

import argparse
import shlex
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch
    from torch import nn

    from hf_attnscale.evaluation.corpus import Document
    from hf_attnscale.evaluation.lengths import LengthMark
    from hf_attnscale.evaluation.report import SweepResult, SweepRow
    from hf_attnscale.evaluation.sweep import OnVariant
    from hf_attnscale.evaluation.variants import Variant


class Tokenized(NamedTuple):
    """Documents as a sweep reads them: their token ids and names, and the BOS id its segments are read behind
    (None: read as they are)."""

    ids: list[torch.Tensor]
    names: list[str]
    bos_id: int | None


def tokenized(tokenizer, documents: Sequence[Document]) -> Tokenized:
    """The documents' token ids, names and BOS id (the tokenizer's, if it opens every text with it: the model saw
    BOS first, so each segment is read behind it)."""
    from hf_attnscale.evaluation.corpus import tokenize_documents

    ids = tokenizer("a")["input_ids"]
    opens_with_bos = tokenizer.bos_token_id is not None and bool(ids) and ids[0] == tokenizer.bos_token_id
    return Tokenized(
        tokenize_documents(tokenizer, documents),
        [doc.name for doc in documents],
        tokenizer.bos_token_id if opens_with_bos else None,
    )


def run_sweep(
    args: argparse.Namespace,
    model,
    documents: Tokenized,
    lengths: list[int],
    variants: list[Variant],
    *,
    train_length: int | None,
    max_documents: int | None,
    on_variant: OnVariant | None = None,
    positions: Sequence[int] | None = None,
) -> SweepResult:
    """`hf_attnscale.evaluation.sweep.sweep` on the documents, its rows printed as they come (by `row_printer`
    unless ``on_variant`` is given); with ``positions``, perplexity by position too."""
    from hf_attnscale.evaluation.sweep import sweep

    return sweep(
        model,
        documents.ids,
        lengths,
        variants,
        names=documents.names,
        max_documents=max_documents,
        train_length=train_length,
        chunk_size=args.chunk_size,
        bos_id=documents.bos_id,
        progress=args.progress,
        on_variant=on_variant or row_printer(lengths, train_length, "perplexity"),
        positions=positions,
    )


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
                f"\n{what} by evaluation length, {rows[0].documents} document{'' if rows[0].documents == 1 else 's'} "
                f"({DEFINITIONS[measure]}):"
                f"\n\n{header}",
                flush=True,
            )
            printed_header = True
        print(table_row(rows, seconds), flush=True)

    return print_row


def recall(
    args: argparse.Namespace,
    model: nn.Module,
    tokenizer: object,
    variants: Sequence[Variant],
    lengths: Sequence[int],
    train_length: int | None,
) -> tuple[dict[str, list[dict]] | None, str]:
    """Each variant on one passkey prompt per length and depth (``args.passkey_depths``, seed 0; none with
    ``args.no_passkeys``): prints the table as rows finish, draws passkeys.png; returns every prompt's result, by
    variant, and a note on what was run (and, where the first variant is the unpatched model and finds no key
    within ``train_length``, that the model cannot do the task)."""
    if args.no_passkeys:
        return None, "recall left out (--no-passkeys)."
    from tqdm.auto import tqdm

    from hf_attnscale.evaluation.figure import passkey_figure
    from hf_attnscale.evaluation.lengths import length_label
    from hf_attnscale.evaluation.passkey import passkey_prompts, passkey_recall

    prompts, short = [], []
    for length in lengths:
        try:
            prompts += passkey_prompts(tokenizer, [length], args.passkey_depths)
        except ValueError:  # too short for the key and the question
            short.append(length)
    lengths = [n for n in lengths if n not in short]
    if not lengths:
        return {}, f"recall left out: every length is too short for a passkey prompt ({short[-1]} tokens)."
    depths = ", ".join(f"{d:.0%}" for d in args.passkey_depths)
    print(
        f"\nPasskeys found (every key token the model's top choice) of {len(args.passkey_depths)} prompts per "
        f"length (key at {depths} of the haystack; Y or N at each depth, in that order), and the key's mean "
        "log-likelihood (a guess: about -11.5):\n\n"
        f"| variant | {' | '.join(length_label(n, train_length) for n in lengths)} |\n"
        f"|---|{'---|' * len(lengths)}",
        flush=True,
    )
    table, found = {}, {}
    bar = tqdm(
        total=len(variants) * len(prompts),
        desc="passkeys",
        unit="prompt",
        disable=None if args.progress is None else not args.progress,
    )
    with bar:
        for variant in variants:
            with variant.applied(model):
                results = []
                for prompt in prompts:
                    results.append(
                        passkey_recall(model, tokenizer, prompt, variant.new_cache(), args.chunk_size)
                    )
                    bar.update()
            table[variant.name] = [vars(r) for r in results]
            cells, found[variant.name] = [], []
            for length in lengths:
                at = [r for r in results if r.length == length]
                hits = sum(r.found for r in at)
                found[variant.name].append((hits, len(at)))
                by_depth = "".join("Y" if r.found else "N" for r in at)
                cells.append(
                    f"{hits}/{len(at)} {by_depth} ({sum(r.loglikelihood for r in at) / len(at):.1f})"
                )
            bar.write(f"| {variant.name} | {' | '.join(cells)} |")
    within = [i for i, n in enumerate(lengths) if train_length is None or n <= train_length]
    first = variants[0] if variants else None
    plain = found[first.name] if first is not None and first.patch is None and not first.streaming else None
    unable = bool(within) and plain is not None and not any(plain[i][0] for i in within)
    figure = passkey_figure(lengths, found, train_length=train_length)
    args.out.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out / "passkeys.png")
    note = (
        f"recall: one passkey prompt per length and depth, seed 0; the figure is {args.out / 'passkeys.png'}"
    )
    if short:
        note += f"; no prompt at {', '.join(map(str, short))} tokens (too short for the key and the question)"
    if unable:
        note += (
            f"; {first.name} finds no key even within the trained length, so this model cannot do the task "
            "and recall tells nothing about the variants here"
        )
    return table, note + "."


def write_results(
    args: argparse.Namespace,
    result: SweepResult,
    started: float,
    *,
    marks: Sequence[LengthMark] = (),
    title: str | None = None,
    **info: Any,
) -> int:
    """Record the run in the result (``info``, the command, the wall time), print its notes (``info["notes"]``)
    and write its JSON and plot, which marks ``marks`` (`hf_attnscale.cli.options.length_marks`)."""
    if info.get("notes"):
        print("\n" + "\n".join(f"note: {note}" for note in info["notes"]), flush=True)
    seconds = time.perf_counter() - started
    result.marks = list(marks)
    result.info.update(info, command=shlex.join(["hf-attnscale", *args.argv]), wall_seconds=seconds)
    if result.positions is not None:
        longest = max(result.lengths)
        print(
            f"\nPerplexity by position within the {longest}-token segments (each read from its start):\n\n"
            f"{result.positions.table()}",
            flush=True,
        )
    json_path = result.write_json(args.out / "results.json")
    png_path = result.plot(args.out / "ppl_vs_length.png", title=title)
    print(f"\nwrote {json_path} and {png_path} in {seconds:.0f} s")
    return 0
