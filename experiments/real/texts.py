"""The long real text the experiments read, none of it written here.

* ``stdlib``: the built-in corpus's held-out split (this interpreter's standard library sources, split by a
  hash of the path; the files concatenated in name order, a blank line between them).
* ``kjv``: the King James Bible, English prose of about a million tokens, from Debian's ``bible-kjv-text``
  package (its text is stored compressed; the package ``bible-kjv``'s own ``bible`` program prints it).
  Fetched on first use by `hf_attnscale.evaluation.long_texts.kjv_text` and cached.
"""

from __future__ import annotations

import torch

from hf_attnscale.evaluation.corpus import builtin_documents
from hf_attnscale.evaluation.long_texts import kjv_text

TEXTS = ("stdlib", "kjv")


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
