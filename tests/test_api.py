"""Public API contract: validation, errors, atomic patching, visible-key counting, fast-path preservation."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch
from conftest import VOCAB, tiny_model
from transformers import BloomConfig, BloomForCausalLM
from transformers.modeling_utils import AttentionInterface

import hf_attnscale as hfa
from hf_attnscale.core.call.masks import visible_key_counts
from hf_attnscale.core.install import patching


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"scale": "cube"}, "valid scales are 'none', 'logn', 'ssmax', 'gradmax'"),
        ({"scale": "logn"}, "needs train_length"),
        ({"scale": "logn", "train_length": 1}, "train_length must be an int >= 2"),
        ({"clamp": True}, "clamp only applies with a scale"),
        ({"train_length": 512}, "train_length only applies with a scale"),
        ({"sink_logit": float("inf")}, "sink_logit must be a finite float"),
        ({"sink_logit": float("nan")}, "sink_logit must be a finite float"),
        ({"sink_logit": "big"}, "sink_logit must be a finite float, 'learnable' or None"),
        (
            {"zero_kv": True, "sink_logit": "learnable"},
            "zero_kv=True cannot be combined with a learnable sink",
        ),
        ({"zero_kv": True, "sink_logit": 1.0}, "zero_kv=True cannot be combined with a sink logit"),
        ({"zero_kv": 1}, "zero_kv must be True or False"),
    ],
)
def test_bad_options_raise_value_error(options, message):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=re.escape(message)):
        hfa.patch(model, **options)
    assert hfa.get_config(model) is None and model.config._attn_implementation == "sdpa"


def test_unsupported_model_says_why():
    model = BloomForCausalLM(BloomConfig(n_layer=1, hidden_size=16, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match=r"model_type 'bloom'.*calls transformers' AttentionInterface"):
        hfa.patch(model, scale="logn", train_length=8)
    assert hfa.get_config(model) is None
    supported = hfa.supported_model_types()
    assert "bloom" not in supported and {"qwen3", "gpt2", "roformer", "bert"} <= set(supported)


def test_supported_model_types_prints_nothing():
    """Building the list instantiates every default config, some of which warn; the user sees none of it."""
    code = "import hf_attnscale as hfa; print(len(hfa.supported_model_types()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(done.stdout) >= 60 and done.stderr == "", done.stderr


def test_failed_patch_leaves_model_untouched(monkeypatch):
    model = tiny_model("llama")
    hfa.patch(model, scale="logn", train_length=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(3, VOCAB, (1, 9))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    calls = []

    real_routed_config = patching.routed_config

    def explode(config):
        calls.append(config)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real_routed_config(config)

    monkeypatch.setattr(patching, "routed_config", explode)
    with pytest.raises(RuntimeError, match="boom"):
        hfa.patch(model, sink_logit="learnable", scale="ssmax", train_length=4)
    assert hfa.get_config(model) == hfa.AttnScaleConfig(scale="logn", train_length=4)
    assert model.state_dict().keys() == before.keys()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)


def test_config_is_saved_in_model_config():
    model = tiny_model("llama")
    hfa.patch(model, scale="logn", train_length=4096, zero_kv=True)
    saved = model.config.to_dict()["hf_attnscale"]
    assert saved == {
        "scale": "logn",
        "train_length": 4096,
        "clamp": True,
        "zero_kv": True,
        "sink_logit": None,
        "beta": None,
        "clipped_softmax": None,
        "gate": None,
        "shifted_sparse_group": None,
        "rerope_window": None,
        "rerope_leak": None,
        "self_extend_group": None,
        "self_extend_window": None,
        "dual_chunk_size": None,
        "dual_chunk_local": None,
        "string_shift": None,
        "string_local": None,
        "string_factor": None,
        "rope_parameters": None,
        "version": 1,
    }
    assert hfa.AttnScaleConfig.from_dict(saved) == hfa.get_config(model)
    with pytest.raises(ValueError, match="Unknown attn_scale config keys"):
        hfa.AttnScaleConfig.from_dict({**saved, "temperature": 2})


def _brute_force_counts(q_len, k_len, pad, causal, window, bottom_right):
    """Count visible keys by enumerating every (query, key) pair with the backends' conventions."""
    offset = k_len - q_len if (bottom_right or q_len == 1 or pad is not None) and causal else 0
    out = torch.zeros(1 if pad is None else pad.shape[0], 1, q_len)
    for b in range(out.shape[0]):
        for i in range(q_len):
            qi = i + offset
            for j in range(k_len):
                ok = j <= qi if causal else True
                if window:
                    ok = ok and (qi - j < window if causal else abs(qi - j) < window)
                if pad is not None:
                    ok = ok and bool(pad[b, j])
                out[b, 0, i] += ok
    return out


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize(
    ("causal", "shape"), [(True, (7, 7)), (True, (1, 9)), (True, (4, 10)), (False, (7, 7))]
)
@pytest.mark.parametrize("padded", [False, True])
def test_visible_key_counts_match_brute_force(causal, window, shape, padded):
    q_len, k_len = shape  # encoders attend over their own keys: q_len == k_len
    pad = None
    if padded:
        pad = torch.ones(2, k_len, dtype=torch.bool)
        pad[1, :2] = False
    bottom_right = padded or q_len == 1  # 2D masks come from flash, which aligns bottom-right
    got = visible_key_counts(
        q_len, k_len, pad, causal=causal, sliding_window=window, bottom_right=bottom_right
    )
    want = _brute_force_counts(q_len, k_len, pad, causal, window, bottom_right)
    assert torch.equal(got, want)


