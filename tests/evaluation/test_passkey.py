"""Passkey retrieval prompts and their lm-eval tasks (generated offline)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_attnscale.checkpoints.models import default_model_path
from hf_attnscale.evaluation.passkey import FILLER, NEEDLE, QUESTION, passkey_prompts, passkey_recall


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path())


def test_prompts_have_the_length_the_key_at_its_depth_and_are_reproducible(tokenizer):
    prompts = passkey_prompts(tokenizer, [512, 2048], [0.0, 0.5, 1.0], per_cell=2, seed=3)
    assert [(p.length, p.depth) for p in prompts] == [
        (n, d) for n in (512, 2048) for d in (0.0, 0.5, 1.0) for _ in "ab"
    ]
    unit = len(tokenizer(FILLER, add_special_tokens=False)["input_ids"])
    for p in prompts:
        tokens = len(tokenizer(p.context)["input_ids"])
        assert p.length - unit - 2 <= tokens <= p.length, (tokens, p.length)
        assert len(p.key) == 5 and p.key.isdigit()
        assert p.context.count(p.key) == 2 and p.context.endswith(QUESTION)
        before, _, after = p.context.partition(NEEDLE.format(key=p.key))
        units = before.count(FILLER) + after.count(FILLER)
        assert before == FILLER * before.count(FILLER) and after == FILLER * after.count(FILLER) + QUESTION
        assert before.count(FILLER) == (round(p.depth * units) if p.depth < 1 else units - 1)
        assert NEEDLE.format(key=p.key) + QUESTION not in p.context  # never directly before the question
    assert passkey_prompts(tokenizer, [512, 2048], [0.0, 0.5, 1.0], per_cell=2, seed=3) == prompts
    assert len({p.key for p in prompts}) > 1


def test_version_2_moves_only_the_last_depths_needle_one_unit_back(tokenizer):
    """Version 1's prompts, written out here as they were built (the needle after ``round(depth * units)``
    units, the same seeded keys): every prompt below depth 1 is byte-identical in version 2, so results at
    those depths stand; at depth 1 the needle moves before the last unit, which now separates it from the
    question."""
    depths = [0.0, 0.25, 0.5, 0.75, 1.0]
    prompts = passkey_prompts(tokenizer, [4096, 16384], depths, per_cell=2, seed=0)
    rng = random.Random(0)
    for p in prompts:
        units = p.context.count(FILLER)
        needle = NEEDLE.format(key=str(rng.randint(10000, 99999)))
        before = round(p.depth * units)
        version_1 = FILLER * before + needle + FILLER * (units - before) + QUESTION
        if p.depth < 1:
            assert p.context == version_1
        else:
            assert version_1.endswith(needle + QUESTION)
            assert p.context == FILLER * (units - 1) + needle + FILLER + QUESTION


def test_bad_lengths_and_depths_are_one_line(tokenizer):
    with pytest.raises(ValueError, match=r"needs more than \d+ tokens of this tokenizer; got 8\.$"):
        passkey_prompts(tokenizer, [8], [0.5])
    with pytest.raises(ValueError, match=r"from 0 to 1; got 1\.5\.$"):
        passkey_prompts(tokenizer, [512], [1.5])


def test_the_tasks_build_and_score_by_depth():
    lm_eval = pytest.importorskip("lm_eval.tasks")
    from hf_attnscale.integrations.lm_eval_tasks_data import (
        PASSKEY_DEPTHS,
        TASKS_DIR,
        mean_present,
        passkey_results,
    )

    manager = lm_eval.TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    assert {f"hfa_passkey_{n}" for n in ("4k", "8k", "16k", "32k", "64k")} <= set(manager.all_tasks)
    task = manager.load(["hfa_passkey_4k"])["tasks"]["hfa_passkey_4k"]
    docs = list(task.test_docs())
    assert len(docs) == 2 * len(PASSKEY_DEPTHS) and {d["length"] for d in docs} == {4096}
    assert task.doc_to_target(docs[0]) == " " + docs[0]["key"]
    rows = [passkey_results(doc, [(-1.5, doc["depth"] < 0.5)]) for doc in docs]
    assert sum(r["acc"] for r in rows) == 4 and all(r["key_loglikelihood"] == -1.5 for r in rows)
    assert mean_present([r["acc_depth_0"] for r in rows]) == 1.0
    assert mean_present([r["acc_depth_75"] for r in rows]) == 0.0
    assert math.isnan(mean_present([None, None]))


@pytest.mark.parametrize("favoured", ["none", "all-but-the-last", "all"])
def test_recall_is_the_keys_argmax_and_log_likelihood(tokenizer, favoured):
    """`passkey_recall` against the definition on the whole forward's logits: found when every key token is the
    argmax, and the key's log-likelihood summed over its tokens. The shipped model finds no key; a bias of 30 on
    the key's tokens in its logits makes it find the key only where every key token has it."""
    model = AutoModelForCausalLM.from_pretrained(default_model_path()).eval()
    prompt = passkey_prompts(tokenizer, [120], [0.5], seed=1)[0]  # read in chunks of 32 below
    key = tokenizer(" " + prompt.key, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([tokenizer(prompt.context)["input_ids"] + key])
    count = {"none": 0, "all-but-the-last": len(key) - 1, "all": len(key)}[favoured]
    rows = torch.arange(ids.shape[1] - 1 - len(key), ids.shape[1] - 1)[:count]  # the key's tokens' rows

    call_end = []  # the position after each model call's last input token

    def call(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        call_end.append((cache.get_seq_length() if cache is not None else 0) + kwargs["input_ids"].shape[1])

    def bias(module, args, logits):  # the logits of the call's last positions (all, or those it keeps)
        first = call_end[-1] - logits.shape[1]
        inside = rows[(rows >= first) & (rows < call_end[-1])]
        logits[0, inside - first, ids[0, inside + 1]] += 30.0
        return logits

    model.register_forward_pre_hook(call, with_kwargs=True)
    model.lm_head.register_forward_hook(bias)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1][-len(key) :]
    targets = ids[0, -len(key) :]
    want_found = bool((logits.argmax(-1) == targets).all())
    want = logits.double().log_softmax(-1).gather(-1, targets[:, None]).sum().item()
    got = passkey_recall(model, tokenizer, prompt, chunk_size=32)
    assert got.found == want_found == (favoured == "all")
    assert abs(got.loglikelihood - want) < 1e-4, (got.loglikelihood, want)
    assert (got.length, got.depth) == (120, 0.5)
