"""Which modules of a model get the patch, found from the model itself; and the few families that differ.

A model is supported when its self-attention modules call transformers' AttentionInterface: their class's
``forward`` reads ``ALL_ATTENTION_FUNCTIONS``. Those modules are found on the model instance, so a new family
that follows transformers' conventions works with no code here. `RULES` holds only the exceptions: modules
that bypass the dispatch (RoFormer), and families whose attention must be refused an option. Cross-attention
and the vision / audio towers of multimodal models are left alone.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from hf_attnscale.core.install.roformer import roformer_self_attention_forward

ATTENTION_ENTRY = "ALL_ATTENTION_FUNCTIONS"
SKIPPED_CLASSES = re.compile(r"Cross|Vision|Audio|Image|VQVAE|Residual")
"""Attention classes left unpatched: cross-attention, the non-text towers of multimodal models, and attention
residuals (Inkling-2's learned queries over the stack of earlier layers' outputs: attention across depth, not
across tokens, so no length law or exit applies)."""
HEAD_COUNT_NAMES = ("num_heads", "num_attention_heads", "n_heads", "n_head", "num_q_heads")


@dataclass(frozen=True)
class Rule:
    """How one ``model_type`` differs from what discovery finds.

    Attributes:
        attention_classes: class names to patch, for modules that bypass the AttentionInterface.
        forward: replacement forward for those modules (they compute their scores inline).
        no_exit: why the exit (zero_kv / sink logit) is refused for this family, if it is.
    """

    attention_classes: tuple[str, ...] = ()
    forward: Callable[..., tuple] | None = None
    no_exit: str | None = None


_INKLING2 = Rule(
    no_exit="Inkling-2 has attention sinks of its own (a sink logit per query and head); a second exit is refused"
)
RULES: dict[str, Rule] = {
    "roformer": Rule(("RoFormerSelfAttention",), forward=roformer_self_attention_forward),
    "gpt_oss": Rule(
        no_exit="gpt-oss has learned attention sinks of its own (s_aux); a second exit is refused"
    ),
    "inkling2_text": _INKLING2,
    "inkling2_loop_text": _INKLING2,
}


def forward_names(cls: type) -> tuple[str, ...]:
    """The global and attribute names ``cls.forward`` reads (through decorators), from its code object."""
    forward = inspect.unwrap(cls.forward)
    code = getattr(forward, "__code__", None)
    return code.co_names if code is not None else ()


@functools.cache
def uses_attention_interface(cls: type) -> bool:
    """Whether ``cls`` is a self-attention class that dispatches through the AttentionInterface."""
    return ATTENTION_ENTRY in forward_names(cls) and SKIPPED_CLASSES.search(cls.__name__) is None


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of ``model`` that the patch applies to, in module order.

    Raises ValueError, saying why, when there are none.
    """
    config = model.config
    model_type = getattr(config, "model_type", None)
    rule = rule_for(model)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"hf_attnscale does not support encoder-decoder models (model_type {model_type!r}): their decoder "
            "self-attention and cross-attention share one attention class, so the patch cannot tell them apart."
        )
    if rule.attention_classes:
        found = [m for m in model.modules() if type(m).__name__ in rule.attention_classes]
    else:
        found = [m for m in model.modules() if uses_attention_interface(type(m))]
        found = [m for m in found if not getattr(m, "is_cross_attention", False)]
        text_config = getattr(config, "text_config", None)
        if text_config is not None:  # a multimodal model: only the language model's attention
            found = [m for m in found if getattr(m, "config", None) is text_config]
    if not found:
        raise ValueError(
            f"hf_attnscale cannot patch this {type(model).__name__} (model_type {model_type!r}): none of its "
            f"attention modules calls transformers' AttentionInterface ({ATTENTION_ENTRY}), which is where the "
            "patch applies. See hfa.supported_model_types() for the model types of this transformers version "
            "that do."
        )
    return found


def rule_for(model: nn.Module | Any) -> Rule:
    """The `Rule` of the family of ``model`` (or of a model config); the empty rule when discovery suffices."""
    config = model.config if isinstance(model, nn.Module) else model
    return RULES.get(getattr(config, "model_type", None), Rule())


