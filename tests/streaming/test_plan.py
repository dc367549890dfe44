"""The streaming plan's decoding steps against the definition, and the RoPE table against the model's rotary."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from hf_attnscale.core.call.rope import family_rotation
from hf_attnscale.streaming.plan import LayerGeometry, SlotRecord, build_plan, decode_plan
from hf_attnscale.streaming.rope import RopeTable, rotation_basis


def _visible_tokens(plan, key_index: torch.Tensor, row: int) -> set[int]:
    return set(key_index[row][plan.mask[row, 0, 0] == 0].tolist())


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(
    "geometry",
    [
        LayerGeometry(4, 6),
        LayerGeometry(1, 3),
        LayerGeometry(0, 5),
        LayerGeometry(3, 1),
        LayerGeometry(2, 30),
        LayerGeometry(4, 6, local=8),
    ],
    ids=str,
)
def test_decoding_steps_show_each_query_what_the_definition_says(geometry, batch):
    """Chunks with padding (the general path, laid out at capacity), then decoding steps (the ring, some rows
    padding): every real query reads exactly the first S tokens of its row (those its own window shows, on a
    local layer) and its last W, at their true distances (sinks: at most S + W - 1 - i); each token is held once."""
    generator = torch.Generator().manual_seed(geometry.capacity * 10 + batch)
    sinks, window, capacity = geometry.sinks, geometry.window, geometry.capacity
    slots, decoded = SlotRecord.empty(batch, sinks, torch.device("cpu")), 0
    for step in range(6 * capacity + 20):
        if step % 17 == 0 or not slots.sinks_held:  # a chunk with padding in some rows, or a row short of its
            # sinks: the general path (appended, compacted, laid out at capacity)
            new_valid = torch.rand(batch, 5, generator=generator) > 0.3
            new_valid[:, -1] = True
            plan = build_plan(slots, new_valid, geometry, torch.float32, all_valid=False, full_size=True)
            assert plan.after.index.shape[1] == capacity
        else:
            new_valid = torch.rand(batch, 1, generator=generator) > 0.1
            plan = decode_plan(slots, new_valid, geometry, torch.float32)
            for row in range(batch):
                token = int(slots.real_tokens[row])
                if not new_valid[row, 0]:
                    assert int(plan.after.real_tokens[row]) == token
                    continue
                far = min(token, capacity - 1)  # where the sinks sit, seen from the query
                shown = {
                    i
                    for i in range(min(sinks, token + 1))
                    if geometry.local is None or far - i < geometry.local
                }
                shown |= set(range(max(0, token - window + 1), token + 1))
                assert _visible_tokens(plan, plan.after.index, row) == shown, (step, row)
                held = plan.after.index[row][plan.after.index[row] >= 0].tolist()
                assert len(held) == len(set(held)) and token in held
                position = int(plan.new_positions[row, 0])
                assert position == token - int(slots.base[row])
                sink_distance = position - (int(plan.sink_offset[row, 0]) + 0)
                assert sink_distance == far or sinks == 0
            decoded += 1
        assert int(plan.after.seen) == int(slots.seen) + new_valid.shape[1]
        slots = plan.after
    assert decoded > 5 * capacity


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
    rotate = family_rotation(apply_rotary_pos_emb, 8)
    a, b = rotation_basis(rotate, keys, cos_sin)
    other = tuple(f(torch.rand(2, 4, 8) * 6) for f in (torch.cos, torch.sin))
    assert torch.equal(a * other[0].unsqueeze(1) + b * other[1].unsqueeze(1), rotate(keys, *other))
    # A rotation of another form (here: not linear in cos) has no basis, and keeps the usual path.
    squared = lambda q, k, cos, sin: apply_rotary_pos_emb(q, k, cos * cos, sin)  # noqa: E731
    assert rotation_basis(family_rotation(squared, 8), keys, cos_sin) is None
    assert rotation_basis(rotate, keys, tuple(x[..., :4] for x in cos_sin)) is None  # partial
