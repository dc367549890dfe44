"""Models to evaluate: the shipped checkpoint, and a user's model by path or Hub id, with its saved patch.

The shipped checkpoint is trained by this repo (`hf_attnscale.training.lm`; see ``benchmarks/PRETRAIN.md``)
and ships inside the package, so demos and tests run offline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from hf_attnscale.core.loading import from_pretrained

DEFAULT_MODEL_NAME = "tiny-llama-stdlib"
DEFAULT_MODEL = f"builtin:{DEFAULT_MODEL_NAME}"
"""Name of the shipped checkpoint wherever a model path or Hub id is taken."""
PRETRAIN_COMMAND = "see benchmarks/PRETRAIN.md (python -m hf_attnscale.training.lm ...)"


def default_model_path() -> Path:
    """Directory of the shipped checkpoint (it may be missing from a stripped install)."""
    return Path(__file__).resolve().parents[1] / "assets" / DEFAULT_MODEL_NAME


def resolve_model_path(name: str) -> str:
    """``builtin:tiny-llama-stdlib`` -> the shipped checkpoint's directory; anything else unchanged."""
    if not name.startswith("builtin:"):
        return name
    if name != DEFAULT_MODEL:
        raise ValueError(f"Unknown built-in model {name!r}; the shipped one is {DEFAULT_MODEL!r}.")
    return str(default_model_path())


def load_default_model(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the shipped model (in eval mode) and its tokenizer from disk, never from the network."""
    path = default_model_path()
    missing = [
        name for name in ("config.json", "model.safetensors", "tokenizer.json") if not (path / name).is_file()
    ]
    if missing:
        raise FileNotFoundError(
            f"The shipped checkpoint at {path} lacks {', '.join(missing)}. Recreate it from a source "
            f"checkout: {PRETRAIN_COMMAND}"
        )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = from_pretrained(AutoModelForCausalLM, str(path), dtype=dtype, local_files_only=True).to(device)
    return model.eval(), tokenizer


def load_model(
    name: str, device: torch.device, dtype: Any, attn_implementation: str = "sdpa"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM (in eval mode, on ``device``, with the patch saved with it) and its tokenizer.

    Raises:
        FileNotFoundError: no such local directory, or the Hub cannot provide it (offline, unknown id).
        ValueError: the checkpoint is not a causal language model.
    """
    resolved = resolve_model_path(name)
    path = Path(resolved).expanduser()
    # Anything that cannot be a Hub id ("org/name") is a local path; never send it to the Hub.
    looks_local = path.exists() or resolved.startswith((".", "/", "~")) or resolved.count("/") > 1
    if looks_local and not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise FileNotFoundError(
            f"Model directory {resolved!r} {what}; pass a saved model directory or a Hub id."
        )
    source = str(path) if looks_local else resolved
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = from_pretrained(
            AutoModelForCausalLM, source, dtype=dtype, attn_implementation=attn_implementation
        )
    except OSError as err:
        raise FileNotFoundError(
            f"Cannot load model {name!r}: it is not a local directory, and the Hugging Face Hub could not "
            f"provide it (offline, private, or no such id). {err}"
        ) from err
    except ValueError as err:
        if "Unrecognized configuration class" in str(err):
            raise ValueError(f"Model {name!r} is not a causal language model: {err}") from err
        raise
    return model.to(device).eval(), tokenizer
