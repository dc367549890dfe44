"""What the causal-LM and MLM trainers share: the command's skeleton (`train`: each trainer gives only its own
parts, a `Trainer`), their common flags, window sampling, the optimizer, the patch the model trains under, the
loss, resumable checkpoints and what a finished run saves and records."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from hf_attnscale.core.install.installed import get_config
from hf_attnscale.core.install.patching import patch
from hf_attnscale.core.options.flags import add_patch_arguments, patch_options
from hf_attnscale.evaluation.report import versions

CHECKPOINT = "checkpoint.pt"
SNAPSHOTS = "snapshots"
RUNTIME_ONLY = frozenset({"out", "threads", "save_every", "stop_after", "eval_lengths"})
"""Flags that do not change the trained weights, so a resumed run may change them."""


class WindowSampler:
    """Random fixed-length windows, each from one document, uniform over all start positions.

    With ``bos_id``, every window starts with that token followed by ``length - 1`` tokens of text, the way
    LLMs are trained on documents that begin with BOS (and the way attention sinks form on token 0).
    """

    def __init__(
        self, token_docs: Sequence[torch.Tensor], length: int, seed: int, bos_id: int | None = None
    ) -> None:
        self.text_length = length - (bos_id is not None)
        self.docs = [doc for doc in token_docs if len(doc) >= self.text_length]
        if not self.docs:
            raise ValueError(f"No document has the {self.text_length} tokens a training window needs.")
        self.length = length
        self.bos_id = bos_id
        self.weights = torch.tensor(
            [len(doc) - self.text_length + 1 for doc in self.docs], dtype=torch.float64
        )
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, batch_size: int) -> torch.Tensor:
        """``(batch_size, length)`` token ids."""
        doc_ids = torch.multinomial(self.weights, batch_size, replacement=True, generator=self.generator)
        rows = []
        for i in doc_ids.tolist():
            start = int(torch.randint(int(self.weights[i]), (1,), generator=self.generator))
            window = self.docs[i][start : start + self.text_length]
            if self.bos_id is not None:
                window = torch.cat([window.new_tensor([self.bos_id]), window])
            rows.append(window)
        return torch.stack(rows)


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains, biases, sink logits and slopes are not decayed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


@dataclass
class TrainRun:
    """One resumable training run in ``out``: the step loop, its checkpoints and its log.

    Args:
        out: the run's directory.
        model, optimizer: what is trained.
        steps, warmup: the cosine schedule's length and linear warmup.
        settings: everything that defines the run (a resumed run must have the same).
        generators: random generators whose state must survive a restart (samplers, masking).
    """

    out: Path
    model: nn.Module
    optimizer: torch.optim.Optimizer
    steps: int
    warmup: int
    settings: dict[str, Any]
    generators: dict[str, torch.Generator] = field(default_factory=dict)
    step: int = 0
    log: list[dict[str, float]] = field(default_factory=list)
    unlogged_losses: list[float] = field(default_factory=list)
    """The losses since the last log entry: checkpointed, so a resumed run logs the same means."""
    session_steps: int = field(default=0, init=False)
    session_seconds: float = field(default=0.0, init=False)
    """Steps trained and seconds spent by the last `run` call (this process, not the whole run)."""

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, model: nn.Module, generators: dict[str, torch.Generator]
    ) -> TrainRun:
        """The run the trainer's flags describe: in ``--out``, with the flags of `add_training_arguments`, and
        every flag but `RUNTIME_ONLY` as its settings."""
        return cls(
            out=args.out,
            model=model,
            optimizer=make_optimizer(model, args.lr, args.weight_decay),
            steps=args.steps,
            warmup=args.warmup,
            settings=run_settings(args),
            generators=generators,
        )

    def __post_init__(self) -> None:
        self.schedule = get_cosine_schedule_with_warmup(self.optimizer, self.warmup, self.steps)
        path = self.out / CHECKPOINT
        if path.exists():
            self._resume(torch.load(path, weights_only=False))

    def _resume(self, state: dict[str, Any]) -> None:
        if state["settings"] != self.settings:
            changed = sorted(
                k
                for k in {*state["settings"], *self.settings}
                if state["settings"].get(k) != self.settings.get(k)
            )
            raise ValueError(
                f"{self.out / CHECKPOINT} belongs to a run with other settings (they differ in {changed}); "
                "pass another --out, or delete the checkpoint to start over."
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        for name, generator in self.generators.items():
            generator.set_state(state["generators"][name])
        torch.set_rng_state(state["torch_rng"])
        self.step, self.log = state["step"], state["log"]
        self.unlogged_losses = state.get("unlogged_losses", [])  # older checkpoints lack it
        tqdm.write(f"resumed {self.out} at step {self.step}/{self.steps}")

    def save_checkpoint(self) -> None:
        """Write the whole training state atomically (a crash mid-write keeps the previous checkpoint)."""
        state = {
            "settings": self.settings,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "generators": {name: g.get_state() for name, g in self.generators.items()},
            "torch_rng": torch.get_rng_state(),
            "step": self.step,
            "log": self.log,
            "unlogged_losses": self.unlogged_losses,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / (CHECKPOINT + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.out / CHECKPOINT)

    def run(
        self,
        loss_fn: Callable[[], torch.Tensor],
        *,
        save_every: int,
        snapshot_every: int | None,
        on_snapshot: Callable[[Path], None],
        stop_after: int | None = None,
        log_every: int = 25,
    ) -> bool:
        """Train from the current step to ``steps`` (or ``stop_after``): one ``loss_fn()`` per step.

        Gradients are clipped at norm 1. Returns whether the run is complete; a run stopped early has saved
        its checkpoint, and running it again continues from there.
        """
        self.model.train()
        first, started = self.step, time.perf_counter()
        last = self.steps if stop_after is None else min(self.steps, stop_after)
        bar = tqdm(range(self.step + 1, last + 1), desc=self.out.name, unit="step", mininterval=10)
        for step in bar:
            loss = loss_fn()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.schedule.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step = step
            self.unlogged_losses.append(loss.item())
            if step % log_every == 0 or step == self.steps:
                mean = sum(self.unlogged_losses) / len(self.unlogged_losses)
                self.log.append({"step": step, "loss": mean})
                tqdm.write(f"{self.out.name} step {step}/{self.steps} loss {self.log[-1]['loss']:.4f}")
                self.unlogged_losses = []
            if snapshot_every and (step % snapshot_every == 0 or step == self.steps):
                self.model.eval()
                on_snapshot(self.out / SNAPSHOTS / f"step-{step:06d}")
                self.model.train()
            if step % save_every == 0 or step == last:
                self.save_checkpoint()
        self.model.eval()
        self.session_steps, self.session_seconds = self.step - first, time.perf_counter() - started
        if self.step < self.steps:
            tqdm.write(f"stopped at step {self.step}/{self.steps}; run the same command again to continue")
        return self.step == self.steps

    @property
    def final_loss(self) -> float | None:
        """Mean training loss of the last logged interval."""
        return self.log[-1]["loss"] if self.log else None


def add_training_arguments(
    parser: argparse.ArgumentParser,
    *,
    hidden: int,
    layers: int,
    heads: int,
    intermediate: int,
    steps: int,
    batch_size: int,
    lr: float,
    warmup: int,
    weight_decay: float,
    exits: bool = True,
) -> None:
    """The flags that define the trained weights in both trainers, with each trainer's defaults: the model's
    size, the optimization, the seed, and the patch the model trains under (``exits``: with its exit flags)."""
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--intermediate", type=int, default=intermediate)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch-size", type=int, default=batch_size, help="windows per optimizer step")
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--warmup", type=int, default=warmup, help="linear warmup steps")
    parser.add_argument("--weight-decay", type=float, default=weight_decay)
    parser.add_argument("--seed", type=int, default=0)
    add_patch_arguments(
        parser,
        "train under an hf_attnscale patch",
        length_flag="--scale-length",
        length_help="L of the scale law (default: --context)",
        exits=exits,
    )


def add_running_arguments(
    parser: argparse.ArgumentParser, *, save_every: int, eval_lengths: Sequence[int], eval_help: str
) -> argparse._ArgumentGroup:
    """The "running" flags (all in `RUNTIME_ONLY`); returns their group for a trainer's own."""
    run = parser.add_argument_group("running")
    run.add_argument("--threads", type=int, default=1, help="CPU threads for torch and tokenizers")
    run.add_argument("--save-every", type=int, default=save_every, help="steps between resumable checkpoints")
    run.add_argument(
        "--stop-after", type=int, help="stop at this step (checkpoint saved); run again to continue"
    )
    run.add_argument("--eval-lengths", type=int, nargs="*", default=list(eval_lengths), help=eval_help)
    return run


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The flags that define the trained weights (paths as strings): what a resumed run must repeat."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in RUNTIME_ONLY}


