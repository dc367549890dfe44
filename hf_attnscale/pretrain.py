"""Train the shipped tiny checkpoint: a byte-level BPE tokenizer and a small RoPE Llama.

Trains on the built-in stdlib corpus (see :mod:`hf_attnscale.corpus`) at a short context, so
the unpatched model visibly breaks when evaluated past that length. The defaults reproduce the
shipped checkpoint (about 20 minutes on one CPU thread)::

    python -m hf_attnscale.pretrain --out hf_attnscale/assets/tiny-llama-stdlib
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import tokenizers
import torch
import torch.nn.functional as F
import transformers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    get_cosine_schedule_with_warmup,
)

from hf_attnscale.corpus import Document, builtin_documents, tokenize_documents

MODULE = "hf_attnscale.pretrain"
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


class WindowSampler:
    """Random fixed-length windows, each from a single document, uniform over all start positions."""

    def __init__(self, token_docs: Sequence[torch.Tensor], length: int, seed: int) -> None:
        self.docs = [doc for doc in token_docs if len(doc) >= length]
        self.length = length
        self.weights = torch.tensor([len(doc) - length + 1 for doc in self.docs], dtype=torch.float64)
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, batch_size: int) -> torch.Tensor:
        doc_ids = torch.multinomial(self.weights, batch_size, replacement=True, generator=self.generator)
        rows = []
        for i in doc_ids.tolist():
            start = int(torch.randint(int(self.weights[i]), (1,), generator=self.generator))
            rows.append(self.docs[i][start : start + self.length])
        return torch.stack(rows)


@torch.inference_mode()
def perplexity(model: torch.nn.Module, token_docs: Sequence[torch.Tensor], window: int) -> float:
    """Token-weighted perplexity, each document scored alone in non-overlapping windows of ``window``.

    The first token of every window has no context and is not scored; a final partial window
    is scored if it has at least two tokens.
    """
    device = next(model.parameters()).device
    windows = [doc[i : i + window] for doc in token_docs for i in range(0, len(doc), window)]
    windows = [w for w in windows if len(w) >= 2]
    total_nll, total_tokens = 0.0, 0
    for w in windows:
        ids = w.unsqueeze(0).to(device)
        logits = model(input_ids=ids).logits[0, :-1].float()
        total_nll += F.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        total_tokens += len(w) - 1
    return math.exp(total_nll / total_tokens)


def long_eval_docs(token_docs: Sequence[torch.Tensor], max_length: int) -> list[torch.Tensor]:
    """Documents of at least ``max_length`` tokens, cut to a multiple of it.

    Cutting makes every evaluation length score the same tokens, so perplexities at
    different lengths differ only by how much context each window gives.
    """
    return [doc[: len(doc) // max_length * max_length] for doc in token_docs if len(doc) >= max_length]


def build_model(args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
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


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    # Norm gains are 1-D; decaying them toward zero only fights the normalisation.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--context", type=int, default=256, help="training context length in tokens")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--rope-theta", type=float, default=10000.0)
    parser.add_argument("--steps", type=int, default=640)
    parser.add_argument("--batch-size", type=int, default=16, help="windows per optimizer step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=50, help="linear warmup steps")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for torch and tokenizers (default leaves cores free)",
    )
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument(
        "--eval-lengths",
        type=int,
        nargs="*",
        default=list(DEFAULT_EVAL_LENGTHS),
        help="held-out perplexity lengths, measured on held-out documents at least max(lengths) tokens long",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # The Rust tokenizers pool reads this when it first starts, which is after this line.
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()

    train_docs, heldout_docs = builtin_documents("train"), builtin_documents("heldout")
    tokenizer = train_tokenizer(train_docs, args.vocab_size)
    train_tokens = tokenize_documents(tokenizer, train_docs)
    heldout_tokens = tokenize_documents(tokenizer, heldout_docs)
    corpus_tokens = sum(len(t) for t in train_tokens)
    tqdm.write(f"tokenizer ready: {len(train_docs)} train docs, {corpus_tokens} tokens")

    model = build_model(args, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    tqdm.write(f"model: {n_params / 1e6:.2f}M parameters")
    optimizer = make_optimizer(model, args.lr, args.weight_decay)
    schedule = get_cosine_schedule_with_warmup(optimizer, args.warmup, args.steps)
    # One extra token per window so every one of the `context` positions gets a target.
    sampler = WindowSampler(train_tokens, args.context + 1, args.seed)

    model.train()
    recent_losses: deque[float] = deque(maxlen=args.log_every)
    train_started = time.perf_counter()
    progress = tqdm(range(1, args.steps + 1), desc="pretrain", unit="step")
    for step in progress:
        batch = sampler.sample(args.batch_size)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        recent_losses.append(loss.item())
        progress.set_postfix(loss=f"{loss.item():.3f}")
        if step % args.log_every == 0 or step == args.steps:
            mean_loss = sum(recent_losses) / len(recent_losses)
            tqdm.write(f"step {step}/{args.steps} loss {mean_loss:.4f} lr {schedule.get_last_lr()[0]:.2e}")
    train_seconds = time.perf_counter() - train_started
    tokens_seen = args.steps * args.batch_size * args.context

    model.eval()
    heldout_ppl = perplexity(model, heldout_tokens, args.context)
    tqdm.write(f"held-out perplexity at {args.context}: {heldout_ppl:.3f}")
    long_docs = long_eval_docs(heldout_tokens, max(args.eval_lengths)) if args.eval_lengths else []
    length_ppl = {}
    for length in args.eval_lengths:
        length_ppl[str(length)] = perplexity(model, long_docs, length)
        tqdm.write(f"long held-out docs, window {length}: perplexity {length_ppl[str(length)]:.3f}")

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    info = {
        "command": shlex.join(["python", "-m", MODULE, *argv]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "parameters": n_params,
        "steps": args.steps,
        "tokens_seen": tokens_seen,
        "train_corpus_tokens": corpus_tokens,
        "train_tokens_per_second": tokens_seen / train_seconds,
        "final_train_loss": sum(recent_losses) / len(recent_losses),
        "final_train_loss_steps": len(recent_losses),
        f"heldout_ppl_{args.context}": heldout_ppl,
        "heldout_documents": len(heldout_docs),
        "long_heldout_ppl": length_ppl,
        "long_heldout_documents": len(long_docs),
        "long_heldout_tokens": sum(len(d) for d in long_docs),
        "train_seconds": train_seconds,
        "wall_seconds": time.perf_counter() - started,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }
    (args.out / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    tqdm.write(f"saved to {args.out}")


if __name__ == "__main__":
    main()
