"""Results kept on disk as soon as they are computed, so that a stopped run continues where it stopped."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class Cells:
    """A folder of computed results, one file per key (``torch.save``: tensors, numbers, dicts of them)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, key: str) -> Path:
        """Where the result ``key`` lives."""
        return self.root / (re.sub(r"[^A-Za-z0-9_.+=-]+", "_", key) + ".pt")

    def get(self, key: str, compute: Callable[[], Any]) -> Any:
        """The result ``key``: read from disk if it was computed before, else computed now and saved."""
        path = self.path(key)
        if path.is_file():
            return torch.load(path, weights_only=False)
        print(f"  computing {key}", flush=True)
        value = compute()
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        torch.save(value, partial)
        os.replace(partial, path)
        return value
