"""Train a small RoFormer masked LM on the built-in corpus: the setting of Su's Attention-O/E table.

Windows of ``--context`` tokens (64 in the article), 15% of the tokens masked (80% mask token, 10% random,
10% kept), optionally under an `hf_attnscale` patch: Attention-E is ``--scale logn --scale-length 512
--no-clamp`` (``log_512(n)/sqrt(d)``, unclamped, in training too). MLM accuracy is measured at the end at
``--eval-lengths`` on held-out documents.

    python -m hf_attnscale.training.mlm --out runs/mlm-e --scale logn --scale-length 512 --no-clamp
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer, RoFormerConfig, RoFormerForMaskedLM

from hf_attnscale.checkpoints.models import default_model_path
from hf_attnscale.evaluation.corpus import builtin_documents, tokenize_documents
from hf_attnscale.evaluation.mlm import masked_lm_accuracy
from hf_attnscale.training.loop import (
    Trainer,
    WindowSampler,
    add_running_arguments,
    add_training_arguments,
    train,
)

MODULE = "hf_attnscale.training.mlm"
MASK = "<mask>"
MASK_FRACTION = 0.15


def mask_tokens(
    batch: torch.Tensor, mask_id: int, vocab_size: int, special: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: inputs with 15% of the ordinary tokens chosen (80/10/10), and labels (-100 elsewhere)."""
    chosen = (torch.rand(batch.shape, generator=generator) < MASK_FRACTION) & ~torch.isin(batch, special)
    labels = batch.masked_fill(~chosen, -100)
    action = torch.rand(batch.shape, generator=generator)
    random_ids = torch.randint(vocab_size, batch.shape, generator=generator)
    inputs = batch.masked_fill(chosen & (action < 0.8), mask_id)
    inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_ids, inputs)
    return inputs, labels


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="run directory (checkpoint, model)")
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer directory (default: the shipped model's)")
    parser.add_argument("--context", type=int, default=64, help="training window in tokens")
    parser.add_argument("--max-positions", type=int, default=1024, help="RoFormer's sinusoidal table size")
    add_training_arguments(
        parser,
        hidden=128,
        layers=4,
        heads=4,
        intermediate=512,
        steps=3000,
        batch_size=32,
        lr=1e-3,
        warmup=100,
        weight_decay=0.01,
        exits=False,
    )
    add_running_arguments(
        parser, save_every=200, eval_lengths=(64, 128, 256, 512, 1024), eval_help="MLM accuracy lengths"
    )
    return parser.parse_args(argv)


def build(args: argparse.Namespace) -> Trainer:
    """The masked LM's own parts: the tokenizer (``--tokenizer``, else the shipped model's, with a mask token),
    the RoFormer, BERT-masked batches, and its MLM accuracy at ``--eval-lengths``."""
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or default_model_path(), local_files_only=True)
    if tokenizer.mask_token is None:
        tokenizer.add_special_tokens({"mask_token": MASK})
    train_tokens = tokenize_documents(tokenizer, builtin_documents("train"))
    heldout_tokens = tokenize_documents(tokenizer, builtin_documents("heldout"))

    config = RoFormerConfig(
        vocab_size=len(tokenizer),
        embedding_size=args.hidden,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=args.intermediate,
        max_position_embeddings=args.max_positions,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = RoFormerForMaskedLM(config)
    sampler = WindowSampler(train_tokens, args.context, args.seed)
    masking = torch.Generator().manual_seed(args.seed + 1)
    special = torch.tensor(tokenizer.all_special_ids)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        windows = sampler.sample(args.batch_size)
        return mask_tokens(windows, tokenizer.mask_token_id, len(tokenizer), special, masking)

    def measure() -> dict[str, Any]:
        accuracy = masked_lm_accuracy(model, heldout_tokens, args.eval_lengths, tokenizer.mask_token_id)
        for result in accuracy:
            tqdm.write(
                f"MLM accuracy at {result.length}: {100 * result.accuracy:.2f}% ({result.tokens} tokens)"
            )
        return {
            "mlm_accuracy": {str(r.length): r.accuracy for r in accuracy},
            "mlm_masked_tokens": {str(r.length): r.tokens for r in accuracy},
        }

    return Trainer(
        model,
        tokenizer,
        batch,
        generators={"sampler": sampler.generator, "masking": masking},
        measure=measure,
    )


def main(argv: Sequence[str] | None = None) -> None:
    train(MODULE, parse_args, build, argv)


if __name__ == "__main__":
    main()
