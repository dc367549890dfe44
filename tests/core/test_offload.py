"""The patch on models dispatched by accelerate: loaded with a ``device_map`` that offloads layers to disk, or
offloaded to CPU (`accelerate.cpu_offload`), against the same checkpoint loaded whole.

Every option gives the whole model's logits, streaming perplexity and generated tokens; the learnable ones
(exit logits, SSMax slopes) train with PEFT with the whole model's gradients, and save and reload; unpatching
gives back the model and its accelerate hooks exactly. A model built under ``init_empty_weights`` is patched
with the options that have no parameters and loaded afterwards; the others are refused until it is loaded.
"""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import cpu_offload, dispatch_model, init_empty_weights, load_checkpoint_and_dispatch
from accelerate.hooks import AlignDevicesHook, add_hook_to_module
from conftest import sharp_model, stream_logits
from transformers import AutoConfig, AutoModelForCausalLM

import hf_attnscale as hfa
from hf_attnscale.core.install.families import attention_modules
from hf_attnscale.diagnostics import activation_outliers, attention_statistics
from hf_attnscale.diagnostics.quantization import fake_quantized

peft = pytest.importorskip("peft")

LAYERS = 4
DEVICE_MAP = {
    "model.embed_tokens": "cpu",
    "model.rotary_emb": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.layers.2": "cpu",
    "model.layers.3": "disk",
    "model.norm": "cpu",
    "lm_head": "cpu",
}
"""Layers 1 and 3 offloaded to disk (their weights are ``meta`` between calls), the rest on the CPU."""
RESIDENT_LAYERS = [0, 2]
OPTIONS = {
    "logn": {"scale": "logn", "train_length": 8},
    "sink_fixed": {"sink_logit": 2.0},
    "zero_kv": {"zero_kv": True},
    "sink_learnable": {"sink_logit": "learnable"},
    "ssmax": {"scale": "ssmax", "train_length": 8},
    "ssmax+sink_learnable": {"scale": "ssmax", "train_length": 8, "sink_logit": "learnable"},
}
LEARNABLE = {"scale": "ssmax", "train_length": 8, "sink_logit": "learnable"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    sharp_model("llama", num_hidden_layers=LAYERS).save_pretrained(path)
    return str(path)


def load_whole(checkpoint: str):
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval()


def load_dispatched(checkpoint: str, layout: str, tmp_path):
    """The checkpoint with layers offloaded: to disk by ``from_pretrained``'s device_map, or all to CPU memory."""
    if layout == "disk":
        return AutoModelForCausalLM.from_pretrained(
            checkpoint, device_map=DEVICE_MAP, offload_folder=str(tmp_path / "offload")
        ).eval()
    return cpu_offload(load_whole(checkpoint), execution_device=torch.device("cpu")).eval()


def perturb_like(models) -> None:
    """Give the learnable parameters of ``models`` the same random values (the init would hide a wrong one)."""
    generator = torch.Generator().manual_seed(3)
    states = [[m.hfa for m in attention_modules(model)] for model in models]
    for group in zip(*states, strict=True):
        for name, param in group[0].named_parameters():
            value = param.detach().cpu() + 0.5 * torch.randn(param.shape, generator=generator)
            for state in group:
                with torch.no_grad():
                    getattr(state, name).copy_(value)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def hooks_and_forwards(model) -> list:
    """What accelerate and the patch put on each attention module: its hook, forward and wrapped forward."""
    return [
        (
            m.__dict__.get("_hf_hook"),
            m.__dict__.get("forward"),
            m.__dict__.get("_old_forward"),
            set(m._modules),
        )
        for m in attention_modules(model)
    ]


IDS = torch.randint(2, 97, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("layout", ["disk", "cpu_offload"])
def test_every_option_gives_the_whole_models_logits_and_unpatches_exactly(checkpoint, layout, tmp_path):
    whole, dispatched = load_whole(checkpoint), load_dispatched(checkpoint, layout, tmp_path)
    assert any(p.is_meta for p in dispatched.parameters())  # really offloaded
    plain, before = logits(whole, IDS), hooks_and_forwards(dispatched)
    assert torch.equal(logits(dispatched, IDS), plain)
    for name, options in OPTIONS.items():
        hfa.patch(whole, **options)
        hfa.patch(dispatched, **options)
        perturb_like([whole, dispatched])
        expected = logits(whole, IDS)
        assert (expected - plain).abs().max() > 0.1, name  # the patch shows
        torch.testing.assert_close(logits(dispatched, IDS), expected, atol=1e-5, rtol=0, msg=name)
        hfa.unpatch(whole)
        hfa.unpatch(dispatched)
        assert hooks_and_forwards(dispatched) == before, name
        assert torch.equal(logits(dispatched, IDS), plain), name
    with hfa.patched(dispatched, hfa.AttnScaleConfig(**LEARNABLE)):
        assert not torch.equal(logits(dispatched, IDS), plain)
    assert hooks_and_forwards(dispatched) == before
    assert torch.equal(logits(dispatched, IDS), plain)


def test_patched_attention_runs_under_its_accelerate_hook(checkpoint, tmp_path):
    model = load_dispatched(checkpoint, "disk", tmp_path)
    hfa.patch(model, **LEARNABLE)
    module = attention_modules(model)[1]
    calls = []
    hook = module._hf_hook
    original = hook.pre_forward
    hook.pre_forward = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    logits(model, IDS)
    assert calls == [1]
    assert module.hfa.sink.device == torch.device(hook.execution_device)


def test_each_modules_parameters_go_to_its_own_execution_device(checkpoint):
    # One CPU cannot hold layers on two devices: a hook naming another device (meta, which runs nothing) shows
    # that each attention module's parameters follow its own hook, not the model's first weight.
    model = load_whole(checkpoint)
    add_hook_to_module(attention_modules(model)[2], AlignDevicesHook(execution_device=torch.device("meta")))
    hfa.patch(model, **LEARNABLE)
    devices = [m.hfa.sink.device.type for m in attention_modules(model)]
    assert devices == ["cpu", "cpu", "meta", "cpu"]
    assert {m.hfa.ssmax.device.type for m in attention_modules(model)} == {"cpu", "meta"}


STREAM = torch.randint(2, 97, (1, 40), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("layout", ["disk", "cpu_offload"])
def test_streaming_and_generate_match_the_whole_model(checkpoint, layout, tmp_path):
    whole, dispatched = load_whole(checkpoint), load_dispatched(checkpoint, layout, tmp_path)
    for options in (OPTIONS["logn"], LEARNABLE):
        for model in (whole, dispatched):
            hfa.patch(model, **options)
        perturb_like([whole, dispatched])
        with torch.no_grad():
            streamed = [stream_logits(m, STREAM, hfa.SinkCache(2, 8), [5, 1, 3]) for m in (whole, dispatched)]
        torch.testing.assert_close(streamed[1], streamed[0], atol=1e-5, rtol=0)
        for cache in (hfa.SinkCache, None):
            tokens = [
                m.generate(
                    STREAM[:, :6], max_new_tokens=12, do_sample=False, past_key_values=cache and cache(2, 8)
                )
                for m in (whole, dispatched)
            ]
            assert torch.equal(tokens[1], tokens[0])
        if layout == "disk":
            ppl = [
                hfa.perplexity(m, STREAM, cache=hfa.SinkCache(2, 8), chunk_size=5, progress=False)
                for m in (whole, dispatched)
            ]
            torch.testing.assert_close(ppl[1].nll, ppl[0].nll, atol=1e-5, rtol=0)


def test_evaluation_and_diagnostics_of_a_model_whose_first_weight_is_offloaded(checkpoint, tmp_path):
    # cpu_offload leaves every weight on meta: the inputs must go to accelerate's execution device.
    whole = hfa.patch(load_whole(checkpoint))
    dispatched = hfa.patch(load_dispatched(checkpoint, "cpu_offload", tmp_path))
    assert next(dispatched.parameters()).device.type == "meta"
    ppl = [
        hfa.perplexity(m, STREAM, cache=hfa.SinkCache(2, 8), chunk_size=5, progress=False).nll
        for m in (whole, dispatched)
    ]
    torch.testing.assert_close(ppl[1], ppl[0], atol=1e-5, rtol=0)
    dense = [hfa.perplexity(m, STREAM, chunk_size=7, progress=False).nll for m in (whole, dispatched)]
    torch.testing.assert_close(dense[1], dense[0], atol=1e-5, rtol=0)
    stats = [attention_statistics(m, STREAM).sink_mass for m in (whole, dispatched)]
    torch.testing.assert_close(stats[1], stats[0], atol=1e-5, rtol=0)
    outliers = [activation_outliers(m, STREAM).hidden_max_abs for m in (whole, dispatched)]
    torch.testing.assert_close(outliers[1], outliers[0], atol=1e-5, rtol=1e-6)


def test_learnable_parameters_train_with_peft_as_on_the_whole_model(checkpoint, tmp_path):
    whole, dispatched = load_whole(checkpoint), load_dispatched(checkpoint, "disk", tmp_path)
    peft_models = []
    for model in (whole, dispatched):
        hfa.patch(model, **LEARNABLE)
    perturb_like([whole, dispatched])
    with pytest.raises(ValueError, match=r"offloads 2 attention layers.*layers_to_transform"):
        hfa.lora_config(dispatched, r=4)  # PEFT would put their LoRA weights on meta, where they cannot train
    for model in (whole, dispatched):
        # LoRA on the layers kept on a device; the patch's parameters train on every layer.
        config = hfa.lora_config(model, r=4, layers_to_transform=RESIDENT_LAYERS)
        torch.manual_seed(5)
        peft_models.append(peft.get_peft_model(model, config))
    grads = []
    for peft_model in peft_models:
        with torch.no_grad():  # LoRA's B starts at zero; give it values so that A gets gradients too
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.copy_(0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(6)))
        peft_model.train()
        peft_model(input_ids=IDS, labels=IDS).loss.backward()
        grads.append({n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad})
    patch_names = [n for n in grads[0] if ".hfa." in n]
    assert len(patch_names) == 2 * LAYERS and grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        assert grad is not None and grad.norm() > 0, name
        assert (grads[1][name] - grad).norm() <= 1e-5 * grad.norm(), name
    for peft_model in peft_models:
        torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=0.5).step()
        peft_model.eval()
    torch.testing.assert_close(logits(peft_models[1], IDS), logits(peft_models[0], IDS), atol=1e-5, rtol=0)


def test_learned_values_save_and_reload_offloaded(checkpoint, tmp_path):
    whole, dispatched = load_whole(checkpoint), load_dispatched(checkpoint, "disk", tmp_path)
    for model in (whole, dispatched):
        hfa.patch(model, **LEARNABLE)
    perturb_like([whole, dispatched])
    expected = logits(whole, IDS)
    dispatched.save_pretrained(tmp_path / "saved")
    offloaded = {"device_map": DEVICE_MAP, "offload_folder": str(tmp_path / "offload2")}
    for options in (offloaded, {}):
        reloaded = hfa.from_pretrained(AutoModelForCausalLM, str(tmp_path / "saved"), **options)
        assert hfa.get_config(reloaded) == hfa.get_config(whole)
        torch.testing.assert_close(logits(reloaded.eval(), IDS), expected, atol=1e-5, rtol=0)


def test_a_model_patched_then_dispatched_takes_its_parameters_back(checkpoint, tmp_path):
    whole = load_whole(checkpoint)
    hfa.patch(whole, **LEARNABLE)
    perturb_like([whole])
    expected = logits(whole, IDS)
    model = dispatch_model(copy.deepcopy(whole), DEVICE_MAP, offload_dir=str(tmp_path / "offload"))
    assert attention_modules(model)[1].hfa.sink.is_meta  # accelerate offloaded them with the weights
    torch.testing.assert_close(logits(model, IDS), expected, atol=1e-5, rtol=0)
    sinks = [m.hfa.sink for m in attention_modules(model)]
    assert all(s.device.type == "cpu" and s.requires_grad for s in sinks)
    assert not any(
        getattr(m.hfa.__dict__.get("_hf_hook"), "offload", False) for m in attention_modules(model)
    )
    for m in (model, whole):
        hfa.unpatch(m)
    assert torch.equal(logits(model, IDS), logits(whole, IDS))
    for m in attention_modules(model):  # unpatched; accelerate's hook still wraps the class's forward
        assert "hfa" not in m._modules and m._old_forward.__func__ is type(m).forward


def test_empty_weights_patch_before_loading_or_refuse_clearly(checkpoint, tmp_path):
    config = AutoConfig.from_pretrained(checkpoint)
    whole = load_whole(checkpoint)
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"init_empty_weights.*Load the weights first"):
        hfa.patch(empty, sink_logit="learnable")
    assert hfa.get_config(empty) is None  # refused: untouched
    hfa.patch(empty, **OPTIONS["logn"])  # no parameters: patched before loading
    model = load_checkpoint_and_dispatch(
        empty, checkpoint, device_map=DEVICE_MAP, offload_folder=str(tmp_path / "offload")
    ).eval()
    hfa.patch(whole, **OPTIONS["logn"])
    torch.testing.assert_close(logits(model, IDS), logits(whole, IDS), atol=1e-5, rtol=0)
    for m in (model, whole):  # loaded: the learnable options patch as on any dispatched model
        hfa.patch(m, **LEARNABLE)
    perturb_like([whole, model])
    torch.testing.assert_close(logits(model, IDS), logits(whole, IDS), atol=1e-5, rtol=0)
    for m in (model, whole):
        hfa.unpatch(m)
    assert torch.equal(logits(model, IDS), logits(whole, IDS))


