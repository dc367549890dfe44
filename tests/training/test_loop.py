"""The trainers as users run them: a run stopped and continued equals one run straight through."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from hf_attnscale.checkpoints.models import default_model_path
from hf_attnscale.evaluation.corpus import builtin_documents
from hf_attnscale.training import lm, mlm

TINY = ["--hidden", "32", "--layers", "2", "--heads", "2", "--intermediate", "64", "--batch-size", "2"]


@pytest.fixture(autouse=True)
def small_corpus(monkeypatch):
    """A slice of each split: tokenizing and scoring the whole corpus in every run would take most of the time."""
    docs = {"train": builtin_documents("train")[:30], "heldout": builtin_documents("heldout")[:2]}
    for trainer in (lm, mlm):
        monkeypatch.setattr(trainer, "builtin_documents", docs.__getitem__)


def lm_args(out, *extra: str) -> list[str]:
    return [
        *("--out", str(out), "--tokenizer", str(default_model_path()), "--bos", "--context", "32"),
        *("--steps", "4", "--save-every", "1", "--eval-lengths", *TINY, *extra),
    ]


def mlm_args(out, *extra: str) -> list[str]:
    return ["--out", str(out), "--steps", "4", "--save-every", "1", "--eval-lengths", "64", *TINY, *extra]


def assert_same_run(straight, resumed) -> None:
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    info_a = json.loads((straight / "training_info.json").read_text())
    info_b = json.loads((resumed / "training_info.json").read_text())
    assert info_a["loss_log"] == info_b["loss_log"]
    assert info_a["settings"] == info_b["settings"]


@pytest.mark.parametrize("trainer, args", [(lm, lm_args), (mlm, mlm_args)], ids=["lm", "mlm"])
def test_stopped_and_continued_run_equals_one_straight_run(trainer, args, tmp_path, capsys):
    trainer.main(args(tmp_path / "straight"))
    trainer.main(args(tmp_path / "resumed", "--stop-after", "2"))
    assert "stopped at step 2/4; run the same command again" in capsys.readouterr().out
    assert not (tmp_path / "resumed" / "training_info.json").exists()
    trainer.main(args(tmp_path / "resumed"))
    assert "at step 2/4" in capsys.readouterr().out
    assert_same_run(tmp_path / "straight", tmp_path / "resumed")

    info = json.loads((tmp_path / "straight" / "training_info.json").read_text())
    assert info["steps"] == 4 and info["command"].startswith(f"python -m {trainer.MODULE} --out ")
    assert info["tokens_seen"] == 4 * 2 * (32 if trainer is lm else 64)
    assert info["parameters"] > 0 and info["patch"] is None
    assert info["train_seconds_this_session"] > 0 and info["train_tokens_per_second"] > 0
    assert "out" not in info["settings"] and "threads" not in info["settings"]


def test_continuing_with_other_settings_names_them(tmp_path):
    lm.main(lm_args(tmp_path / "run", "--stop-after", "1"))
    with pytest.raises(ValueError, match=r"differ in \['lr'\].*another --out"):
        lm.main(lm_args(tmp_path / "run", "--lr", "1e-4"))
    # A flag that does not change the weights may change between sessions.
    lm.main(lm_args(tmp_path / "run", "--threads", "1", "--save-every", "2"))
    assert json.loads((tmp_path / "run" / "training_info.json").read_text())["steps"] == 4


def test_a_patched_run_records_its_patch(tmp_path):
    lm.main(lm_args(tmp_path / "run", "--zero-kv", "--steps", "1"))
    info = json.loads((tmp_path / "run" / "training_info.json").read_text())
    assert info["patch"]["zero_kv"] is True
    assert info["settings"]["zero_kv"] is True