def test_visible_key_counts_from_4d_masks():
    mask = torch.ones(2, 1, 3, 5, dtype=torch.bool).tril(2)
    mask[1, :, :, 0] = False
    want = torch.tensor([[[3.0, 4, 5]], [[2, 3, 4]]])
    assert torch.equal(visible_key_counts(3, 5, mask, causal=True), want)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    assert torch.equal(visible_key_counts(3, 5, additive, causal=True), want)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_fully_masked_row_with_exit_gives_zeros(attn):
    model = tiny_model("llama", attn, num_hidden_layers=1)
    hfa.patch(model, zero_kv=True)
    module = model.model.layers[0].self_attn
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool).tril()
    mask[:, :, 0] = False  # the first query sees nothing
    if attn == "eager":
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    fn = AttentionInterface._global_mapping[module.config._attn_implementation]
    out, _ = fn(module, q, k, v, mask, scaling=8**-0.5, dropout=0.0)
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))
    assert out[:, 1:].abs().min() > 0


def test_sdpa_keeps_is_causal_fast_path(monkeypatch):
    """No mask is materialised where sdpa ran with is_causal: sdpa sees attn_mask=None, with or without the exit
    (which adds one key and a dummy query row, so the call stays square)."""
    seen = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy_sdpa(q, k, *args, attn_mask=None, is_causal=False, **kwargs):
        seen.append((is_causal, attn_mask, q.shape[2] == k.shape[2]))
        return real_sdpa(q, k, *args, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy_sdpa)
    ids = torch.randint(3, VOCAB, (2, 16))
    for options in (
        {"scale": "logn", "train_length": 4},
        {"scale": "logn", "train_length": 4, "zero_kv": True},
    ):
        model = hfa.patch(tiny_model("llama"), **options)
        seen.clear()
        with torch.no_grad():
            model(input_ids=ids)
        assert len(seen) == 2 and all(c and m is None and square for c, m, square in seen), seen


def test_learnable_parameters_are_per_head_and_initialised():
    model = hfa.patch(tiny_model("llama"), scale="ssmax", train_length=512, sink_logit="learnable")
    names = [n for n, _ in model.named_parameters() if ".hfa." in n]
    assert names == [f"model.layers.{i}.self_attn.hfa.{p}" for i in range(2) for p in ("sink", "ssmax")]
    state = model.model.layers[0].self_attn.hfa
    assert torch.equal(state.sink, torch.zeros(4))
    torch.testing.assert_close(state.ssmax, torch.full((4,), 1 / math.log(512)))


