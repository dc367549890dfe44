"""A patched model through transformers' own paths: attention weights, rebuilding from its config, switching
backends, inner models and wrappers, and save / load with learned values (in this process)."""

from __future__ import annotations

import copy
import logging
import threading

import pytest
import torch
from conftest import VOCAB, tiny_model
from reference import make_reference

import hf_attnscale as hfa
from hf_attnscale.core.install.families import attention_modules

LEARNABLE = {"scale": "ssmax", "train_length": 4, "sink_logit": "learnable"}


def _train_a_little(model) -> None:
    """Give the learnable patch values no fresh patch would have."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".hfa." in name:
                p.copy_(torch.randn_like(p) + (1.0 if name.endswith("ssmax") else 0.0))


@pytest.mark.parametrize("how", ["config", "argument"])
def test_patched_eager_model_returns_its_attention_weights(how):
    model = tiny_model("llama", "eager")
    hfa.patch(model, scale="logn", train_length=2, zero_kv=True)
    reference = copy.deepcopy(model)
    hfa.unpatch(reference)
    make_reference(
        reference,
        {type(m).__name__ for m in attention_modules(reference)},
        scale="logn",
        train_length=2,
        zero_kv=True,
    )
    ids = torch.randint(3, VOCAB, (2, 9))
    if how == "config":
        model.config.output_attentions = True  # raised "not supported ... hfa_eager" before
        out = model(ids)
    else:
        out = model(ids, output_attentions=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (2, 4, 9, 9)
    # The weights of the patched attention (scaled, the exit column dropped: rows sum to less than 1) ...
    assert float(out.attentions[0].detach().sum(-1).max()) < 1 - 1e-3
    # ... exactly those of the plain reference implementation.
    with torch.no_grad():
        want = reference(ids, output_attentions=True).attentions
    for got, expected in zip(out.attentions, want, strict=True):
        torch.testing.assert_close(got.detach(), expected, atol=1e-6, rtol=1e-5)


def test_a_model_rebuilt_from_a_patched_config_is_not_patched_until_patched():
    a = hfa.patch(tiny_model("llama"), scale="logn", train_length=2, zero_kv=True)
    b = type(a)(a.config)
    b.load_state_dict(a.state_dict())
    b.eval()
    ids = torch.randint(3, VOCAB, (2, 9))
    assert hfa.get_config(b) is None  # it records a patch, but none is in force
    hfa.patch(b)  # installs the recorded patch (it returned early before)
    assert hfa.get_config(b) == hfa.get_config(a)
    with torch.no_grad():
        torch.testing.assert_close(b(ids).logits, a(ids).logits, atol=0, rtol=0)


def test_a_rebuilt_model_without_the_learned_values_refuses_to_invent_them():
    a = hfa.patch(tiny_model("llama"), **LEARNABLE)
    b = type(a)(a.config)
    with pytest.raises(ValueError, match=r"learned parameters .* cannot be loaded.*hfa\.from_pretrained"):
        hfa.patch(b)
    assert hfa.get_config(b) is None
    hfa.patch(b, **LEARNABLE)  # asked for explicitly: a fresh patch
    assert hfa.get_config(b) == hfa.get_config(a)


def test_switching_backend_keeps_the_patch():
    model = hfa.patch(tiny_model("llama", "sdpa"), scale="logn", train_length=2, zero_kv=True)
    ids = torch.randint(3, VOCAB, (2, 9))
    with torch.no_grad():
        before = model(ids).logits
        model.set_attn_implementation("eager")
        assert model.config._attn_implementation == "eager" and hfa.get_config(model).zero_kv
        after = model(ids).logits
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    baseline = tiny_model("llama", "eager")
    with torch.no_grad():
        assert (baseline(ids).logits - after).abs().max() > 1e-3  # the patch still acts
    model.set_attn_implementation("flex_attention")
    with pytest.raises(ValueError, match="under flex_attention need a GPU"):
        model(ids)


@pytest.mark.parametrize("wrap", ["inner", "data_parallel"])
def test_one_answer_whichever_object_is_passed(wrap, tmp_path):
    model = tiny_model("llama")
    target = model.model if wrap == "inner" else torch.nn.DataParallel(model)
    hfa.patch(target, scale="logn", train_length=2, zero_kv=True)
    for view in (model, model.model, torch.nn.DataParallel(model)):
        assert hfa.get_config(view).zero_kv
    model.save_pretrained(tmp_path)
    loaded = hfa.from_pretrained(type(model), tmp_path)
    assert hfa.get_config(loaded) == hfa.get_config(model)
    hfa.unpatch(target)
    assert hfa.get_config(model) is None and not hasattr(model.config, "hf_attnscale")


def test_round_trip_keeps_learned_values_and_loads_quietly(tmp_path, caplog):
    model = hfa.patch(tiny_model("llama"), **LEARNABLE)
    _train_a_little(model)
    ids = torch.randint(3, VOCAB, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING):
        loaded = hfa.from_pretrained(type(model), tmp_path)
    assert "UNEXPECTED" not in caplog.text and "LOAD REPORT" not in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, atol=1e-6, rtol=1e-6)
    # Plain from_pretrained, then the same options given explicitly: the learned values come back too.
    plain = type(model).from_pretrained(tmp_path).eval()
    hfa.patch(plain, **LEARNABLE)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, want, atol=1e-6, rtol=1e-6)


def test_loading_in_one_thread_hides_no_other_threads_load_report(tmp_path, caplog, monkeypatch):
    """The patch's quiet load holds back its own thread's report only: a report another thread logs meanwhile
    (its own load, with keys that matter) reaches the logs."""
    model = hfa.patch(tiny_model("llama"), **LEARNABLE)
    model.save_pretrained(tmp_path)
    other = "LOAD REPORT from another thread: MISSING keys that matter"
    load = type(model).from_pretrained.__func__

    def load_while_another_thread_logs(cls, *args, **kwargs):
        thread = threading.Thread(
            target=logging.getLogger("transformers.modeling_utils").warning, args=(other,)
        )
        thread.start()
        thread.join()
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(type(model), "from_pretrained", classmethod(load_while_another_thread_logs))
    with caplog.at_level(logging.WARNING):
        hfa.from_pretrained(type(model), tmp_path)
    assert other in caplog.text
    assert "UNEXPECTED" not in caplog.text  # this thread's own report (patch keys only) is still held back


def test_moved_checkpoint_is_an_error_not_silent_initial_values(tmp_path):
    model = hfa.patch(tiny_model("llama"), **LEARNABLE)
    _train_a_little(model)
    first, moved = tmp_path / "first", tmp_path / "moved"
    model.save_pretrained(first)
    loaded = type(model).from_pretrained(first).eval()
    first.rename(moved)
    with pytest.raises(ValueError, match=r"cannot be loaded: the directory .*first.* does not exist"):
        hfa.patch(loaded)
    assert hfa.get_config(loaded) is None
    reloaded = hfa.from_pretrained(type(model), moved)  # where it is now
    ids = torch.randint(3, VOCAB, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=1e-6, rtol=1e-6)


def test_a_checkpoint_saved_without_the_learned_values_is_refused(tmp_path):
    model = hfa.patch(tiny_model("llama"), **LEARNABLE)
    state = {k: v for k, v in model.state_dict().items() if ".hfa." not in k}
    model.save_pretrained(tmp_path, state_dict=state)
    with pytest.raises(ValueError, match=r"checkpoint lacks 4 of them"):
        hfa.from_pretrained(type(model), tmp_path)


def test_an_attention_call_registers_nothing(monkeypatch):
    """The wrappers are registered when the model is patched; calls (and switching backends) only read them."""
    from transformers.modeling_utils import AttentionInterface

    fresh = {k: v for k, v in AttentionInterface._global_mapping.items() if not k.startswith("hfa_")}
    monkeypatch.setattr(AttentionInterface, "_global_mapping", fresh)  # as in a new process
    model = hfa.patch(tiny_model("llama"), scale="logn", train_length=2, zero_kv=True)

    def refuse(*args, **kwargs):
        raise AssertionError("an attention call changed the global attention registry")

    monkeypatch.setattr(AttentionInterface, "register", refuse)
    ids = torch.randint(3, VOCAB, (1, 6))
    for backend in ("sdpa", "eager"):
        model.set_attn_implementation(backend)
        with torch.no_grad():
            model(ids)
