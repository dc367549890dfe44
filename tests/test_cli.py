"""The hf-attnscale command: demo and eval end to end, and one clear line for each user error."""

from __future__ import annotations

import json
import re

import pytest
from conftest import tiny_lm_with_tokenizer

from hf_attnscale.cli import build_parser, main
from hf_attnscale.evaluation.corpus import builtin_documents
from hf_attnscale.evaluation.models import default_model_path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model, tokenizer = tiny_lm_with_tokenizer()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    texts = [doc.text[:3000] for doc in builtin_documents("heldout")[:3]]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_eval_writes_table_json_and_plot(model_dir, data_file, tmp_path, capsys):
    out_dir = tmp_path / "eval"
    code, out, err = run(
        capsys,
        *("eval", "--model", str(model_dir), "--data", str(data_file), "--lengths", "16,32,64"),
        *("--scale", "logn", "--train-length", "16", "--sink-tokens", "2", "--window", "14"),
        *("--baseline", "--device", "cpu", "--out", str(out_dir), "--no-progress"),
    )
    assert code == 0, err
    name = "logn(L=16) + sink+window (2+14)"
    assert "| variant | 16 (1x) | 32 (2x) | 64 (4x) | tok/s |" in out
    assert f"| {name} |" in out and "| unpatched |" in out

    saved = json.loads((out_dir / "results.json").read_text())
    assert saved["command"].startswith("hf-attnscale eval --model ")
    assert saved["model"] == str(model_dir) and saved["device"] == "cpu"
    assert len(saved["documents"]) == 3
    assert saved["variants"][1] == {
        "name": name,
        "patch": {"scale": "logn", "train_length": 16},
        "sink_tokens": 2,
        "window": 14,
    }
    ppl = {(r["variant"], r["length"]): r["ppl"] for r in saved["rows"]}
    # At the trained length both read every segment alike; past it the patch changes the result.
    assert ppl[(name, 16)] == pytest.approx(ppl[("unpatched", 16)], rel=1e-5)
    assert ppl[(name, 64)] != pytest.approx(ppl[("unpatched", 64)], rel=1e-4)
    assert (out_dir / "ppl_vs_length.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "{tmp}/no-such-model"], r"Model directory '.*no-such-model' does not exist"),
        (["--data", "{tmp}/missing.jsonl"], r"Data file '.*missing.jsonl' does not exist"),
        (["--lengths", "64,8k"], r"No document has at least 8192 tokens .* Ask for lengths up to \d+ tokens"),
        (["--scale", "logn"], r"--scale logn needs --train-length N"),
        (["--sink-tokens", "4"], r"--sink-tokens needs --window W"),
        (["--zero-kv", "--sink-logit", "1.0"], r"zero_kv=True cannot be combined with a sink logit"),
        (["--device", "cuda:7"], r"torch sees no CUDA GPU|only \d+ CUDA GPU"),
    ],
)
def test_eval_errors_are_one_clear_line(model_dir, data_file, tmp_path, capsys, args, message):
    base = {"--model": str(model_dir), "--data": str(data_file), "--lengths": "16,32"}
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    for flag in list(base):
        if flag in args:
            del base[flag]
    argv = [
        "eval",
        *[x for kv in base.items() for x in kv],
        *args,
        "--out",
        str(tmp_path / "o"),
        "--no-progress",
    ]
    code, _, err = run(capsys, *argv)
    assert code == 2
    # transformers may draw a weight-loading bar first; the error is one line of its own.
    last = err.strip().splitlines()[-1]
    assert last.startswith("hf-attnscale eval: error: "), err
    assert re.search(message, last), err
    assert not (tmp_path / "o").exists()


def test_eval_rejects_a_model_the_patch_does_not_support(data_file, tmp_path, capsys):
    from transformers import BloomConfig, BloomForCausalLM

    path = tmp_path / "bloom"
    _, tokenizer = tiny_lm_with_tokenizer()
    BloomForCausalLM(
        BloomConfig(vocab_size=len(tokenizer), hidden_size=32, n_layer=1, n_head=2)
    ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    common = ["eval", "--model", str(path), "--data", str(data_file), "--lengths", "16,32", "--no-progress"]
    common += ["--attn-implementation", "eager"]  # Bloom has no sdpa
    code, _, err = run(
        capsys, *common, "--scale", "logn", "--train-length", "16", "--out", str(tmp_path / "a")
    )
    assert code == 2
    assert "model_type 'bloom'" in err and "AttentionInterface" in err and "supported_model_types" in err
    # Unpatched, any causal LM works.
    code, out, err = run(capsys, *common, "--out", str(tmp_path / "b"))
    assert code == 0, err
    assert "| unpatched |" in out


def test_bad_lengths_are_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["eval", "--lengths", "1.5k"])
    assert exit_info.value.code == 2
    assert "write token counts such as 512,1k,2k,4k" in capsys.readouterr().err


@pytest.mark.skipif(not (default_model_path() / "config.json").is_file(), reason="shipped checkpoint missing")
def test_demo_runs_the_shipped_model(tmp_path, capsys):
    # The full demo takes minutes; one document and two lengths exercise the same path.
    code, out, err = run(capsys, "demo", "--documents", "1", "--lengths", "128,256", "--out", str(tmp_path))
    assert code == 0, err
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["train_length"] == 128 and saved["model"] == "builtin:tiny-llama-stdlib"
    # Segments are read behind BOS (L + 1 positions), so the caches hold one token more than L.
    assert saved["bos_id"] == 1 and [v["name"] for v in saved["variants"]][-1] == "streaming+logn (4+253)"
    at_1x = [r["ppl"] for r in saved["rows"] if r["length"] == 128]
    # At the trained length no variant changes anything: caches hold the segment and logn is clamped to 1.
    assert len(at_1x) == 6 and max(at_1x) == pytest.approx(min(at_1x), rel=1e-5)
    assert 10 < at_1x[0] < 500  # a trained model, not a random one (which would be near the vocab size)
    assert "| window-only (129) |" in out and (tmp_path / "ppl_vs_length.png").exists()


def test_diagnose_prints_its_table_and_writes_plots_and_json(model_dir, data_file, tmp_path, capsys):
    out_dir = tmp_path / "diag"
    code, out, err = run(
        capsys,
        *("diagnose", "--model", str(model_dir), "--data", str(data_file), "--length", "32"),
        *("--documents", "2", "--zero-kv", "--device", "cpu", "--out", str(out_dir)),
    )
    assert code == 0, err
    assert "| layer | entropy | entropy at n=L | ln L | sink mass | gradient | exit mass |" in out
    assert "patch: " in out and "zero_kv=True" in out
    saved = json.loads((out_dir / "diagnostics.json").read_text())
    assert saved["patch"]["zero_kv"] is True and saved["length"] == 32 and saved["documents"] == 2
    assert (out_dir / "attention.png").exists() and (out_dir / "outliers.png").exists()
