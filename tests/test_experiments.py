"""``experiments/evidence.py`` end to end on tiny runs trained by the package's own trainers (slow: minutes)."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest
import torch

from hf_attnscale.checkpoints.models import default_model_path
from hf_attnscale.training import lm, mlm

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TINY = ["--hidden", "32", "--layers", "2", "--heads", "2", "--intermediate", "64", "--batch-size", "2"]


@pytest.fixture
def evidence(monkeypatch):
    """``experiments/evidence.py`` imported as its command runs it: with ``experiments/`` first on the path."""
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    return importlib.import_module("evidence")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("runs")
    lm_args = ["--tokenizer", str(default_model_path()), "--bos", "--context", "128", "--steps", "4"]
    lm_args += ["--snapshot-every", "2", "--eval-lengths", "128", *TINY]
    for name, patch in {
        "lm-vanilla": [],
        "lm-zerokv": ["--zero-kv"],
        "lm-sink": ["--sink-logit", "learnable"],
        "lm-logn": ["--scale", "logn", "--no-clamp"],
        "lm-vanilla-lr6e-3": ["--lr", "6e-3"],
    }.items():
        lm.main(["--out", str(runs / name), *lm_args, *patch])
    for name, patch in {"lm-vanilla-s1": [], "lm-logn-s1": ["--scale", "logn", "--no-clamp"]}.items():
        lm.main(["--out", str(runs / name), *lm_args, "--seed", "1", *patch])  # a second decoder seed
    for seed in (0, 1, 2):
        for name, patch in {"o": [], "e": ["--scale", "logn", "--scale-length", "512", "--no-clamp"]}.items():
            mlm.main(
                [
                    "--out",
                    str(runs / f"mlm-{name}-s{seed}"),
                    "--seed",
                    str(seed),
                    "--steps",
                    "3",
                    *TINY,
                    *patch,
                ]
            )
    return runs


def test_every_section_writes_its_table_data_and_figure(evidence, runs, tmp_path, capsys):
    from sections.heldout import STREAM_LENGTH
    from sections.streaming import STREAM_METHODS

    evidence.main(["--runs", str(runs), "--out", str(tmp_path), "--threads", "1"])
    printed = capsys.readouterr().out
    for section in evidence.SECTIONS:
        assert f"## {section}\n" in printed
        table = (tmp_path / f"{section}.md").read_text()
        assert table.startswith("| ") and (tmp_path / f"{section}.png").stat().st_size > 10_000
        assert json.loads((tmp_path / f"{section}.json").read_text())
    sinks = json.loads((tmp_path / "sinks.json").read_text())
    assert set(sinks) == {"vanilla", "zero_kv", "learnable sink"} and set(sinks["vanilla"]) == {"2", "4"}
    assert sinks["vanilla"]["4"]["exit"] == 0 and sinks["zero_kv"]["4"]["exit"] > 0
    streaming = json.loads((tmp_path / "streaming.json").read_text())
    # While the smallest cache (32) still holds the whole stream, every method predicts alike.
    curves = list(streaming["vanilla"].values())
    assert len(curves) == len(STREAM_METHODS) and len(curves[0]) == STREAM_LENGTH - 1
    assert all(c[:31] == pytest.approx(curves[0][:31], abs=1e-4) for c in curves)
    decoder = json.loads((tmp_path / "decoder.json").read_text())
    assert decoder["seeds"] == [0, 1] and "(seed 2: needs finished runs at" in printed
    cells = [seeds for row in decoder["perplexity"].values() for seeds in row.values()]
    assert len(decoder["perplexity"]) == 8 and all(len(c) == 2 and all(map(math.isfinite, c)) for c in cells)
    assert all(c[0] != c[1] for c in cells)  # the seeds are different models
    assert "(min..max) over seeds 0, 1" in (tmp_path / "decoder.md").read_text()
    targets = json.loads((tmp_path / "targets.json").read_text())
    assert list(targets) == ["4 x 256, weight decay 0.1", "4 x 256, peak lr 6e-3"]
    assert "weight decay 0.5: no finished run" in printed
    assert targets["4 x 256, weight decay 0.1"]["trained_length"] == 128
    # (targets, layers, heads)
    mass = torch.tensor(list(targets["4 x 256, weight decay 0.1"]["targets"].values()))
    assert mass.shape == (5, 2, 2) and mass.min() >= -1e-6 and mass.sum(0) == pytest.approx(torch.ones(2, 2))
    rates = json.loads((tmp_path / "rates.json").read_text())
    assert list(rates) == ["peak lr 2e-3", "peak lr 6e-3"] and "peak lr 4e-3: no finished run" in printed
    fast = rates["peak lr 6e-3"]
    assert set(fast["over_training"]) == {"2", "4"} and fast["final"] == fast["over_training"]["4"]
    assert rates["peak lr 2e-3"]["streaming"] == streaming["vanilla"]  # the same model, read alike
    assert (tmp_path / "rates-sinks.png").stat().st_size > 10_000
    mlm_table = (tmp_path / "mlm.md").read_text()
    assert mlm_table.count("\n| O |") + mlm_table.count("\n| E |") == 2


def test_a_missing_run_skips_its_section_and_says_which(evidence, tmp_path, capsys):
    evidence.main(["--runs", str(tmp_path / "none"), "--out", str(tmp_path), "--only", "decoder", "mlm"])
    printed = capsys.readouterr().out
    assert "## decoder: skipped (no seed of (0, 1, 2) has both" in printed and "## mlm: skipped" in printed
    assert not (tmp_path / "decoder.md").exists()
