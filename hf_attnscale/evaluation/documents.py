"""The user's data for evaluation: a ``.jsonl`` file, a text file, or a built-in corpus."""

from __future__ import annotations

import json
from pathlib import Path

from .corpus import BUILTIN_SPECS, Document, load_builtin


def load_documents(data: str, text_field: str = "text") -> list[Document]:
    """Documents from a built-in spec (``builtin:stdlib-heldout``), a ``.jsonl`` file or a text file.

    A ``.jsonl`` file holds one JSON object per line, its text under ``text_field``. Any other file is read as
    UTF-8 text and is one document (a book, a source file).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: unknown built-in, unreadable or malformed file, or no text in it.
    """
    if data.startswith("builtin:"):
        return load_builtin(data)
    path = Path(data).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"Data file {str(path)!r} does not exist. Pass a .jsonl file (one {{{text_field!r}: ...}} object per "
            f"line), a text file, or a built-in corpus: {', '.join(BUILTIN_SPECS)}."
        )
    if not path.is_file():
        raise ValueError(f"Data path {str(path)!r} is not a file; pass a .jsonl or text file.")
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"Data file {str(path)!r} is not UTF-8 text ({err}).") from err
    except OSError as err:
        raise ValueError(f"Cannot read data file {str(path)!r}: {err}.") from err
    if path.suffix.lower() != ".jsonl":
        documents = [Document(path.name, raw)] if raw.strip() else []
    else:
        documents = []
        for number, line in enumerate(raw.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number} is not valid JSON ({err.msg}).") from err
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"{path}:{number} has no string field {text_field!r} (found {keys}); pick the field with --text-field."
                )
            if not isinstance(record[text_field], str):
                raise ValueError(
                    f"{path}:{number}: field {text_field!r} holds {type(record[text_field]).__name__}, not a string."
                )
            documents.append(Document(f"{path.name}:{number}", record[text_field]))
    if not documents:
        raise ValueError(f"Data file {str(path)!r} holds no text.")
    return documents
