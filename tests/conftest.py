"""Shared fixtures and tiny-model factories, built from configs (nothing is downloaded).

* `tiny_model`: a tiny model of one of the main families (`DECODERS`, `ENCODERS`), default initialisation;
* `sharp_model`: a tiny RoPE decoder with weights large enough that attention is sharp and positions matter
  (the streaming and perplexity tests);
* `tiny_lm_with_tokenizer`, `tiny_mlm_with_tokenizer`: a Llama or a BERT masked LM with a BPE tokenizer
  trained on stdlib text (the evaluation, CLI and lm-eval tests);
* every supported model type: `model_zoo`; the eager reference attention: `reference`.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    BertConfig,
    BertForMaskedLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from hf_attnscale.evaluation.corpus import builtin_documents
from hf_attnscale.training.lm import train_tokenizer

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
"""The decoder families every feature is tested on, with the config each needs at tiny sizes."""
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


SHARP_VOCAB = 97
SHARP_OVERRIDES: dict[str, dict] = {
    "mistral": {"sliding_window": 64},  # streaming windows up to 64 stay inside the model's own
    "phi3": {"partial_rotary_factor": 0.5},  # pos-shift must keep the unrotated half as it is
}


def sharp_model(model_type: str = "llama", attn: str = "sdpa", seed: int = 0, **overrides):
    """A 2-layer `DECODERS` model with weights large enough that attention is sharp and positions matter."""
    torch.manual_seed(seed)
    kwargs = {
        "vocab_size": SHARP_VOCAB,
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
        **DECODERS[model_type],
        **SHARP_OVERRIDES.get(model_type, {}),
        **overrides,
    }
    config = AutoConfig.for_model(model_type, **kwargs)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, (2.5 if "q_proj" in name or "qkv" in name else 1.0) / math.sqrt(p.shape[1]))
    return model


def tiny_lm_with_tokenizer(vocab_size: int = 320, max_position_embeddings: int = 64):
    """A random 2-layer Llama and a byte-level BPE tokenizer (adds <s>) trained on a few stdlib files.

    Its weights are drawn 10x wider than the default so that attention changes move the loss measurably.
    """
    tokenizer = train_tokenizer(builtin_documents("train")[:3], vocab_size)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.2,
    )
    return LlamaForCausalLM(config).eval(), tokenizer


def tiny_mlm_with_tokenizer(max_position_embeddings: int = 128, **overrides):
    """A random 1-layer BERT masked LM and the tokenizer of `tiny_lm_with_tokenizer`, with a ``<mask>`` token."""
    _, tokenizer = tiny_lm_with_tokenizer()
    tokenizer.add_special_tokens({"mask_token": "<mask>"})
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=max_position_embeddings,
        **overrides,
    )
    return BertForMaskedLM(config).eval(), tokenizer


def random_documents(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    """Documents of random token ids (1..127), of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (n,), generator=generator) for n in lengths]


@pytest.fixture(autouse=True)
def _deterministic():
    """A fixed seed, and one torch thread: tiny models gain nothing from more, and on shared cores torch's
    OpenMP threads wait on each other (lm-eval's streaming test ran 25x slower with 2 threads than with 1 on a
    busy 2-core machine). Reset for every test, as some (the CLI's) set their own."""
    torch.manual_seed(1234)
    torch.set_num_threads(1)
    yield