def test_flex_attention_scale_matches_sdpa():
    ids = torch.randint(3, VOCAB, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :3] = 0
    flex = hfa.patch(tiny_model("llama", "flex_attention"), scale="logn", train_length=2)
    sdpa = hfa.patch(tiny_model("llama", "sdpa"), scale="logn", train_length=2)
    with torch.no_grad():  # flex attention has no CPU backward
        got = flex(input_ids=ids, attention_mask=mask).logits
        want = sdpa(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=1e-5)
    hfa.patch(flex, zero_kv=True)  # patched on the CPU, as before a move to a GPU: it may not run here
    with pytest.raises(ValueError, match="under flex_attention need a GPU"), torch.no_grad():
        flex(input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_every_learnable_sink_gets_a_gradient_at_init(attn):
    model = hfa.patch(tiny_model("llama", attn), sink_logit="learnable")
    model(input_ids=torch.randint(3, VOCAB, (2, 8))).logits.square().sum().backward()
    for layer in model.model.layers:
        grad = layer.self_attn.hfa.sink.grad
        assert grad.shape == (4,) and (grad.abs() > 0).all(), grad


def test_patch_without_options_keeps_a_live_patch_and_its_trained_values():
    model = hfa.patch(tiny_model("llama"), sink_logit="learnable")
    sink = model.model.layers[0].self_attn.hfa.sink
    with torch.no_grad():
        sink.fill_(0.7)
    assert hfa.patch(model) is model
    assert model.model.layers[0].self_attn.hfa.sink is sink
    assert torch.equal(sink, torch.full((4,), 0.7))


def test_every_patch_option_reaches_the_api_the_cli_and_lm_eval():
    """One declaration (`AttnScaleConfig`'s fields): each option, given as text, is a flag of the CLI that
    `patch_options` passes on, a model_arg of the lm-eval model type, and a keyword of hfa.patch, all three with
    the same value. A new field must add a row here (its text and value), and then reaches all three."""
    import argparse

    from hf_attnscale.core.options.config import OPTIONS
    from hf_attnscale.core.options.flags import add_patch_arguments, patch_options

    examples = {  # option: (flags, model_arg text, the value every reader must arrive at)
        "scale": (["--scale", "llama4", "--train-length", "8"], "llama4", "llama4"),
        "train_length": (["--scale", "logn", "--train-length", "8"], "8", 8),
        "clamp": (["--scale", "logn", "--train-length", "8", "--no-clamp"], "false", False),
        "zero_kv": (["--zero-kv"], "true", True),
        "sink_logit": (["--sink-logit", "learnable"], "learnable", "learnable"),
        "beta": (["--scale", "llama4", "--train-length", "8", "--beta", "0.2"], "0.2", 0.2),
        "clipped_softmax": (["--clipped-softmax=-0.03,1"], "-0.03;1", (-0.03, 1.0)),
        "gate": (["--gate", "head"], "head", "head"),
        "shifted_sparse_group": (["--shifted-sparse-group", "8"], "8", 8),
        "rerope_window": (["--rerope-window", "8"], "8", 8),
        "rerope_leak": (["--rerope-window", "8", "--rerope-leak", "16"], "16", 16.0),
        "self_extend_group": (["--self-extend-group", "4", "--self-extend-window", "8"], "4", 4),
        "self_extend_window": (["--self-extend-group", "4", "--self-extend-window", "8"], "8", 8),
        "dual_chunk_size": (["--dual-chunk-size", "12", "--dual-chunk-local", "2"], "12", 12),
        "dual_chunk_local": (["--dual-chunk-size", "12", "--dual-chunk-local", "2"], "2", 2),
        "string_shift": (["--string-shift", "300"], "300", 300),
        "string_local": (["--string-shift", "12", "--string-local", "4"], "4", 4),
        "string_factor": (["--string-shift", "300", "--string-factor", "1"], "1.0", 1.0),
        "rope_parameters": (
            ["--rope-parameters", '{"rope_type": "yarn", "factor": 4}'],
            "rope_type=yarn;factor=4",
            {"rope_type": "yarn", "factor": 4},
        ),
    }
    assert set(examples) == set(OPTIONS), "a new patch option needs its row here"
    parser = argparse.ArgumentParser()
    add_patch_arguments(parser, "patch")
    lm_eval = pytest.importorskip("hf_attnscale.integrations.lm_eval_model")
    for name, (flags, text, value) in examples.items():
        from_flags = patch_options(parser.parse_args(flags))
        assert from_flags[name] == value, name
        context = {k: v for k, v in from_flags.items() if k != name}
        config = hfa.AttnScaleConfig.from_text(**context, **{name: text})
        assert getattr(config, name) == value, name
        model = hfa.patch(tiny_model("llama"), **from_flags)
        assert getattr(hfa.get_config(model), name) == value, name
        bad = {"clipped_softmax": "big", "train_length": 1, "scale": "cube"}.get(name, "not-an-option")
        with pytest.raises(ValueError, match=name if name != "train_length" else "scale"):
            lm_eval.HFAttnScaleLM(pretrained="no-such-model", **{name: bad})
    with pytest.raises(ValueError, match=r"Unknown patch option.*scale, train_length"):
        hfa.patch(tiny_model("llama"), scael="logn")


def test_the_public_api_is_declared_once_in_the_stub():
    """``__init__.pyi`` is the one list: every name it imports resolves to that object, ``__all__`` is its names
    (less HFAttnScaleLM, which needs lm-eval); in a fresh process the import pays for no torch until a name is
    used, and a star import works without lm-eval's model type."""
    import ast
    import subprocess
    import sys
    from importlib import import_module
    from importlib.util import find_spec
    from pathlib import Path

    stub = ast.parse((Path(hfa.__file__).parent / "__init__.pyi").read_text())
    declared = {}
    for node in stub.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                declared[alias.name] = f"hf_attnscale.{node.module}" if node.module else None
    assert {"patch", "SinkCache", "fetch", "HFAttnScaleLM", "diagnostics"} <= set(declared)
    if find_spec("lm_eval") is None:  # without the [eval] extra (CI's lower bounds) it cannot be imported
        del declared["HFAttnScaleLM"]
    for name, module in declared.items():
        expected = (
            import_module(f"hf_attnscale.{name}") if module is None else getattr(import_module(module), name)
        )
        assert getattr(hfa, name) is expected, name
    assert sorted(hfa.__all__) == sorted(set(declared) - {"HFAttnScaleLM"})
    code = "import sys, hf_attnscale\nprint('torch' in sys.modules)\nfrom hf_attnscale import *\nprint(callable(patch))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]
