"""Train a small RoPE Llama on the built-in corpus, optionally patched while it trains.

The shipped demo model is trained by this script (see ``benchmarks/PRETRAIN.md`` for the command). Flags of
note: ``--bos`` starts every training window with the BOS token, the way LLMs see documents, which is what
lets an attention sink form on the first token; ``--zero-kv`` / ``--sink-logit`` / ``--scale`` train with an
`hf_attnscale` patch in force, and the saved checkpoint records it (``hfa.from_pretrained`` restores it).

    python -m hf_attnscale.training.lm --out runs/lm --bos --steps 2000
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from tqdm.auto import tqdm
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_attnscale.evaluation.corpus import Document, builtin_documents, tokenize_documents
from hf_attnscale.evaluation.perplexity import windowed_perplexity
from hf_attnscale.evaluation.sweep import whole_windows
from hf_attnscale.training.loop import (
    Trainer,
    WindowSampler,
    add_running_arguments,
    add_training_arguments,
    train,
)

MODULE = "hf_attnscale.training.lm"
BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
DEFAULT_EVAL_LENGTHS = (256, 512, 1024, 2048, 4096)


def train_tokenizer(documents: Sequence[Document], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (no unknown bytes possible) that prepends ``<s>`` to every encoded text."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[UNK, BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator((doc.text for doc in documents), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK
    )


def build_model(args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """The Llama the flags describe, freshly initialised (unpatched)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.context,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="run directory (checkpoint, snapshots, model)"
    )
    parser.add_argument("--tokenizer", type=Path, help="an existing tokenizer directory (default: train one)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="when training the tokenizer")
    parser.add_argument("--context", type=int, default=256, help="training context length in tokens")
    parser.add_argument("--bos", action="store_true", help="start every training window with the BOS token")
    parser.add_argument("--rope-theta", type=float, default=10000.0)
    add_training_arguments(
        parser,
        hidden=256,
        layers=4,
        heads=4,
        intermediate=688,
        steps=640,
        batch_size=16,
        lr=2e-3,
        warmup=50,
        weight_decay=0.1,
    )
    run = add_running_arguments(
        parser,
        save_every=100,
        eval_lengths=DEFAULT_EVAL_LENGTHS,
        eval_help="held-out perplexity lengths, on held-out documents at least max(lengths) tokens long",
    )
    run.add_argument("--snapshot-every", type=int, help="also save the model every N steps (for diagnostics)")
    return parser.parse_args(argv)


def build(args: argparse.Namespace) -> Trainer:
    """The causal LM's own parts: its tokenizer (trained, or ``--tokenizer``), the Llama, next-token batches
    (``--bos``: each window opening with BOS), and its held-out perplexities."""
    train_docs, heldout_docs = builtin_documents("train"), builtin_documents("heldout")
    if args.tokenizer is not None:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    else:
        tokenizer = train_tokenizer(train_docs, args.vocab_size)
    train_tokens = tokenize_documents(tokenizer, train_docs)
    heldout_tokens = tokenize_documents(tokenizer, heldout_docs)
    corpus_tokens = sum(len(t) for t in train_tokens)
    tqdm.write(f"{len(train_docs)} train docs, {corpus_tokens} tokens")

    model = build_model(args, tokenizer)
    # One extra token per window so that every one of the `context` positions gets a target.
    bos_id = tokenizer.bos_token_id if args.bos else None
    sampler = WindowSampler(train_tokens, args.context + 1, args.seed, bos_id=bos_id)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        windows = sampler.sample(args.batch_size)
        return windows[:, :-1], windows[:, 1:]

    def measure() -> dict[str, Any]:
        heldout_ppl = windowed_perplexity(model, heldout_tokens, args.context, bos_id)
        tqdm.write(f"held-out perplexity at {args.context}: {heldout_ppl:.3f}")
        long_docs = whole_windows(heldout_tokens, max(args.eval_lengths)) if args.eval_lengths else []
        length_ppl = {str(n): windowed_perplexity(model, long_docs, n, bos_id) for n in args.eval_lengths}
        for length, ppl in length_ppl.items():
            tqdm.write(f"long held-out docs, window {length}: perplexity {ppl:.3f}")
        return {
            "train_corpus_tokens": corpus_tokens,
            f"heldout_ppl_{args.context}": heldout_ppl,
            "heldout_documents": len(heldout_docs),
            "long_heldout_ppl": length_ppl,
            "long_heldout_documents": len(long_docs),
            "long_heldout_tokens": sum(len(d) for d in long_docs),
        }

    return Trainer(
        model,
        tokenizer,
        batch,
        generators={"sampler": sampler.generator},
        measure=measure,
        snapshot_every=args.snapshot_every,
    )


def main(argv: Sequence[str] | None = None) -> None:
    train(MODULE, parse_args, build, argv)


if __name__ == "__main__":
    main()
