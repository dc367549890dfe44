"""``hf-attnscale finetune``: fine-tune a causal LM to read past its trained length, LoRA+ with PoSE
(`hf_attnscale.training.long_context`), and write the adapter with the patch it trained under.

    hf-attnscale finetune --model smollm2-135m --target-length 32768 --window 2048 --steps 200 \\
        --rope-parameters rope_type=yarn;factor=4 --out runs/pose
    hf-attnscale lm-eval --model hf-attnscale --model_args pretrained=smollm2-135m,peft=runs/pose/adapter ...
"""

from __future__ import annotations

import argparse

from hf_attnscale.core.options.flags import add_patch_arguments

from .options import (
    add_model_arguments,
    add_output_arguments,
    count_type,
    device,
    given_patch,
    load_model,
    model_name,
    show_progress,
)


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The ``finetune`` subparser."""
    parser = commands.add_parser(
        "finetune",
        help="fine-tune a causal LM to read past its trained length (LoRA+ with PoSE), writing an adapter",
        description="Fine-tune a causal LM for a longer context on one machine: LoRA on attention plus trainable "
        "embeddings and norms (LongLoRA's LoRA+), in windows of --window tokens whose position ids reach "
        "--target-length (PoSE), under the patch given (a scale, --rope-parameters, --shifted-sparse-group). "
        "The training text is the built-in corpus's train split (Python standard library sources), never the "
        "evaluation texts. Resumable: run it again with the same --out to continue. Writes OUT/adapter (with "
        "the patch), OUT/losses.json and OUT/loss.png.",
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--target-length", type=count_type(2), required=True, help="the length to read toward"
    )
    parser.add_argument("--window", type=count_type(2), default=2048, help="training window (default 2048)")
    parser.add_argument("--chunks", type=count_type(1), default=2, help="PoSE's chunks a window (default 2)")
    parser.add_argument("--steps", type=count_type(1), default=200, help="optimizer steps (default 200)")
    parser.add_argument("--batch-size", type=count_type(1), default=1, help="windows a step (default 1)")
    parser.add_argument("--learning-rate", type=float, default=2e-4, help="peak learning rate (default 2e-4)")
    parser.add_argument("--rank", type=count_type(1), default=8, help="LoRA rank (default 8)")
    parser.add_argument(
        "--lora-only",
        action="store_true",
        help="LoRA alone, without LongLoRA's trainable embeddings and norms",
    )
    parser.add_argument("--seed", type=count_type(0), default=0, help="seed of the windows' order and PoSE")
    parser.add_argument("--save-every", type=count_type(1), default=25, help="steps between checkpoints")
    add_patch_arguments(parser, "patch to train under")
    add_output_arguments(parser, "hf-attnscale-finetune")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Fine-tune and write the adapter; returns the exit status."""
    from hf_attnscale.core.install.patching import patch
    from hf_attnscale.training.long_context import LongContextRun, finetune

    if args.window > args.target_length:
        raise ValueError(f"--window ({args.window}) must not pass --target-length ({args.target_length}).")
    on = device(args)
    model, tokenizer, kind = load_model(args, on)
    if kind != "causal":
        raise ValueError(f"{model_name(args)} is a masked LM; finetune trains causal LMs.")
    options = given_patch(args, model)
    if options:
        patch(model, **options)
    settings = LongContextRun(
        target_length=args.target_length,
        window=args.window,
        chunks=args.chunks,
        steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        rank=args.rank,
        long_context=not args.lora_only,
        seed=args.seed,
        save_every=args.save_every,
    )
    adapter = finetune(model, tokenizer, settings, args.out, progress=show_progress(args))
    print(f"adapter written to {adapter} (loss by step: {args.out / 'loss.png'})")
    return 0
