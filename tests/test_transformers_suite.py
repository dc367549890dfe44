"""The plugin that patches every model transformers' own tests build (`tests/transformers_suite`)."""

from __future__ import annotations

from conftest import VOCAB, tiny_config
from transformers import AutoModel, AutoModelForCausalLM, LlamaForCausalLM
from transformers_suite.plugin import counts, patched_on_construction
from transformers_suite.run import reason_for

import hf_attnscale as hfa


def test_each_outermost_model_is_patched_once_while_the_plugin_is_open():
    before = dict(counts)
    with patched_on_construction({"scale": "logn", "train_length": 10**6}):
        decoder = AutoModelForCausalLM.from_config(tiny_config("llama"))  # holds a LlamaModel inside
        encoder = AutoModel.from_config(tiny_config("bert"))
    assert hfa.get_config(decoder).scale == "logn" and hfa.get_config(encoder).train_length == 10**6
    assert counts["patched"] - before["patched"] == 2
    assert (
        hfa.get_config(LlamaForCausalLM(tiny_config("llama", vocab_size=VOCAB))) is None
    )  # closed: as it was


def test_reasons_match_by_pattern(monkeypatch):
    from transformers_suite import run

    monkeypatch.setattr(run, "REASONS", {r"::test_attn_implementation_name$": "checks a name"})
    assert reason_for("LlamaModelTest::test_attn_implementation_name") == "checks a name"
    assert reason_for("LlamaModelTest::test_generate") is None