@pytest.mark.filterwarnings("ignore:for base_model.*copying from a non-meta parameter")  # PEFT's, on offload
def test_an_adapter_loads_onto_an_offloaded_model_or_is_refused_clearly(checkpoint, tmp_path, monkeypatch):
    # PEFT rewrites the offloaded weights under a path it builds from the absolute one without its leading "/"
    # (peft_model.py, os.path.join(*fname.split(os.sep))), so relative to the working directory: run it here.
    monkeypatch.chdir(tmp_path)
    # PEFT dispatches an offloaded model again when it loads an adapter (given the device map: its default,
    # "auto", cannot place meta weights on a machine with only a CPU). It keeps LoRA's weights, but drops the
    # patch's: a learnable patch is then refused with what to do, not run on meta tensors.
    device_map = {f"base_model.model.{name}": device for name, device in DEVICE_MAP.items()}
    for options, works in ((OPTIONS["logn"] | {"zero_kv": True}, True), (OPTIONS["sink_learnable"], False)):
        whole = hfa.patch(load_whole(checkpoint), **options)
        perturb_like([whole])
        trained = peft.get_peft_model(whole, hfa.lora_config(whole, r=4))
        with torch.no_grad():
            for name, param in trained.named_parameters():
                if "lora_B" in name:
                    param.copy_(0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(6)))
        trained.save_pretrained(tmp_path / "adapter")
        dispatched = load_dispatched(checkpoint, "disk", tmp_path)
        loaded = hfa.load_adapter(
            dispatched, tmp_path / "adapter", device_map=device_map, offload_dir=str(tmp_path / "again")
        )
        if works:
            torch.testing.assert_close(logits(loaded, IDS), logits(trained, IDS), atol=1e-5, rtol=0)
        else:
            with pytest.raises(ValueError, match=r"without their values.*merge_and_unload"):
                logits(loaded, IDS)


def test_fake_quantisation_of_an_offloaded_model_equals_the_whole_models(checkpoint, tmp_path):
    """W8A8 runs each linear layer under its accelerate hook (so an offloaded weight is quantised as loaded, not
    as ``meta``), and gives the model back exactly: hooks, forwards and logits as before."""
    whole, offloaded = load_whole(checkpoint), load_dispatched(checkpoint, "disk", tmp_path)
    before = [(m.__dict__.get("forward"), m.__dict__.get("_old_forward")) for m in offloaded.modules()]
    exact = logits(offloaded, IDS)
    with fake_quantized(whole):
        want = logits(whole, IDS)
    with fake_quantized(offloaded):
        got = logits(offloaded, IDS)
    assert (want - exact).abs().max() > 1e-3  # the quantisation shows
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits(offloaded, IDS), exact, atol=0, rtol=0)
    assert [
        (m.__dict__.get("forward"), m.__dict__.get("_old_forward")) for m in offloaded.modules()
    ] == before
