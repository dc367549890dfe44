"""Tiny models of every text model type that `hfa.supported_model_types()` reports, built from config.

`zoo_model(model_type, attn)` takes the type's default config, shrinks every size it has (`SMALL`, then the
few per-type fixes in `OVERRIDES`: `zoo_config`), builds the causal-LM head (or the masked-LM head for encoders),
and gives it sharp random weights (`tiny.sharpen`), so that attention is peaked and a wrong scale, mask or
position shows in the logits. `SKIPPED` names the types that cannot be exercised this way, each with its reason.
(`conftest.tiny_model` is the other factory: the main families only, at smaller shared sizes, default weights.)
"""

from __future__ import annotations

import copy
import warnings

import torch
from reference import make_reference
from tiny import VOCAB, build, sharpen
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM
from transformers.models.auto import modeling_auto

from hf_attnscale.core.install.families import attention_modules

SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "n_embd": 64,
    "dim": 64,
    "hidden_dim": 96,
    "dff": 96,
    "n_heads": 4,
    "n_layers": 2,
    "swa_head_dim": 16,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "expert_ffn_hidden_size": 32,
    "zero_expert_num": 2,
    "moe_shared_expert_intermediate_size": 32,
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16,
    "pronunciation_embed_dim": 16,
    "pronunciation_vocab_size": 32,
    "shape_embed_dim": 16,
    "shape_vocab_size": 32,
    "ngram_vocab_size_base": 1024,
    "d_model": 64,
    "embedding_size": 64,
    "intermediate_size": 96,
    "ffn_hidden_size": 96,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rotary_dim": 8,  # GPT-J / CodeGen: half of a head (64 / 4), rotated
    "max_position_embeddings": 256,
    "n_positions": 256,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "num_expert_group": 1,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "qk_head_dim": 16,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "sep_token_id": 2,
    "cls_token_id": 1,
    "mask_token_id": 3,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
}
"""Sizes every type gets, where its config has the field."""

