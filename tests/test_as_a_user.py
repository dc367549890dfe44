"""A user's round trip outside this repo, run as a user runs it: fresh processes in empty directories, the
installed console script, saved and reloaded models, a Hub-style id served from a local cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import VOCAB, tiny_lm_with_tokenizer, tiny_mlm_with_tokenizer, tiny_model

import hf_attnscale as hfa
from hf_attnscale.cli import main
from hf_attnscale.evaluation.corpus import builtin_documents

LEARNABLE = {"scale": "ssmax", "train_length": 4, "sink_logit": "learnable"}
SCRIPT = Path(sys.executable).with_name("hf-attnscale")


def run_python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter whose working directory is ``cwd`` (not the repo)."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    environment.pop("PYTHONPATH", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A patched model with learned sink / SSMax values, saved; and its logits on fixed inputs."""
    model = hfa.patch(tiny_model("llama"), **LEARNABLE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".hfa." in name:
                p.copy_(torch.randn_like(p) + (1.0 if name.endswith("ssmax") else 0.0))
    path = tmp_path_factory.mktemp("saved") / "model"
    model.save_pretrained(path)
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(ids).logits
    return path, ids, logits


LOAD_AND_SCORE = """
    import sys, torch, hf_attnscale as hfa
    from transformers import AutoModelForCausalLM
    ids = torch.tensor({ids})
    model = {load}
    with torch.no_grad():
        torch.save(model(ids).logits, "logits.pt")
    print("patch:", hfa.get_config(model))
"""


@pytest.mark.parametrize("load", ["hfa", "plain+patch"])
def test_learned_patch_comes_back_in_a_fresh_process(trained, tmp_path, load):
    path, ids, want = trained
    loader = {
        "hfa": f"hfa.from_pretrained(AutoModelForCausalLM, {str(path)!r})",
        "plain+patch": f"hfa.patch(AutoModelForCausalLM.from_pretrained({str(path)!r}).eval())",
    }[load]
    result = run_python(LOAD_AND_SCORE.format(ids=ids.tolist(), load=loader), tmp_path)
    assert result.returncode == 0, result.stderr
    assert "patch: AttnScaleConfig(scale='ssmax'" in result.stdout
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), want, atol=1e-6, rtol=1e-6)
    if load == "hfa":  # the patch's weights are expected: no load report about them
        assert "UNEXPECTED" not in result.stderr and "LOAD REPORT" not in result.stderr


