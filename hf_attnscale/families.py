"""Registry of supported model families: which modules are patched, and what each family needs.

Adding a family that routes attention through transformers' AttentionInterface is one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Family:
    """How to patch one ``model_type``.

    Attributes:
        attention_classes: class names of the self-attention modules that receive the patch state.
        decoder: causal decoder (True) or bidirectional encoder (False).
        rope: rotary positions applied inside the attention forward (StreamingLLM's pos-shift applies).
        forward: replacement forward for modules that bypass the AttentionInterface (RoFormer).
    """

    attention_classes: tuple[str, ...]
    decoder: bool
    rope: bool
    forward: Callable[..., tuple] | None = None


def _roformer_forward() -> Callable[..., tuple]:
    from .roformer import roformer_self_attention_forward

    return roformer_self_attention_forward


def _decoder(name: str) -> Family:
    return Family((f"{name}Attention",), decoder=True, rope=True)


def _encoder(cls: str, rope: bool = False) -> Family:
    return Family((cls,), decoder=False, rope=rope)


FAMILIES: dict[str, Family] = {
    "llama": _decoder("Llama"),
    "mistral": _decoder("Mistral"),
    "qwen2": _decoder("Qwen2"),
    "qwen3": _decoder("Qwen3"),
    "gemma": _decoder("Gemma"),
    "phi3": _decoder("Phi3"),
    "bert": _encoder("BertSelfAttention"),
    "roberta": _encoder("RobertaSelfAttention"),
    "xlm-roberta": _encoder("XLMRobertaSelfAttention"),
    "electra": _encoder("ElectraSelfAttention"),
    "distilbert": _encoder("DistilBertSelfAttention"),
    "albert": _encoder("AlbertAttention"),
    "modernbert": _encoder("ModernBertAttention"),
}


def supported_model_types() -> list[str]:
    """The ``config.model_type`` values `hfa.patch` accepts."""
    return sorted([*FAMILIES, "roformer"])


def family_for(model_type: str) -> Family:
    """The `Family` of ``model_type``; raises ValueError naming the supported types."""
    if model_type == "roformer":
        return Family(("RoFormerSelfAttention",), decoder=False, rope=True, forward=_roformer_forward())
    if model_type not in FAMILIES:
        raise ValueError(
            f"hf_attnscale does not support model_type {model_type!r}. "
            f"Supported model types: {', '.join(supported_model_types())}."
        )
    return FAMILIES[model_type]


def attention_modules(model: nn.Module, family: Family) -> list[nn.Module]:
    """The self-attention modules of ``model`` that the family patches, in module order."""
    return [m for m in model.modules() if type(m).__name__ in family.attention_classes]
