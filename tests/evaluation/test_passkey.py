"""Passkey retrieval prompts and their lm-eval tasks (generated offline)."""

from __future__ import annotations

import math

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
        assert before.count(FILLER) == round(p.depth * units)
    assert passkey_prompts(tokenizer, [512, 2048], [0.0, 0.5, 1.0], per_cell=2, seed=3) == prompts
    assert len({p.key for p in prompts}) > 1


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
    assert {f"hfa_passkey_{n}" for n in ("4k", "8k", "16k", "32k")} <= set(manager.all_tasks)
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
    prompt = passkey_prompts(tokenizer, [120], [0.5], seed=1)[0]
    key = tokenizer(" " + prompt.key, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([tokenizer(prompt.context)["input_ids"] + key])
    count = {"none": 0, "all-but-the-last": len(key) - 1, "all": len(key)}[favoured]
    rows = torch.arange(ids.shape[1] - 1 - len(key), ids.shape[1] - 1)[:count]  # the key's tokens' rows

    def bias(module, args, logits):
        logits[0, rows, ids[0, rows + 1]] += 30.0
        return logits

    model.lm_head.register_forward_hook(bias)
    with torch.no_grad():
        logits = model(ids).logits[0, :-1][-len(key) :]
    targets = ids[0, -len(key) :]
    want_found = bool((logits.argmax(-1) == targets).all())
    want = logits.double().log_softmax(-1).gather(-1, targets[:, None]).sum().item()
    got = passkey_recall(model, tokenizer, prompt)
    assert got.found == want_found == (favoured == "all")
    assert abs(got.loglikelihood - want) < 1e-4, (got.loglikelihood, want)
    assert (got.length, got.depth) == (120, 0.5)
