"""Perplexity by position in lm-eval: the ppl_<bucket> metrics against hfa.perplexity's per-token NLL."""

from __future__ import annotations

import math
import pickle
import warnings

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import hf_attnscale as hfa  # noqa: E402
from hf_attnscale.checkpoints.models import default_model_path  # noqa: E402
from hf_attnscale.evaluation.corpus import Document  # noqa: E402
from hf_attnscale.integrations.lm_eval_model import (  # noqa: E402
    DocumentLogLikelihood,
    HFAttnScaleLM,
    ModelArgsError,
)
from hf_attnscale.integrations.lm_eval_tasks_data import TASKS_DIR, builtin_dataset, long_dataset  # noqa: E402

TASK = "hfa_stdlib_heldout"
DOCUMENTS = 3
FIRST_TOKENS = 300
EDGES = (40, 100, 250)


@pytest.fixture(scope="module")
def shipped():
    """The shipped model (real trained weights) and its tokenizer."""
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def documents() -> list[str]:
    """The task's documents as lm-eval reads them (its first DOCUMENTS, each cut to FIRST_TOKENS tokens)."""
    texts = builtin_dataset(first_tokens=FIRST_TOKENS)["test"]["text"][:DOCUMENTS]
    assert len(texts) == DOCUMENTS
    return texts


def evaluate(lm, **metadata) -> dict:
    manager = TaskManager(
        include_path=str(TASKS_DIR),
        include_defaults=False,
        metadata={"first_tokens": FIRST_TOKENS, **metadata},
    )
    results = lm_eval.simple_evaluate(
        model=lm, tasks=[TASK], task_manager=manager, limit=DOCUMENTS, bootstrap_iters=0
    )
    return results["results"][TASK]


def expected_by_bucket(per_document: list[torch.Tensor], edges) -> dict[str, float]:
    """Each bucket's log-perplexity from per-token NLL (position 0: the document's first token)."""
    starts, ends = [0, *edges], [*edges, None]
    labels = ["0-40", "40-100", "100-250", "250+"]
    expected = {}
    for label, start, end in zip(labels, starts, ends):
        parts = torch.cat([nll[start:end].double() for nll in per_document])
        if parts.numel():
            expected[label] = parts.mean().item()
    return expected


def assert_buckets(metrics: dict, expected: dict[str, float]) -> None:
    reported = {
        k.removeprefix("ppl_").removesuffix(",none"): v
        for k, v in metrics.items()
        if k.startswith("ppl_") and "_stderr" not in k
    }
    assert sorted(reported) == sorted(expected)
    for label, log_ppl in expected.items():
        assert math.log(reported[label]) == pytest.approx(log_ppl, abs=1e-4), label


def document_ids(tokenizer, text: str) -> torch.Tensor:
    """The tokens lm-eval scores: the prefix token, then the text as HFLM encodes it (special tokens too)."""
    return torch.tensor([tokenizer.bos_token_id, *tokenizer(text)["input_ids"]])


def test_dense_buckets_equal_hfa_perplexity_over_the_same_positions(shipped, documents):
    model, tokenizer = shipped
    hfa.unpatch(model)
    lm = HFAttnScaleLM(pretrained=model, tokenizer=tokenizer, max_length=512, scale="logn", train_length=64)
    metrics = evaluate(lm, position_buckets="40;100;250")
    per_document = [
        hfa.perplexity(lm.model, document_ids(tokenizer, t), progress=False).nll for t in documents
    ]
    assert min(map(len, per_document)) > 250  # every bucket reached
    assert_buckets(metrics, expected_by_bucket(per_document, EDGES))
    # The patch is in the scores: unpatched, the positions past the trained 64 score differently.
    hfa.unpatch(lm.model)
    plain = [hfa.perplexity(lm.model, document_ids(tokenizer, t), progress=False).nll for t in documents]
    assert (
        abs(expected_by_bucket(plain, EDGES)["100-250"] - expected_by_bucket(per_document, EDGES)["100-250"])
        > 1e-3
    )


def test_streamed_buckets_equal_hfa_perplexity_through_the_same_sink_cache(shipped, documents):
    model, tokenizer = shipped
    hfa.unpatch(model)
    lm = HFAttnScaleLM(pretrained=model, tokenizer=tokenizer, sink_tokens=4, window=60, chunk_size=32)
    metrics = evaluate(lm, position_buckets=[40, 100, 250])  # a list, as a task YAML's metadata gives it
    per_document = [
        hfa.perplexity(lm.model, document_ids(tokenizer, t), cache=hfa.SinkCache(4, 60), progress=False).nll
        for t in documents
    ]
    assert_buckets(metrics, expected_by_bucket(per_document, EDGES))
    dense = [hfa.perplexity(lm.model, document_ids(tokenizer, t), progress=False).nll for t in documents]
    assert (
        abs(expected_by_bucket(dense, EDGES)["250+"] - expected_by_bucket(per_document, EDGES)["250+"]) > 1e-3
    )


