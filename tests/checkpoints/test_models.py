"""`checkpoints.models`: the one rule for the head a model class says it has."""

from __future__ import annotations

import pytest

from hf_attnscale.checkpoints.models import head_kind


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("LlamaForCausalLM", "causal"),
        ("GPT2LMHeadModel", "causal"),  # ends in "Model" too: the head wins
        ("BertForMaskedLM", "masked"),
        ("BertModel", "base"),
        ("BertForPreTraining", "pretraining"),
        ("Gemma3ForConditionalGeneration", "conditional-generation"),
        ("LlamaForSequenceClassification", "sequence-classification"),
        ("BertForTokenClassification", "token-classification"),
        ("BertForQuestionAnswering", "question-answering"),
        ("PeftModelForCausalLM", "causal"),
        ("LlamaDecoderLayer", None),
    ],
)
def test_head_kind_reads_the_end_of_the_class_name(name, kind):
    assert head_kind(name) == kind