def _module_size(module: nn.Module, model_config: Any, names: tuple[str, ...]) -> int | None:
    """The first positive int among ``names`` on the module, then its config, then the model's config."""
    for source in (module, getattr(module, "config", None), model_config):
        for name in names:
            value = getattr(source, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def query_heads(module: nn.Module, model_config: Any) -> int:
    """The number of query heads of an attention module (the size of its per-head exit-logit / SSMax parameters)."""
    heads = _module_size(module, model_config, HEAD_COUNT_NAMES)
    if heads is None:
        raise ValueError(f"Cannot find the number of attention heads of {type(module).__name__}.")
    return heads


def gate_features(module: nn.Module, model_config: Any) -> tuple[int, int]:
    """``(input width, value head dim)`` of an attention module, for its output gate: the input width is its
    first projection's (MobileBERT's attention runs on a bottleneck narrower than the model)."""
    first = next((m for m in module.modules() if isinstance(m, nn.Linear)), None)
    width = first.in_features if first is not None else model_config.hidden_size
    head_dim = _module_size(
        module, model_config, ("v_head_dim", "head_dim", "attention_head_size", "head_size")
    )
    return width, head_dim or model_config.hidden_size // query_heads(module, model_config)


def is_causal_attention(module: nn.Module) -> bool:
    """Whether the attention module is a decoder's (``is_causal``; RoFormer's says ``is_decoder``)."""
    return getattr(module, "is_causal", getattr(module, "is_decoder", True))


def takes_position_embeddings(module: nn.Module) -> bool:
    """Whether the module's forward receives RoPE's ``(cos, sin)``: where StreamingLLM's pos-shift can act."""
    forward = inspect.unwrap(type(module).forward)
    return "position_embeddings" in inspect.signature(forward).parameters


@functools.cache
def supported_model_types() -> list[str]:
    """The ``config.model_type`` values of this transformers version whose text model `hfa.patch` accepts.

    A type counts when it has a causal-LM or masked-LM head, is a plain text model (neither an encoder-decoder
    nor a multimodal composite, whose language models have types of their own, e.g. ``gemma3_text``), and its
    modeling file defines a self-attention class that calls the AttentionInterface (or the family has a
    `Rule`). Built on first call by importing the modeling files (several seconds), then cached.
    """
    # Importing every modeling file is slow and only needed here: imported on first call.
    from transformers.models.auto import configuration_auto, modeling_auto

    heads = {
        **modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        **modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    }
    supported = []
    for model_type in sorted(heads):
        try:
            config_class = configuration_auto.CONFIG_MAPPING[model_type]
            if config_class.sub_configs or _is_encoder_decoder(config_class):
                continue
            module_name = configuration_auto.model_type_to_module_name(model_type)
            modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
        except Exception:
            continue
        if model_type in RULES and RULES[model_type].attention_classes:
            supported.append(model_type)
            continue
        classes = [
            v for v in vars(modeling).values() if isinstance(v, type) and v.__module__ == modeling.__name__
        ]
        if any(
            issubclass(c, nn.Module) and "forward" in vars(c) and uses_attention_interface(c) for c in classes
        ):
            supported.append(model_type)
    return supported


def _is_encoder_decoder(config_class: type) -> bool:
    """Whether ``config_class``'s defaults describe an encoder-decoder, read from its signature and class (building
    a default config would log warnings some defaults raise, and silencing them would touch shared state)."""
    parameter = inspect.signature(config_class.__init__).parameters.get("is_encoder_decoder")
    if parameter is not None and parameter.default is not inspect.Parameter.empty:
        return bool(parameter.default)
    return bool(getattr(config_class, "is_encoder_decoder", False))


Rotary = tuple[nn.Module, str | None]
"""A model's rotary embedding module, and the layer type a module passes it (Gemma-3's), if any."""


def rotary_for(root: nn.Module, module: nn.Module) -> Rotary | None:
    """The model's rotary embedding that feeds ``module``, and the layer type it takes (Gemma-3), if any.

    The rotary embedding is the module that holds a ``rope_type`` (transformers' RoPE initialisation reads it).
    None when the model has none, or several to choose between (streaming then says it cannot run).
    """
    rotaries = [m for m in root.modules() if hasattr(m, "rope_type")]
    if len(rotaries) != 1:
        return None
    rotary = rotaries[0]
    layer_types = getattr(getattr(module, "config", None), "layer_types", None)
    takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
    layer_type = layer_types[module.layer_idx] if takes_type and layer_types else None
    return rotary, layer_type


def own_sliding_window(module: nn.Module) -> int | None:
    """The sliding window of ``module``'s own, None where it has none: Qwen2/3, Gemma-2/3 and Cohere-2 keep one per
    layer (None on global layers), Mistral and Phi-3 one in the config; 0 is none (Qwen2-MoE's full layers)."""
    own = getattr(module, "sliding_window", getattr(getattr(module, "config", None), "sliding_window", None))
    return own or None
