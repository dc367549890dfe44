"""Models with the attention shapes and RoPE settings of real checkpoints (one layer, tiny vocabulary and MLP,
random sharp weights): the patch against the eager reference, and, on the decoders, streaming chunked against
token by token. The configs copy the fields of the checkpoints' config.json that shape attention.
"""

from __future__ import annotations

import copy

import pytest
import tiny
import torch
from model_zoo import reference_of
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

import hf_attnscale as hfa

SMALL = {"vocab_size": 128, "num_hidden_layers": 1, "intermediate_size": 64, "pad_token_id": 0}

CHECKPOINTS: dict[str, dict] = {
    "Llama-3.1-8B (rope llama3)": {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "Qwen2.5-7B-Instruct (YaRN 4x)": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 131072,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    },
    "Mistral-7B-v0.1 (sliding window 4096)": {
        "model_type": "mistral",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "Mixtral-8x7B (MoE)": {
        "model_type": "mixtral",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "Gemma-2-9B (softcap, query_pre_attn_scalar)": {
        "model_type": "gemma2",
        "hidden_size": 3584,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "sliding_window": 4096,
        "num_hidden_layers": 2,
    },
    "Gemma-3-4B text (local/global, two RoPE bases)": {
        "model_type": "gemma3_text",
        "hidden_size": 2560,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 1024,
        "layer_types": ["sliding_attention", "full_attention"],
        "num_hidden_layers": 2,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        },
    },
    "Phi-3-mini-128k (longrope)": {
        "model_type": "phi3",
        "hidden_size": 3072,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.01 * i for i in range(48)],
            "long_factor": [1.0 + 0.5 * i for i in range(48)],
            "original_max_position_embeddings": 4096,
        },
    },
    "OLMo-2-7B (q/k norm)": {
        "model_type": "olmo2",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    },
    "SmolLM3-3B (NoPE every 4th layer)": {
        "model_type": "smollm3",
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "num_hidden_layers": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0},
    },
    "Pythia-1.4B (GPT-NeoX, partial rotary 25%)": {
        "model_type": "gpt_neox",
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "rotary_pct": 0.25,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    },
    "Llama-3 dynamic NTK": {
        "model_type": "llama",
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rope_parameters": {"rope_type": "dynamic", "rope_theta": 500000.0, "factor": 2.0},
    },
    "BERT-base": {"model_type": "bert", "hidden_size": 768, "num_attention_heads": 12},
    "RoBERTa-base": {
        "model_type": "roberta",
        "hidden_size": 768,
        "num_attention_heads": 12,
        "pad_token_id": 1,
    },
    "ModernBERT-base (local 128 / global)": {
        "model_type": "modernbert",
        "hidden_size": 768,
        "num_attention_heads": 12,
        "num_hidden_layers": 3,
        "global_attn_every_n_layers": 3,
        "local_attention": 128,
    },
}


def build(name: str, attn: str = "sdpa") -> torch.nn.Module:
    fields = {**SMALL, **CHECKPOINTS[name]}
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    head = AutoModelForMaskedLM if model_type in ("bert", "roberta", "modernbert") else AutoModelForCausalLM
    return tiny.sharpen(tiny.build(head, config, attn))


def backend(name: str) -> str:
    return "eager" if "Gemma-2" in name else "sdpa"  # Gemma-2's softcap runs on eager only


def is_decoder(name: str) -> bool:
    return CHECKPOINTS[name]["model_type"] not in ("bert", "roberta", "modernbert")


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_real_shapes_match_the_reference(name):
    attn = backend(name)
    plain = build(name, attn)
    options = {"scale": "logn", "train_length": 8, "sink_logit": 0.5}
    patched = hfa.patch(copy.deepcopy(plain), **options)
    reference = reference_of(plain, attn, **options)
    ids = torch.randint(3, 120, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, (slice(0, 3) if is_decoder(name) else slice(21, 24))] = 0
    rows = mask.bool()
    with torch.no_grad():
        got, want = (
            patched(input_ids=ids, attention_mask=mask).logits,
            reference(input_ids=ids, attention_mask=mask).logits,
        )
        before = plain(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[rows], want[rows], atol=1e-4, rtol=1e-4)
    assert (got[rows] - before[rows]).abs().max() > 1e-3


@pytest.mark.parametrize("name", [n for n in CHECKPOINTS if is_decoder(n)])
def test_real_shapes_stream_chunked_as_token_by_token(name):
    model = hfa.patch(build(name, backend(name)), scale="logn", train_length=8)
    ids = torch.randint(3, 120, (48,), generator=torch.Generator().manual_seed(2))
    chunked = hfa.perplexity(model, ids, cache=hfa.SinkCache(4, 12), chunk_size=10, progress=False).nll
    stepped = hfa.perplexity(model, ids, cache=hfa.SinkCache(4, 12), chunk_size=1, progress=False).nll
    assert float((chunked - stepped).abs().max()) < 1e-4
