"""RULER (lm-eval's ``lm_eval/tasks/ruler/``) through ``hf-attnscale lm-eval``, offline and built once.

RULER's tasks make their own samples, sized with a tokenizer they load by name from the model_args, which lm-eval
hands them as metadata. Before lm-eval's run starts, `prepare_run`:

- gives the tasks the tokenizer of the model that the ``hf-attnscale`` model type loads (``pretrained=smollm2-135m``
  is a folder in the cache, not a name `AutoTokenizer` knows), unless ``tokenizer=`` is given;
- refuses, in one line, the tasks that download their haystack or questions at run time where the Hub cannot be
  used (naming the six, `SYNTHETIC`, that need nothing), and RULER's tasks when ``wonderwords`` or ``nltk`` is
  missing (they come with ``pip install 'hf_attnscale[ruler]'``).

While it runs, `offline_and_cached`:

- stops nltk downloading ``punkt_tab`` where the Hub cannot be used (only the essay haystacks need it);
- keeps each synthetic task's 500 samples (a cache keyed by the task, its lengths, the tokenizer's content and
  lm-eval's version, in ``$HF_ATTNSCALE_CACHE/ruler``), so a second run of the same task, lengths and tokenizer
  builds nothing. The samples are drawn with Python's and NumPy's random seeded with RULER's own seed (42),
  the global state put back after, so they do not depend on which tasks ran before them in the same process.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import random
import shutil
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hf_attnscale.checkpoints.models import hub_unavailable, resolve_model_path, split_gguf
from hf_attnscale.checkpoints.real import cache_root

SYNTHETIC = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")
"""RULER's tasks that need no download: their haystacks are generated."""
DOWNLOADING = {
    "niah_single_2": "Paul Graham's essays",
    "niah_single_3": "Paul Graham's essays",
    "niah_multikey_1": "Paul Graham's essays",
    "niah_multivalue": "Paul Graham's essays",
    "niah_multiquery": "Paul Graham's essays",
    "ruler_qa_squad": "SQuAD",
    "ruler_qa_hotpot": "HotpotQA",
}
"""RULER's tasks that download their data at run time, and what they download."""
GROUP = "ruler"
"""lm-eval's group of all thirteen."""
TAG = "longcxt"
"""The tag lm-eval gives them (with other long-context tasks)."""
NEEDS = ("wonderwords", "nltk", "scipy")
"""What RULER's task code imports beyond lm-eval (its ``[ruler]`` extra)."""
SEED = 42
"""RULER's own seed (``prepare_niah.RANDOM_SEED``), with which the samples are drawn."""
CACHE_FORMAT = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


class RulerError(ValueError):
    """A RULER run that cannot start here, in one line."""


