"""The long real text the experiments read, none of it written here.

* ``stdlib``: the built-in corpus's held-out split (this interpreter's standard library sources, split by a
  hash of the path; the files concatenated in name order, a blank line between them).
* ``kjv``: the King James Bible, English prose of about a million tokens, from Debian's ``bible-kjv-text``
  package (its text is stored compressed; the package ``bible-kjv``'s own ``bible`` program prints it).
  Both are fetched with ``apt-get download`` (no root needed) on first use and the text is cached.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from hf_attnscale.checkpoints.real import cache_root
from hf_attnscale.evaluation.corpus import builtin_documents

TEXTS = ("stdlib", "kjv")
KJV_PACKAGES = ("bible-kjv-text", "bible-kjv")
KJV_SHA256 = "82fa5f3788c6a9a010fb128a0f0bf588984b5888a82058520620eded59b033ea"
"""The text the ``bible`` program of Debian bookworm's bible-kjv 4.38 prints (checked on every fetch)."""


def text(name: str) -> str:
    """The text called ``name`` (one of `TEXTS`)."""
    if name == "stdlib":
        return "\n\n".join(doc.text for doc in sorted(builtin_documents("heldout"), key=lambda d: d.name))
    if name == "kjv":
        return kjv_text()
    raise ValueError(f"Unknown text {name!r}; choose one of {TEXTS}.")


def token_stream(tokenizer, name: str, tokens: int | None = None) -> torch.Tensor:
    """Text ``name`` tokenized as the tokenizer reads a document (its BOS first, if it adds one), cut to its
    first ``tokens`` tokens (None: all). Raises ValueError if the text is shorter."""
    ids = tokenizer(text(name), return_tensors="pt").input_ids[0]
    if tokens is not None:
        if ids.numel() < tokens:
            raise ValueError(f"Text {name!r} has {ids.numel()} tokens, fewer than the {tokens} asked for.")
        ids = ids[:tokens]
    return ids


def kjv_text() -> str:
    """The King James Bible as plain text, from Debian's packages (cached under the checkpoint cache)."""
    path = cache_root() / "texts" / "kjv.txt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as work:
            printed = _print_kjv(Path(work))
            digest = hashlib.sha256(printed.encode()).hexdigest()
            if digest != KJV_SHA256:
                raise RuntimeError(
                    f"The King James text printed by Debian's bible-kjv has sha256 {digest}, not the "
                    f"{KJV_SHA256} these experiments were run on; a different package version?"
                )
            partial = Path(work) / "kjv.txt"
            partial.write_text(printed)
            os.replace(partial, path)
    return path.read_text()


def _print_kjv(work: Path) -> str:
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise RuntimeError(
                f"The King James text comes from Debian packages ({', '.join(KJV_PACKAGES)}) and needs "
                f"{tool}, which this machine does not have. Use --texts stdlib."
            )
    try:
        subprocess.run(["apt-get", "download", *KJV_PACKAGES], cwd=work, check=True, capture_output=True)
    except subprocess.CalledProcessError as err:
        raise RuntimeError(
            f"apt-get download {' '.join(KJV_PACKAGES)} failed: {err.stderr.decode()[-500:]}"
        ) from None
    for deb in work.glob("*.deb"):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(work / "root")], check=True)
    root = work / "root" / "usr"
    printed = subprocess.run(
        [str(root / "bin" / "bible"), "-p", str(root / "lib"), "gen1:1-rev22:21"],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "80"},
    ).stdout
    if len(printed) < 4_000_000:
        raise RuntimeError(f"bible printed {len(printed)} characters; the whole Bible is about 4.3 million.")
    return printed
