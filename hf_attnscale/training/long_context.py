"""Fine-tuning a causal LM to read past its trained length on one machine: LoRA+ (LongLoRA's LoRA with trainable
embeddings and norms) through `transformers.Trainer`, in short windows whose position ids reach the target length
(PoSE), under the model's patch (a scale, ``rope_parameters``, S²-Attn). Resumable; writes the adapter (with the
patch it trained under), the losses and their plot.

The training text is the built-in corpus's ``train`` split (Python standard library sources; `builtin_documents`).
The evaluation texts are elsewhere: the ``heldout`` split, the King James Bible, the passkeys.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import Trainer, TrainingArguments, set_seed
from transformers.trainer_utils import get_last_checkpoint

from hf_attnscale.evaluation.corpus import builtin_documents
from hf_attnscale.integrations.peft_adapters import lora_config
from hf_attnscale.integrations.pose import PoSECollator

ADAPTER = "adapter"
CHECKPOINTS = "checkpoints"


@dataclass(frozen=True)
class LongContextRun:
    """What one fine-tuning run trains toward, and how."""

    target_length: int
    window: int = 2048
    chunks: int = 2
    steps: int = 200
    batch_size: int = 1
    learning_rate: float = 2e-4
    rank: int = 8
    long_context: bool = True
    seed: int = 0
    save_every: int = 25


def training_windows(tokenizer: Any, window: int, documents: Sequence[str] | None = None) -> list[dict]:
    """The training text cut into windows of ``window`` tokens: each document tokenized, joined with EOS between
    (the built-in ``train`` split by default), the remainder dropped."""
    texts = [d.text for d in builtin_documents("train")] if documents is None else list(documents)
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    if len(ids) < window:
        raise ValueError(f"The training text holds {len(ids)} tokens, fewer than one window of {window}.")
    return [{"input_ids": ids[start : start + window]} for start in range(0, len(ids) - window + 1, window)]


def finetune(model: Any, tokenizer: Any, run: LongContextRun, out: Path, *, progress: bool = True) -> Path:
    """Fine-tune ``model`` (already patched as it is to train) with LoRA+ and PoSE for ``run``, keeping a
    checkpoint every ``run.save_every`` steps in ``out/checkpoints`` (a re-run continues from the last one);
    returns ``out/adapter``, where the adapter and its patch are written, with ``losses.json`` and ``loss.png``
    beside it."""
    from peft import get_peft_model  # the [peft] extra

    out.mkdir(parents=True, exist_ok=True)
    set_seed(run.seed)  # LoRA's initial weights too
    peft_model = get_peft_model(model, lora_config(model, r=run.rank, long_context=run.long_context))
    peft_model.train()
    checkpoints = out / CHECKPOINTS
    args = TrainingArguments(
        str(checkpoints),
        max_steps=run.steps,
        per_device_train_batch_size=run.batch_size,
        learning_rate=run.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=min(10, run.steps // 10),
        logging_steps=1,
        save_steps=run.save_every,
        save_total_limit=1,
        seed=run.seed,
        data_seed=run.seed,
        report_to=[],
        disable_tqdm=not progress,
        remove_unused_columns=False,
        use_cpu=next(model.parameters()).device.type == "cpu",
    )
    trainer = Trainer(
        peft_model,
        args,
        train_dataset=training_windows(tokenizer, run.window),
        data_collator=PoSECollator(tokenizer, run.target_length, chunks=run.chunks, seed=run.seed),
    )
    last = get_last_checkpoint(str(checkpoints)) if checkpoints.is_dir() else None
    trainer.train(resume_from_checkpoint=last)
    adapter = out / ADAPTER
    peft_model.save_pretrained(str(adapter))
    losses = [(entry["step"], entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
    (out / "losses.json").write_text(json.dumps({"run": run.__dict__, "losses": losses}, indent=1))
    from hf_attnscale.diagnostics.plots import plot_losses  # matplotlib

    lora = "LoRA+" if run.long_context else "LoRA"
    plot_losses(
        losses, out / "loss.png", f"{lora} with PoSE: windows of {run.window} toward {run.target_length}"
    )
    return adapter
