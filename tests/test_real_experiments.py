"""``experiments/real_models.py`` end to end on the real SmolLM2 checkpoint, every section on short inputs
(``--quick``; slow: minutes). The checkpoint is fetched as the user fetches it."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def real_models(monkeypatch):
    """``experiments/real_models.py`` imported as its command runs it: with ``experiments/`` first on the path."""
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    return importlib.import_module("real_models")


def test_every_section_writes_its_table_data_and_figure(real_models, tmp_path, capsys):
    out, work = tmp_path / "out", tmp_path / "work"
    argv = [
        "--out",
        str(out),
        "--work",
        str(work),
        "--models",
        "smollm2-135m",
        "--texts",
        "stdlib",
        "--quick",
    ]
    real_models.main(argv)
    for section in real_models.SECTIONS:
        table = (out / f"{section}.md").read_text()
        assert table.startswith(("|", "**")), section
        assert json.loads((out / f"{section}.json").read_text()), section
    for figure in (
        "streaming-smollm2-135m-stdlib",
        "caches",
        "million",
        "dense-smollm2-135m-stdlib",
        "outliers-smollm2-135m",
        "finetune",
        "recall",
    ):
        assert (out / f"{figure}.png").stat().st_size > 10_000, figure
    sinks = json.loads((out / "sinks.json").read_text())["smollm2-135m/stdlib"]
    assert list(sinks) == ["0+1024", "1+1023", "2+1022", "4+1020", "8+1016", "4 newlines+1020"]
    assert sinks["4+1020"] < sinks["0+1024"]  # even on 1,024 tokens the sinks matter on this model
    (first_block,) = json.loads((out / "million.json").read_text())
    # the control reads the stream's first block through a fresh cache, as the stream itself read it
    assert first_block["fresh_cache_ppl"] == pytest.approx(first_block["block_ppl"], rel=1e-5)
    finetune = json.loads((out / "finetune.json").read_text())
    assert (
        finetune["LoRA + learnable sink"]["sink_logits"]
        and not finetune["LoRA alone (control)"]["sink_logits"]
    )

    # A second run reads every number from the cells: nothing is computed again.
    capsys.readouterr()
    real_models.main(argv)
    assert "computing" not in capsys.readouterr().out
