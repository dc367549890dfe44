"""A saved model's weight files, and the learned patch values read from them.

A saved checkpoint is found as transformers finds it: a local directory, or a Hub id resolved through the
local Hugging Face cache first (so it works offline and with a mirrored cache), then the Hub.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, cached_file


def is_local_path(name: str) -> bool:
    """Whether a model named ``name`` can only be a local path, never a Hub id (``org/name``): it exists, starts
    with ``.``, ``/`` or ``~``, or has more than one ``/``."""
    return Path(name).expanduser().exists() or name.startswith((".", "/", "~")) or name.count("/") > 1


class CheckpointNotFound(LookupError):
    """No safetensors checkpoint could be found at a model's source."""


def safetensors_files(source: str | Path, **hub_kwargs: Any) -> list[Path]:
    """The ``.safetensors`` weight files of a saved model (a directory or a Hub id), sharded or not."""
    directory = Path(source).expanduser()
    if directory.is_dir():
        index = directory / SAFE_WEIGHTS_INDEX_NAME
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [directory / name for name in names]
        if (directory / SAFE_WEIGHTS_NAME).is_file():
            return [directory / SAFE_WEIGHTS_NAME]
        raise CheckpointNotFound(f"{directory} has no {SAFE_WEIGHTS_NAME} (or a sharded index)")
    if not str(source) or is_local_path(str(source)):
        raise CheckpointNotFound(f"the directory {str(source)!r} does not exist (was it moved or deleted?)")
    for local_only in (True, False) if not hub_kwargs.get("local_files_only") else (True,):
        options = {**hub_kwargs, "local_files_only": local_only}
        index = _hub_file(str(source), SAFE_WEIGHTS_INDEX_NAME, options)
        if index is not None:
            names = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
            files = [_hub_file(str(source), name, options) for name in names]
            if all(f is not None for f in files):
                return [Path(f) for f in files]
        single = _hub_file(str(source), SAFE_WEIGHTS_NAME, options)
        if single is not None:
            return [Path(single)]
    raise CheckpointNotFound(
        f"{str(source)!r} is not a local directory, and neither the Hugging Face cache nor the Hub provides its weights"
    )


def _hub_file(repo: str, name: str, options: dict[str, Any]) -> str | None:
    try:
        return cached_file(
            repo,
            name,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
            **options,
        )
    except OSError:
        return None


def read_tensors(files: Iterable[Path], wanted: Iterable[str]) -> dict[str, torch.Tensor]:
    """Tensors whose names match ``wanted``, from safetensors ``files``.

    A stored name matches a wanted one when they are equal or one ends with ``"." + the other``, so that a
    checkpoint saved from a task model (``model.layers.0...``) serves its base model (``layers.0...``) too.
    """
    wanted = set(wanted)
    found: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for stored in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                match = next(
                    (
                        k
                        for k in wanted
                        if stored == k or stored.endswith("." + k) or k.endswith("." + stored)
                    ),
                    None,
                )
                if match is not None:
                    found[match] = handle.get_tensor(stored)
    return found