def test_dense_documents_longer_than_max_length_are_scored_in_lm_evals_own_windows(shipped, documents):
    """The per-token path reads HFLM's windows: each document's log-likelihood equals HFLM's own."""
    model, tokenizer = shipped
    hfa.unpatch(model)
    lm = HFAttnScaleLM(pretrained=model, tokenizer=tokenizer, max_length=70, batch_size=2)
    requests = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(documents)]
    ours = lm.loglikelihood_rolling(requests)
    theirs = HFLM.loglikelihood_rolling(lm, requests)
    for score, reference, text in zip(ours, theirs, documents):
        assert isinstance(score, DocumentLogLikelihood) and len(score.nll) == len(
            tokenizer(text)["input_ids"]
        )
        assert float(score) == pytest.approx(reference, abs=1e-4 * len(score.nll))
        assert float(score) == pytest.approx(-score.nll.double().sum().item(), abs=1e-6)
    restored = pickle.loads(pickle.dumps(ours[0]))  # lm-eval's request cache pickles results
    assert float(restored) == float(ours[0]) and torch.equal(restored.nll, ours[0].nll)


def test_default_buckets_and_a_model_type_without_per_token_scores(shipped):
    model, tokenizer = shipped
    hfa.unpatch(model)
    ours = evaluate(HFAttnScaleLM(pretrained=model, tokenizer=tokenizer, max_length=512))
    assert [k for k in ours if k.startswith("ppl_") and "stderr" not in k] == [
        "ppl_0-2k,none"
    ]  # 300 tokens: the first bucket only
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stock = evaluate(HFLM(pretrained=model, tokenizer=tokenizer, max_length=512))
    assert not [k for k in stock if k.startswith("ppl_")]
    assert any("per-token scores" in str(w.message) for w in caught)
    assert stock["word_perplexity,none"] == pytest.approx(ours["word_perplexity,none"], rel=1e-4)


@pytest.mark.parametrize(
    "value",
    ["abc", "4096;2048", "0;10", [], "2048;2048"],
    ids=["text", "decreasing", "zero", "empty", "twice"],
)
def test_bad_buckets_are_one_line_before_the_model_loads(value):
    with pytest.raises(ModelArgsError, match="position_buckets must be") as err:
        HFAttnScaleLM(pretrained="/nonexistent/model", position_buckets=value)
    assert "\n" not in str(err.value)


def test_first_tokens_cuts_long_documents_in_the_evaluated_models_tokens(monkeypatch, capsys):
    """Each document cut to its first ``first_tokens`` tokens; one shorter is read whole, and a note says so."""
    from hf_attnscale.integrations import lm_eval_tasks_data

    books = [Document("Genesis", "In the beginning " * 400), Document("Exodus", "Now these are " * 300)]
    monkeypatch.setattr(lm_eval_tasks_data, "kjv_books", lambda: books)
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    cut = long_dataset("kjv", first_tokens=100, pretrained=str(default_model_path()))["test"]
    assert cut["name"] == ["Genesis", "Exodus"]
    for text, book in zip(cut["text"], books):
        assert book.text.startswith(text)
        assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == 100
    assert "note:" not in capsys.readouterr().err
    exodus = len(tokenizer(books[1].text, add_special_tokens=False)["input_ids"])
    genesis = len(tokenizer(books[0].text, add_special_tokens=False)["input_ids"])
    assert exodus < genesis
    cut = long_dataset("kjv", first_tokens=genesis, pretrained=str(default_model_path()))["test"]
    assert cut["text"] == [books[0].text, books[1].text]
    (note,) = capsys.readouterr().err.splitlines()
    assert note.startswith(f"note: 1 of 2 documents have fewer than first_tokens={genesis}")
    assert f"(the shortest {exodus})" in note


def test_the_joined_bible_starts_at_genesis_and_is_cut_in_the_evaluated_models_tokens(monkeypatch):
    """``hfa_kjv_64k``'s text: the books joined in order into documents of at least ``min_tokens`` tokens, each
    cut to ``first_tokens``; the task YAML asks for 64k documents (``--limit 1`` reads the first)."""
    from hf_attnscale.integrations import lm_eval_tasks_data

    books = [Document(name, f"{name} says hello. " * 60) for name in ("Genesis", "Exodus", "Leviticus")]
    monkeypatch.setattr(lm_eval_tasks_data, "kjv_books", lambda: books)
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    per_book = [len(tokenizer(book.text, add_special_tokens=False)["input_ids"]) for book in books]
    assert sum(per_book[:2]) > max(per_book) + 1
    data = long_dataset(
        "kjv-joined",
        min_tokens=max(per_book) + 1,
        first_tokens=per_book[0] + 50,
        pretrained=str(default_model_path()),
    )["test"]
    assert data["name"] == ["Genesis .. Exodus"]  # Leviticus alone is too short: left out
    (text,) = data["text"]
    assert text.startswith(books[0].text + "\n\n" + "Exodus says")
    assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == per_book[0] + 50
    with pytest.raises(ValueError, match="'kjv-joined'"):
        long_dataset("bible")
    task = (TASKS_DIR / "hfa_kjv_64k.yaml").read_text()
    assert "text: kjv-joined" in task and "min_tokens: 65536" in task and "first_tokens: 65536" in task
