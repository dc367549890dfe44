"""The exit (zero_kv / sink logit) as public sdpa sees it (`hf_attnscale.core.call.exit`), against the eager reference.

The exit rides on extra channels through transformers' own sdpa wrapper, the same code on every device: these
tests hold it to the reference (fp32 1e-5, gradients relative to their size) in every shape a model passes
(causal or not, no mask, a padding mask, a per-head additive mask, one query, a prompt after a cache, GQA),
check that bf16 keeps the logit, and that nothing of size T² or per-head mask is made where the model had none.
They also hold the two defects of the private-kernel path it replaced: a learnable mask bias's gradient, and a
family's own sinks passed twice to a native-sink backend.
"""

from __future__ import annotations

import copy

import pytest
import torch
from model_zoo import reference_of, zoo_model
from reference import reference_attention
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_attnscale as hfa
from hf_attnscale.core.call import backends, exit

SINKS = torch.tensor([0.0, 1.5, -2.0, 3.0])


class Attention(torch.nn.Module):
    """What transformers' sdpa wrapper reads of a module: its GQA groups and causality."""

    def __init__(self, groups: int, is_causal: bool) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, is_causal


def visible_keys(batch, q_len, k_len, causal, padded):
    """Bool (B, 1, Tq, Tk): causal queries are the last Tq keys; row 1 of a padded batch loses its first 2 keys."""
    visible = torch.ones(q_len, k_len, dtype=torch.bool)
    visible = (visible.tril(k_len - q_len) if causal else visible).expand(batch, 1, q_len, k_len).clone()
    if padded:
        visible[1, :, :, :2] = False
    return visible


def exit_through_sdpa(q, k, v, mask, sinks, causal, scaling):
    module = Attention(q.shape[1] // k.shape[1], causal)
    out = exit.sdpa_exit_attention(
        exit.ExitCall(sdpa_attention_forward, module, q, k, v, mask, sinks, causal, {"scaling": scaling})
    )
    return out.transpose(1, 2)


# (causal, q_len, k_len, mask): no mask, a padding mask, a per-head additive mask with values, one query
# (decoding), a prompt of 3 after a cache of 9 (the mask a model passes then).
SHAPES = [
    (True, 12, 12, None),
    (True, 12, 12, "bool"),
    (True, 12, 12, "per-head float"),
    (True, 1, 12, None),
    (True, 1, 12, "bool"),
    (True, 3, 12, "bool"),
    (False, 12, 12, None),
    (False, 12, 12, "bool"),
]


@pytest.mark.parametrize(("multiple", "chunk"), [(1, exit.MASK_CHUNK), (8, exit.MASK_CHUNK), (1, 40)])
@pytest.mark.parametrize("head_dim", [8, 64, 61])
@pytest.mark.parametrize(("causal", "q_len", "k_len", "mask_kind"), SHAPES)
def test_exit_through_sdpa_matches_reference(
    causal, q_len, k_len, mask_kind, head_dim, multiple, chunk, monkeypatch
):
    """Forward and backward (q, k, v, the per-head sink and a learnable mask) against the reference, fp32, at
    the CPU's width (D + 2) and at the accelerators' (a multiple of 8), the queries with a mask in one call
    and in chunks of 3 (40 mask entries over 13 keys)."""
    monkeypatch.setattr(exit, "width_multiple", lambda device: multiple)
    monkeypatch.setattr(exit, "MASK_CHUNK", chunk)
    generator = torch.Generator().manual_seed(head_dim + q_len)
    q = torch.randn(2, 4, q_len, head_dim, generator=generator) * 2
    k, v = (torch.randn(2, 2, k_len, head_dim, generator=generator) for _ in range(2))
    visible = visible_keys(2, q_len, k_len, causal, padded=mask_kind is not None)
    bias = None
    if mask_kind is None:
        mask = None
    elif mask_kind == "bool":
        mask = visible
    else:
        bias = torch.randn(2, 4, q_len, k_len, generator=generator).requires_grad_()
        mask = bias.masked_fill(~visible, torch.finfo(torch.float32).min)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, SINKS)]
    mine = [t.clone().requires_grad_() for t in (q, k, v, SINKS)]
    got = exit_through_sdpa(*mine[:3], mask, mine[3], causal, 0.3)
    want = reference_attention(
        *leaves[:3],
        visible,
        0.3,
        sink=leaves[3],
        bias=None if bias is None else bias.masked_fill(~visible, 0),
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if mask_kind is not None and causal and q_len == k_len:  # row 1's first two queries see only padding
        assert torch.equal(got[1, :, :2], torch.zeros_like(got[1, :, :2]))
    grad = torch.randn(want.shape, generator=generator)
    if bias is not None:
        got.backward(grad, inputs=[*mine, bias])
        mask_grad = bias.grad.clone()
        bias.grad = None
        want.backward(grad, inputs=[*leaves, bias])
        torch.testing.assert_close(mask_grad, bias.grad, atol=1e-5 * bias.grad.abs().max(), rtol=1e-4)
    else:
        got.backward(grad)
        want.backward(grad)
    for a, b in zip(mine, leaves, strict=True):
        assert b.grad.abs().max() > 0
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5 * b.grad.abs().max(), rtol=1e-4)


