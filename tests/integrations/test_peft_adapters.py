"""PEFT LoRA on patched models: training, gradients of the patch's parameters, save/load, merge, checks.

Also gradient checkpointing, bf16 autocast and torch.compile of a patched PEFT model against eager fp32.
"""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import DECODERS, ENCODERS, SHARP_VOCAB, VOCAB, sharp_model, tiny_config, tiny_model
from peft import LoraConfig, PeftModel, get_peft_model
from reference import make_reference
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

import hf_attnscale as hfa
from hf_attnscale.core.install.families import attention_modules
from hf_attnscale.core.install.routing import cache_argument
from hf_attnscale.integrations.peft_adapters import ADAPTER_PATCH_FILE, attention_projections

# A patch with both kinds of parameters (per-head sink logits and SSMax slopes), active at 16 tokens.
LEARNABLE = {"scale": "ssmax", "train_length": 4, "sink_logit": "learnable"}
LOGN_SINK = {"scale": "logn", "train_length": 4, "sink_logit": "learnable"}
FAMILIES = [*DECODERS, *ENCODERS]
# Linear projections per attention block: the LoRA targets `lora_config` must find in each family.
PROJECTIONS = {
    **dict.fromkeys(["llama", "mistral", "qwen2", "qwen3", "gemma"], 4),
    "phi3": 2,  # fused qkv_proj + o_proj
    **dict.fromkeys(["bert", "roberta", "xlm-roberta", "electra", "roformer"], 4),  # q, k, v + output.dense
    "distilbert": 4,
    "albert": 4,
    "modernbert": 2,  # fused Wqkv + Wo
}


