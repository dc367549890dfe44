"""The transformers model under the wrappers users train with (PEFT, DataParallel / DDP, torch.compile)."""

from __future__ import annotations

from typing import Any

from torch import nn


def wrapped(module: Any) -> nn.Module | None:
    """The module that ``module`` wraps, one level down, or None where it is no wrapper: PEFT's
    ``get_base_model()``, ``DataParallel`` / ``DistributedDataParallel``'s ``.module``, ``torch.compile``'s
    ``_orig_mod``."""
    if isinstance(module, nn.Module) and callable(getattr(module, "get_base_model", None)):
        inner = module.get_base_model()
    elif isinstance(module, nn.DataParallel | nn.parallel.DistributedDataParallel):
        inner = module.module
    elif isinstance(module, nn.Module) and isinstance(getattr(module, "_orig_mod", None), nn.Module):
        inner = module._orig_mod  # torch.compile's OptimizedModule keeps the model here
    else:
        return None
    return None if inner is module else inner


def unwrap(model: Any) -> nn.Module:
    """The transformers model inside ``model``, through any stack of wrappers (`wrapped`).

    Raises ValueError for anything that is not a model with a ``config``.
    """
    seen = model
    while (inner := wrapped(seen)) is not None:
        seen = inner
    if not isinstance(seen, nn.Module) or getattr(seen, "config", None) is None:
        raise ValueError(
            f"Expected a transformers model (a PreTrainedModel, or one wrapped by PEFT, DataParallel, DDP or "
            f"torch.compile), got {type(model).__name__}"
            + (f" wrapping {type(seen).__name__}" if seen is not model else "")
            + "."
        )
    return seen


def backbone(model: nn.Module) -> nn.Module:
    """``model`` without its task head: its ``base_model`` (``LlamaModel`` in ``LlamaForCausalLM``), or itself.

    What reads attention and hidden states runs this, so that a long input does not pay for the head's
    ``(batch, length, vocabulary)`` logits: 17 GB for 4 x 4,096 tokens of Gemma-3's 262k-token vocabulary.
    """
    base = getattr(model, "base_model", None)
    return base if isinstance(base, nn.Module) else model
