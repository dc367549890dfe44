"""The built-in lm-eval tasks and their data: the task classes and the datasets and metrics that the task
YAMLs in `TASKS_DIR` name (through ``lm_eval_tasks/hfa_builtin.py``, which lm-eval imports by path).

The documents are built in memory (the stdlib's own sources, the King James Bible fetched from Debian, passkey
prompts), so the tasks need no data file and no absolute path. The model type they are scored with is
`hf_attnscale.integrations.lm_eval_model`'s (importing this module registers it).

Importing this module needs lm-eval (``pip install hf_attnscale[eval]``).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
from lm_eval.api.metrics import weighted_perplexity
from lm_eval.api.task import ConfigurableTask
from transformers import AutoTokenizer

from hf_attnscale.checkpoints.models import default_model_path, resolve_model_path
from hf_attnscale.core.options.validation import check_int
from hf_attnscale.evaluation.corpus import builtin_documents
from hf_attnscale.evaluation.long_texts import joined_documents, kjv_books
from hf_attnscale.evaluation.passkey import passkey_prompts
from hf_attnscale.evaluation.positions import bucket_sums, position_buckets as read_buckets
from hf_attnscale.integrations.lm_eval_model import MODEL_TYPE, as_written

PASSKEY_LENGTHS = (4096, 8192, 16384, 32768, 65536)
PASSKEY_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
"""The built-in passkey tasks' haystack lengths (each task takes one) and depths (their per-depth metrics)."""
TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
"""The package's lm-eval task configs (the built-in corpus at several lengths, templates, Hub corpora)."""