def lm_model(model_type: str, attn: str = "sdpa", dtype=torch.float32) -> torch.nn.Module:
    """A tiny model with an LM head (causal for decoders, masked for encoders), random weights."""
    if model_type in DECODERS:
        return tiny_model(model_type, attn, dtype=dtype)
    torch.manual_seed(0)
    impl = "eager" if model_type == "roformer" else attn
    config = tiny_config(model_type)
    return AutoModelForMaskedLM.from_config(config, attn_implementation=impl, dtype=dtype).eval()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one thread; two OpenMP threads on a shared 2-core machine thrash (~50x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def batch(
    model_type: str, size: int = 2, length: int = 16, seed: int = 0, vocab: int = VOCAB
) -> dict[str, torch.Tensor]:
    """A fixed batch of repeating 5-token patterns: learnable within a few steps by attention-only LoRA."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (size, 5), generator=gen).repeat(1, length // 5 + 1)[:, :length]
    labels = ids.clone()
    if model_type not in DECODERS:  # masked LM: hide a fixed third of the tokens (id 2) and predict those
        hidden = torch.zeros_like(ids, dtype=torch.bool)
        hidden[:, 1::3] = True
        labels[~hidden] = -100
        ids = ids.masked_fill(hidden, 2)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def peft_model(model_type: str, options: dict, attn: str = "sdpa", dtype=torch.float32, **lora_kwargs):
    model = lm_model(model_type, attn, dtype)
    hfa.patch(model, **options)
    torch.manual_seed(1)
    return get_peft_model(model, hfa.lora_config(model, r=4, lora_alpha=8, **lora_kwargs))


def train(
    model, inputs: dict, steps: int = 6, lr: float = 2e-2, autocast: torch.dtype | None = None
) -> list[float]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        # Autocast around the forward only: its cache of cast weights lives until the context exits, so a
        # context around the whole loop would keep using the weights from before each optimizer step.
        with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def patch_params(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in hfa.trainable_parameters(model)}


def logits(model, inputs: dict) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits


# --- training -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", FAMILIES)
def test_lora_trains_every_family(model_type):
    model = peft_model(model_type, LEARNABLE)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = patch_params(model)
    inputs = batch(model_type)

    losses = train(model, inputs, steps=10)

    assert losses[-1] < losses[0] - 0.08, losses
    after = patch_params(model)
    assert before.keys() == after.keys() and len(after) > 0
    for name in after:  # the patch's own parameters moved with the LoRA weights
        assert not torch.equal(before[name], after[name]), name
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[name]), f"frozen base weight {name} changed"
    lora = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" in n]
    assert len(lora) == 2 * PROJECTIONS[model_type] * (1 if model_type == "albert" else 2)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_lora_trains_through_rerope(attn, tmp_path):
    """A LoRA fine-tune through ReRoPE with a learnable sink, on a sharp model: the trained model, in training
    mode and in eval mode, equals the reference (tests/reference.py) with its merged weights and learned sinks;
    saved and loaded back onto a fresh patched base, it gives the same logits."""
    options = {"rerope_window": 4, "rerope_leak": 4.0, "sink_logit": "learnable"}
    model = hfa.patch(sharp_model("llama", attn), **options)
    torch.manual_seed(1)
    model = get_peft_model(model, hfa.lora_config(model, r=4, lora_alpha=8))
    before = patch_params(model)
    inputs = batch("llama", vocab=SHARP_VOCAB)
    losses = train(model, inputs, steps=10)
    assert losses[-1] < losses[0] - 0.08, losses
    after = patch_params(model)
    assert after and all(not torch.equal(before[name], after[name]) for name in after)

    merged = copy.deepcopy(model).merge_and_unload()
    sinks = [m.hfa.sink.detach() for m in attention_modules(merged)]
    hfa.unpatch(merged)
    refs = make_reference(merged, {type(m).__name__ for m in attention_modules(merged)}, **options)
    for ref, sink in zip(refs, sinks, strict=True):
        ref.sink.data.copy_(sink)
    for mode in (True, False):  # dropout is 0: training mode computes what eval mode does
        model.train(mode), merged.train(mode)
        with torch.no_grad():
            got, want = model(**inputs).logits, merged(**inputs).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    model.save_pretrained(tmp_path / "adapter")
    reloaded = hfa.load_adapter(sharp_model("llama", attn), tmp_path / "adapter")
    assert hfa.get_config(reloaded).rerope_window == 4
    torch.testing.assert_close(logits(reloaded, inputs), logits(model, inputs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_lora_config_targets_the_attention_projections(model_type):
    model = lm_model(model_type)
    hfa.patch(model, **LOGN_SINK)
    config = hfa.lora_config(model, r=2)
    assert isinstance(config, LoraConfig)
    assert config.modules_to_save == ["hfa"]
    assert config.attn_scale == hfa.get_config(model).to_dict()
    wrapped = get_peft_model(model, config)
    layers = 1 if model_type == "albert" else 2  # ALBERT shares one layer
    names = [n for n, m in wrapped.named_modules() if hasattr(m, "lora_A") and len(m.lora_A)]
    assert len(names) == PROJECTIONS[model_type] * layers, names
    # Every target sits inside an attention block: nothing in the MLP, embeddings or head.
    assert all(any(k in n for k in ("attn", "attention")) for n in names), names


def test_lora_config_options():
    model = tiny_model("llama")
    assert attention_projections(model) == [f"self_attn.{p}_proj" for p in "koqv"]
    # Unpatched: a plain LoRA config that records "no patch".
    unpatched = hfa.lora_config(model)
    assert unpatched.modules_to_save is None and unpatched.attn_scale is None
    assert unpatched.task_type == "CAUSAL_LM"
    # A patch without parameters: nothing to save beyond LoRA.
    hfa.patch(model, scale="logn", train_length=8, zero_kv=True)
    assert hfa.lora_config(model).modules_to_save is None
    assert list(hfa.trainable_parameters(model)) == []
    # User choices are kept and merged.
    hfa.patch(model, sink_logit="learnable")
    config = hfa.lora_config(model, target_modules=["q_proj"], modules_to_save=["lm_head"], r=3)
    assert config.target_modules == {"q_proj"} and config.r == 3
    assert config.modules_to_save == ["lm_head", "hfa"]
    # On a PEFT model (a second adapter): the same targets, not the insides of the LoRA layers.
    wrapped = get_peft_model(copy.deepcopy(model), hfa.lora_config(model))
    assert attention_projections(wrapped) == attention_projections(model)
    wrapped.add_adapter("second", hfa.lora_config(wrapped))
    assert wrapped.peft_config["second"].target_modules == set(attention_projections(model))
    frozen = get_peft_model(copy.deepcopy(model), hfa.lora_config(model, train_patch=False))
    assert frozen.peft_config["default"].modules_to_save is None
    assert all(not p.requires_grad for _, p in hfa.trainable_parameters(frozen))
    # Picklable (e.g. by multiprocessing data loaders or Trainer checkpoints), record included.
    assert pickle.loads(pickle.dumps(config)).attn_scale == config.attn_scale


def test_repatching_a_peft_model_is_refused():
    """A new patch state would replace the copy PEFT trains and saves (core check in hfa.patch)."""
    wrapped = peft_model("llama", LEARNABLE)
    before = hfa.get_config(wrapped)
    with pytest.raises(ValueError, match="patch state is held by PEFT"):
        hfa.patch(wrapped, zero_kv=True)
    assert hfa.get_config(wrapped) == before
    assert len(list(hfa.trainable_parameters(wrapped))) == 4
    # Without modules_to_save (a patch without parameters) re-patching stays allowed, e.g. for evaluation.
    plain = peft_model("llama", {"zero_kv": True})
    assert hfa.get_config(hfa.patch(plain, scale="logn", train_length=4)).scale == "logn"


def test_import_without_peft():
    code = (
        "import sys; sys.modules['peft'] = None; import hf_attnscale as hfa; "
        "assert callable(hfa.lora_config) and callable(hfa.trainable_parameters); print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


# --- the patch's parameters ---------------------------------------------------------------------------------


def test_trainable_parameters_are_the_ones_in_force():
    model = tiny_model("llama")
    hfa.patch(model, **LEARNABLE)
    names = [n for n, _ in hfa.trainable_parameters(model)]
    assert names == [f"model.layers.{i}.self_attn.hfa.{p}" for i in range(2) for p in ("sink", "ssmax")]

    wrapped = get_peft_model(model, hfa.lora_config(model))
    params = dict(hfa.trainable_parameters(wrapped))
    assert sorted(params) == sorted(
        f"base_model.model.model.layers.{i}.self_attn.hfa.modules_to_save.default.{p}"
        for i in range(2)
        for p in ("sink", "ssmax")
    )
    assert all(p.requires_grad for p in params.values())
    inputs = batch("llama")
    reference = logits(wrapped, inputs)
    with torch.no_grad():  # the yielded copies are the ones the forward reads
        next(iter(params.values())).add_(3.0)
    assert not torch.allclose(logits(wrapped, inputs), reference)
    with wrapped.disable_adapter():
        originals = [n for n, _ in hfa.trainable_parameters(wrapped)]
    assert all(".hfa.original_module." in n for n in originals) and len(originals) == 4


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_patch_parameters_get_exact_gradients(attn):
    """Gradients of sink and SSMax through PEFT equal the plain patched model's and finite differences."""
    plain = tiny_model("llama", attn, dtype=torch.float64)
    hfa.patch(plain, **LEARNABLE)
    with torch.no_grad():  # move off the initial values so every term of the gradient is exercised
        for _, p in hfa.trainable_parameters(plain):
            p.add_(torch.linspace(-0.5, 0.5, p.numel(), dtype=p.dtype))
    wrapped = get_peft_model(copy.deepcopy(plain), hfa.lora_config(plain))  # lora_B = 0: same function
    inputs = batch("llama")

    for model in (plain, wrapped):
        model.train()
        model(**inputs).loss.backward()
    want = [p.grad for _, p in hfa.trainable_parameters(plain)]
    got = dict(hfa.trainable_parameters(wrapped))
    for (name, p), ref in zip(got.items(), want, strict=True):
        assert p.grad is not None and p.grad.abs().max() > 1e-6, name
        torch.testing.assert_close(p.grad, ref, atol=1e-12, rtol=1e-9)

    def loss64() -> float:  # transformers' loss casts logits to float32; keep float64 for the differences
        out = wrapped(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        return torch.nn.functional.cross_entropy(out[0, :-1], inputs["labels"][0, 1:]).item() / 2 + (
            torch.nn.functional.cross_entropy(out[1, :-1], inputs["labels"][1, 1:]).item() / 2
        )

    # A layer-0 sink logit by central differences; the core runs its exit in float32, so eps cannot be tiny.
    name, param = next(iter(got.items()))
    eps = 0.05
    with torch.no_grad():
        param[1] += eps
        up = loss64()
        param[1] -= 2 * eps
        down = loss64()
        param[1] += eps
    assert (up - down) / (2 * eps) == pytest.approx(param.grad[1].item(), rel=1e-3)


# --- save / load / merge ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA adapter trained on a patched Llama (sink and SSMax moved), saved with save_pretrained."""
    torch.manual_seed(0)
    model = peft_model("llama", LEARNABLE)
    train(model, batch("llama"), steps=4)
    path = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(path)
    return model, path


def padded_batch() -> dict[str, torch.Tensor]:
    inputs = batch("llama", size=3, length=20, seed=5)
    inputs["attention_mask"][1, :6] = 0  # left padding exercises the masked path
    return inputs


def valid(tensor: torch.Tensor, inputs: dict) -> torch.Tensor:
    return tensor[inputs["attention_mask"].bool()]


def test_save_writes_the_patch_record(trained):
    model, path = trained
    assert (path / "adapter_model.safetensors").is_file()
    assert json.loads((path / ADAPTER_PATCH_FILE).read_text()) == {
        "attn_scale": hfa.get_config(model).to_dict()
    }
    assert hfa.adapter_patch_config(path) == hfa.AttnScaleConfig(**LEARNABLE)
    assert "attn_scale" not in json.loads((path / "adapter_config.json").read_text())  # vanilla for PEFT


def test_round_trip_plain_peft(trained):
    """base -> hfa.patch from the saved config -> PeftModel.from_pretrained reproduces the logits."""
    model, path = trained
    inputs = padded_batch()
    want = logits(model, inputs)
    base = tiny_model("llama")
    hfa.patch(base, config=hfa.adapter_patch_config(path))
    loaded = PeftModel.from_pretrained(base, path)
    got = logits(loaded, inputs)
    torch.testing.assert_close(valid(got, inputs), valid(want, inputs), atol=1e-5, rtol=0)
    for (n1, p1), (n2, p2) in zip(
        hfa.trainable_parameters(model), hfa.trainable_parameters(loaded), strict=True
    ):
        assert n1 == n2 and torch.equal(p1, p2)


def test_round_trip_load_adapter(trained, tmp_path):
    """hfa.load_adapter patches an unpatched base as saved; a trainable reload saves its record again."""
    model, path = trained
    inputs = padded_batch()
    want = logits(model, inputs)
    base = tiny_model("llama")
    loaded = hfa.load_adapter(base, path)
    assert hfa.get_config(loaded) == hfa.AttnScaleConfig(**LEARNABLE)
    torch.testing.assert_close(valid(logits(loaded, inputs), inputs), valid(want, inputs), atol=1e-5, rtol=0)

    resumed = hfa.load_adapter(tiny_model("llama"), path, is_trainable=True)
    assert all(p.requires_grad for _, p in hfa.trainable_parameters(resumed))
    resumed.save_pretrained(tmp_path)
    assert hfa.adapter_patch_config(tmp_path) == hfa.AttnScaleConfig(**LEARNABLE)


def test_merge_and_unload_keeps_the_patch(trained, tmp_path):
    model, path = trained
    inputs = padded_batch()
    want = logits(model, inputs)
    merged = hfa.load_adapter(tiny_model("llama"), path).merge_and_unload()
    assert type(merged).__name__ == "LlamaForCausalLM"
    assert hfa.get_config(merged) == hfa.AttnScaleConfig(**LEARNABLE)
    assert [n for n, _ in hfa.trainable_parameters(merged)] == [
        f"model.layers.{i}.self_attn.hfa.{p}" for i in range(2) for p in ("sink", "ssmax")
    ]
    got = logits(merged, inputs)
    torch.testing.assert_close(valid(got, inputs), valid(want, inputs), atol=1e-5, rtol=0)
    assert (
        valid(logits(hfa.unpatch(copy.deepcopy(merged)), inputs), inputs) - valid(got, inputs)
    ).abs().max() > 1e-3

    # The merged model saves as a normal checkpoint; hfa.patch() restores the patch and the learned values.
    merged.save_pretrained(tmp_path)
    reloaded = hfa.patch(AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa"))
    torch.testing.assert_close(
        valid(logits(reloaded, inputs), inputs), valid(want, inputs), atol=1e-5, rtol=0
    )


def test_load_adapter_refuses_a_different_patch(trained, tmp_path):
    _, path = trained
    other = tiny_model("llama")
    hfa.patch(other, scale="ssmax", train_length=8, sink_logit="learnable")  # a different trained length
    with pytest.raises(
        ValueError, match=r"trained with the attention patch AttnScaleConfig\(scale='ssmax', train_length=4"
    ):
        hfa.load_adapter(other, path)
    zero_kv = hfa.patch(tiny_model("llama"), zero_kv=True)
    with pytest.raises(ValueError, match="zero_kv=True"):
        hfa.load_adapter(zero_kv, path)
    with pytest.warns(UserWarning, match="trained with the attention patch"):
        loaded = hfa.load_adapter(zero_kv, path, strict=False)
    assert isinstance(loaded, PeftModel)

    # An adapter trained unpatched, loaded onto a patched model.
    plain = tiny_model("llama")
    get_peft_model(plain, hfa.lora_config(plain)).save_pretrained(tmp_path / "unpatched")
    with pytest.raises(ValueError, match=r"none \(unpatched\).*hfa.unpatch"):
        hfa.load_adapter(hfa.patch(tiny_model("llama"), **LEARNABLE), tmp_path / "unpatched")

    # An adapter made with a plain LoraConfig carries no record: loaded with a warning.
    plain = tiny_model("llama")
    get_peft_model(plain, LoraConfig(target_modules=["q_proj"])).save_pretrained(tmp_path / "vanilla")
    with pytest.raises(FileNotFoundError, match="does not record its attention patch"):
        hfa.adapter_patch_config(tmp_path / "vanilla")
    with pytest.warns(UserWarning, match="cannot be checked"):
        hfa.load_adapter(hfa.patch(tiny_model("llama"), zero_kv=True), tmp_path / "vanilla")


def test_load_adapter_into_a_peft_model(trained):
    model, path = trained
    host = hfa.load_adapter(tiny_model("llama"), path)
    assert hfa.load_adapter(host, path, adapter_name="second") is host
    assert set(host.peft_config) == {"default", "second"}
    assert host.peft_config["second"].attn_scale == hfa.get_config(model).to_dict()
    with pytest.raises(ValueError, match="trained with the attention patch"):
        hfa.load_adapter(hfa.load_adapter(tiny_model("llama"), path), _unpatched_adapter(path.parent))


def _unpatched_adapter(directory):
    target = directory / "unpatched_for_peft_host"
    if not target.exists():
        plain = tiny_model("llama")
        get_peft_model(plain, hfa.lora_config(plain)).save_pretrained(target)
    return target


# --- gradient checkpointing, bf16 autocast, torch.compile ---------------------------------------------------


def _grads(model, inputs: dict, call=None) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of ``model``'s trainable parameters, running the forward through ``call``."""
    model.train()
    model.zero_grad(set_to_none=True)
    loss = (model if call is None else call)(**inputs).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _nonzero_lora_b(model) -> None:
    """LoRA B starts at zero, which would leave A without gradient; a nonzero B tests both."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing(reentrant):
    model = peft_model("llama", LEARNABLE)
    _nonzero_lora_b(model)
    inputs = batch("llama")
    loss, want = _grads(model, inputs)

    # transformers 5.23 renamed gradient_checkpointing_enable; the floor (5.13) has only the old name.
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": reentrant})
    calls = []
    attn = [m for n, m in model.named_modules() if n.endswith("self_attn")]
    hooks = [m.register_forward_hook(lambda *_: calls.append(1)) for m in attn]
    got_loss, got = _grads(model, inputs)
    for hook in hooks:
        hook.remove()
    assert len(calls) == 2 * len(attn), "the layers were not recomputed: checkpointing is off"
    assert got_loss == pytest.approx(loss, abs=1e-6)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)
    assert all(got[n].abs().max() > 0 for n in want)


@pytest.mark.parametrize("options", [LEARNABLE, {"scale": "logn", "train_length": 4, "zero_kv": True}])
def test_bf16_autocast(options):
    model = peft_model("llama", options)
    _nonzero_lora_b(model)
    inputs = batch("llama")
    loss, want = _grads(model, inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_loss, got = _grads(model, inputs)
    assert got_loss == pytest.approx(loss, rel=2e-2)
    for name in want:
        assert got[name].dtype == torch.float32 and torch.isfinite(got[name]).all(), name
        cosine = torch.nn.functional.cosine_similarity(got[name].flatten(), want[name].flatten(), dim=0)
        assert cosine > 0.98, (name, cosine.item())
    losses = train(peft_model("llama", options), inputs, autocast=torch.bfloat16)
    assert losses[-1] < losses[0] - 0.05, losses


def _compiled_matches_eager(backend: str, options: dict) -> float:
    model = peft_model("llama", options)
    _nonzero_lora_b(model)
    inputs = batch("llama")
    loss, want = _grads(model, inputs)
    torch._dynamo.reset()
    start = time.perf_counter()
    compiled = torch.compile(model, backend=backend, fullgraph=True)  # fullgraph: no silent graph breaks
    got_loss, got = _grads(model, inputs, call=compiled)
    seconds = time.perf_counter() - start
    assert got_loss == pytest.approx(loss, abs=1e-5)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)
    return seconds


@pytest.mark.parametrize("options", [LEARNABLE, {"scale": "logn", "train_length": 4, "zero_kv": True}])
def test_torch_compile_traces_whole_graph(options):
    """Dynamo + AOTAutograd (the front half of torch.compile) capture the model in one graph, exactly."""
    _compiled_matches_eager("aot_eager", options)


@pytest.mark.slow
def test_torch_compile_inductor():
    """Full torch.compile with the default inductor backend (C++ codegen; about a minute on 2 CPU cores)."""
    _compiled_matches_eager("inductor", LEARNABLE)


# --- the example ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_example_runs(tmp_path):
    """examples/peft_finetune.py end to end on the shipped model, shortened: table, sinks, save and reload."""
    script = Path(__file__).resolve().parents[2] / "examples" / "peft_finetune.py"
    args = [
        "--steps",
        "2",
        "--batch-size",
        "1",
        "--eval-docs",
        "1",
        "--threads",
        "1",
        "--save",
        str(tmp_path),
    ]
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout
    for row in ("shipped (unpatched)", "patched, before fine-tuning", "patched + LoRA at 256"):
        line = next(line for line in out.splitlines() if line.startswith(row))
        ppl = [float(x) for x in line[len(row) :].split()]
        assert len(ppl) == 4 and all(1 < p < 4096 for p in ppl), line  # 1x..8x, below the vocabulary size
    assert "learned sink logits (layer x head)" in out
    assert "max |logit difference| 0.0e+00" in out
    assert hfa.adapter_patch_config(tmp_path) == hfa.AttnScaleConfig(
        scale="logn", train_length=128, sink_logit="learnable"
    )


@pytest.mark.parametrize("method", ["dense", "stream"])
def test_perplexity_through_a_peft_wrapper_passes_the_cache_as_the_model_names_it(method):
    """PeftModelForCausalLM's forward names no cache argument: the chunked read passes the cache under the
    name the wrapped model's forward takes (``cache`` from transformers 5.24 on, where ``past_key_values``
    raises a FutureWarning), and scores as the unwrapped model does (LoRA starts as the identity)."""
    model = hfa.patch(sharp_model("llama"), scale="logn", train_length=8, zero_kv=True)
    wrapped = get_peft_model(copy.deepcopy(model), hfa.lora_config(model, r=4))
    assert cache_argument(wrapped) == cache_argument(model)
    ids = torch.randint(3, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))

    def ppl(m):
        cache = hfa.SinkCache(2, 12) if method == "stream" else None
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            return hfa.perplexity(m, ids, cache, method=method, chunk_size=8, progress=False).nll

    torch.testing.assert_close(ppl(wrapped), ppl(model), rtol=0, atol=1e-6)


@pytest.mark.parametrize("tied", [False, True])
def test_long_context_trains_embeddings_and_norms_beside_lora_and_reloads(tied, tmp_path):
    """LongLoRA's LoRA+: the input embeddings and every norm train with LoRA and come back with the adapter;
    tied output embeddings stay tied."""
    model = sharp_model(tie_word_embeddings=tied)
    hfa.patch(model, scale="logn", train_length=16)
    peft_model = get_peft_model(model, hfa.lora_config(model, r=4, long_context=True))
    trained = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    kinds = {
        ("lora" if "lora_" in n else n.split(".modules_to_save.")[0].rpartition(".")[2]) for n in trained
    }
    assert kinds == {"lora", "embed_tokens", "input_layernorm", "post_attention_layernorm", "norm"}
    ids = torch.randint(0, SHARP_VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=0.05)
    for _ in range(2):
        peft_model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    base = peft_model.base_model.model
    embedding = base.get_input_embeddings()
    assert not torch.equal(embedding.weight, embedding.original_module.weight)  # the copy trained
    if tied:
        assert base.get_output_embeddings().weight is embedding.weight
    peft_model.eval()
    expected = peft_model(ids).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    reloaded = hfa.load_adapter(sharp_model(tie_word_embeddings=tied), tmp_path / "adapter")
    torch.testing.assert_close(reloaded(ids).logits, expected, rtol=0, atol=1e-5)
