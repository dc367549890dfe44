"""``hf-attnscale finetune``: LoRA+ with PoSE through Trainer on the shipped model; resumable, the adapter reloads
with its patch."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("peft")

from hf_attnscale.cli import main

ARGS = [
    "finetune", "--model", "builtin:tiny-llama-stdlib", "--target-length", "512", "--window", "64",
    "--save-every", "2", "--scale", "logn", "--train-length", "128", "--no-progress", "--threads", "1",
]  # fmt: skip


def adapter_weights(out):
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


class Stopped(Exception):
    pass


def test_a_stopped_run_continues_to_the_straight_runs_adapter_which_eval_reads(tmp_path, monkeypatch):
    from transformers import Trainer

    assert main([*ARGS, "--steps", "4", "--out", str(tmp_path / "straight")]) == 0
    step = Trainer.training_step
    calls = []

    def stop_at_the_third(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise Stopped  # as a run killed after its checkpoint at step 2
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "training_step", stop_at_the_third)
    with pytest.raises(Stopped):
        main([*ARGS, "--steps", "4", "--out", str(tmp_path / "resumed")])
    monkeypatch.setattr(Trainer, "training_step", step)
    assert main([*ARGS, "--steps", "4", "--out", str(tmp_path / "resumed")]) == 0
    straight, resumed = adapter_weights(tmp_path / "straight"), adapter_weights(tmp_path / "resumed")
    assert straight.keys() == resumed.keys() and any("embed_tokens" in k for k in straight)  # LoRA+
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=1e-6)
    losses = json.loads((tmp_path / "resumed" / "losses.json").read_text())["losses"]
    assert [step for step, _ in losses][-2:] == [3, 4]
    assert (tmp_path / "resumed" / "loss.png").stat().st_size > 0
    patch = json.loads((tmp_path / "straight" / "adapter" / "attn_scale.json").read_text())["attn_scale"]
    assert patch["scale"] == "logn" and patch["train_length"] == 128
    out = tmp_path / "eval"  # the adapter read back by eval, under its patch
    code = main(["eval", "--model", "builtin:tiny-llama-stdlib", "--peft", str(tmp_path / "straight" / "adapter"),
                 "--lengths", "64", "--max-documents", "1", "--out", str(out), "--no-progress"])  # fmt: skip
    assert code == 0 and '"logn"' in (out / "results.json").read_text()


def test_a_window_past_the_target_is_one_line(capsys):
    assert main([*ARGS, "--steps", "1", "--window", "1024"]) == 2
    assert capsys.readouterr().err.strip() == (
        "hf-attnscale finetune: error: --window (1024) must not pass --target-length (512)."
    )
