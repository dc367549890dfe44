"""The tiny pretrained checkpoint shipped inside the package, so demos and tests run offline.

It is a 4-layer RoPE Llama trained at 256 tokens on the built-in stdlib corpus by
:mod:`hf_attnscale.pretrain`; see ``benchmarks/PRETRAIN.md`` for how and how well.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL_NAME = "tiny-llama-stdlib"
PRETRAIN_COMMAND = f"python -m hf_attnscale.pretrain --out hf_attnscale/assets/{DEFAULT_MODEL_NAME}"


def default_model_path() -> Path:
    """Directory of the shipped checkpoint (it may be missing from a stripped install)."""
    return Path(__file__).resolve().parent / "assets" / DEFAULT_MODEL_NAME


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
            f"checkout (about 20 minutes on one CPU thread) with:\n    {PRETRAIN_COMMAND}"
        )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device)
    return model.eval(), tokenizer