def prepare_run(args: argparse.Namespace, model_type: str) -> bool:
    """Check and complete lm-eval's parsed ``run`` arguments for RULER's tasks (see the module's docstring):
    ``args.metadata`` gains ``tokenizer`` where the model type resolves ``pretrained`` to a folder of its own.
    Returns whether the run asks for any of RULER's tasks (by name, group or tag).

    Raises:
        RulerError: a task that downloads while the Hub cannot be used, a missing package, or a model whose
            folder has no tokenizer for the tasks to load.
    """
    asked = getattr(args, "tasks", None) or []
    tasks = [name for name in asked if name in SYNTHETIC or name in DOWNLOADING or name in (GROUP, TAG)]
    if not tasks:
        return False
    missing = [name for name in NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise RulerError(
            f"RULER's tasks need {', '.join(missing)}: pip install 'hf_attnscale[ruler]' (or lm-eval's "
            "[ruler] extra)."
        )
    downloading = [name for name in tasks if name not in SYNTHETIC and name != TAG]
    reason = hub_unavailable() if downloading else None
    if reason is not None:
        what = sorted({DOWNLOADING.get(name, "essays, SQuAD and HotpotQA") for name in downloading})
        raise RulerError(
            f"{', '.join(map(repr, downloading))} download{'s' * (len(downloading) == 1)} {' and '.join(what)} at "
            f"run time, and {reason}; RULER's tasks that need no download: {', '.join(SYNTHETIC)}."
        )
    model_args, metadata = args.model_args or {}, args.metadata or {}
    pretrained = model_args.get("pretrained")
    if getattr(args, "model", None) != model_type or "tokenizer" in {**model_args, **metadata}:
        return True
    if not isinstance(pretrained, str):
        return True
    name, _ = split_gguf(pretrained, model_args.get("gguf_file"))
    folder = resolve_model_path(name)
    if Path(folder).is_dir() and not any((Path(folder) / file).is_file() for file in TOKENIZER_FILES):
        raise RulerError(
            f"RULER's tasks load their tokenizer by name, and {folder} has no tokenizer files (a GGUF file "
            "alone): add tokenizer=NAME (a folder or Hub id with that model's tokenizer) to --model_args."
        )
    if folder != pretrained:
        args.metadata = {**metadata, "tokenizer": folder}
    return True


@contextlib.contextmanager
def offline_and_cached(cache_dir: str | Path | None = None) -> Iterator[None]:
    """While lm-eval runs RULER's tasks: no nltk download where the Hub cannot be used, and RULER's synthetic
    samples kept in (and read from) ``cache_dir/ruler`` (default: the package's cache folder). lm-eval's task
    class and nltk are put back as they were however the run ends."""
    from lm_eval.api.task import ConfigurableTask

    download = ConfigurableTask.download
    root = cache_root(cache_dir) / "ruler"

    def cached_download(task: Any, *args: Any, **kwargs: Any) -> None:
        generate = task.config.custom_dataset
        if task.config.task in SYNTHETIC and getattr(generate, "__module__", "").startswith(
            "lm_eval.tasks.ruler"
        ):
            task.dataset = cached_samples(task.config.task, generate, task.config.metadata or {}, root)
        else:
            download(task, *args, **kwargs)

    with _no_nltk_download():
        ConfigurableTask.download = cached_download
        try:
            yield
        finally:
            ConfigurableTask.download = download


def cached_samples(task: str, generate: Any, metadata: Mapping[str, Any], root: Path) -> dict[str, Any]:
    """RULER task ``task``'s samples: read from ``root`` when a run of the same task, lengths, tokenizer and
    lm-eval version kept them, else drawn by ``generate`` (the task's own ``custom_dataset``, with
    ``metadata``; seeded with `SEED`) and kept."""
    import datasets
    from lm_eval.tasks.ruler.common_utils import DEFAULT_SEQ_LENGTHS, get_tokenizer, resolve_tokenizer_name

    lengths = [int(n) for n in metadata.get("max_seq_lengths", DEFAULT_SEQ_LENGTHS)]
    tokenizer = get_tokenizer(resolve_tokenizer_name(dict(metadata)))
    key = json.dumps(
        [
            CACHE_FORMAT,
            SEED,
            importlib.metadata.version("lm_eval"),
            task,
            lengths,
            tokenizer_digest(tokenizer),
        ]
    )
    folder = root / f"{task}-{'-'.join(map(str, lengths))}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (folder / "key.json").is_file():
        print(f"{task}: RULER's samples at {lengths} reused from {folder}", file=sys.stderr, flush=True)
        return dict(datasets.load_from_disk(str(folder / "samples")))
    with _seeded(SEED):
        samples = generate(**metadata)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    datasets.DatasetDict(samples).save_to_disk(str(partial / "samples"))
    (partial / "key.json").write_text(key + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return samples


def tokenizer_digest(tokenizer: Any) -> str:
    """A hash of what decides a tokenizer's token counts: its class and its whole definition (a fast
    tokenizer's JSON, else its vocabulary)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(f"{type(tokenizer).__name__}\n{text}".encode()).hexdigest()


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Python's and NumPy's global random seeded with ``seed``, and put back after."""
    state, np_state = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed)
    try:
        yield
    finally:
        random.setstate(state)
        np.random.set_state(np_state)


@contextlib.contextmanager
def _no_nltk_download() -> Iterator[None]:
    """nltk's ``download`` refused where the Hub cannot be used: lm-eval's ``prepare_niah`` fetches ``punkt_tab``
    when it is imported, and only the essay haystacks use it (refused offline by `prepare_run`)."""
    import nltk

    fetch = nltk.download

    def refused_offline(*args: Any, **kwargs: Any) -> Any:
        reason = hub_unavailable()
        if reason is None:
            return fetch(*args, **kwargs)
        what = repr(args[0]) if args else "its data"
        print(f"note: nltk's download of {what} skipped: {reason}.", file=sys.stderr, flush=True)
        return False

    nltk.download = refused_offline
    try:
        yield
    finally:
        nltk.download = fetch
