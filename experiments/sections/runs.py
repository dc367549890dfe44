"""The trained runs under ``--runs``: which ones have finished, and loading them."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_attnscale as hfa

TRAIN_LENGTH = 128
"""The LM runs' training window (``--context 128``): 128 positions, BOS then 127 tokens of text."""
LM_RUNS = {"vanilla": "lm-vanilla", "zero_kv": "lm-zerokv", "learnable sink": "lm-sink"}
"""The three decoders trained without a scale law (label -> run), seed 0."""
E_RUN = "lm-logn"
"""The decoder trained with Attention-E (``log_128(n)/sqrt(d)``), seed 0."""


class MissingRuns(Exception):
    """A section's checkpoints are not there."""


def is_finished(path: Path) -> bool:
    """Whether a run directory holds its final model (the trainers save it last)."""
    return (path / "config.json").is_file()


def run_dir(runs: Path, name: str) -> Path:
    """The finished run ``name``; raises MissingRuns if it has not finished."""
    path = runs / name
    if not is_finished(path):
        raise MissingRuns(f"no finished run at {path}")
    return path


def finished(runs: Path, names: dict[str, str]) -> dict[str, Path]:
    """The finished runs among ``names`` (label -> directory name); raises MissingRuns if there is none."""
    found = {label: runs / name for label, name in names.items() if is_finished(runs / name)}
    if not found:
        raise MissingRuns(f"none of {list(names.values())} under {runs}")
    for label, name in names.items():
        if label not in found:
            print(f"({label}: no finished run at {runs / name}; left out)")
    return found


def load(path: Path, **overrides):
    """A trained LM with the patch it was trained under (in eval mode); ``overrides`` change its config."""
    return hfa.from_pretrained(AutoModelForCausalLM, str(path), local_files_only=True, **overrides).eval()


def shared_tokenizer(paths: Iterable[Path]):
    """The runs' tokenizer: every run shares the shipped one, so the first run's."""
    return AutoTokenizer.from_pretrained(next(iter(paths)))


def training_info(path: Path) -> dict:
    """What the trainer recorded about a finished run (parameters, held-out perplexity, ...)."""
    return json.loads((path / "training_info.json").read_text())