def test_a_query_that_sees_no_key_gives_zeros():
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool).tril()
    mask[:, :, 0] = False
    out = exit_through_sdpa(q, k, v, mask, SINKS, True, 0.3)
    assert torch.isfinite(out).all() and torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_half_precision_keeps_the_exit_logit(dtype, head_dim):
    """The logit s / scale in one bf16 channel would be off by up to 2^-9 of itself (0.01 nats for s = 5 at
    head dim 128); split over two channels it keeps ~16 bits: the kernel's fp32 dot product of the query's
    channels with the exit key gives back s to 2^-15 of its size."""
    seen = {}

    def recording(module, q, k, v, mask, scaling=None, **kwargs):
        seen.update(q=q, k=k, scaling=scaling)
        return sdpa_attention_forward(module, q, k, v, mask, scaling=scaling, **kwargs)

    sinks = torch.tensor([5.0, -3.3, 0.7, 12.345])
    q, k, v = torch.randn(1, 4, 5, head_dim, dtype=dtype), *torch.randn(2, 1, 2, 5, head_dim, dtype=dtype)
    exit.sdpa_exit_attention(
        exit.ExitCall(recording, Attention(2, True), q, k, v, None, sinks, True, {"scaling": head_dim**-0.5})
    )
    assert seen["q"].shape[-1] == head_dim + 2  # on the CPU; a multiple of 8 on accelerators
    logit = (seen["q"][0, :, 1:, head_dim:].float() * seen["k"][0, 0, 0, head_dim:].float()).sum(-1)
    logit = (
        logit * seen["scaling"]
    )  # (H, Tq): every real row carries its head's logit; the dummy row is first
    torch.testing.assert_close(logit, sinks[:, None].expand_as(logit), atol=0, rtol=2**-15)
    one_channel = (sinks / seen["scaling"]).to(dtype).float() * seen["scaling"]
    assert (one_channel - sinks).abs().max() > 2**-15 * sinks.abs().max(), "one channel would have done"


def test_no_mask_is_made_where_the_model_had_none(monkeypatch):
    """Causal without a mask: sdpa gets a square is_causal call and no mask (every kernel's causal block
    skipping kept); with a padding mask and a learnable per-head sink, the mask gets one column, shared by the
    heads (memory O(T·D) per head, not a column per head)."""
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kwargs):
        seen.append(
            (tuple(q.shape), tuple(k.shape), is_causal, None if attn_mask is None else attn_mask.shape)
        )
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    ids = torch.randint(3, 100, (2, 16))
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[1, :3] = 0
    for options in ({"zero_kv": True}, {"scale": "logn", "train_length": 4, "sink_logit": "learnable"}):
        model = hfa.patch(zoo_model("llama"), **options)
        seen.clear()
        with torch.no_grad():
            model(input_ids=ids)
        assert len(seen) == 2
        for q_shape, k_shape, is_causal, mask_shape in seen:
            assert is_causal and mask_shape is None and q_shape[2] == k_shape[2] == 17, seen
        seen.clear()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=padding)
        for _, _, is_causal, mask_shape in seen:
            assert not is_causal and mask_shape == (2, 1, 16, 17), seen


def test_a_learnable_mask_bias_gets_its_gradient():
    """Inkling's relative position bias is an nn.Parameter projection folded into the mask: under the exit its
    gradient must reach it, equal to the eager reference's (the private-kernel path gave None)."""
    options = {"scale": "logn", "train_length": 2, "sink_logit": "learnable"}
    plain = zoo_model("inkling_text", "sdpa")
    patched = hfa.patch(copy.deepcopy(plain), **options)
    reference = reference_of(plain, "sdpa", **options)
    ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    weight = torch.randn(2, 10, patched.config.vocab_size, generator=torch.Generator().manual_seed(1))
    for model in (patched, reference):
        model.train()
        (model(input_ids=ids).logits * weight).sum().backward()
    want = dict(reference.named_parameters())
    biases = [name for name, _ in patched.named_parameters() if "rel_logits" in name]
    assert biases, "Inkling has no relative position bias here: the test tests nothing"
    for name, p in patched.named_parameters():
        if ".hfa." in name:
            continue
        assert p.grad is not None, f"{name} got no gradient"
        scale = want[name].grad.abs().max()
        torch.testing.assert_close(p.grad, want[name].grad, atol=1e-5 * scale, rtol=1e-4, msg=name)
    assert all(patched.get_parameter(name).grad.abs().max() > 0 for name in biases)


def test_a_family_with_sinks_of_its_own_passes_one_row_of_sinks(monkeypatch):
    """granite_swa passes its sinks as s_aux; a native-sink backend must get one s_aux, logaddexp of both, and
    the model must equal the eager one (its own sinks beside the patch's exit column)."""
    from torch.nn.attention.flex_attention import create_mask

    received = []

    def recording_flex(module, query, key, value, block_mask, scaling=None, s_aux=None, **kwargs):
        received.append(s_aux.detach().clone())
        batch, _, q_len, _ = query.shape
        visible = create_mask(block_mask.mask_mod, batch, 1, q_len, key.shape[2], device=query.device)
        out = reference_attention(query, key, value, visible, scaling, sink=s_aux)
        return out.transpose(1, 2).contiguous(), None

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flex_attention", recording_flex)
    monkeypatch.setattr(backends.Backend, "check_exit", lambda backend, device: None)  # flex sinks need CUDA
    model = hfa.patch(zoo_model("granite_swa", "eager"), sink_logit=1.5)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, layer.self_attn.sinks.numel()))
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = model(input_ids=ids).logits
        model.set_attn_implementation("flex_attention")
        flex = model(input_ids=ids).logits
    own = model.model.layers[0].self_attn.sinks.detach()
    torch.testing.assert_close(received[0], torch.logaddexp(own, torch.tensor(1.5)))
    torch.testing.assert_close(flex, eager, atol=1e-5, rtol=1e-5)
