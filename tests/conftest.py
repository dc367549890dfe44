"""Shared fixtures and tiny-model factories, built from configs (nothing is downloaded).

* `tiny_config`, `tiny_model`: a tiny config / model of one of the main families (`DECODERS`, `ENCODERS`), shared
  small sizes, default initialisation;
* `sharp_model`: a tiny `DECODERS` model with weights large enough that attention is sharp and positions matter
  (the streaming and perplexity tests);
* `tiny_lm_with_tokenizer`, `tiny_mlm_with_tokenizer`: a Llama or a BERT masked LM with a BPE tokenizer
  trained on stdlib text (the evaluation, CLI and lm-eval tests);
* `FEATURES`, `patched_and_reference`, `sample_inputs`: every feature's patch, a patched tiny model beside its
  eager reference (same weights), and a padded batch for it;
* `stream_logits`: a model's logits fed through a cache in chunks; `OperatorCount`: the operators a block runs;
* `device`: the device of the gpu suite (``--device``, default cuda);
* every supported model type (`zoo_model`): `model_zoo`; building and sharpening, shared by both: `tiny`; the eager
  reference attention: `reference`.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from reference import make_reference, set_gate
from tiny import VOCAB, build, sharpen
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    BertConfig,
    BertForMaskedLM,
)

import hf_attnscale as hfa
from hf_attnscale.core.install.families import attention_modules
from hf_attnscale.evaluation.corpus import builtin_documents
from hf_attnscale.training.lm import train_tokenizer

# The suite proves the public formulations, the ones every device runs; the CPU's fused kernels (on by default
# for users) have their own tests, which turn them on (tests/core/test_fused_exit.py, test_key_parts.py, and
# test_rerope.py's "sdpa+fused").
os.environ.setdefault("HF_ATTNSCALE_FUSED_EXIT", "0")
os.environ.setdefault("HF_ATTNSCALE_FUSED_PARTS", "0")

# Tiny models gain nothing from a second thread, and oversubscribed cores make them many times slower.
torch.set_num_threads(1)

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
    """The config of a tiny ``model_type`` (one of `DECODERS`, `ENCODERS`): the shared sizes, the type's own
    fields, then ``overrides``; no dropout."""
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
    head = AutoModelForCausalLM if model_type in DECODERS else AutoModel
    impl = "eager" if model_type == "roformer" else attn
    return build(head, tiny_config(model_type, **overrides), impl, seed, dtype=dtype)


def model_output(model, **inputs) -> torch.Tensor:
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


# ---------------------------------------------------------------------------------------------------------
# The patch against the eager reference (tests/reference.py)

FEATURES = {
    "logn": {"scale": "logn", "train_length": 2},
    "logn_unclamped": {"scale": "logn", "train_length": 2, "clamp": False},
    "ssmax": {"scale": "ssmax", "train_length": 2},
    "gradmax": {"scale": "gradmax", "train_length": 2},
    "llama4": {"scale": "llama4", "train_length": 2, "beta": 0.5},
    "ministral3": {"scale": "ministral3", "train_length": 3, "beta": 0.5},
    "zero_kv": {"zero_kv": True},
    "sink_fixed": {"sink_logit": 2.0},
    "sink_learnable": {"sink_logit": "learnable"},
    "logn+zero_kv": {"scale": "logn", "train_length": 2, "zero_kv": True},
    "ssmax+sink_learnable": {"scale": "ssmax", "train_length": 2, "sink_logit": "learnable"},
    "clipped": {"clipped_softmax": (-0.03, 1.02)},
    "logn+clipped_learnable": {"scale": "logn", "train_length": 2, "clipped_softmax": "learnable"},
    "gate_head": {"gate": "head"},
    "logn+zero_kv+gate_element": {"scale": "logn", "train_length": 2, "zero_kv": True, "gate": "element"},
}
"""The features every reference test covers, with tiny train lengths so that the laws act at tiny n."""


def sample_inputs(model_type: str, batch: int = 3, length: int = 11, padded: bool = True):
    """Random ids with a padding mask: left padding for decoders, a mixed-length batch for encoders."""
    ids = torch.randint(3, VOCAB, (batch, length))
    mask = torch.ones(batch, length, dtype=torch.long)
    if padded and model_type in DECODERS:
        mask[1, :4] = 0  # left padding
        mask[2, :1] = 0
    elif padded:
        mask[1, 6:] = 0  # mixed-length encoder batch
        mask[2, 9:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def patched_and_reference(model_type: str, attn: str, options: dict, **overrides):
    """(patched model, reference model) with identical weights; learnable parameters perturbed identically.
    ``overrides``: of the tiny model's config (`tiny_config`)."""
    patched, reference = patched_beside_reference(tiny_model(model_type, attn, **overrides), options)
    refs = [m.hfa_ref for m in reference.modules() if hasattr(m, "hfa_ref")]  # make_reference's, in its order
    states = [m.hfa for m in patched.modules() if hasattr(m, "hfa") and isinstance(m.hfa, torch.nn.Module)]
    gen = torch.Generator().manual_seed(7)
    for state, ref in zip(states, refs, strict=True):
        with torch.no_grad():
            if state.sink is not None:
                state.sink.copy_(torch.randn(state.sink.shape, generator=gen))
                ref.sink.copy_(state.sink)
            if state.ssmax is not None:
                state.ssmax.mul_(1 + 0.3 * torch.randn(state.ssmax.shape, generator=gen))
                ref.slope.copy_(state.ssmax)
            if state.clip_gamma is not None:  # gamma in [-0.06, 0], zeta in [1, 1.06]
                state.clip_gamma.copy_(-0.06 * torch.rand(state.clip_gamma.shape, generator=gen))
                state.clip_zeta.copy_(1 + 0.06 * torch.rand(state.clip_zeta.shape, generator=gen))
                ref.clip[0].copy_(state.clip_gamma)
                ref.clip[1].copy_(state.clip_zeta)
            if state.output_gate is not None:
                perturb_gate(state.output_gate, gen)
                set_gate(ref, state.output_gate.weight, state.output_gate.bias)
    return patched, reference, states, refs


