"""What every section is given: the models, the texts, where results go, and the cells that keep them."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_attnscale as hfa

from .cells import Cells
from .texts import token_stream

TRAINED_LENGTH = {"smollm2-135m": 8192, "gemma3-270m": 32768}
"""Each checkpoint's trained context (its config's max_position_embeddings)."""
SHORT_NAME = {"smollm2-135m": "SmolLM2-135M-Instruct", "gemma3-270m": "Gemma-3-270M"}


@dataclass(eq=False)
class Context:
    """A run of the experiments: which models and texts, where tables and figures go (``out``), and the
    cells that keep every computed number (under ``work``)."""

    out: Path
    work: Path
    models: tuple[str, ...]
    texts: tuple[str, ...]
    quick: bool = False
    """Every section on short inputs (minutes in all), to check the code end to end; not for the results."""
    kept_only: bool = False
    """Tables and figures from the cells computed so far, computing none (section rerope)."""

    @property
    def stream_tokens(self) -> int:
        """Tokens of the streams of sections 1-3: 2.5x SmolLM2's trained context, past which dense must break."""
        return 2048 if self.quick else 20_480

    @functools.cached_property
    def cells(self) -> Cells:
        return Cells(self.work / "cells")

    def load(self, name: str, **config_overrides) -> torch.nn.Module:
        """The real checkpoint ``name`` (fetched on first use), in float32 and eval mode; ``config_overrides``
        change its config (``rope_parameters=...``)."""
        path = hfa.fetch(name)
        return hfa.from_pretrained(
            AutoModelForCausalLM, str(path), dtype=torch.float32, **config_overrides
        ).eval()

    @functools.cache  # noqa: B019 - one context per run
    def tokenizer(self, name: str):
        return AutoTokenizer.from_pretrained(hfa.fetch(name))

    def stream(self, model: str, text: str, tokens: int | None = None) -> torch.Tensor:
        """Text ``text`` as model ``model``'s tokenizer reads it, its first ``tokens`` tokens."""
        return self.cells.get(
            f"tokens/{model}/{text}/{tokens}", lambda: token_stream(self.tokenizer(model), text, tokens)
        )


class Lazy:
    """A model loaded (and given the identity patch that streaming needs) only if some cell is missing."""

    def __init__(self, context: Context, name: str) -> None:
        self.context, self.name, self._model = context, name, None

    def __call__(self) -> torch.nn.Module:
        if self._model is None:
            self._model = hfa.patch(self.context.load(self.name))
        return self._model
