"""Evaluation across processes: joining the processes that ``torchrun`` or ``accelerate launch`` started, each
process's share of the documents, and sums over all of them.

accelerate (the ``[peft]`` extra) is imported only where several processes are joined: a process alone, as in
a base install's ``hf-attnscale demo``, ``hfa.perplexity`` or ``hfa.sweep``, never needs it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from accelerate import PartialState

EXTRA = 'pip install "hf_attnscale[peft]"'


class MissingExtra(ModuleNotFoundError, ValueError):
    """A run that needs an optional dependency which is not installed. A `ModuleNotFoundError`, and a
    `ValueError` so that the command line reports it in one line, as it does the user's other errors."""


def join_processes() -> PartialState | None:
    """Under ``torchrun`` or ``accelerate launch`` with several processes (``WORLD_SIZE`` > 1): accelerate's
    process state, its process group started (gloo on a machine without an accelerator, NCCL on GPUs, one GPU
    per process). None for a process alone. `MissingExtra` if several processes need accelerate and it is not
    installed."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        return None
    try:
        from accelerate import PartialState  # optional: only processes that are joined need it
    except ImportError:
        raise MissingExtra(
            f"Evaluating in {world} processes (WORLD_SIZE={world}) needs accelerate: {EXTRA}",
            name="accelerate",
        ) from None
    return PartialState(cpu=torch.accelerator.current_accelerator() is None)


def process_share() -> tuple[int, int]:
    """``(rank, world size)`` of torch.distributed's default process group; ``(0, 1)`` without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def summed_across_processes(values: list[float]) -> list[float]:
    """``values`` summed element-wise over the processes of the default group (unchanged without one)."""
    if process_share()[1] == 1:
        return values
    on = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.distributed.get_backend() == "nccl"
        else None
    )
    summed = torch.tensor(values, dtype=torch.float64, device=on)
    torch.distributed.all_reduce(summed)
    return summed.tolist()