def perturb_gate(gate: torch.nn.Linear, generator: torch.Generator) -> None:
    """Move a gate off its identity start: weights of std 1/sqrt(in), biases of std 0.5 (gates in ~0.3-1.7)."""
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=generator) / math.sqrt(gate.in_features))
        gate.bias.copy_(0.5 * torch.randn(gate.bias.shape, generator=generator))


SHARP_VOCAB = 97
SHARP: dict = {
    "vocab_size": SHARP_VOCAB,
    "rope_theta": 100.0,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": None,
}
"""What `sharp_model` sets on top of `tiny_config`."""
SHARP_OVERRIDES: dict[str, dict] = {
    "mistral": {
        "sliding_window": 64
    },  # wider than the streaming tests' caches: there it streams as llama does
    "phi3": {"partial_rotary_factor": 0.5},  # pos-shift must keep the unrotated half as it is
}


def sharp_model(model_type: str = "llama", attn: str = "sdpa", seed: int = 0, **overrides):
    """A 2-layer `DECODERS` model with weights large enough that attention is sharp and positions matter: every
    matrix, embeddings too, re-drawn by `sharpen` from torch's generator as the construction left it."""
    config = tiny_config(model_type, **{**SHARP, **SHARP_OVERRIDES.get(model_type, {}), **overrides})
    return sharpen(build(AutoModelForCausalLM, config, attn, seed), None, embeddings=True)


def watch_fused_parts(monkeypatch, on: bool) -> list:
    """The CPU's fused key parts (`hf_attnscale.core.parts.key_parts`) switched ``on`` or off for this test, their
    first-use verdicts cleared so the test's own heads are checked; returns a list that each call of the kernel
    appends to."""
    from hf_attnscale.core.call import cpu_flash
    from hf_attnscale.core.parts import key_parts

    monkeypatch.setenv(key_parts.ENV_SWITCH, "1" if on else "0")
    monkeypatch.setattr(key_parts.CHECK, "verdicts", {})
    calls = []
    kernel = cpu_flash.flash_forward
    monkeypatch.setattr(cpu_flash, "flash_forward", lambda *args: calls.append(1) or kernel(*args))
    return calls