def _hub_cache(path: Path, cache: Path, repo: str) -> None:
    """Lay ``path`` out as the Hugging Face cache would hold ``repo`` (what a mirror or a download leaves)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in path.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())


@pytest.mark.parametrize("load", ["hfa", "plain+patch"])
def test_hub_style_id_from_a_local_cache(trained, tmp_path, load):
    path, ids, want = trained
    _hub_cache(path, tmp_path / "cache", "hfa-test/tiny-patched")
    loader = {
        "hfa": "hfa.from_pretrained(AutoModelForCausalLM, 'hfa-test/tiny-patched')",
        "plain+patch": "hfa.patch(AutoModelForCausalLM.from_pretrained('hfa-test/tiny-patched').eval())",
    }[load]
    result = run_python(
        LOAD_AND_SCORE.format(ids=ids.tolist(), load=loader),
        tmp_path,
        HF_HUB_CACHE=str(tmp_path / "cache"),
        HF_HUB_OFFLINE="1",
    )
    assert result.returncode == 0, result.stderr
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), want, atol=1e-6, rtol=1e-6)


@pytest.fixture(scope="module")
def saved_lm(tmp_path_factory):
    """A tiny causal LM with a tokenizer, saved with a logn + zero_kv patch."""
    model, tokenizer = tiny_lm_with_tokenizer()
    hfa.patch(model, scale="logn", train_length=16, zero_kv=True)
    path = tmp_path_factory.mktemp("lm") / "patched"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    data = path.parent / "docs.jsonl"
    data.write_text(
        "".join(json.dumps({"text": d.text[:3000]}) + "\n" for d in builtin_documents("heldout")[:2])
    )
    return path, data


def _console(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(SCRIPT), *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_eval_command_runs_the_saved_patch(saved_lm, tmp_path, capsys):
    path, data = saved_lm
    common = ["eval", "--model", str(path), "--data", str(data), "--lengths", "16,32", "--device", "cpu"]
    result = _console(*common, "--baseline", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "| saved: logn(L=16) + zero-kv |" in result.stdout and "| unpatched |" in result.stdout
    rows = json.loads((tmp_path / "hf-attnscale-eval" / "results.json").read_text())["rows"]
    ppl = {(r["variant"], r["length"]): r["ppl"] for r in rows}
    assert ppl[("saved: logn(L=16) + zero-kv", 32)] != pytest.approx(ppl[("unpatched", 32)], rel=1e-3)
    # Options on the command line replace the saved patch, and say so (in this process: the console's path is above).
    assert main([*common, "--scale", "logn", "--train-length", "16", "--out", str(tmp_path / "o2")]) == 0
    out = capsys.readouterr().out
    assert "note: the patch options given replace the patch saved with the model" in out
    assert "| logn(L=16) |" in out
    # The same patch as the saved one replaces nothing: no note.
    same = ["--scale", "logn", "--train-length", "16", "--zero-kv", "--out", str(tmp_path / "o3")]
    assert main([*common, *same]) == 0
    out = capsys.readouterr().out
    assert "| logn(L=16) + zero-kv |" in out and "replace the patch saved" not in out


def test_eval_measures_an_encoder_by_mlm(saved_lm, tmp_path, capsys):
    _, data = saved_lm  # two short documents: pseudo-perplexity costs a forward per 16 scored tokens
    bert, tokenizer = tiny_mlm_with_tokenizer()
    path = tmp_path / "bert"
    bert.save_pretrained(path)
    tokenizer.save_pretrained(path)
    common = ["eval", "--model", str(path), "--data", str(data), "--lengths", "16,32", "--device", "cpu"]
    result = _console(*common, "--scale", "logn", "--train-length", "16", "--baseline", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Pseudo-perplexity and MLM accuracy" in result.stdout
    assert "| variant | PPPL 16 (1x) | PPPL 32 (2x) | acc 16 (1x) | acc 32 (2x) | tok/s |" in result.stdout
    saved = json.loads((tmp_path / "hf-attnscale-eval" / "results.json").read_text())
    assert saved["measure"] == "pseudo-perplexity" and all(0 <= r["accuracy"] <= 1 for r in saved["rows"])
    assert main([*common, "--measure", "perplexity", "--out", str(tmp_path / "o2")]) == 2
    assert "is a masked LM (an encoder): causal perplexity means nothing for it" in capsys.readouterr().err


@pytest.mark.parametrize("value", [np.int64(512), torch.tensor(512), 512])
def test_integer_train_lengths_of_any_kind_are_accepted(value):
    config = hfa.AttnScaleConfig(scale="logn", train_length=value)
    assert config.train_length == 512 and type(config.train_length) is int


@pytest.mark.parametrize(
    ("value", "kind"), [(512.0, "float"), ("512", "str"), (torch.tensor(512.0), "Tensor"), (True, "bool")]
)
def test_other_train_lengths_are_refused_by_type(value, kind):
    with pytest.raises(ValueError, match=rf"train_length must be an int >= 2, got .* of type {kind}"):
        hfa.AttnScaleConfig(scale="logn", train_length=value)


@pytest.mark.parametrize("bad", ["model", None, 3])
def test_patching_what_is_not_a_model_says_so(bad):
    with pytest.raises(ValueError, match=rf"Expected a transformers model .* got {type(bad).__name__}"):
        hfa.patch(bad)


def test_a_jsonl_field_of_the_wrong_type_is_named(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": 12345}\n')
    code = main(["eval", "--data", str(data), "--lengths", "16", "--out", str(tmp_path / "o")])
    assert code == 2
    assert "field 'text' holds int, not a string" in capsys.readouterr().err


def test_unavailable_backend_and_unreachable_hub_fail_in_one_line(saved_lm, tmp_path, capsys):
    path, data = saved_lm
    common = ["eval", "--data", str(data), "--lengths", "16", "--device", "cpu"]
    flash = [*common, "--model", str(path), "--attn-implementation", "flash_attention_2"]
    assert main([*flash, "--out", str(tmp_path / "o")]) == 2
    assert "attn_implementation='flash_attention_2' cannot run here" in capsys.readouterr().err
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty-cache")}
    result = subprocess.run(
        [str(SCRIPT), *common, "--model", "no-such-org/no-such-model"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "is not a local directory and is not in the Hugging Face cache" in result.stderr
    assert "HF_HUB_OFFLINE is set" in result.stderr


def test_the_command_line_loads_nothing_heavy_for_help(tmp_path):
    result = run_python(
        """
        import sys, hf_attnscale.cli as cli
        cli.build_parser()
        print(sorted(m for m in ("torch", "transformers", "lm_eval", "peft") if m in sys.modules))
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_demo_uses_every_core_by_default():
    from hf_attnscale.cli import build_parser

    assert build_parser().parse_args(["demo"]).threads is None  # torch's default: one thread per core


def test_rows_are_printed_as_each_variant_finishes(saved_lm, tmp_path, capsys, monkeypatch):
    """The second variant fails: the first one's row must already be out."""
    from hf_attnscale.evaluation import sweep as sweep_module

    path, data = saved_lm
    real = sweep_module._score_variant
    calls = []

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("stopped on purpose")
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep_module, "_score_variant", second_fails)
    argv = [
        "eval",
        "--model",
        str(path),
        "--data",
        str(data),
        "--lengths",
        "16",
        "--baseline",
        "--no-progress",
    ]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    out, err = capsys.readouterr()
    assert "| unpatched |" in out and "stopped on purpose" in err


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    """The package built as a wheel and installed into a fresh venv (its dependencies borrowed from this one)."""
    root = Path(__file__).resolve().parents[1]
    work = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(work),
            str(root),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = work.glob("hf_attnscale-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    # This environment's packages (torch, transformers, lm-eval...), but not its editable hf_attnscale:
    # a .pth path line adds a directory without running the .pth files inside it.
    borrowed = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (site / "borrowed.pth").write_text(borrowed + "\n")
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--no-deps",
            "-q",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr
    return venv


def test_wheel_runs_the_readme_lm_eval_command_from_an_empty_directory(wheel_venv, tmp_path):
    python = wheel_venv / "bin" / "python"
    where = subprocess.run(
        [str(python), "-c", "import hf_attnscale, sys; print(hf_attnscale.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert str(wheel_venv) in where.stdout, where.stdout + where.stderr  # the installed copy, not the repo
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [
            str(wheel_venv / "bin" / "hf-attnscale"),
            "lm-eval",
            "--model",
            "hf-attnscale",
            "--model_args",
            "pretrained=builtin:tiny-llama-stdlib,max_length=1024",
            "--tasks",
            "hfa_stdlib_heldout_1k",
            "--device",
            "cpu",
            "--limit",
            "1",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "hfa_stdlib_heldout_1k" in result.stdout and "word_perplexity" in result.stdout
