"""The laws of 2026 against the families that ship them: transformers' own code is the reference.

A tiny Ministral 3 (and Llama 4, every layer NoPE, where its temperature tuning applies) with its own query
scaling switched off and patched with ours equals the same weights with the family's scaling on. The family
scales by the token's position, ours by n, the keys the query sees: n = position + 1 in an unpadded causal row,
so they agree there, and not under left padding (the family counts the padding as positions) nor under a
`SinkCache` (n is the visible cache, so our temperature stops growing with the stream).
"""

from __future__ import annotations

import copy

import pytest
import torch
from model_zoo import zoo_model

import hf_attnscale as hfa

BETA, LENGTH = 0.7, 3  # at 16 tokens the multiplier takes five values, up to 1 + 0.7·ln 6 = 2.25


def with_own_scaling(model_type: str, attn: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The family's model with its own scaling on, and a copy of the same weights with it off."""
    if model_type == "ministral3":
        on = zoo_model(model_type, attn)
        on.config.rope_parameters.update(llama_4_scaling_beta=BETA, original_max_position_embeddings=LENGTH)
        off = copy.deepcopy(on)
        off.config.rope_parameters["llama_4_scaling_beta"] = 0.0
        return on, off
    layers = 2
    on = zoo_model(
        model_type,
        attn,
        num_hidden_layers=layers,
        no_rope_layers=[0] * layers,  # NoPE everywhere: where Llama 4 tunes the temperature
        attn_temperature_tuning=True,
        floor_scale=LENGTH,
        attn_scale=BETA,
    )
    off = copy.deepcopy(on)
    for layer in off.model.layers:
        layer.self_attn.attn_temperature_tuning = False
    return on, off


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(("model_type", "law"), [("ministral3", "ministral3"), ("llama4_text", "llama4")])
def test_our_law_equals_the_familys_own(model_type, law, attn):
    on, off = with_own_scaling(model_type, attn)
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, unscaled = on(input_ids=ids).logits, off(input_ids=ids).logits
        got = hfa.patch(off, scale=law, train_length=LENGTH, beta=BETA)(input_ids=ids).logits
    assert (want - unscaled).abs().max() > 1e-2, "the family's own scaling changed nothing here"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_laws_are_steps_of_n():
    from hf_attnscale.core.options.config import AttnScaleConfig
    from hf_attnscale.core.options.laws import query_multiplier

    n = torch.arange(1.0, 13.0).view(1, 1, -1)
    llama4 = query_multiplier(AttnScaleConfig(scale="llama4", train_length=4), n)
    ministral3 = query_multiplier(AttnScaleConfig(scale="ministral3", train_length=4, beta=0.5), n)
    steps = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3.0])  # floor(n / 4)
    torch.testing.assert_close(llama4.flatten(), 1 + 0.1 * torch.log1p(steps))
    torch.testing.assert_close(
        ministral3.flatten(), 1 + 0.5 * torch.log1p(torch.floor((n.flatten() - 1) / 4))
    )
