"""pytest plugin: every transformers model built in the run is patched right after construction.

Loaded by `run.py` into transformers' own test suite (``-p plugin``). ``HFA_SUITE_MODE`` picks the patch:

* ``unpatched``: nothing (the baseline);
* ``identity``: ``hfa.patch(model)``;
* ``logn``: ``hfa.patch(model, scale="logn", train_length=10**6)`` (the identity at test lengths, through the
  scaling code).

A model is patched when its outermost ``__init__`` ends (its ``post_init``), so a task model and the base
model inside it are patched once, as a user patches the model they load. Model types the library does not
support are left as they are and counted; the counts are written to ``HFA_SUITE_COUNTS`` (a JSON file).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator

import pytest
from transformers import PreTrainedModel

import hf_attnscale as hfa

MODES = {
    "unpatched": None,
    "identity": {},
    "logn": {"scale": "logn", "train_length": 10**6},
}

_building = threading.local()  # how many model __init__ calls are open (a task model holds a base model)
counts = {"patched": 0, "unsupported": 0}
_open = contextlib.ExitStack()


@contextlib.contextmanager
def patched_on_construction(options: dict) -> Iterator[None]:
    """While open, each outermost model built is patched with ``options`` (``PreTrainedModel`` is wrapped)."""
    original_init, original_post_init = PreTrainedModel.__init__, PreTrainedModel.post_init

    def __init__(self, *args, **kwargs):
        _building.depth = getattr(_building, "depth", 0) + 1
        original_init(self, *args, **kwargs)

    def post_init(self):
        original_post_init(self)
        _building.depth = max(0, getattr(_building, "depth", 1) - 1)
        if _building.depth:
            return  # a model inside another: the outer one is patched when it is complete
        if self.config.model_type not in hfa.supported_model_types():
            counts["unsupported"] += 1
            return
        hfa.patch(self, **options)
        counts["patched"] += 1

    PreTrainedModel.__init__, PreTrainedModel.post_init = __init__, post_init
    try:
        yield
    finally:
        PreTrainedModel.__init__, PreTrainedModel.post_init = original_init, original_post_init
        _building.depth = 0


def pytest_configure(config: pytest.Config) -> None:
    mode = os.environ.get("HFA_SUITE_MODE", "unpatched")
    if mode not in MODES:
        raise pytest.UsageError(f"HFA_SUITE_MODE must be one of {sorted(MODES)}, got {mode!r}.")
    if MODES[mode] is not None:
        _open.enter_context(patched_on_construction(MODES[mode]))


def pytest_unconfigure(config: pytest.Config) -> None:
    _open.close()


def pytest_runtest_setup(item: pytest.Item) -> None:
    _building.depth = 0  # a model whose __init__ raised in the last test never reached post_init


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("HFA_SUITE_COUNTS")
    if path:
        with open(path, "w") as f:
            json.dump(counts, f)