def run_info(run: TrainRun, command: Sequence[str], tokens_per_step: int) -> dict[str, Any]:
    """What every finished run records: its command, settings, size, patch, tokens, speed and loss log."""
    patch = get_config(run.model)
    return {
        "command": shlex.join(command),
        "settings": run.settings,
        "parameters": sum(p.numel() for p in run.model.parameters()),
        "patch": None if patch is None else patch.to_dict(),
        "steps": run.steps,
        "tokens_seen": run.steps * tokens_per_step,
        "train_tokens_per_second": run.session_steps * tokens_per_step / max(run.session_seconds, 1e-9),
        "final_train_loss": run.final_loss,
        "loss_log": run.log,
        "train_seconds_this_session": run.session_seconds,
    }


def start_session(args: argparse.Namespace) -> None:
    """Apply ``--threads``, and seed torch's global generator (it draws the initial weights) with ``--seed``."""
    # The Rust tokenizers pool reads this when it first starts, which is after this line.
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)


def patch_for_training(model: nn.Module, args: argparse.Namespace) -> None:
    """Patch ``model`` as the patch flags ask (L defaults to ``--context``), and report its size and patch."""
    options = patch_options(args, default_length=args.context)
    if options:
        patch(model, **options)
    parameters = sum(p.numel() for p in model.parameters())
    tqdm.write(f"model: {parameters / 1e6:.2f}M parameters, patch: {get_config(model)}")