def count_flex_bands(monkeypatch) -> list:
    """Each call of the flex key bands (`hf_attnscale.core.parts.flex_parts`, CUDA's ReRoPE path) that served a
    model: outside their first-use check (its verdicts cleared first), and not handed back to the chunks."""
    from hf_attnscale.core.parts import flex_parts

    monkeypatch.setattr(flex_parts.CHECK, "verdicts", {})
    served, checking = [], []
    attention, check = flex_parts.attention, flex_parts._check

    def counted(*args):
        out = attention(*args)
        if out is not None and not checking:
            served.append(1)
        return out

    def flagged(*args):
        checking.append(1)
        try:
            return check(*args)
        finally:
            checking.pop()

    monkeypatch.setattr(flex_parts, "attention", counted)
    monkeypatch.setattr(flex_parts, "_check", flagged)
    return served


def watch_flex_bands(monkeypatch) -> list:
    """The flex key bands switched on for the CPU, where flex runs uncompiled and forward only: their first-use
    check, which runs backward too, is the GPU suite's. Returns `count_flex_bands`' list."""
    from hf_attnscale.core.parts import flex_parts

    monkeypatch.setattr(flex_parts, "SERVED_DEVICES", {"cpu": 1})
    monkeypatch.setattr(flex_parts, "_check", lambda *args: None)
    return count_flex_bands(monkeypatch)


@pytest.fixture
def attn(request, monkeypatch):
    """The backend by name, for the methods of key parts (ReRoPE, Self-Extend, DCA). "sdpa+fused" is sdpa with
    the CPU's fused key parts on (the suite runs the public formulation every device runs), "sdpa+flex" with
    CUDA's flex key parts, run on the CPU (forward only); there the fast path must have done the work, and with
    a clipped softmax, which it cannot serve, never."""
    name, _, fast = request.param.partition("+")
    calls = watch_fused_parts(monkeypatch, fast == "fused")
    if fast == "flex":
        calls = watch_flex_bands(monkeypatch)
    yield name
    if fast == "fused":
        from hf_attnscale.core.parts import key_parts

        assert all(key_parts.CHECK.verdicts.values())
    if fast:
        assert bool(calls) == ("clipped" not in request.node.name), len(calls)


ATTNS = ["sdpa", "sdpa+fused", "eager"]
FORWARD_ATTNS = [*ATTNS, "sdpa+flex"]
"""Also flex's bands, which run no backward on the CPU."""


ROPE_TYPES = {  # transformers' own rope_parameters, each with what the tiny model's RoPE needs
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
        "rope_theta": 10000.0,
    },
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 8,
        "rope_theta": 10000.0,
    },
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
}
OWN_FAMILIES = {
    # a local layer (a window of 6 within the 16 tokens) and a global one, each with its own RoPE frequencies
    "gemma3_text": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6},
    "gpt_neox": {},  # partial rotary (a quarter of each head), sliced off before its own rotation
    "smollm3": {"no_rope_layers": [1, 0]},  # the second layer is NoPE, left as it is
}


def assert_logits_match(patched, reference, inputs):
    """``patched``'s logits on the real rows equal ``reference``'s (fp32 atol 1e-5); returns them."""
    rows = inputs["attention_mask"].bool()
    with torch.no_grad():
        got, want = patched(**inputs).logits, reference(**inputs).logits
    torch.testing.assert_close(got[rows], want[rows], atol=1e-5, rtol=1e-5)
    return got[rows]


def assert_unchanged(model, before) -> None:
    """``model`` is as ``before`` (its copy from before a refused patch): the same weights, no per-instance
    forward or patch state on any module, the same backend and config."""
    assert model.state_dict().keys() == before.state_dict().keys()
    assert all(torch.equal(v, before.state_dict()[k]) for k, v in model.state_dict().items())
    for module, twin in zip(model.modules(), before.modules(), strict=True):
        assert type(module) is type(twin) and module.__dict__.keys() == twin.__dict__.keys(), type(module)
        hooks = ("_forward_hooks", "_forward_pre_hooks")
        assert [len(getattr(module, h)) for h in hooks] == [len(getattr(twin, h)) for h in hooks]
    assert model.config.to_dict() == before.config.to_dict()