class BuiltinTask(ConfigurableTask):
    """lm-eval's ``ConfigurableTask``, for the built-in tasks, where a ``--metadata`` key wins over the same key
    of the task YAML's ``dataset_kwargs``.

    lm-eval builds a ``custom_dataset`` task's data with ``custom_dataset(**metadata, **dataset_kwargs)``, so a
    key in both (``--metadata '{"first_tokens": 512}'`` on ``hfa_stdlib_heldout_1k``, whose YAML sets
    ``first_tokens: 1024``) would be a TypeError: here the metadata's value is taken (the user's ``--metadata``
    or ``--model_args``, which lm-eval passes to tasks as metadata too) and the YAML's is dropped from the
    task's ``dataset_kwargs``, so the saved task config shows the value used, under ``metadata``.

    Named in a task YAML as ``class: !function hfa_builtin.BuiltinTask`` (or a subclass).
    """

    def __init__(self, config: dict | None = None) -> None:
        super().__init__(config={key: value for key, value in (config or {}).items() if key != "class"})

    def download(self, dataset_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        metadata = self.config.metadata or {}
        if callable(self.config.custom_dataset) and self.config.dataset_kwargs:
            kept = {key: v for key, v in self.config.dataset_kwargs.items() if key not in metadata}
            self.config.dataset_kwargs = dataset_kwargs = kept
        super().download(dataset_kwargs, **kwargs)


class PositionPerplexityTask(BuiltinTask):
    """A perplexity task (``loglikelihood_rolling``) that also reports perplexity by token position.

    One ``ppl_<bucket>`` metric per position bucket (``ppl_0-2k``, ``ppl_2k-4k``... ``ppl_32k+``): lm-eval's
    weighted perplexity over every document's tokens at those positions, each token predicted as the model
    type reads the document (streamed whole with ``window=``; else in windows of ``max_length``, the whole
    document when it fits). A bucket no document reaches is not reported. The edges come from the metadata's
    ``position_buckets`` (the task YAML's ``metadata``, lm-eval's ``--metadata``, or ``--model_args``, which
    lm-eval passes to tasks as metadata), else `hf_attnscale.evaluation.positions.DEFAULT_EDGES`.

    Named in a task YAML as ``class: !function hfa_builtin.PositionPerplexityTask``. The per-token scores come
    from the ``hf-attnscale`` model type; under another model type the position metrics are left out, with a
    warning.
    """

    def __init__(self, config: dict | None = None) -> None:
        super().__init__(config=config)
        self.buckets = read_buckets(as_written((self.config.metadata or {}).get("position_buckets")))
        for bucket in self.buckets:
            self._aggregation_list[bucket.metric] = weighted_perplexity
            self._higher_is_better[bucket.metric] = False
        self._warned = False

    def process_results(self, doc: dict, results: list) -> dict[str, Any]:
        metrics = super().process_results(doc, results)
        nll = getattr(results[0], "nll", None)
        if nll is None:
            if not self._warned:
                warnings.warn(
                    f"{self.config.task}: perplexity by position needs per-token scores, which the "
                    f"{MODEL_TYPE!r} model type gives; this model type gives one number per document, so the "
                    "ppl_* metrics are left out.",
                    stacklevel=2,
                )
                self._warned = True
            return metrics
        for bucket, (total, count) in zip(self.buckets, bucket_sums(nll, self.buckets)):
            if count:
                metrics[bucket.metric] = (-total, count)
        return metrics


class PasskeyTask(BuiltinTask):
    """The passkey tasks' class: one ``acc_depth_D`` metric for each depth that the run's prompts have, and none
    for the others.

    `passkey_results` gives each prompt a metric for every depth of `PASSKEY_DEPTHS` (None but at its own); a
    depth that no prompt of the run has (cut by ``--limit``, or not in ``--metadata '{"depths": [...]}'``)
    would print as NaN. Here every prompt reports the depths of the prompts run (its own value, None at the
    others), so each depth row is the mean over its own prompts (`mean_present`) and no row is NaN; a depth
    outside `PASSKEY_DEPTHS` gets its row the same way.

    Named in ``_hfa_passkey_base.yaml`` as ``class: !function hfa_builtin.PasskeyTask``.
    """

    depths_run: tuple[str, ...] | None = None
    """The depth metrics of the prompts run (every process's), once lm-eval has built the requests."""

    def build_all_requests(
        self, *, limit: int | None = None, samples: list[int] | None = None, **kwargs: Any
    ):
        # Every process's prompts, not this one's share: every process must report the same metrics.
        run = self.doc_iterator(rank=0, world_size=1, limit=limit, samples=samples)
        self.depths_run = tuple(sorted({depth_metric(doc["depth"]) for _, doc in run}))
        for metric in self.depths_run:
            self._aggregation_list[metric] = mean_present
            self._higher_is_better[metric] = True
        super().build_all_requests(limit=limit, samples=samples, **kwargs)

    def process_results(self, doc: dict, results: list) -> dict[str, Any]:
        metrics = super().process_results(doc, results)
        if self.depths_run is None:
            return metrics
        own = depth_metric(doc["depth"])
        kept = {key: value for key, value in metrics.items() if not key.startswith("acc_depth_")}
        return kept | dict.fromkeys(self.depths_run) | {own: metrics[own]}


def builtin_dataset(
    split: str = "heldout", min_tokens: int = 0, first_tokens: int | None = None, **_runtime_metadata: Any
):
    """The built-in stdlib corpus as a ``datasets.DatasetDict`` with one ``test`` split (fields name, text).

    Used by the ``hfa_stdlib_*`` task YAMLs through lm-eval's ``custom_dataset``, so no data file or absolute
    path is needed. Token counts are those of the shipped tokenizer.

    Args:
        split: ``"heldout"`` or ``"train"``.
        min_tokens: keep only documents of at least this many tokens.
        first_tokens: cut each document to the text of its first ``first_tokens`` tokens.
        **_runtime_metadata: lm-eval passes its model_args and metadata here too; they are ignored.
    """
    documents = builtin_documents(split)
    texts = [doc.text for doc in documents]
    names = [doc.name for doc in documents]
    if min_tokens or first_tokens:
        tokenizer = AutoTokenizer.from_pretrained(default_model_path())
        encoded = tokenizer(texts, return_offsets_mapping=True, verbose=False)
        kept = [
            (name, text if first_tokens is None else _text_of_first(text, offsets, first_tokens))
            for name, text, offsets in zip(names, texts, encoded["offset_mapping"])
            if len(offsets) >= min_tokens
        ]
        names, texts = [n for n, _ in kept], [t for _, t in kept]
    return _test_split({"name": names, "text": texts})


def long_dataset(
    text: str = "kjv",
    min_tokens: int = 32768,
    first_tokens: int | None = None,
    pretrained: str | None = None,
    **_runtime_metadata: Any,
):
    """Long documents for reading past a real model's trained length, as a ``datasets.DatasetDict`` with one
    ``test`` split (fields name, text), for the ``hfa_kjv_books`` and ``hfa_stdlib_32k`` task YAMLs.

    Args:
        text: ``"kjv"``, the King James Bible's 66 books (fetched from Debian on first use,
            `hf_attnscale.evaluation.long_texts`); ``"kjv-joined"``, the same books joined in order into
            documents of at least ``min_tokens`` tokens of the evaluated model's tokenizer (the first starts at
            Genesis); or ``"stdlib"``, the held-out stdlib files joined in name order into documents of at
            least ``min_tokens`` tokens of the shipped tokenizer.
        min_tokens: with ``"kjv-joined"`` and ``"stdlib"``, the joined documents' least length.
        first_tokens: cut each document to the text of its first ``first_tokens`` tokens of the evaluated
            model's tokenizer (``pretrained``, from ``--model_args``; else the shipped model's), for a shorter
            run (``--metadata '{"first_tokens": 32768}'``).
        **_runtime_metadata: lm-eval passes its model_args and metadata here too; the others are ignored.
    """
    if text == "kjv":
        documents = kjv_books()
    elif text == "kjv-joined":
        tokenizer = AutoTokenizer.from_pretrained(_tokenizer_source(pretrained))
        documents = joined_documents(kjv_books(), tokenizer, check_int("min_tokens", min_tokens, 1))
    elif text == "stdlib":
        tokenizer = AutoTokenizer.from_pretrained(default_model_path())
        documents = joined_documents(builtin_documents("heldout"), tokenizer, min_tokens)
    else:
        raise ValueError(f"Unknown long text {text!r}; valid: 'kjv', 'kjv-joined', 'stdlib'.")
    names, texts = [d.name for d in documents], [d.text for d in documents]
    if first_tokens is not None:
        first_tokens = check_int("first_tokens", first_tokens, 1)
        tokenizer = AutoTokenizer.from_pretrained(_tokenizer_source(pretrained))
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        texts = [
            _text_of_first(t, offsets, first_tokens) for t, offsets in zip(texts, encoded["offset_mapping"])
        ]
        short = [len(offsets) for offsets in encoded["offset_mapping"] if len(offsets) < first_tokens]
        if short:  # read whole: say so, or a position bucket past them goes missing without a word
            print(
                f"note: {len(short)} of {len(texts)} documents have fewer than first_tokens={first_tokens} tokens "
                f"of this tokenizer (the shortest {min(short)}); they are read whole.",
                file=sys.stderr,
                flush=True,
            )
    return _test_split({"name": names, "text": texts})


def passkey_dataset(
    lengths: Sequence[int] = PASSKEY_LENGTHS,
    depths: Sequence[float] = PASSKEY_DEPTHS,
    per_cell: int = 2,
    seed: int = 0,
    pretrained: str | None = None,
    **_runtime_metadata: Any,
):
    """Passkey prompts (`hf_attnscale.evaluation.passkey`) as a ``datasets.DatasetDict`` with one ``test``
    split (fields context, key, length, depth), for the ``hfa_passkey_*`` task YAMLs. Sized in the tokens of the
    evaluated model's tokenizer (``pretrained``, which lm-eval passes from ``--model_args``), else the shipped
    model's."""
    tokenizer = AutoTokenizer.from_pretrained(_tokenizer_source(pretrained))
    prompts = passkey_prompts(tokenizer, lengths, depths, per_cell, seed)
    columns = {field: [getattr(p, field) for p in prompts] for field in ("context", "key", "length", "depth")}
    return _test_split(columns)


def passkey_results(doc: dict, results: list) -> dict[str, Any]:
    """A passkey prompt's metrics: ``acc`` (every key token is the greedy choice: greedy decoding would write
    the key), ``key_loglikelihood``, and ``acc_depth_D`` for its depth D in percent (None at the others; see
    `mean_present`)."""
    loglikelihood, is_greedy = results[0]
    by_depth = {depth_metric(d): None for d in PASSKEY_DEPTHS}
    by_depth[depth_metric(doc["depth"])] = int(is_greedy)
    return {"acc": int(is_greedy), "key_loglikelihood": loglikelihood, **by_depth}


def depth_metric(depth: float) -> str:
    """The name of the passkey metric at ``depth`` (a fraction of the haystack): ``acc_depth_D``, D in percent."""
    return f"acc_depth_{round(100 * depth)}"


def mean_present(values: Sequence[float | None]) -> float:
    """The mean of the values that are not None (a per-depth metric is None on prompts of other depths)."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else float("nan")


def _text_of_first(text: str, offsets: list[tuple[int, int]], tokens: int) -> str:
    """``text`` up to the end of its first ``tokens`` tokens (``offsets``: the tokenizer's offset mapping)."""
    return text[: offsets[:tokens][-1][1]]


def _tokenizer_source(pretrained: str | None) -> str:
    """Where the evaluated model's tokenizer is (``pretrained`` from model_args), else the shipped model's."""
    return resolve_model_path(pretrained, progress=False) if pretrained else str(default_model_path())


def _test_split(columns: dict[str, list]) -> datasets.DatasetDict:
    """``columns`` as the one ``test`` split the built-in task YAMLs read (``test_split: test``)."""
    return datasets.DatasetDict({"test": datasets.Dataset.from_dict(columns)})
