"""Long texts past a real model's trained length: the Bible's books, the stdlib joined, and their lm-eval tasks."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from hf_attnscale.checkpoints.models import default_model_path
from hf_attnscale.checkpoints.real import FetchError
from hf_attnscale.evaluation import long_texts
from hf_attnscale.evaluation.corpus import builtin_documents
from hf_attnscale.evaluation.long_texts import joined_documents, split_books

PRINTED = (
    "\nGenesis 1\n\n  1 In the beginning.\n\nGenesis 2\n\n  1 Thus the heavens.\n"
    "\n1 Samuel 1\n\n  1 Now there was a certain man.\n"
    "\nSong of Solomon 1\n\n  1 The song of songs.\n\nSong of Solomon 2\n\n  1 I am the rose.\n"
)


def test_a_printed_bible_splits_at_each_books_first_chapter():
    books = split_books(PRINTED)
    assert [b.name for b in books] == ["Genesis", "1 Samuel", "Song of Solomon"]
    assert books[0].text == "Genesis 1\n\n  1 In the beginning.\n\nGenesis 2\n\n  1 Thus the heavens.\n"
    assert books[2].text.endswith("I am the rose.\n")
    assert "".join(b.text for b in books).replace("\n", "") == PRINTED.replace("\n", "")  # nothing lost


def test_joined_documents_reach_the_length_in_order_and_drop_only_a_short_tail():
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    parts = sorted(builtin_documents("heldout"), key=lambda d: d.name)
    joined = joined_documents(parts, tokenizer, 8192)
    assert len(joined) >= 2
    counts = [len(tokenizer(d.text, add_special_tokens=False)["input_ids"]) for d in joined]
    assert min(counts) >= 8192 - 2 * len(parts)  # parts are counted alone; a join merges a token or two
    whole = "\n\n".join(p.text for p in parts)
    used = "\n\n".join(d.text for d in joined)
    assert whole.startswith(used)  # in order, nothing skipped
    assert (
        len(tokenizer(whole[len(used) :], add_special_tokens=False)["input_ids"]) < 8192
    )  # only a short tail
    assert joined[0].name.startswith(parts[0].name + " .. ")


def test_without_apt_get_the_bible_is_one_line_saying_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ATTNSCALE_CACHE", str(tmp_path))
    monkeypatch.setattr(long_texts.shutil, "which", lambda tool: None if tool == "apt-get" else "/bin/true")
    with pytest.raises(FetchError, match=r"needs apt-get, which this machine does not have\.$"):
        long_texts.kjv_text(progress=False)
    assert not (tmp_path / "texts" / "kjv.txt").exists()


def test_the_long_tasks_are_indexed_and_the_stdlib_one_builds():
    lm_eval = pytest.importorskip("lm_eval.tasks")
    from hf_attnscale.integrations.lm_eval_tasks_data import TASKS_DIR

    manager = lm_eval.TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    assert {"hfa_kjv_books", "hfa_kjv_64k", "hfa_stdlib_32k"} <= set(manager.all_tasks)
    task = manager.load(["hfa_stdlib_32k"])["tasks"]["hfa_stdlib_32k"]
    docs = list(task.test_docs())
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    assert docs and all(len(tokenizer(d["text"])["input_ids"]) >= 32768 for d in docs)


@pytest.mark.slow
def test_the_bible_is_fetched_checked_and_split_into_its_66_books():
    books = long_texts.kjv_books(progress=False)
    assert len(books) == 66
    assert (books[0].name, books[-1].name) == ("Genesis", "Revelation")
    assert books[-1].text.rstrip().endswith("Amen.")
