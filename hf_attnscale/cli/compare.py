"""``hf-attnscale compare``: the demo's comparison on any causal LM: unpatched, logn, window-only and
sink+window streaming at each cache size, and re-computation; past the trained length, YaRN, ReRoPE + logn,
Self-Extend and Dual Chunk Attention too. Beside perplexity, recall: passkeys found at each length and depth,
and the key's log-likelihood, for every variant but re-computation (a variant with low perplexity can still
have forgotten what it read).

Re-computation predicts each token from its last C tokens re-read from scratch (StreamingLLM's oracle
baseline): a model call per token. On a long stream it is scored on an evenly spaced subsample of the tokens
(``--recompute-every``), the same tokens at every length, and the output says so.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .options import (
    CommandError,
    add_data_arguments,
    add_model_arguments,
    add_output_arguments,
    add_recall_arguments,
    count_type,
    device,
    documents,
    length_marks,
    lengths_type,
    load_model,
    model_name,
    trained_length,
)
from .results import Tokenized, recall, row_printer, run_sweep, tokenized, write_results

if TYPE_CHECKING:
    from torch import nn

    from hf_attnscale.evaluation.report import SweepResult
    from hf_attnscale.evaluation.sweep import OnVariant
    from hf_attnscale.evaluation.variants import Variant

CACHE = 256
"""The default cache size (or the trained length, if shorter)."""
MULTIPLES = (1, 2, 4, 8)
"""The default lengths, as multiples of the smallest cache: minutes for a 135M model on two CPU cores."""
DOCUMENTS = 2
RECOMPUTE_EVERY = 32
FEW_TOKENS = 200
"""Re-computation scoring fewer tokens than this gets a warning that its estimate is noisy."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The ``compare`` subparser."""
    parser = commands.add_parser(
        "compare",
        help="the demo's comparison on any causal LM: perplexity and passkeys of unpatched, logn, YaRN, "
        "ReRoPE + logn, Self-Extend, DCA, window-only, sink+window and re-computation",
        description="Evaluate a causal LM (a folder, a Hub id, a GGUF file or a real checkpoint's name) on "
        "held-out text at several lengths, as the demo does: unpatched; logn, YaRN (factor: the longest "
        "length over the trained length), ReRoPE + logn (window: a quarter of the trained length), "
        "Self-Extend (neighbours: a quarter of it, the least group that keeps the longest length within it) "
        "and Dual Chunk Attention (chunks of three quarters of it, local a sixteenth), if a length exceeds the "
        "trained length; window-only and sink+window streaming (StreamingLLM's "
        "SinkCache) at each cache size; and re-computation, each token predicted from its last C tokens "
        "re-read from scratch. Then passkeys by length and depth for each variant but re-computation "
        "(--no-passkeys skips them). Prints the tables and writes results.json, ppl_vs_length.png and "
        "passkeys.png. With no arguments: the shipped tiny model, offline.",
    )
    add_model_arguments(parser)
    add_data_arguments(parser)
    parser.add_argument(
        "--caches",
        type=lengths_type,
        help=f"cache sizes in tokens, sinks included, e.g. 256,1k (default {CACHE}, or the trained length if "
        "shorter)",
    )
    parser.add_argument(
        "--sink-tokens",
        type=count_type(0),
        help="sink tokens of the sink+window caches (default: SinkCache's, StreamingLLM's choice)",
    )
    parser.add_argument(
        "--lengths",
        type=lengths_type,
        help="evaluation lengths, each dividing the longest (default: the smallest cache times 1, 2, 4, 8)",
    )
    parser.add_argument(
        "--train-length",
        type=count_type(2),
        help="L of logn, YaRN's factor (longest length / it), ReRoPE's window (a quarter of it), and the length "
        "the table's multiples are of (default: max_position_embeddings, which the plot marks as the trained length)",
    )
    parser.add_argument(
        "--documents",
        type=count_type(1),
        default=DOCUMENTS,
        help=f"held-out documents to evaluate (default {DOCUMENTS}; more is slower and steadier)",
    )
    add_recall_arguments(parser)
    recompute = parser.add_argument_group("re-computation (a model call per scored token: slow)")
    recompute.add_argument(
        "--recompute-every",
        type=count_type(1),
        default=RECOMPUTE_EVERY,
        metavar="N",
        help=f"score it on every Nth token only, the same tokens at every length (default {RECOMPUTE_EVERY}; "
        "1: every token)",
    )
    recompute.add_argument("--no-recompute", action="store_true", help="leave re-computation out")
    add_output_arguments(parser, "hf-attnscale-compare")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the comparison; returns the exit status."""
    started = time.perf_counter()
    docs = documents(args.data, args.text_field)  # data errors are cheaper to find than a download
    on = device(args)
    model, tokenizer, kind = load_model(args, on)
    name = model_name(args)
    if kind != "causal":
        raise CommandError(
            f"{name} is a masked LM (an encoder); compare reads causal LMs. For an encoder's MLM measures "
            "use hf-attnscale eval."
        )
    train_length = trained_length(args, model)
    if not train_length:
        raise CommandError(f"{name}'s config gives no max_position_embeddings; pass --train-length N.")
    caches = args.caches or [min(CACHE, train_length)]
    if args.sink_tokens is None:
        from hf_attnscale.streaming.cache import DEFAULT_SINK_TOKENS

        args.sink_tokens = DEFAULT_SINK_TOKENS
    if min(caches) <= args.sink_tokens:
        raise CommandError(
            f"Each cache must hold more than the {args.sink_tokens} sink tokens; got {caches}."
        )
    lengths = args.lengths or [min(caches) * m for m in MULTIPLES]
    variants = comparison_variants(caches, args.sink_tokens, train_length, max(lengths))
    variants, refused = applicable(model, variants)
    # The trained length is marked (and lengths labelled as multiples of it) only where a length reaches it.
    shown_length = train_length if max(lengths) >= train_length else None
    texts = tokenized(tokenizer, docs)
    printer = row_printer(lengths, shown_length, "perplexity")
    result = run_sweep(
        args,
        model,
        texts,
        lengths,
        variants,
        train_length=shown_length,
        max_documents=args.documents,
        on_variant=printer,
    )
    notes = []
    if not any(v.name == "logn" for v in variants):
        from hf_attnscale.evaluation.variants import unchanged_within

        logn = logn_variant(train_length)
        notes.append(f"logn left out: {unchanged_within(logn.config, max(lengths))}.")
    notes += refused
    if args.no_recompute:
        notes.append("re-computation left out (--no-recompute).")
    else:
        notes.append(add_recompute(args, model, texts, result, caches, printer))
    passkeys, note = recall(args, model, tokenizer, variants, sorted(set(lengths)), shown_length)
    notes.append(note)
    marks = length_marks(args, model)  # the config's trained length first, then a --train-length that differs
    return write_results(
        args,
        result,
        started,
        marks=marks,
        model=name,
        data=args.data,
        device=str(on),
        trained_length=train_length,
        caches=caches,
        sink_tokens=args.sink_tokens,
        recompute_every=None if args.no_recompute else args.recompute_every,
        passkeys=passkeys,
        notes=notes,
        title=f"{name} (trained at {marks[0].length} tokens): {args.data}",
    )


def comparison_variants(
    caches: Sequence[int], sink_tokens: int, train_length: int, longest: int
) -> list[Variant]:
    """unpatched; logn where it changes something at ``longest`` (past ``train_length``: within it, logn is 1,
    `unchanged_within`); past ``train_length``, YaRN (factor ``longest / train_length``) and every method of
    key parts at its registered default (`hf_attnscale.core.options.methods`: ReRoPE + logn with a window of
    ``train_length / 4``, Self-Extend, DCA...), the methods that recall there; then window-only and sink+window streaming with each cache (of ``cache`` tokens,
    ``sink_tokens`` of them sinks)."""
    from hf_attnscale.evaluation.variants import Variant, method_variants, unchanged_within

    variants = [Variant("unpatched")]
    logn = logn_variant(train_length)
    if unchanged_within(logn.config, longest) is None:
        variants.append(logn)
    if longest > train_length:
        factor = longest / train_length
        yarn = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": train_length}
        variants += [
            Variant(f"YaRN (x{factor:g})", patch={"rope_parameters": yarn}),
            *method_variants(train_length, longest),
        ]
    for cache in caches:
        variants += [Variant.streamed(cache, 0), Variant.streamed(cache, sink_tokens)]
    return variants


def applicable(model: nn.Module, variants: Sequence[Variant]) -> tuple[list[Variant], list[str]]:
    """The variants ``model`` can run, and a note on each it refuses (a model without RoPE refuses YaRN)."""
    kept, notes = [], []
    for variant in variants:
        try:
            with variant.applied(model):
                pass
        except ValueError as error:
            notes.append(f"{variant.name} left out: {error}")
            continue
        kept.append(variant)
    return kept, notes


def logn_variant(train_length: int) -> Variant:
    """The comparison's logn variant, scaling from ``train_length``."""
    from hf_attnscale.evaluation.variants import Variant

    return Variant("logn", patch={"scale": "logn", "train_length": train_length})


