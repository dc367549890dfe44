"""Every text model type of the installed transformers that routes attention through the AttentionInterface:
a tiny model of each (tests/model_zoo.py), patched with logn, with the exit and with both, against the plain
eager reference of tests/reference.py, on eager and on sdpa.

The rule for which types are here: `hfa.supported_model_types()` (text decoders and encoders with a causal- or
masked-LM head, not encoder-decoders nor multimodal wrappers, whose attention calls the interface), minus
`model_zoo.SKIPPED` (each with its reason). `scripts/support_matrix.py` turns these results into docs/SUPPORT.md's
support matrix.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from conftest import perturb_gate
from model_zoo import EAGER_ONLY, LOGIT_TOLERANCE, family_types, head_of, reference_of, zoo_model
from reference import set_gate

import hf_attnscale as hfa
from hf_attnscale.core.call.state import AttnScaleState
from hf_attnscale.core.install.families import rule_for

TYPES = family_types()
FEATURES = {
    "logn": {"scale": "logn", "train_length": 2},
    "exit": {"sink_logit": 1.5},
    "logn+exit": {"scale": "logn", "train_length": 2, "zero_kv": True},
    "clipped": {"clipped_softmax": (-0.03, 1.02)},
    "gate": {"gate": "element"},
}
BACKEND_FREE = ("clipped", "gate")
"""Features that run the same code whatever the backend (the clipped softmax's eager formula, the gate after the
backend): every family on eager, and on sdpa a few families whose masks differ (sliding windows, encoders)."""
SDPA_SAMPLE = ("llama", "mistral", "gemma2", "bert", "modernbert")
CASES = [
    (model_type, attn, feature)
    for model_type in TYPES
    for attn in (("eager",) if model_type in EAGER_ONLY else ("eager", "sdpa"))
    for feature in FEATURES
    if attn == "eager" or feature not in BACKEND_FREE or model_type in SDPA_SAMPLE
]


def inputs_for(model_type: str) -> dict:
    """A batch of two rows, the second padded (left for decoders, right for encoders)."""
    ids = torch.randint(3, 120, (2, 12), generator=torch.Generator().manual_seed(11))
    mask = torch.ones(2, 12, dtype=torch.long)
    if head_of(model_type) == "causal":
        mask[1, :2] = 0
    else:
        mask[1, 10:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@functools.cache
def _built(model_type: str, attn: str):
    model = zoo_model(model_type, attn)
    with torch.no_grad():
        return model, model(**inputs_for(model_type)).logits


def test_at_least_sixty_text_model_types_are_supported_and_tested():
    assert len(TYPES) >= 60, f"only {len(TYPES)} types are exercised"


def test_finding_the_families_leaves_logging_alone(monkeypatch):
    """Discovery reads the config classes without building them, so it never silences transformers' logging
    (a global another thread's code would lose warnings to), and finds what it found before."""
    from transformers.utils import logging as hf_logging

    from hf_attnscale.core.install import families

    def refuse(*args, **kwargs):
        raise AssertionError("discovery changed transformers' logging")

    monkeypatch.setattr(hf_logging, "set_verbosity", refuse)
    monkeypatch.setattr(hf_logging, "set_verbosity_error", refuse)
    assert families.supported_model_types.__wrapped__() == hfa.supported_model_types()


@pytest.mark.parametrize(("model_type", "attn", "feature"), CASES)
def test_family_matches_the_reference(model_type, attn, feature):
    plain, baseline = _built(model_type, attn)
    options = FEATURES[feature]
    if "exit" in feature and rule_for(plain).no_exit:
        with pytest.raises(ValueError, match="zero_kv / sink_logit"):
            hfa.patch(copy.deepcopy(plain), **options)
        pytest.skip(f"exit refused: {rule_for(plain).no_exit}")
    patched = hfa.patch(copy.deepcopy(plain), **options)
    reference = reference_of(plain, attn, **options)
    if "gate" in options:  # off its identity start, the same in both
        generator = torch.Generator().manual_seed(5)
        for name, module in patched.named_modules():
            state = module._modules.get("hfa")
            if isinstance(state, AttnScaleState):
                perturb_gate(state.output_gate, generator)
                gate = state.output_gate
                set_gate(reference.get_submodule(name).hfa_ref, gate.weight, gate.bias)
    inputs = inputs_for(model_type)
    rows = inputs["attention_mask"].bool()
    with torch.no_grad():
        got, want = patched(**inputs).logits, reference(**inputs).logits
    # Logits after two sharp layers (MoE routing, logit scaling): fp32 rounding compounds to ~5e-5 here;
    # a wrong law, mask or exit moves them by 1e-2 or more. Attention outputs alone are held to 1e-5 in core/test_attention.py.
    tolerance = LOGIT_TOLERANCE.get(model_type, 1e-4)
    torch.testing.assert_close(got[rows], want[rows], atol=tolerance, rtol=tolerance)
    assert (got[rows] - baseline[rows]).abs().max() > 1e-5, "the patch changed nothing"
