"""Diagnostics against hand-built cases whose answers are known."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import VOCAB, tiny_model

import hf_attnscale as hfa
from hf_attnscale.diagnostics import activation_outliers, attention_statistics, layer_table
from hf_attnscale.diagnostics.outliers import kurtosis
from hf_attnscale.diagnostics.quantization import fake_quantized, quantize_symmetric


def _uniform(model_type: str = "llama", **overrides):
    """A model whose queries are zero: every visible key gets the same logit, so attention is uniform."""
    model = tiny_model(model_type, **overrides)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "q_proj.bias", "query.weight", "query.bias", "Wqkv.weight")):
                if name.endswith("Wqkv.weight"):  # ModernBERT: the first third is the query
                    p[: p.shape[0] // 3].zero_()
                else:
                    p.zero_()
    return model


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_uniform_attention_has_entropy_ln_n(attn):
    model = _uniform(attn=attn)
    ids = torch.randint(3, VOCAB, (2, 40))
    stats = attention_statistics(model, ids, sink_tokens=2)
    n = torch.arange(1, 41, dtype=torch.float32)
    assert stats.entropy.shape == (2, 4, 40)
    torch.testing.assert_close(stats.visible, n.expand(2, 40))
    torch.testing.assert_close(stats.entropy, n.log().expand_as(stats.entropy), atol=1e-5, rtol=0)
    torch.testing.assert_close(stats.gradient, (2 * (1 - 1 / n)).expand_as(stats.gradient), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        stats.sink_mass, (2 / n).clamp_max(1).expand_as(stats.sink_mass), atol=1e-6, rtol=0
    )
    assert stats.exit_mass.abs().max() == 0
    assert hfa.get_config(model) is None  # the identity patch it needed is gone again


def test_uniform_attention_with_exit_and_padding():
    """With zero_kv every row is uniform over its n keys plus the exit: ln(n+1), exit mass 1/(n+1)."""
    model = hfa.patch(_uniform(), zero_kv=True)
    ids = torch.randint(3, VOCAB, (1, 24))
    stats = attention_statistics(model, ids)
    n = torch.arange(1, 25, dtype=torch.float32)
    torch.testing.assert_close(stats.entropy, (n + 1).log().expand_as(stats.entropy), atol=1e-5, rtol=0)
    torch.testing.assert_close(stats.exit_mass, (1 / (n + 1)).expand_as(stats.exit_mass), atol=1e-6, rtol=0)
    assert hfa.get_config(model).zero_kv  # a patched model keeps its patch


def test_encoder_rows_see_their_non_padding_keys():
    model = _uniform("bert")
    ids = torch.randint(3, VOCAB, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    stats = attention_statistics(model, ids, mask)
    # Batch mean of n: 12 for row 0, 7 for row 1 (its padding rows see the same 7 keys).
    torch.testing.assert_close(stats.visible, torch.full((2, 12), 9.5))
    want = (math.log(12) + math.log(7)) / 2
    torch.testing.assert_close(stats.entropy, torch.full_like(stats.entropy, want), atol=1e-5, rtol=0)


def test_a_head_that_favours_token_zero_is_a_sink():
    """Token 0's key made large along every query: each head puts all its mass there.

    Queries and keys live in the slowest RoPE pair of each head (dim 3 of 8: 0.001 rad per token with
    theta 1e4), so the logit barely depends on the distance, and only token 0's hidden state has a key.
    """
    model = tiny_model("llama", num_hidden_layers=1, rope_theta=1e4)
    attn = model.model.layers[0].self_attn
    ids = torch.randint(3, VOCAB, (1, 30))
    with torch.no_grad():
        hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))[0]
        direction = hidden[0] - hidden[1:].mean(0)
        direction = direction / (direction @ hidden[0])  # <direction, h_0> = 1
        attn.q_proj.weight.zero_()
        attn.k_proj.weight.zero_()
        attn.q_proj.bias = torch.nn.Parameter(torch.zeros(attn.q_proj.out_features))
        attn.q_proj.bias[3::8] = 1.0
        attn.k_proj.weight[3::8] = 200.0 * direction
    assert float((hidden[1:] @ direction).max()) < 0.9  # every other token's key is smaller by a margin
    stats = attention_statistics(model, ids)
    assert stats.sink_mass.shape == (1, 4, 30)
    assert float(stats.sink_mass[..., 1:].min()) > 0.99
    assert float(stats.entropy[..., 1:].max()) < 0.05


def test_kurtosis_and_outliers():
    torch.manual_seed(0)
    assert abs(float(kurtosis(torch.randn(200_000))) - 3.0) < 0.1
    spiky = torch.zeros(1000)
    spiky[0] = 1.0
    assert float(kurtosis(spiky)) > 900  # one outlier in a thousand: kurtosis ~ n
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (2, 16))
    stats = activation_outliers(model, ids)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[1:]
    torch.testing.assert_close(stats.hidden_max_abs, torch.stack([h.abs().max() for h in hidden]))
    torch.testing.assert_close(stats.hidden_kurtosis, torch.stack([kurtosis(h) for h in hidden]))
    assert stats.attention_kurtosis.shape == (2,) and (stats.attention_max_abs > 0).all()


def test_plots_are_written(tmp_path):
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 32))
    assert attention_statistics(model, ids).plot(tmp_path / "a.png").stat().st_size > 10_000
    assert activation_outliers(model, ids).plot(tmp_path / "o.png").stat().st_size > 10_000


def test_layer_table_has_a_row_per_layer():
    model = _uniform()
    ids = torch.randint(3, VOCAB, (1, 40))
    table = layer_table(
        attention_statistics(model, ids), activation_outliers(model, ids), skip=16
    ).splitlines()
    assert table[0].startswith("| layer | entropy | entropy at n=L | ln L | sink mass |")
    assert len(table) == 2 + 2 and all(line.count("|") == 10 for line in table)
    # Uniform attention: the last query's entropy is ln of the 40 keys it sees.
    assert table[2].startswith("| 0 | ") and f"| {math.log(40):.3f} | {math.log(40):.3f} |" in table[2]


def test_symmetric_int8_rounding_by_hand():
    x = torch.tensor([[254.0, -127.0, 1.0], [0.5, 0.25, -0.1]])
    # Per tensor: absmax 254, step 2: 1 rounds to 2 (1/2 = 0.5 rounds to even 0 -> 0), small values vanish.
    torch.testing.assert_close(quantize_symmetric(x), torch.tensor([[254.0, -128.0, 0.0], [0.0, 0.0, 0.0]]))
    # Per row (dim=0): the second row keeps its own step 0.5/127.
    step = 0.5 / 127
    expected = torch.tensor(
        [[254.0, -128.0, 0.0], [0.5, round(0.25 / step) * step, round(-0.1 / step) * step]]
    )
    torch.testing.assert_close(quantize_symmetric(x, dim=0), expected)


def test_w8a8_runs_quantised_linears_and_restores_the_model():
    torch.manual_seed(0)
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        exact = model(ids).logits
        linear = model.model.layers[0].mlp.down_proj
        x = torch.randn(4, linear.in_features)
        x[0, 0] = 1e3  # one outlier sets the input's scale
        with fake_quantized(model):
            quantized = model(ids).logits
            got = linear(x)
        want = torch.nn.functional.linear(
            quantize_symmetric(x), quantize_symmetric(linear.weight, dim=0), linear.bias
        )
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        # The outlier's scale (1e3/127 ~ 7.9) rounds every ordinary input to 0.
        assert quantize_symmetric(x)[1:].abs().max() == 0
        assert 0 < (quantized - exact).abs().max() < 0.5 * exact.abs().max()
        torch.testing.assert_close(model(ids).logits, exact, rtol=0, atol=0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any("forward" in m.__dict__ for m in model.modules())
    with pytest.raises(ValueError, match=r"no nn\.Linear"), fake_quantized(torch.nn.Embedding(3, 2)):
        pass


def test_w8a8_keeps_the_first_tokens_out_of_the_quantisation_range():
    torch.manual_seed(0)
    model = tiny_model("llama")
    linear = model.model.layers[0].mlp.down_proj
    x = torch.randn(2, 5, linear.in_features)
    x[:, 0, 0] = 1e3  # the sink token's outlier
    weight = quantize_symmetric(linear.weight, dim=0)
    with torch.no_grad(), fake_quantized(model, keep_first=1):
        got = linear(x)
        short = linear(x[:, :1])
    # The first token is exact (in float), the rest quantised on their own range, which the outlier no longer sets.
    rest = quantize_symmetric(x[:, 1:])
    want = torch.nn.functional.linear(torch.cat([x[:, :1], rest], dim=1), weight, linear.bias)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert rest.abs().max() < 10 and (rest - x[:, 1:]).abs().max() < x[:, 1:].abs().max() / 127
    # (a different matmul shape: float rounding of outputs of size ~1e3)
    torch.testing.assert_close(
        short, torch.nn.functional.linear(x[:, :1], weight, linear.bias), rtol=1e-6, atol=1e-4
    )
    with pytest.raises(ValueError, match="keep_first"), fake_quantized(model, keep_first=-1):
        pass
