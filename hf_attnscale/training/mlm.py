"""Train a small RoFormer masked LM on the built-in corpus: the setting of Su's Attention-O/E table.

Windows of ``--context`` tokens (64 in the article), 15% of the tokens masked (80% mask token, 10% random,
10% kept), optionally under an `hf_attnscale` patch: Attention-E is ``--scale logn --scale-length 512
--no-clamp`` (``log_512(n)/sqrt(d)``, unclamped, in training too). MLM accuracy is measured at the end at
``--eval-lengths`` on held-out documents.

    python -m hf_attnscale.training.mlm --out runs/mlm-e --scale logn --scale-length 512 --no-clamp
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import AutoTokenizer, RoFormerConfig, RoFormerForMaskedLM

import hf_attnscale as hfa
from hf_attnscale.evaluation.corpus import builtin_documents, tokenize_documents
from hf_attnscale.evaluation.mlm import masked_lm_accuracy
from hf_attnscale.evaluation.models import default_model_path
from hf_attnscale.training.loop import (
    TrainRun,
    WindowSampler,
    add_running_arguments,
    make_optimizer,
    run_info,
    run_settings,
    set_threads,
    write_info,
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
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--max-positions", type=int, default=1024, help="RoFormer's sinusoidal table size")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    patch = parser.add_argument_group("train under an hf_attnscale patch")
    patch.add_argument("--scale", default="none", choices=("none", "logn", "ssmax", "gradmax"))
    patch.add_argument("--scale-length", type=int, help="L of the scale law (default: --context)")
    patch.add_argument("--clamp", action=argparse.BooleanOptionalAction, default=None)
    add_running_arguments(
        parser, save_every=200, eval_lengths=(64, 128, 256, 512, 1024), eval_help="MLM accuracy lengths"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    set_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()

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
    if args.scale != "none":
        hfa.patch(model, scale=args.scale, train_length=args.scale_length or args.context, clamp=args.clamp)
    n_params = sum(p.numel() for p in model.parameters())
    tqdm.write(f"model: {n_params / 1e6:.2f}M parameters, patch: {hfa.get_config(model)}")

    sampler = WindowSampler(train_tokens, args.context, args.seed)
    masking = torch.Generator().manual_seed(args.seed + 1)
    special = torch.tensor(tokenizer.all_special_ids)
    run = TrainRun(
        out=args.out,
        model=model,
        optimizer=make_optimizer(model, args.lr, args.weight_decay),
        steps=args.steps,
        warmup=args.warmup,
        settings=run_settings(args),
        generators={"sampler": sampler.generator, "masking": masking},
    )

    def loss_fn() -> torch.Tensor:
        inputs, labels = mask_tokens(
            sampler.sample(args.batch_size), tokenizer.mask_token_id, len(tokenizer), special, masking
        )
        logits = model(input_ids=inputs).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)

    finished = run.run(
        loss_fn, save_every=args.save_every, snapshot_every=None, on_snapshot=None, stop_after=args.stop_after
    )
    if not finished:
        return

    accuracy = masked_lm_accuracy(model, heldout_tokens, args.eval_lengths, tokenizer.mask_token_id)
    for result in accuracy:
        tqdm.write(f"MLM accuracy at {result.length}: {100 * result.accuracy:.2f}% ({result.tokens} tokens)")
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    write_info(
        args.out,
        {
            **run_info(run, ["python", "-m", MODULE, *argv], args.batch_size * args.context),
            "mlm_accuracy": {str(r.length): r.accuracy for r in accuracy},
            "mlm_masked_tokens": {str(r.length): r.tokens for r in accuracy},
            "wall_seconds_this_session": time.perf_counter() - started,
        },
    )
    tqdm.write(f"saved to {args.out}")


if __name__ == "__main__":
    main()
