"""Long real texts for reading past a model's trained length, offline: the King James Bible split into its 66
books, and the built-in stdlib corpus joined into long documents.

The Bible comes from Debian's packages (``bible-kjv-text``, printed by ``bible-kjv``'s ``bible`` program):
``apt-get download`` needs no root, and the printed text is checked by its sha256, then cached under
``$HF_ATTNSCALE_CACHE/texts/``. In SmolLM2's tokens its books run from 431 (2 John) to 65,469 (Psalms); 34 of
them pass its 8,192-token trained length and 17 pass 32,768.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from hf_attnscale.checkpoints.real import FetchError, cache_root

from .corpus import Document

KJV_PACKAGES = ("bible-kjv-text", "bible-kjv")
KJV_SHA256 = "82fa5f3788c6a9a010fb128a0f0bf588984b5888a82058520620eded59b033ea"
"""The text the ``bible`` program of Debian bookworm's bible-kjv 4.38 prints (checked on every fetch)."""
_BOOK_START = re.compile(r"^(\S.*) 1$", re.MULTILINE)
"""A book's first chapter heading (``Genesis 1``, ``1 Samuel 1``, ``Song of Solomon 1``)."""


def kjv_text(progress: bool = True) -> str:
    """The King James Bible as plain text, fetched from Debian's packages on first use, then cached.

    Raises:
        FetchError: apt-get or dpkg-deb is missing, the download fails, or the text is not the one checked here.
    """
    path = cache_root() / "texts" / "kjv.txt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as work:
            printed = _print_kjv(Path(work), progress)
            digest = hashlib.sha256(printed.encode()).hexdigest()
            if digest != KJV_SHA256:
                raise FetchError(
                    f"The King James text printed by Debian's {' '.join(KJV_PACKAGES)} has sha256 {digest}, not "
                    f"{KJV_SHA256}: another package version than the one checked here."
                )
            partial = Path(work) / "kjv.txt"
            partial.write_text(printed)
            os.replace(partial, path)
    return path.read_text()


def kjv_books(progress: bool = True) -> list[Document]:
    """The King James Bible's 66 books, in order, each one document (`split_books` of `kjv_text`)."""
    return split_books(kjv_text(progress))


def split_books(text: str) -> list[Document]:
    """A printed Bible cut at each book's first chapter heading: a `Document` per book, named by the book."""
    starts = list(_BOOK_START.finditer(text))
    ends = [m.start() for m in starts[1:]] + [len(text)]
    return [Document(m.group(1), text[m.start() : end].strip("\n") + "\n") for m, end in zip(starts, ends)]


def joined_documents(
    documents: Sequence[Document], tokenizer: PreTrainedTokenizerBase, min_tokens: int
) -> list[Document]:
    """``documents`` joined in order, a blank line between them, into documents of at least ``min_tokens``
    tokens each (counted as ``tokenizer`` reads each part alone, special tokens left out); a last group shorter
    than that is left out. Each is named after its first and last part."""
    joined, group, tokens = [], [], 0
    for doc in documents:
        group.append(doc)
        tokens += len(tokenizer(doc.text, add_special_tokens=False)["input_ids"])
        if tokens >= min_tokens:
            name = f"{group[0].name} .. {group[-1].name}" if len(group) > 1 else group[0].name
            joined.append(Document(name, "\n\n".join(d.text for d in group)))
            group, tokens = [], 0
    return joined


def _print_kjv(work: Path, progress: bool) -> str:
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise FetchError(
                f"The King James text comes from Debian's packages ({', '.join(KJV_PACKAGES)}) and needs {tool}, "
                "which this machine does not have."
            )
    with tqdm(total=3, desc="kjv: fetching from Debian", unit="step", disable=not progress) as bar:
        try:
            subprocess.run(["apt-get", "download", *KJV_PACKAGES], cwd=work, check=True, capture_output=True)
        except subprocess.CalledProcessError as err:
            last = err.stderr.decode().strip().splitlines()[-1:] or ["no message"]
            raise FetchError(f"apt-get download {' '.join(KJV_PACKAGES)} failed: {last[0]}") from None
        bar.update()
        for deb in work.glob("*.deb"):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(work / "root")], check=True)
        bar.update()
        root = work / "root" / "usr"
        printed = subprocess.run(
            [str(root / "bin" / "bible"), "-p", str(root / "lib"), "gen1:1-rev22:21"],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "80"},
        ).stdout
        bar.update()
    return printed
