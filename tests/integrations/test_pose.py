"""PoSE: the position ids of one training window, drawn as the paper draws them, and the Trainer collator that puts
them in each batch, beside RoPE rescaling, logn and LoRA."""

from __future__ import annotations

import pytest
import torch
from conftest import SHARP_VOCAB, assert_gradients_match, patched_beside_reference, sharp_model

import hf_attnscale as hfa

WINDOW, TARGET = 64, 1024


def runs(ids: torch.Tensor) -> list[torch.Tensor]:
    """``ids`` cut where they jump."""
    cuts = (torch.nonzero(ids.diff() != 1).flatten() + 1).tolist()
    return list(torch.tensor_split(ids, cuts))


@pytest.mark.parametrize("chunks", [1, 2, 3, 5])
def test_each_window_is_chunks_runs_from_zero_to_below_the_target(chunks):
    generator = torch.Generator().manual_seed(0)
    highest = 0
    for _ in range(300):
        ids = hfa.pose_position_ids(WINDOW, TARGET, chunks, generator)
        assert ids.dtype == torch.long and ids.shape == (WINDOW,) and ids[0] == 0 and ids[-1] < TARGET
        steps = ids.diff()
        assert (steps >= 1).all() and int(
            (steps > 1).sum()
        ) <= chunks - 1  # a skip equal to the last one: no jump
        assert all((run.diff() == 1).all() for run in runs(ids))
        highest = max(highest, int(ids[-1]))
    assert chunks == 1 or highest > 0.97 * TARGET  # the target's far end is reached


def test_skips_are_drawn_each_from_the_last_one_up():
    """u_2 ~ U[u_1, R] after u_1 ~ U[0, R] has mean 3R/4; the larger of two independent draws would have 2R/3."""
    generator = torch.Generator().manual_seed(1)
    room = TARGET - WINDOW
    last_skip = []
    for _ in range(4000):
        ids = hfa.pose_position_ids(WINDOW, TARGET, 3, generator)
        last_skip.append(float(ids[-1] - (WINDOW - 1)))
    assert abs(sum(last_skip) / len(last_skip) / room - 0.75) < 0.015


def test_a_seed_draws_the_same_ids():
    first = hfa.pose_position_ids(WINDOW, TARGET, 2, torch.Generator().manual_seed(7))
    assert torch.equal(first, hfa.pose_position_ids(WINDOW, TARGET, 2, torch.Generator().manual_seed(7)))
    assert not torch.equal(first, hfa.pose_position_ids(WINDOW, TARGET, 2, torch.Generator().manual_seed(8)))


@pytest.mark.parametrize(
    "args, message",
    [
        ((64, 32), "target_length must be at least window (64), got 32."),
        ((4, 64, 5), "chunks must be at most window (4)"),
        ((0, 64), "window must be an int >= 1, got 0."),
        ((64, 128, 0), "chunks must be an int >= 1, got 0."),
    ],
)
def test_bad_arguments_are_one_line(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        hfa.pose_position_ids(*args)
    assert "\n" not in str(err.value)


class Tokenizer:
    """What DataCollatorForLanguageModeling asks of a tokenizer, for id lists."""

    pad_token_id = 0
    padding_side = "right"

    def pad(self, features, return_tensors="pt", **_):
        length = max(len(f["input_ids"]) for f in features)
        ids = [list(f["input_ids"]) + [0] * (length - len(f["input_ids"])) for f in features]
        mask = [[1] * len(f["input_ids"]) + [0] * (length - len(f["input_ids"])) for f in features]
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}


def windows(count: int, length: int = WINDOW, seed: int = 0) -> list[dict]:
    draw = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(1, SHARP_VOCAB, (length,), generator=draw).tolist()} for _ in range(count)
    ]


def collator(seed=0, target_length=TARGET, **kwargs):
    from transformers import DataCollatorForLanguageModeling

    base = DataCollatorForLanguageModeling(Tokenizer(), mlm=False)
    return hfa.PoSECollator(None, target_length, seed=seed, collator=base, **kwargs)


def test_the_collator_adds_a_draw_per_row_to_the_base_collators_batch():
    batch = collator()(windows(3))
    assert set(batch) == {"input_ids", "attention_mask", "labels", "position_ids"}
    ids = batch["position_ids"]
    assert ids.shape == (3, WINDOW) and (ids[:, 0] == 0).all() and (ids < TARGET).all()
    assert len({tuple(row.tolist()) for row in ids}) == 3
    assert torch.equal(ids, collator()(windows(3))["position_ids"])  # seeded
    with pytest.raises(ValueError, match="longer than target_length"):
        collator()(windows(1, TARGET + 1))


