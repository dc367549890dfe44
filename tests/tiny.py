"""What every tiny test model shares: its vocabulary, how it is built from a config, and how it is sharpened.

The factories that choose the configs live where their tests look for them: `conftest.tiny_model` (the main
families, shared small sizes, default initialisation) and `conftest.sharp_model` (a main decoder, sharpened);
`model_zoo.zoo_model` (every supported type, sharpened). Each builds through `build` and sharpens through
`sharpen`.
"""

from __future__ import annotations

import math

import torch
import transformers

VOCAB = 128
"""The vocabulary of the tiny models (`conftest.sharp_model`'s is `conftest.SHARP_VOCAB`)."""


def build(head: type, config, attn: str = "sdpa", seed: int = 0, **kwargs) -> torch.nn.Module:
    """A model of ``config`` in eval mode, its weights drawn right after ``torch.manual_seed(seed)``, with
    transformers' construction warnings silenced. ``head`` is a model class, or an auto class
    (``AutoModelForCausalLM``) that picks the class for ``config``'s type; ``kwargs`` go to ``_from_config``
    (``dtype``)."""
    model_class = head._model_mapping[type(config)] if hasattr(head, "_model_mapping") else head
    torch.manual_seed(seed)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        model = model_class._from_config(config, attn_implementation=attn, **kwargs)
    finally:
        transformers.logging.set_verbosity(verbosity)
    return model.eval()


def sharpen(
    model: torch.nn.Module, seed: int | torch.Generator | None = 0, *, embeddings: bool = False
) -> torch.nn.Module:
    """Re-draw ``model``'s weight matrices with std 1/sqrt(fan_in), the queries' 2.5x that, so that attention
    is sharp and a patch moves the logits by whole units: a missing or wrong one cannot pass by accident.

    Left alone: the patch's own parameters (``.hfa.``), matrices of one column and, unless ``embeddings``, the
    embedding matrices. ZAYA's key temperature (``qk_norm.temp``, 0 at first: uniform attention) is set to 2.
    ``seed``: an int (a fresh generator, so that models of one shape get the same weights), a generator, or
    None (torch's global generator, going on from where the model's construction left it).
    """
    generator = torch.Generator().manual_seed(seed) if isinstance(seed, int) else seed
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".hfa." in name:
                continue
            if p.dim() == 2 and p.shape[1] > 1 and (embeddings or "embed" not in name):
                wide = 2.5 if "q" in name.rsplit(".", 2)[-2] else 1.0  # the module: q_proj, query, qkv_proj…
                p.copy_(torch.randn(p.shape, generator=generator) * wide / math.sqrt(p.shape[1]))
            elif name.endswith("qk_norm.temp"):
                p.fill_(2.0)
    return model
