"""The transformers model under the wrappers users train with (PEFT, DataParallel / DDP, torch.compile)."""

from __future__ import annotations

from typing import Any

from torch import nn


def unwrap(model: Any) -> nn.Module:
    """The transformers model inside ``model``, through any stack of wrappers.

    Follows PEFT's ``get_base_model()``, ``DataParallel`` / ``DistributedDataParallel``'s ``.module`` and
    ``torch.compile``'s ``_orig_mod``. Raises ValueError for anything that is not a model with a ``config``.
    """
    seen = model
    while True:
        if isinstance(seen, nn.Module) and callable(getattr(seen, "get_base_model", None)):
            inner = seen.get_base_model()
        elif isinstance(seen, nn.DataParallel | nn.parallel.DistributedDataParallel):
            inner = seen.module
        elif isinstance(seen, nn.Module) and isinstance(getattr(seen, "_orig_mod", None), nn.Module):
            inner = seen._orig_mod  # torch.compile's OptimizedModule keeps the model here
        else:
            break
        if inner is seen:
            break
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
