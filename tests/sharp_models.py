"""Tiny RoPE decoders with sharp attention, for the streaming and perplexity tests."""

from __future__ import annotations

import math

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 97
FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": {"sliding_window": 64},
    "qwen2": {},
    "qwen3": {"head_dim": 8},
    "gemma": {"head_dim": 8},
    "phi3": {"partial_rotary_factor": 0.5},
}


def tiny(model_type: str = "llama", attn: str = "sdpa", seed: int = 0, **overrides):
    """A 2-layer model with weights large enough that attention is sharp and positions matter."""
    torch.manual_seed(seed)
    kwargs = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 512,
        "rope_theta": 100.0,
        "attention_dropout": 0.0,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": None,
        **FAMILIES[model_type],
        **overrides,
    }
    config = AutoConfig.for_model(model_type, **kwargs)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, (2.5 if "q_proj" in name or "qkv" in name else 1.0) / math.sqrt(p.shape[1]))
    return model
