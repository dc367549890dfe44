"""``hf-attnscale lm-eval`` with bad ``--model_args`` (issue 48): one line on stderr that says what is wrong and
what is valid, exit status 2, instead of a traceback (or a minute of Hub retries)."""

from __future__ import annotations

import logging
import re

import huggingface_hub
import pytest

pytest.importorskip("lm_eval")

from transformers import RecurrentGemmaConfig

import hf_attnscale as hfa
from hf_attnscale.checkpoints.models import default_model_path
from hf_attnscale.cli import main
from hf_attnscale.integrations.lm_eval_model import HFAttnScaleLM

KNOWN = "smollm2-135m, gemma3-270m, minilm-l6"
NO_LENGTH = "no-length"
"""Stands for a model folder whose config gives no max_position_embeddings (recurrent_gemma's)."""


@pytest.fixture(autouse=True)
def _hub_offline(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(autouse=True)
def _lm_eval_logging():
    """lm-eval's CLI adds its log handler once per process, on the sys.stderr of the time (this test's capture,
    closed after it): take it off again, so later tests' lm-eval logs do not write to a closed stream."""
    logger = logging.getLogger("lm_eval")
    handlers, propagate, level = list(logger.handlers), logger.propagate, logger.level
    yield
    for handler in [h for h in logger.handlers if h not in handlers]:
        logger.removeHandler(handler)
    logger.propagate, logger.level = propagate, level


@pytest.fixture
def _own_tasks_only(monkeypatch):
    """lm-eval's CLI indexes its ~14,000 task files (10-15 s) before it builds the model; the model_args errors
    come from the model, so these tests index only the package's tasks. The misspelt-task test below and
    the launcher's end-to-end tests keep lm-eval's whole index."""
    import lm_eval.tasks

    class OwnTasks(lm_eval.tasks.TaskManager):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", OwnTasks)


@pytest.mark.usefixtures("_own_tasks_only")
@pytest.mark.parametrize(
    ("model_args", "message"),
    [
        pytest.param(
            f"pretrained={NO_LENGTH},scale=logn",
            r"scale='logn' needs train_length=N, the model's trained length "
            r"\(its config gives no max_position_embeddings\)\.",
            id="scale-without-length",
        ),
        pytest.param("window=-4", r"window must be an int >= 1, got -4\.", id="negative-window"),
        pytest.param(
            "windw=124",
            r"Unknown model_args key 'windw' \(did you mean 'window'\?\): hf-attnscale takes pretrained, "
            r"sink_tokens, window, chunk_size, gguf_file, position_buckets, peft and the patch options scale, train_length, .*; "
            r"lm-eval's HFLM takes backend, revision, .*max_length, .*",
            id="misspelled-key",
        ),
        pytest.param(
            "pretrained=smollm2-135n",
            rf"Unknown real checkpoint 'smollm2-135n' \(did you mean 'smollm2-135m'\?\); known: {KNOWN}\.",
            id="near-miss-name",
        ),
        pytest.param(
            "pretrained=no-such-model",
            r"Model 'no-such-model' is not a local directory and is not in the Hugging Face cache, and the Hub "
            rf"cannot be used: HF_HUB_OFFLINE is set\. Pass .* a real checkpoint's name \({KNOWN}\).*",
            id="unknown-name-offline",
        ),
        pytest.param(
            "pretrained=/no/such/model",
            r"Model directory '/no/such/model' does not exist; pass a saved model directory, a Hub id or a "
            r"GGUF file\.",
            id="missing-folder",
        ),
    ],
)
def test_bad_model_args_are_one_line(model_args, message, tmp_path, capsys):
    folder = tmp_path / NO_LENGTH
    RecurrentGemmaConfig(num_hidden_layers=1, hidden_size=16, vocab_size=64).save_pretrained(folder)
    model_args = model_args.replace(NO_LENGTH, str(folder))
    if "pretrained=" not in model_args:
        model_args = f"pretrained={default_model_path()},dtype=float32,{model_args}"
    argv = ["lm-eval", "--model", "hf-attnscale", "--model_args", model_args]
    argv += ["--tasks", "hfa_stdlib_heldout_1k", "--device", "cpu", "--output_path", str(tmp_path / "out")]
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    _, err = capsys.readouterr()
    last = err.rstrip("\n").splitlines()[-1]
    assert code == 2, err[-3000:]
    assert re.fullmatch(rf"hf-attnscale lm-eval: error: {message}", last), last
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_a_scale_without_train_length_takes_max_position_embeddings():
    """The command line's rule (`hf_attnscale.core.options.config.default_train_length`): no train_length, the config's."""
    lm = HFAttnScaleLM(pretrained=str(default_model_path()), scale="logn", dtype="float32", device="cpu")
    patched = hfa.get_config(lm.model)
    assert (
        (patched.scale, patched.train_length)
        == ("logn", lm.model.config.max_position_embeddings)
        == ("logn", 128)
    )
    given = HFAttnScaleLM(pretrained=str(default_model_path()), scale="logn", train_length=64, device="cpu")
    assert hfa.get_config(given.model).train_length == 64


def test_a_misspelt_task_is_one_line_with_the_nearest_names(tmp_path, capsys):
    """``--tasks hfa_paskey_4k`` (issue 54): one line naming it and the nearest names lm-eval knows, ours
    included, instead of lm-eval's traceback."""
    import lm_eval.tasks

    manager_class = lm_eval.tasks.TaskManager
    argv = ["lm-eval", "--model", "hf-attnscale", "--model_args", f"pretrained={default_model_path()}"]
    argv += ["--tasks", "hfa_paskey_4k", "--device", "cpu", "--output_path", str(tmp_path / "out")]
    code = main(argv)
    _, err = capsys.readouterr()
    assert code == 2, err[-3000:]
    assert "Traceback" not in err and not (tmp_path / "out").exists()
    assert re.fullmatch(
        r"hf-attnscale lm-eval: error: Unknown task 'hfa_paskey_4k' \(did you mean 'hfa_passkey_4k', '[^']+' or "
        r"'[^']+'\?\); `hf-attnscale lm-eval ls tasks` lists the tasks, groups and tags lm-eval knows\.",
        err.rstrip("\n").splitlines()[-1],
    ), err[-1000:]
    assert lm_eval.tasks.TaskManager is manager_class  # put back after the run


def test_help_says_what_lm_evals_own_help_cannot(capsys):
    """``hf-attnscale lm-eval --help``: the model type, its model_args and the package's tasks, then lm-eval's
    own help (argparse exits with status 0)."""
    with pytest.raises(SystemExit) as exited:
        main(["lm-eval", "--help"])
    out = capsys.readouterr().out
    assert exited.value.code == 0
    assert out.index("--model hf-attnscale") < out.index("usage:")
    assert "rerope_window=2048" in out and "lm_eval_tasks/README.md" in out
