"""A base install (``pip install hf_attnscale``, no extras) evaluates: the demo, `hfa.perplexity` and `hfa.sweep`
run in a fresh process in which the extras' packages (accelerate and peft: ``[peft]``; lm-eval: ``[eval]``;
datasets, which lm-eval brings) cannot be imported. Only a run in several processes needs accelerate, and says so
in one line. (``.ci/run`` also installs the package with no extras into a venv of its own and runs the demo.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

EXTRAS = ("accelerate", "peft", "lm_eval", "datasets")
WITHOUT_EXTRAS = f"""
    import sys
    for name in {EXTRAS!r}:  # as if not installed: importing one (or a submodule) raises ModuleNotFoundError
        sys.modules[name] = None
"""


def run_without_extras(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (working directory ``cwd``, not the repo) where no extra can be imported."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env}
    environment.pop("PYTHONPATH", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(WITHOUT_EXTRAS) + textwrap.dedent(code)],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_demo_runs_without_the_extras(tmp_path):
    # hf-attnscale demo, shortened: one document, 1x and 2x the trained length; the sweep under it is hfa.sweep.
    result = run_without_extras(
        """
        from hf_attnscale.cli import main
        code = main(["demo", "--documents", "1", "--lengths", "128,256", "--out", "out", "--no-progress"])
        loaded = [name for name in EXTRAS if sys.modules.get(name) is not None]
        print("extras loaded:", loaded)
        sys.exit(code)
        """.replace("EXTRAS", repr(EXTRAS)),
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "extras loaded: []" in result.stdout
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["lengths"] == [128, 256]
    assert (tmp_path / "out" / "ppl_vs_length.png").stat().st_size > 0


def test_perplexity_and_sweep_run_without_the_extras(tmp_path):
    result = run_without_extras(
        """
        import torch
        import hf_attnscale as hfa
        from hf_attnscale import *  # the public names that need no extra
        from hf_attnscale.checkpoints.models import load_default_model
        from hf_attnscale.evaluation.corpus import builtin_documents

        model, tokenizer = load_default_model()
        ids = tokenizer(builtin_documents("heldout")[0].text, return_tensors="pt").input_ids[0, :256]
        dense = hfa.perplexity(model, ids)
        streamed = hfa.perplexity(hfa.patch(model), ids, cache=hfa.SinkCache(4, 124), chunk_size=64)
        result = hfa.sweep(hfa.unpatch(model), [ids], [128, 256], [hfa.Variant("unpatched")])
        print("ok", dense.ppl > 1, streamed.ppl > 1, result.ppl("unpatched", 256) > 1)
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ok True True True" in result.stdout


def test_several_processes_without_accelerate_say_so_in_one_line(tmp_path):
    # Under torchrun (WORLD_SIZE > 1) the processes are joined through accelerate: missing, one line names the
    # extra that brings it, before any model is loaded.
    result = run_without_extras(
        """
        from hf_attnscale.cli import main
        sys.exit(main(["eval", "--lengths", "128", "--no-progress", "--out", "out"]))
        """,
        tmp_path,
        WORLD_SIZE="2",
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        "hf-attnscale eval: error: Evaluating in 2 processes (WORLD_SIZE=2) needs accelerate: "
        'pip install "hf_attnscale[peft]"'
    ]
