"""The streaming plan's fast paths against its general one, and the RoPE table against the model's rotary."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from hf_attnscale.core.call.rope import rotate as rotate_keys
from hf_attnscale.streaming.plan import LayerGeometry, SlotRecord, build_plan
from hf_attnscale.streaming.rope import RopeTable, rotation_basis


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, SlotRecord):
        return a.same_as(b)
    return a == b


def _plan_fields(plan) -> dict:
    return {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if not f.name.startswith("_")}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("sinks, window", [(4, 6), (1, 3), (0, 5), (3, 1), (2, 30)])
def test_decoding_plan_equals_the_general_plan(sinks, window, batch):
    """Rows with different padding histories, prompts appended as chunks, rebases: at every decoding step the
    short paths (one row: in Python numbers) give the general plan field for field, and the stream goes on
    from the general plan."""
    generator = torch.Generator().manual_seed(sinks * 100 + window)
    slots = SlotRecord.empty(batch, sinks, torch.device("cpu"))
    geometry = LayerGeometry(sinks, window)
    decoded = 0
    for step in range(6 * (sinks + window) + 20):
        if step % 17 == 0:  # a chunk with padding in some rows (appended, compacted)
            new_valid = torch.rand(batch, 5, generator=generator) > 0.3
            new_valid[:, -1] = True
            plan = build_plan(slots, new_valid, geometry, torch.float32, in_place=False)
        else:
            new_valid = torch.ones(batch, 1, dtype=torch.bool)
            plan = build_plan(slots, new_valid, geometry, torch.float32, in_place=True)
            fast = build_plan(slots, new_valid, geometry, torch.float32, in_place=True, all_valid=True)
            general, short = _plan_fields(plan), _plan_fields(fast)
            assert general.keys() == short.keys()
            for name in general:
                assert _same(general[name], short[name]), (step, name, general[name], short[name])
            decoded += 1
        slots = plan.after
    assert decoded > 5 * (sinks + window)


def test_rope_table_computes_the_models_own_angles_in_float64():
    config = LlamaConfig(hidden_size=64, num_attention_heads=2, rope_theta=10_000.0)
    rotary = LlamaRotaryEmbedding(config)
    table = RopeTable(rotary, None, torch.zeros(1), length=300)
    assert table.exact
    positions = torch.arange(300)[None]
    for got, want in zip(table(positions), rotary(torch.zeros(1), positions)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    # Past 2^24 float32 cannot even hold the position; the table's angles come from float64 positions.
    far = torch.tensor([[2**24 + 1]])
    angle = (2**24 + 1) * rotary.inv_freq.double()[0]
    assert table(far)[0][0, 0, 0].item() == pytest.approx(torch.cos(angle).item(), abs=1e-6)


def test_rotation_basis_gives_the_familys_rotation_bitwise():
    keys = torch.randn(2, 3, 4, 8)
    cos_sin = tuple(f(torch.rand(2, 4, 8) * 6) for f in (torch.cos, torch.sin))
    a, b = rotation_basis(apply_rotary_pos_emb, keys, cos_sin)
    other = tuple(f(torch.rand(2, 4, 8) * 6) for f in (torch.cos, torch.sin))
    assert torch.equal(
        a * other[0].unsqueeze(1) + b * other[1].unsqueeze(1), rotate_keys(apply_rotary_pos_emb, keys, other)
    )
    # A rotation of another form (here: not linear in cos) has no basis, and keeps the usual path.
    squared = lambda q, k, cos, sin: apply_rotary_pos_emb(q, k, cos * cos, sin)  # noqa: E731
    assert rotation_basis(squared, keys, cos_sin) is None
    assert rotation_basis(apply_rotary_pos_emb, keys, tuple(x[..., :4] for x in cos_sin)) is None  # partial