def test_the_positions_reach_the_model_beside_yarn_and_logn():
    yarn = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "rope_theta": 10000.0,
    }
    model = sharp_model(max_position_embeddings=TARGET, rope_parameters=yarn)
    hfa.patch(model, scale="logn", train_length=256)
    batch = collator()(windows(2))
    loss = model(**batch).loss
    plain = {k: v for k, v in batch.items() if k != "position_ids"}
    assert not torch.isclose(loss, model(**plain).loss)  # the skips moved the scores
    ids, labels = batch["input_ids"], batch["labels"]
    by_row = [
        model(ids[r : r + 1], position_ids=batch["position_ids"][r : r + 1], labels=labels[r : r + 1]).loss
        for r in range(2)
    ]
    torch.testing.assert_close(loss, torch.stack(by_row).mean(), rtol=1e-5, atol=1e-6)


KEY_PARTS = {  # each far part reached by the jumps of a 64-token window toward 256
    "rerope": {"rerope_window": 16},
    "leaky": {"rerope_window": 16, "rerope_leak": 3.0},
    "self_extend": {"self_extend_group": 4, "self_extend_window": 16},
    "dca": {"dual_chunk_size": 48, "dual_chunk_local": 8},
    "string": {"string_shift": 100, "string_local": 16},
}


@pytest.mark.parametrize("method", list(KEY_PARTS))
def test_pose_beside_a_method_of_key_parts_equals_its_reference_forward_and_backward(method):
    """While training (the model's cache is read by no later call), each pair of a PoSE window is scored at its
    own positions, which jump: the logits and every weight's gradient equal the reference's, which places each
    pair at the positions given; the same tokens at positions that run on by one score otherwise. Toward 256:
    the model's own RoPE, computed in float32, parts its sharp logits from the float64 reference by 2e-5 at
    positions near 1,024, with no patch too."""
    model = sharp_model(max_position_embeddings=256)
    patched, reference = patched_beside_reference(model, KEY_PARTS[method])
    batch = collator(target_length=256)(windows(2))
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
    patched.train(), reference.train()
    with torch.no_grad():
        got = patched(**inputs).logits
        torch.testing.assert_close(got, reference(**inputs).logits, atol=1e-5, rtol=1e-5)
        running = patched(**{**inputs, "position_ids": torch.arange(WINDOW).expand(2, -1)}).logits
    assert not torch.allclose(got, running, atol=1e-3)
    assert_gradients_match(patched, reference, inputs)


def test_a_method_of_key_parts_refuses_jumps_kept_in_a_cache_in_one_line():
    """Out of training, with the model's cache, a later call would read the keys at other distances: refused."""
    model = sharp_model(max_position_embeddings=TARGET)
    hfa.patch(model, rerope_window=16)
    batch = collator()(windows(1))
    with pytest.raises(ValueError, match="position_ids jump in a call onto or into a cache") as err:
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    assert "\n" not in str(err.value)
    with torch.no_grad():  # without a cache: each pair at its positions
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)


def test_trainer_trains_lora_through_the_collator(tmp_path):
    pytest.importorskip("peft")
    from peft import get_peft_model
    from transformers import Trainer, TrainingArguments

    model = sharp_model(max_position_embeddings=TARGET)
    hfa.patch(model, scale="logn", train_length=256)
    peft_model = get_peft_model(model, hfa.lora_config(model, r=4))
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    seen = []
    forward = peft_model.forward

    def watched(*args, **kwargs):
        seen.append(kwargs.get("position_ids"))
        return forward(*args, **kwargs)

    peft_model.forward = watched
    args = TrainingArguments(
        str(tmp_path), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2, report_to=[],
        use_cpu=True, save_strategy="no", logging_strategy="no", remove_unused_columns=False,
    )  # fmt: skip
    Trainer(peft_model, args, train_dataset=windows(4), data_collator=collator()).train()
    assert len(seen) == 2 and all(ids is not None and ids[:, -1].max() >= WINDOW for ids in seen)
    moved = [n for n, p in peft_model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert moved and all("lora_" in n for n in moved)