def assert_gradients_match(patched: torch.nn.Module, reference: torch.nn.Module, inputs: dict) -> None:
    """Every weight's gradient of a loss on the real rows' logits: ``patched``'s equals ``reference``'s, relative
    to its size (the patch's own parameters aside)."""
    rows = inputs["attention_mask"].bool()
    grads = []
    for model in (patched, reference):
        model.zero_grad()
        model(**inputs).logits[rows].float().pow(2).mean().backward()
        grads.append(
            {n: p.grad for n, p in model.named_parameters() if p.grad is not None and "hfa" not in n}
        )
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, want in grads[1].items():
        scale = want.abs().max() + 1e-12
        assert ((grads[0][name] - want).abs().max() / scale) < 1e-4, name


def patched_beside_reference(model: torch.nn.Module, options: dict):
    """(``model`` patched with ``options``, its eager reference (tests/reference.py)), the same weights."""
    reference = copy.deepcopy(model)
    hfa.patch(model, **options)
    make_reference(reference, {type(m).__name__ for m in attention_modules(reference)}, **options)
    return model, reference


def sharp_inputs(batch: int = 2, length: int = 16, vocab: int = SHARP_VOCAB, padded: bool = True) -> dict:
    """Seeded ids for a `sharp_model`, row 1 left-padded by 3 where ``padded``."""
    ids = torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(batch, length, dtype=torch.long)
    if padded:
        mask[1, :3] = 0  # left padding
    return {"input_ids": ids, "attention_mask": mask}


GREEDY = {"do_sample": False, "pad_token_id": 0, "return_dict_in_generate": True, "output_logits": True}
"""generate() arguments of a greedy search that returns each step's logits."""
BEAM_SEARCH = {
    "num_beams": 3,
    "num_return_sequences": 3,
    "length_penalty": 0.0,
    "do_sample": False,
    "pad_token_id": 0,
    "return_dict_in_generate": True,
    "output_scores": True,
}
"""generate() arguments of a beam search whose every returned beam's score is its summed log-probability."""


def stream_logits(model, ids: torch.Tensor, cache, chunks) -> torch.Tensor:
    """Logits of ``ids`` (B, T) fed through ``cache`` in pieces of the given sizes (cycled)."""
    out, start, i = [], 0, 0
    while start < ids.shape[1]:
        size = chunks[i % len(chunks)]
        out.append(model(input_ids=ids[:, start : start + size], past_key_values=cache).logits)
        start, i = start + size, i + 1
    return torch.cat(out, dim=1)


def tiny_lm_with_tokenizer(vocab_size: int = 320, max_position_embeddings: int = 64):
    """A random 2-layer Llama and a byte-level BPE tokenizer (adds <s>) trained on a few stdlib files.

    Its weights are drawn 10x wider than the default so that attention changes move the loss measurably.
    """
    tokenizer = train_tokenizer(builtin_documents("train")[:3], vocab_size)
    model = tiny_lm_for(
        tokenizer,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return model, tokenizer


def tiny_lm_for(tokenizer, model_type: str = "llama", attn: str = "sdpa", **overrides):
    """A random 2-layer causal LM of ``model_type`` over ``tokenizer``'s vocabulary (seed 0), its weights drawn
    10x wider than the default; ``overrides`` are config fields."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.2,
        **overrides,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


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


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--device",
        default="cuda",
        help="the device of the gpu suite (-m gpu): cuda, or cpu to run that suite on a machine without a GPU",
    )


@pytest.fixture
def device(request) -> torch.device:
    """The ``--device`` the gpu suite runs on; its tests skip when that is CUDA and there is none."""
    name = request.config.getoption("--device")
    if name.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("no CUDA device (pytest -m gpu --device cpu runs this suite on the CPU)")
    return torch.device(name)


@pytest.fixture(autouse=True)
def _deterministic():
    """A fixed seed, and one torch thread: tiny models gain nothing from more, and on shared cores torch's
    OpenMP threads wait on each other (lm-eval's streaming test ran 25x slower with 2 threads than with 1 on a
    busy 2-core machine). Reset for every test, as some (the CLI's) set their own."""
    torch.manual_seed(1234)
    torch.set_num_threads(1)
    yield


class OperatorCount(TorchDispatchMode):
    """The ATen operators that compute (views left out) in its block, in ``operators``: on a GPU each is one
    kernel launch at least."""

    def __init__(self) -> None:
        super().__init__()
        self.operators = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.operators += not func.is_view
        return func(*args, **(kwargs or {}))