def save_run(
    run: TrainRun,
    tokenizer: Any,
    command: Sequence[str],
    tokens_per_step: int,
    measured: dict[str, Any],
    started: float,
) -> None:
    """Save a finished run's model and tokenizer in its directory, and ``training_info.json``: `run_info`, the
    trainer's ``measured`` numbers, the session's wall time since ``started`` and the versions."""
    run.model.save_pretrained(run.out)
    tokenizer.save_pretrained(run.out)
    info = {
        **run_info(run, command, tokens_per_step),
        **measured,
        "wall_seconds_this_session": time.perf_counter() - started,
        "versions": versions(),
    }
    (run.out / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    tqdm.write(f"saved to {run.out}")


@dataclass
class Trainer:
    """What makes a trainer its own; `train` does the rest.

    Args:
        model: the model the flags describe, freshly initialised and unpatched (`train` patches it).
        tokenizer: saved with the model.
        batch: one step's ``(input_ids, targets)``, targets -100 where no token is predicted; the loss is the
            cross-entropy of the model's logits at the others.
        generators: the random generators ``batch`` draws from, whose state a resumed run restores.
        measure: the finished model's numbers (the trainer's own evaluation), recorded with the run.
        snapshot_every: also save the model every this many steps, in ``snapshots/`` (None: never).
    """

    model: nn.Module
    tokenizer: Any
    batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    generators: dict[str, torch.Generator]
    measure: Callable[[], dict[str, Any]]
    snapshot_every: int | None = None


def train(
    module: str,
    parse_args: Callable[[Sequence[str]], argparse.Namespace],
    build: Callable[[argparse.Namespace], Trainer],
    argv: Sequence[str] | None = None,
) -> None:
    """A trainer's command, ``python -m module`` with ``argv`` (default: ``sys.argv[1:]``): start the session,
    ``build`` the trainer's own parts, patch the model as the flags ask, and train it, resumably (`TrainRun`);
    once the run is complete, measure the model and save it with what the run records (`save_run`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    start_session(args)
    started = time.perf_counter()
    trainer = build(args)
    model = trainer.model
    patch_for_training(model, args)
    run = TrainRun.from_args(args, model, generators=trainer.generators)

    def loss_fn() -> torch.Tensor:
        inputs, targets = trainer.batch()
        logits = model(input_ids=inputs).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)

    finished = run.run(
        loss_fn,
        save_every=args.save_every,
        snapshot_every=trainer.snapshot_every,
        on_snapshot=model.save_pretrained,
        stop_after=args.stop_after,
    )
    if finished:
        command = ["python", "-m", module, *argv]
        save_run(run, trainer.tokenizer, command, args.batch_size * args.context, trainer.measure(), started)