def add_recompute(
    args: argparse.Namespace,
    model: nn.Module,
    texts: Tokenized,
    result: SweepResult,
    caches: Sequence[int],
    printer: OnVariant,
) -> str:
    """Score re-computation with each cache on the sweep's documents and add its rows to ``result``; returns a
    note on what it scored."""
    from hf_attnscale.evaluation.recompute import recompute_rows
    from hf_attnscale.evaluation.sweep import run_variants, sweep_documents
    from hf_attnscale.evaluation.variants import Variant

    longest = result.lengths[-1]
    chosen = sweep_documents(texts.ids, longest, texts.names, args.documents, texts.bos_id)
    sampled = f"; 1 token in {args.recompute_every}" if args.recompute_every > 1 else ""
    by_name = {f"re-computation ({cache}{sampled})": cache for cache in caches}
    extra = run_variants(
        model,
        [Variant(name) for name in by_name],
        lambda variant: recompute_rows(
            model,
            variant.name,
            by_name[variant.name],
            [doc for _, doc in chosen],
            result.lengths,
            every=args.recompute_every,
            bos_id=texts.bos_id,
            chunk_size=args.chunk_size,
            progress=args.progress,
        ),
        lengths=result.lengths,
        documents=chosen,
        train_length=result.train_length,
        info={},
        on_variant=printer,
    )
    result.rows += extra.rows
    result.variants += extra.variants
    result.seconds.update(extra.seconds)
    note = "re-computation: each token predicted from the last C tokens before it in its segment, re-read"
    if args.recompute_every == 1:
        return note + " from scratch."
    scored, total = extra.rows[-1].tokens, next(r.tokens for r in result.rows if r.length == longest)
    note = (
        f"{note} from scratch, on one token in {args.recompute_every} only ({scored} of the {total} tokens "
        "the other rows score at each length): its perplexities are estimates from that subsample"
    )
    if scored < FEW_TOKENS:  # the plot draws these rows apart, as estimates from so many tokens
        for variant in extra.variants:
            result.estimates[variant.name] = next(
                r.tokens for r in extra.rows if r.variant == variant.name and r.length == longest
            )
        return (
            f"{note}, and {scored} tokens are too few for a steady one (its perplexity can differ from the "
            "other rows' by the sample alone): lower --recompute-every or raise --documents."
        )
    return note + "."
