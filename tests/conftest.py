"""Tiny models of every supported family, built from configs (nothing is downloaded)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

# Tiny models gain nothing from a second thread, and oversubscribed cores make them many times slower.
torch.set_num_threads(1)

VOCAB = 128

DECODERS: dict[str, dict] = {
    "llama": {},
    "mistral": {"sliding_window": 6},
    "qwen2": {},
    "qwen3": {"head_dim": 8},
    "gemma": {"head_dim": 8},
    "phi3": {"pad_token_id": 0},
}
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
}
ENCODERS: dict[str, dict] = {
    "bert": {},
    "roberta": {"pad_token_id": 1},
    "xlm-roberta": {"pad_token_id": 1},
    "electra": {"embedding_size": 16},
    "distilbert": {"dim": 32, "hidden_dim": 64, "n_layers": 2, "n_heads": 4},
    "albert": {"embedding_size": 16},
    "modernbert": {"global_attn_every_n_layers": 2, "local_attention": 4, "pad_token_id": 0},
    "roformer": {"embedding_size": 32},
}


def tiny_config(model_type: str, **overrides):
    extra = DECODERS.get(model_type, ENCODERS.get(model_type))
    kwargs = {**_COMMON, **extra, **overrides}
    if model_type in DECODERS:
        kwargs.setdefault("num_key_value_heads", 2)
    if model_type != "distilbert":
        kwargs.setdefault("max_position_embeddings", 512)
    else:
        kwargs["max_position_embeddings"] = 512
    kwargs.update(attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0, attention_dropout=0.0)
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str, attn: str = "sdpa", seed: int = 0, dtype=torch.float32, **overrides):
    """A randomly initialised tiny model in eval mode (a fresh copy; building one is slow, copying is not)."""
    key = (model_type, attn, seed, dtype, tuple(sorted(overrides.items())))
    if key not in _BUILT:
        _BUILT[key] = _build(model_type, attn, seed, dtype, **overrides)
    return copy.deepcopy(_BUILT[key])


_BUILT: dict[tuple, torch.nn.Module] = {}


def _build(model_type: str, attn: str, seed: int, dtype, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    cls = AutoModelForCausalLM if model_type in DECODERS else AutoModel
    impl = "eager" if model_type == "roformer" else attn
    model = cls.from_config(config, attn_implementation=impl, dtype=dtype)
    return model.eval()


def model_output(model, **inputs) -> torch.Tensor:
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(1234)
    yield
