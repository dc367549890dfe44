"""``--model`` names on the command line (issue 46): a near miss of a real checkpoint's name, and a name that
is nothing at all, are one line that lists the real checkpoints' names, as ``hf-attnscale fetch`` does."""

from __future__ import annotations

import huggingface_hub
import pytest

from hf_attnscale.cli import main

KNOWN = "smollm2-135m, gemma3-270m, minilm-l6"


@pytest.fixture(autouse=True)
def _hub_offline(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.mark.parametrize("command", ["diagnose", "eval", "fetch"])
def test_a_near_miss_names_the_closest_and_lists_the_names(command, tmp_path, capsys):
    args = {"diagnose": ["--model"], "eval": ["--lengths", "16", "--model"], "fetch": []}[command]
    extra = ["--out", str(tmp_path)] if command != "fetch" else ["--cache-dir", str(tmp_path)]
    code = main([command, *args, "smollm2-135n", *extra])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err == (
        f"hf-attnscale {command}: error: Unknown real checkpoint 'smollm2-135n' (did you mean 'smollm2-135m'?); "
        f"known: {KNOWN}.\n"
    )


def test_an_unknown_model_lists_the_real_checkpoints(tmp_path, capsys):
    code = main(["diagnose", "--model", "no-such-model", "--out", str(tmp_path)])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("hf-attnscale diagnose: error: Model 'no-such-model' is not a local directory")
    assert f"a real checkpoint's name ({KNOWN})" in err