_HYBRID = {"layer_types": ["linear_attention", "full_attention"]}
_MAMBA = {"mamba_n_heads": 8, "mamba_d_state": 16}
"""Mamba-2 mixers of 8 heads and a state of 16: the defaults' 128 heads and state of 256 took most of a test's
time, and none of the attention the tests check."""
OVERRIDES: dict[str, dict] = {
    # Hybrids: two layers, one of them attention (the defaults' first layers are recurrent / linear).
    "bailing_hybrid": {**_HYBRID, "mlp_layer_types": ["dense", "sparse"]},
    "bamba": {"attn_layer_indices": [1], **_MAMBA},
    "falcon_h1": {**_MAMBA, "mamba_d_head": 8, "mamba_d_ssm": 64},  # Mamba-2 beside attention in every layer
    "granitemoehybrid": {**_HYBRID, **_MAMBA},
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
    "kimi_linear": {**_HYBRID, "mlp_layer_types": ["dense", "sparse"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "lfm3": {"layer_types": ["conv", "full_attention"]},
    "qwen3_5_text": _HYBRID,
    "qwen3_5_moe_text": _HYBRID,
    "qwen3_next": _HYBRID,
    "qwen4_exp_text": {
        **_HYBRID,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 64,
        "indexer_compress_ratio": 4,
    },
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "zamba": {"layers_block_type": ["linear_attention", "hybrid"], "attention_hidden_size": 128},
    "zamba2": {
        "layers_block_type": ["linear_attention", "hybrid"],
        "hybrid_layer_ids": [1],
        "attention_hidden_size": 128,
        "attention_head_dim": 32,
    },
    # Other families whose fields constrain one another.
    "cohere_compass_text": {
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    },
    "dots1": {"n_shared_experts": 1},
    "dory": {  # a looped middle: one input, one recurrent (run twice) and one output layer
        "num_hidden_layers": 3,
        "n_input_layers": 1,
        "n_recurrent_layers": 1,
        "n_output_layers": 1,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
    "dots3_note_text": {
        "num_key_value_heads": 4,
        "head_dim": 16,
        "layer_types": ["indexed_attention", "sliding_attention"],
        "mlp_layer_types": ["dense", "sparse"],
        "per_layer_config": {},
    },
    "esmc": {"num_key_value_heads": 4},
    "gemma3n_text": {
        "layer_types": ["sliding_attention", "full_attention"],
        "num_kv_shared_layers": 0,
        "activation_sparsity_pattern": [0.0, 0.0],
    },
    "zaya": {"num_experts_per_tok": 1},
}
"""Per-type fixes on top of `SMALL`, for configs whose fields constrain one another."""

SKIPPED: dict[str, str] = {
    "roformer": "its attention is computed inline, not through the interface, so the interface reference cannot "
    "stand in for it; tests/core/test_attention.py::test_roformer_matches_reference checks its own forward",
}
"""Types left out of the family tests, with the reason."""

LOGIT_TOLERANCE: dict[str, float] = {"longcat_flash": 2e-3, "gemma4_text": 3e-4}
"""Types whose tiny sharp models amplify the fp32 rounding of the log-n law in their logits (longcat's
zero-expert router, gemma-4's per-layer inputs). The same comparison in float64 agrees to 4e-5 and 1e-5, where
a wrong law, mask or exit moves the logits by 1e-2 or more. The default is 1e-4."""


def head_of(model_type: str) -> str:
    """``"masked"`` for types with a masked-LM head (encoders), else ``"causal"``."""
    return "masked" if model_type in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES else "causal"


def auto_class(model_type: str) -> type:
    """The auto class of the head `zoo_model` builds: masked LM for encoders, else causal LM."""
    return AutoModelForMaskedLM if head_of(model_type) == "masked" else AutoModelForCausalLM


def model_class(model_type: str) -> type:
    """The head class `zoo_model` builds for ``model_type``."""
    return auto_class(model_type)._model_mapping[AutoConfig.for_model(model_type).__class__]


def zoo_config(model_type: str, attn: str = "sdpa", **overrides):
    """``model_type``'s default config with `SMALL`, `OVERRIDES` and then ``overrides`` applied (only fields it
    has, but for ``overrides``)."""
    defaults = AutoConfig.for_model(model_type).to_dict()
    sizes = {k: v for k, v in SMALL.items() if k in defaults}
    if "kv_lora_rank" in defaults:  # multi-head latent attention: RoPE covers only the rope part of a head
        sizes["head_dim"] = SMALL["qk_rope_head_dim"]
        sizes["num_key_value_heads"] = SMALL["num_attention_heads"]
    sizes.update(OVERRIDES.get(model_type, {}))
    sizes.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(model_type, **sizes)
    config._attn_implementation = attn
    return config


def reference_of(plain: torch.nn.Module, attn: str, **options) -> torch.nn.Module:
    """A copy of ``plain`` whose patched attention modules compute tests/reference.py's attention with
    ``options`` (soft-capping as the backend ``attn`` applies it: eager caps, sdpa does not)."""
    reference = copy.deepcopy(plain)
    classes = {type(m).__name__ for m in attention_modules(reference)}
    make_reference(reference, classes, apply_softcap=attn == "eager", **options)
    return reference


def supports_sdpa(model_type: str) -> bool:
    return bool(getattr(model_class(model_type), "_supports_sdpa", False))


def zoo_model(model_type: str, attn: str = "sdpa", seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny, sharp, eval-mode model of ``model_type`` with attention backend ``attn`` (and config ``overrides``):
    `zoo_config`, built by `tiny.build` and sharpened by `tiny.sharpen`, both from ``seed``."""
    config = zoo_config(model_type, attn, **overrides)
    model = build(auto_class(model_type), config, attn, seed)
    if model_type == "xmod":  # X-MOD routes through per-language adapters: pick one
        model.set_default_language(config.languages[0])
    return sharpen(model, seed)


def _eager_only() -> frozenset[str]:
    from hf_attnscale import supported_model_types

    return frozenset(t for t in supported_model_types() if not supports_sdpa(t))


EAGER_ONLY = _eager_only()
"""Types whose models do not run under sdpa (tested under eager only)."""


def family_types() -> list[str]:
    """The model types the family tests exercise: `hfa.supported_model_types()` minus `SKIPPED`."""
    from hf_attnscale import supported_model_types

    return [t for t in supported_model_types() if t not in SKIPPED]
