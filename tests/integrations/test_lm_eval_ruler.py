"""RULER through the launcher: the tokenizer its tasks get, the one-line refusals, the cache of their samples, and
a generate_until request that never holds T x V logits."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("wonderwords")

from conftest import tiny_lm_with_tokenizer
from lm_eval.api.instance import Instance

import hf_attnscale as hfa
from hf_attnscale.checkpoints.models import default_model_path
from hf_attnscale.integrations import lm_eval_ruler as ruler
from hf_attnscale.integrations.lm_eval_launcher import main
from hf_attnscale.integrations.lm_eval_model import MODEL_TYPE, HFAttnScaleLM

TINY = "builtin:tiny-llama-stdlib"
OFFLINE = "HF_HUB_OFFLINE is set"


def run_args(
    model_args: dict, tasks=("niah_single_1",), metadata=None, model=MODEL_TYPE
) -> argparse.Namespace:
    return argparse.Namespace(model=model, model_args=model_args, metadata=metadata, tasks=list(tasks))


def test_a_name_the_model_type_resolves_is_the_tasks_tokenizer():
    args = run_args({"pretrained": TINY}, metadata={"max_seq_lengths": [4096]})
    assert ruler.prepare_run(args, MODEL_TYPE)
    assert args.metadata == {"max_seq_lengths": [4096], "tokenizer": str(default_model_path())}


@pytest.mark.parametrize(
    "model_args, metadata, model",
    [
        (
            {"pretrained": "HuggingFaceTB/SmolLM2-135M"},
            None,
            MODEL_TYPE,
        ),  # a Hub id: RULER loads it, as for hf
        ({"pretrained": TINY, "tokenizer": "gpt2"}, None, MODEL_TYPE),  # the user's tokenizer stays
        ({"pretrained": TINY}, {"tokenizer": "gpt2"}, MODEL_TYPE),
        ({"pretrained": TINY}, None, "hf"),  # another model type: lm-eval's own behaviour
    ],
)
def test_a_hub_id_a_given_tokenizer_or_another_model_type_is_left_alone(model_args, metadata, model):
    args = run_args(dict(model_args), metadata=metadata, model=model)
    assert ruler.prepare_run(args, MODEL_TYPE)
    assert args.metadata == metadata and args.model_args == model_args


def test_a_folder_is_its_own_name(tmp_path):
    folder = str(default_model_path())
    args = run_args({"pretrained": folder})
    ruler.prepare_run(args, MODEL_TYPE)
    assert args.metadata is None  # RULER's AutoTokenizer loads the folder itself


def test_runs_without_rulers_tasks_are_untouched():
    args = run_args({"pretrained": TINY}, tasks=["hfa_kjv_books"])
    assert not ruler.prepare_run(args, MODEL_TYPE)
    assert args.metadata is None


def test_a_task_that_downloads_is_refused_in_one_line_offline(monkeypatch):
    monkeypatch.setattr(ruler, "hub_unavailable", lambda: OFFLINE)
    with pytest.raises(ruler.RulerError) as err:
        ruler.prepare_run(
            run_args({"pretrained": TINY}, tasks=["niah_single_1", "ruler_qa_squad", "ruler"]), MODEL_TYPE
        )
    message = str(err.value)
    assert "\n" not in message and "'ruler_qa_squad', 'ruler' download" in message and OFFLINE in message
    assert message.endswith(", ".join(ruler.SYNTHETIC) + ".")
    # The synthetic tasks alone never ask the Hub.
    monkeypatch.setattr(ruler, "hub_unavailable", lambda: pytest.fail("probed the Hub"))
    ruler.prepare_run(run_args({"pretrained": TINY}, tasks=list(ruler.SYNTHETIC)), MODEL_TYPE)


def test_a_missing_package_says_what_to_install(monkeypatch):
    real = ruler.importlib.util.find_spec
    monkeypatch.setattr(
        ruler.importlib.util, "find_spec", lambda name: None if name == "wonderwords" else real(name)
    )
    with pytest.raises(ruler.RulerError, match=r"need wonderwords: pip install 'hf_attnscale\[ruler\]'"):
        ruler.prepare_run(run_args({"pretrained": TINY}), MODEL_TYPE)


def test_a_folder_without_a_tokenizer_is_refused(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ruler.RulerError, match=r"has no tokenizer files .* add tokenizer=NAME"):
        ruler.prepare_run(run_args({"pretrained": str(tmp_path / "model.gguf")}), MODEL_TYPE)


def test_the_launcher_prints_the_refusal_as_its_error(monkeypatch, capsys):
    monkeypatch.setattr(ruler, "hub_unavailable", lambda: OFFLINE)
    code = main(["--model", MODEL_TYPE, "--model_args", f"pretrained={TINY}", "--tasks", "niah_multivalue"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("hf-attnscale lm-eval: error: 'niah_multivalue' downloads")


def fake_generator(calls: list):
    def niah_single_1(**metadata):
        import datasets

        calls.append(metadata)
        return {"test": datasets.Dataset.from_list([{"input": f"{len(calls)}", "max_length": 64}])}

    niah_single_1.__module__ = "lm_eval.tasks.ruler.niah_utils"
    return niah_single_1


def test_samples_are_kept_per_task_lengths_and_tokenizer(tmp_path, capsys):
    folder = str(default_model_path())
    other = tmp_path / "other-tokenizer"
    shutil.copytree(folder, other)
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text().replace('"<s>"', '"<S>"', 1))
    calls: list = []
    generate = fake_generator(calls)
    root = tmp_path / "cache"

    def samples(tokenizer, lengths):
        meta = {"tokenizer": str(tokenizer), "max_seq_lengths": lengths}
        return ruler.cached_samples("niah_single_1", generate, meta, root)["test"]["input"]

    first = samples(folder, [64])
    assert samples(folder, [64]) == first and len(calls) == 1  # a hit: nothing drawn
    assert "reused from" in capsys.readouterr().err
    assert samples(folder, [128]) != first and len(calls) == 2  # other lengths: a miss
    assert samples(other, [64]) != first and len(calls) == 3  # another tokenizer: a miss
    assert samples(folder, [64]) == first and len(calls) == 3
    assert not list(root.glob("*.partial"))


def test_the_draw_is_seeded_and_leaves_the_global_random_as_it_was(tmp_path):
    import random

    def niah_single_1(**metadata):
        import datasets

        return {"test": datasets.Dataset.from_list([{"draw": random.random()}])}

    niah_single_1.__module__ = "lm_eval.tasks.ruler.niah_utils"
    random.seed(7)
    after = random.random()
    random.seed(7)
    meta = {"tokenizer": str(default_model_path())}
    a = ruler.cached_samples("niah_single_1", niah_single_1, meta, tmp_path / "a")["test"]["draw"]
    b = ruler.cached_samples("niah_single_1", niah_single_1, meta, tmp_path / "b")["test"]["draw"]
    assert a == b and random.random() == after


def test_lm_evals_own_generator_is_kept_and_read_back_as_drawn(tmp_path):
    """lm-eval's own niah_single_1 (500 samples at 512 tokens of the shipped tokenizer): drawn once, then read
    back equal, and a second draw in the same process equals the first (the seed)."""
    with ruler.offline_and_cached(tmp_path):  # its import asks nltk for punkt_tab: refused where offline
        from lm_eval.tasks.ruler.niah_utils import niah_single_1  # 20-30 s: wonderwords' word pairs

    meta = {"tokenizer": str(default_model_path()), "max_seq_lengths": [512]}
    drawn = ruler.cached_samples("niah_single_1", niah_single_1, meta, tmp_path / "a")["test"]
    kept = ruler.cached_samples("niah_single_1", niah_single_1, meta, tmp_path / "a")["test"]
    again = ruler.cached_samples("niah_single_1", niah_single_1, meta, tmp_path / "b")["test"]
    assert len(drawn) == 500 and drawn.to_list() == kept.to_list() == again.to_list()
    assert {row["max_length"] for row in drawn} == {512}


@pytest.mark.slow
def test_lm_evals_own_task_runs_offline_and_its_second_run_builds_nothing(tmp_path):
    """lm-eval's own niah_single_1 through the launcher in a fresh process, the Hub off, twice (about 2 min)."""
    args = [
        "--model", MODEL_TYPE,
        "--model_args", f"pretrained={TINY},max_length=640",
        "--tasks", "niah_single_1",
        "--metadata", '{"max_seq_lengths":[512]}',
        "--limit", "2",
        "--gen_kwargs", "max_gen_toks=4",
    ]  # fmt: skip
    env = {**__import__("os").environ, "HF_ATTNSCALE_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    runs = [
        subprocess.run(
            [sys.executable, "-m", "hf_attnscale.integrations.lm_eval_launcher", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    assert "Generating synthetic samples" in runs[0].stderr and "reused from" not in runs[0].stderr
    assert "Generating synthetic samples" not in runs[1].stderr and "reused from" in runs[1].stderr
    table = [line for line in runs[0].stdout.splitlines() if "512" in line]
    assert table and table == [line for line in runs[1].stdout.splitlines() if "512" in line]
    assert [p.name[:18] for p in (Path(tmp_path) / "ruler").iterdir()] == ["niah_single_1-512-"]


def test_a_generate_until_request_computes_logits_for_one_position_at_a_time():
    """The prompt goes into the cache ``chunk_size`` tokens at a time, and no call computes more than one position's
    logits; the text is the one an unchunked prefill writes."""
    model, tokenizer = tiny_lm_with_tokenizer(max_position_embeddings=512)
    context = " ".join(["The grass is green. The sky is blue."] * 30)
    assert len(tokenizer(context)["input_ids"]) > 300
    texts, shapes, lengths = [], [], []
    model.get_output_embeddings().register_forward_hook(lambda m, i, out: shapes.append(out.shape))
    model.model.layers[0].register_forward_hook(lambda m, i, out: lengths.append(i[0].shape[1]))
    for chunk_size in (512, 64):
        shapes.clear(), lengths.clear()
        lm = HFAttnScaleLM(
            pretrained=model, tokenizer=tokenizer, max_length=512, chunk_size=chunk_size,
            rerope_window=16, scale="logn", train_length=64,
        )  # fmt: skip
        request = Instance(
            "generate_until", {}, (context, {"until": [], "max_gen_toks": 3, "do_sample": False}), 0
        )
        texts += lm.generate_until([request])
        assert all(shape[1] == 1 for shape in shapes), shapes
        assert max(lengths) == min(chunk_size, lengths[0]) and lengths[-2:] == [1, 1]
        hfa.unpatch(model)
    assert texts[0] == texts[1]
