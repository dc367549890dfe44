"""Built-in offline corpus: the Python standard library's own ``.py`` sources.

Every Python installation ships these files, so the demo can train and evaluate
without downloading anything. Their contents differ slightly between Python
versions, so numbers are only comparable on the same interpreter version.
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import torch
from transformers import PreTrainedTokenizerBase

Split = Literal["train", "heldout"]

BUILTIN_NAME = "stdlib"
# "builtin:stdlib" alone means the training split, i.e. the text the shipped model learned from.
BUILTIN_SPECS: dict[str, Split] = {
    f"builtin:{BUILTIN_NAME}": "train",
    f"builtin:{BUILTIN_NAME}-train": "train",
    f"builtin:{BUILTIN_NAME}-heldout": "heldout",
}

# Percent of files held out, chosen by a hash of the relative path so the split never
# depends on the process, the file order, or which other files exist. 5% would leave 10
# held-out files of >= 4096 tokens on Python 3.11 but only about 8 on 3.13, which removed
# cgi and distutils; 8% leaves 18 on 3.11 and keeps a margin on newer versions.
HELDOUT_PERCENT = 8
# Files shorter than this are mostly stubs and re-exports; they add little text.
MIN_CHARS = 2000
# Test suites and tool packages are excluded as the brief for the corpus asks; "encodings" is
# excluded too because its codec modules are machine-generated lookup tables that would make
# up about a third of the bytes and teach the model nothing about real text.
_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "encodings"}
)
# _sysconfigdata_* records the build machine's configuration, so it differs between installs.
_EXCLUDED_PREFIXES = ("_sysconfigdata",)


@dataclass(frozen=True)
class Document:
    """One source file: ``name`` is its path relative to the stdlib root, in POSIX form."""

    name: str
    text: str


def stdlib_root() -> Path:
    """Directory holding this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(name: str) -> Split:
    """Split a document belongs to, from a stable hash of its relative path."""
    bucket = int.from_bytes(hashlib.sha1(name.encode("utf-8")).digest()[:8], "big") % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


@functools.cache
def _all_documents() -> tuple[Document, ...]:
    root = stdlib_root()
    documents = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if _EXCLUDED_DIRS.intersection(relative.parts[:-1]) or relative.name.startswith(_EXCLUDED_PREFIXES):
            continue
        # PEP 3120 makes stdlib sources UTF-8; "replace" only guards against a patched install.
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) >= MIN_CHARS:
            documents.append(Document(relative.as_posix(), text))
    if not documents:
        raise FileNotFoundError(
            f"No standard-library .py sources found under {root}; this Python install ships "
            "only bytecode, so the built-in corpus is unavailable."
        )
    return tuple(sorted(documents, key=lambda doc: doc.name))


def builtin_documents(split: Split) -> list[Document]:
    """Documents of one split of the built-in corpus, sorted by name."""
    if split not in get_args(Split):
        raise ValueError(f"split must be one of {get_args(Split)}, got {split!r}")
    return [doc for doc in _all_documents() if split_of(doc.name) == split]


def tokenize_documents(
    tokenizer: PreTrainedTokenizerBase, documents: Sequence[Document]
) -> list[torch.Tensor]:
    """Token ids of each document as the tokenizer encodes it alone (its BOS token included, if any)."""
    # The tokenizer's model_max_length is about training inputs; whole documents are cut later, by length.
    ids = tokenizer([doc.text for doc in documents], verbose=False)["input_ids"]
    return [torch.tensor(row, dtype=torch.long) for row in ids]


def long_documents(split: Split, min_tokens: int, tokenizer: PreTrainedTokenizerBase) -> list[Document]:
    """Documents of ``split`` whose tokenized length (special tokens included) is at least ``min_tokens``.

    Each document is meant to be evaluated on its own; documents are never concatenated
    to reach a length, since that would let a model score text across unrelated files.
    """
    return [doc for doc in builtin_documents(split) if len(tokenizer(doc.text)["input_ids"]) >= min_tokens]


def load_builtin(spec: str) -> list[Document]:
    """Documents named by a data spec such as ``"builtin:stdlib-heldout"``."""
    if spec not in BUILTIN_SPECS:
        raise ValueError(f"Unknown built-in corpus {spec!r}; valid specs are: {', '.join(BUILTIN_SPECS)}")
    return builtin_documents(BUILTIN_SPECS[spec])
