"""LoRA fine-tuning of the shipped small Llama past its trained length, with a learnable sink plus logn.

The model that ships with hf_attnscale was trained at 128 tokens (its ``max_position_embeddings``, which this
script reads) on the Python standard library's sources. This script patches it (``scale="logn"`` with
``train_length=128``, plus a learnable per-head sink logit, or ``--exit zero_kv``), trains LoRA adapters on
the attention projections together with the sink logits on 256-token windows (2x) of the training split,
and prints held-out perplexity at 1x, 2x, 4x and 8x the trained length: for the model as shipped, patched
before fine-tuning, and patched after. Every length scores the same tokens (the first ``8 x 128`` tokens of
each held-out document) in non-overlapping windows, so the columns differ only in how much context each
token gets. Nothing is downloaded. About 2 minutes on 2 CPU cores with the defaults (3 with ``--control``);
measured results are in benchmarks/RESULTS.md.

    python examples/peft_finetune.py                     # learnable sink + logn
    python examples/peft_finetune.py --exit zero_kv      # zero KV (softmax-off-by-one) + logn
    python examples/peft_finetune.py --control           # also LoRA on the unpatched model, for comparison
    python examples/peft_finetune.py --save runs/adapter # save the adapter, reload it, check the logits
    accelerate launch --multi_gpu --num_processes 2 examples/peft_finetune.py   # data-parallel (CPU: gloo)
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from accelerate import Accelerator
from peft import get_peft_model

import hf_attnscale as hfa
from hf_attnscale.checkpoints.models import load_default_model
from hf_attnscale.evaluation.corpus import builtin_documents, long_documents
from hf_attnscale.evaluation.perplexity import windowed_perplexity

MULTIPLES = (1, 2, 4, 8)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--exit", choices=["sink", "zero_kv"], default="sink", help="the exit added to logn")
    parser.add_argument(
        "--train-length", type=int, default=None, help="fine-tuning window (default: 2x the trained length)"
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=4, help="windows per step (per process)")
    parser.add_argument("--lr", type=float, default=2e-3, help="learning rate of the LoRA weights")
    parser.add_argument("--patch-lr", type=float, default=5e-2, help="learning rate of the sink logits")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--eval-docs", type=int, default=6, help="held-out documents scored at every length")
    parser.add_argument("--control", action="store_true", help="also fine-tune the unpatched model")
    parser.add_argument("--save", default=None, help="save the adapter here, reload it, check the logits")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def perplexities(model, documents: list[torch.Tensor], trained_length: int) -> list[float]:
    """Held-out perplexity at each multiple of the trained length (`windowed_perplexity`)."""
    model.eval()
    return [windowed_perplexity(model, documents, m * trained_length) for m in MULTIPLES]


def training_windows(tokenizer, length: int, seed: int) -> tuple[list[torch.Tensor], torch.Generator]:
    """Every training document of at least ``length + 1`` tokens, as one tensor of ids per document."""
    docs = [torch.tensor(tokenizer(d.text)["input_ids"]) for d in builtin_documents("train")]
    return [d for d in docs if d.numel() > length], torch.Generator().manual_seed(seed)


def sample_batch(docs: list[torch.Tensor], gen: torch.Generator, size: int, length: int) -> torch.Tensor:
    """``size`` random windows of ``length`` tokens, each from one document, documents weighted by length."""
    weights = torch.tensor([float(d.numel() - length) for d in docs])
    rows = []
    for i in torch.multinomial(weights, size, replacement=True, generator=gen).tolist():
        start = torch.randint(0, docs[i].numel() - length, (1,), generator=gen).item()
        rows.append(docs[i][start : start + length])
    return torch.stack(rows)


def fine_tune(model, args, accelerator: Accelerator, tokenizer) -> tuple[object, float]:
    """LoRA (+ the patch's parameters) for ``args.steps`` steps; returns the PEFT model and seconds taken."""
    torch.manual_seed(args.seed)
    peft_model = get_peft_model(model, hfa.lora_config(model, r=args.rank, lora_alpha=2 * args.rank))
    patch_params = [p for _, p in hfa.trainable_parameters(peft_model)]  # none with zero_kv
    ids = {id(p) for p in patch_params}
    lora_params = [p for p in peft_model.parameters() if p.requires_grad and id(p) not in ids]
    # The sink logits start at 0 and are few: they get a larger learning rate than the LoRA weights.
    groups = [{"params": lora_params, "lr": args.lr}]
    if patch_params:
        groups.append({"params": patch_params, "lr": args.patch_lr})
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    wrapped, optimizer = accelerator.prepare(peft_model, optimizer)
    docs, gen = training_windows(tokenizer, args.train_length, args.seed + accelerator.process_index)
    wrapped.train()
    start = time.perf_counter()
    for step in range(args.steps):
        ids = sample_batch(docs, gen, args.batch_size, args.train_length).to(accelerator.device)
        loss = wrapped(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if accelerator.is_main_process and (step % 10 == 0 or step == args.steps - 1):
            print(f"  step {step:3d}  loss {loss.item():.3f}", flush=True)
    return accelerator.unwrap_model(wrapped), time.perf_counter() - start


def print_table(rows: dict[str, list[float]], trained_length: int) -> None:
    header = "".join(f"{f'{m}x ({m * trained_length})':>14}" for m in MULTIPLES)
    print(f"\nheld-out perplexity{'':20}{header}")
    for name, values in rows.items():
        print(f"{name:<39}" + "".join(f"{v:14.2f}" for v in values))


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # Without any accelerator, accelerate needs cpu=True to join the processes that `accelerate launch`
    # started (gloo); otherwise each process would silently train alone.
    accelerator = Accelerator(cpu=torch.accelerator.current_accelerator() is None)
    main_process = accelerator.is_main_process
    base, tokenizer = load_default_model()
    trained_length = base.config.max_position_embeddings  # the shipped model's training window
    args.train_length = args.train_length or 2 * trained_length
    held_out = long_documents("heldout", MULTIPLES[-1] * trained_length, tokenizer)[: args.eval_docs]
    eval_docs = [
        torch.tensor(tokenizer(d.text)["input_ids"][: MULTIPLES[-1] * trained_length]) for d in held_out
    ]
    exit_option = {"sink_logit": "learnable"} if args.exit == "sink" else {"zero_kv": True}
    options = {"scale": "logn", "train_length": trained_length, **exit_option}
    if main_process:
        print(f"{len(eval_docs)} held-out documents x {eval_docs[0].numel()} tokens; patch {options}")
    rows: dict[str, list[float]] = {}
    if main_process:
        rows["shipped (unpatched)"] = perplexities(base, eval_docs, trained_length)
    patched = hfa.patch(copy.deepcopy(base), **options)
    if main_process:
        rows["patched, before fine-tuning"] = perplexities(patched, eval_docs, trained_length)

    if main_process:
        print(
            f"LoRA r={args.rank} (+ the patch's parameters), {args.steps} steps x {args.batch_size} x "
            f"{args.train_length} tokens"
        )
    tuned, seconds = fine_tune(patched, args, accelerator, tokenizer)
    if main_process:
        rows[f"patched + LoRA at {args.train_length}"] = perplexities(tuned, eval_docs, trained_length)
    if args.control:
        if main_process:
            print(f"control: LoRA r={args.rank} on the unpatched model, same data and steps")
        control, _ = fine_tune(copy.deepcopy(base), args, accelerator, tokenizer)
        if main_process:
            rows[f"unpatched + LoRA at {args.train_length}"] = perplexities(
                control, eval_docs, trained_length
            )

    if main_process:
        print_table(rows, trained_length)
        sinks = [p.detach() for _, p in hfa.trainable_parameters(tuned)]
        if sinks:
            print(f"\nlearned sink logits (layer x head):\n{torch.stack(sinks).numpy().round(2)}")
        print(f"fine-tuning took {seconds:.0f} s")
    if args.save and main_process:
        tuned.save_pretrained(args.save)  # adapter + attn_scale.json
        reloaded = hfa.load_adapter(load_default_model()[0], args.save)  # patches the fresh base as saved
        ids = eval_docs[0][:trained_length].unsqueeze(0)
        with torch.no_grad():
            diff = (reloaded(input_ids=ids).logits - tuned(input_ids=ids).logits).abs().max().item()
        print(f"saved to {args.save}; reloaded with hfa.load_adapter: max |logit difference| {diff:.1e}")
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
