"""Perplexity against context length: the sweep behind ``hf-attnscale demo`` and ``hf-attnscale eval``.

What "perplexity at length L" means here, for every variant alike:

* The documents are those with at least ``Lmax = max(lengths)`` tokens, each cut to its first ``Lmax`` tokens,
  so every length and every variant reads the same text.
* At length L each document is cut into ``Lmax / L`` non-overlapping segments of L tokens, and each segment
  is read on its own, from scratch: the model never sees anything before the segment.
* Within a segment, token ``t`` is predicted from what the variant lets it see of tokens ``0..t-1``:
  everything for a dense variant (unpatched, logn: one causal pass, dense attention over the segment), or
  the first ``sink_tokens`` tokens of the segment plus its last ``window`` tokens for a streaming variant
  (the segment is streamed through a fresh `SinkCache`).
* The result is ``exp`` of the token-weighted mean NLL over every predicted token of every segment of every
  document (the first token of a segment has no context and is not predicted).

So the scored tokens are the same at every length, up to the ``Lmax / L`` segment starts, and the curves
differ only by how much context each token gets: within the trained length more context helps, past it a
dense model meets positions it never saw, while a streaming cache bounds what a token sees.
"""

from __future__ import annotations

import json
import math
import platform
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from .cache import SinkCache
from .config import AttnScaleConfig
from .corpus import BUILTIN_SPECS, Document, load_builtin
from .default_model import DEFAULT_MODEL_NAME, default_model_path
from .patching import patch, unpatch
from .perplexity import perplexity

if TYPE_CHECKING:
    from torch import nn

DEFAULT_DATA = "builtin:stdlib-heldout"
DEFAULT_MODEL = f"builtin:{DEFAULT_MODEL_NAME}"
"""Name of the shipped checkpoint wherever a model path or Hub id is taken."""


@dataclass(frozen=True)
class Variant:
    """One way of running a model in a sweep.

    Attributes:
        name: label in tables, JSON and plots.
        patch: options for `hf_attnscale.patch` (``{}``: the identity patch), or None to run it unpatched.
        sink_tokens: sink tokens of the streaming cache (0: window-only).
        window: window of the streaming cache; None reads each segment densely.
    """

    name: str
    patch: Mapping[str, Any] | None = None
    sink_tokens: int = 0
    window: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("A variant needs a non-empty name.")
        if self.patch is not None:
            AttnScaleConfig(**self.patch)  # fail early, with the config's own message
        if self.window is None:
            if self.sink_tokens:
                raise ValueError(
                    f"Variant {self.name!r}: sink_tokens={self.sink_tokens} needs a window; pass window=W "
                    "(the cache holds sink_tokens + W tokens)."
                )
        else:
            SinkCache(self.sink_tokens, self.window)  # validates both counts
            if self.patch is None:
                # Streaming needs the patched attention forward; the identity patch changes nothing else.
                object.__setattr__(self, "patch", {})

    @property
    def streaming(self) -> bool:
        """Whether segments are streamed through a `SinkCache` instead of read densely."""
        return self.window is not None

    def apply(self, model: nn.Module) -> None:
        """Put ``model`` in this variant's state (reconfiguring any earlier patch)."""
        unpatch(model)
        if self.patch is not None:
            patch(model, config=AttnScaleConfig(**self.patch))

    def new_cache(self) -> SinkCache | None:
        """A fresh cache for one segment, or None for dense reading."""
        return SinkCache(self.sink_tokens, self.window) if self.streaming else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "patch": None if self.patch is None else dict(self.patch),
            "sink_tokens": self.sink_tokens if self.streaming else None,
            "window": self.window,
        }


def demo_variants(train_length: int, sink_tokens: int = 4) -> list[Variant]:
    """The variants of ``hf-attnscale demo`` for a model trained at ``train_length`` tokens (L below).

    unpatched; logn (``max(1, log_L(n))``); window-only and sink+window streaming with a cache of L tokens,
    so no token ever sees a position the model was not trained on; and streaming+logn with a cache of 2L,
    next to sink+window with the same 2L cache so the two differ only by logn. (With a cache of at most L,
    the clamped logn factor is 1 everywhere and streaming+logn would equal sink+window exactly.)
    """
    logn = {"scale": "logn", "train_length": train_length}
    window, wide = train_length - sink_tokens, 2 * train_length - sink_tokens
    return [
        Variant("unpatched"),
        Variant("logn", patch=logn),
        Variant(f"window-only ({train_length})", window=train_length),
        Variant(f"sink+window ({sink_tokens}+{window})", sink_tokens=sink_tokens, window=window),
        Variant(f"sink+window ({sink_tokens}+{wide})", sink_tokens=sink_tokens, window=wide),
        Variant(f"streaming+logn ({sink_tokens}+{wide})", patch=logn, sink_tokens=sink_tokens, window=wide),
    ]


@dataclass(frozen=True)
class SweepRow:
    """Perplexity of one variant at one length (see the module docstring for the definition)."""

    variant: str
    length: int
    ppl: float
    nll: float
    tokens: int
    documents: int


@dataclass
class SweepResult:
    """Rows of a sweep plus what produced them; `table`, `write_json` and `plot` present them."""

    rows: list[SweepRow]
    variants: list[Variant]
    lengths: list[int]
    documents: list[str]
    train_length: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def ppl(self, variant: str, length: int) -> float:
        """The perplexity of ``variant`` at ``length``."""
        for row in self.rows:
            if row.variant == variant and row.length == length:
                return row.ppl
        raise KeyError(f"No row for variant {variant!r} at length {length}.")

    def _length_label(self, length: int) -> str:
        if self.train_length:
            return f"{length} ({length / self.train_length:g}x)"
        return str(length)

    def table(self) -> str:
        """A Markdown table: one row per variant, one perplexity column per length, then tokens/s."""
        header = ["variant", *(self._length_label(n) for n in self.lengths), "tok/s"]
        lines = [
            "| " + " | ".join(header) + " |",
            "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
        ]
        for variant in self.variants:
            tokens = sum(r.tokens for r in self.rows if r.variant == variant.name)
            seconds = self.seconds.get(variant.name, 0.0)
            speed = f"{tokens / seconds:,.0f}" if seconds > 0 else "-"
            cells = [f"{self.ppl(variant.name, n):.2f}" for n in self.lengths]
            lines.append("| " + " | ".join([variant.name, *cells, speed]) + " |")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "definition": "ppl at length L: documents of >= max(lengths) tokens, each cut to its first "
            "max(lengths) tokens, split into non-overlapping L-token segments read from scratch; "
            "exp(token-weighted mean NLL) over every predicted token",
            "lengths": self.lengths,
            "train_length": self.train_length,
            "documents": self.documents,
            "variants": [v.to_dict() for v in self.variants],
            "rows": [vars(r) for r in self.rows],
            "seconds": self.seconds,
            **self.info,
        }

    def write_json(self, path: str | Path) -> Path:
        """Write `to_dict` as JSON to ``path`` (parent directories are created)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    def plot(self, path: str | Path, title: str | None = None) -> Path:
        """Write a PNG of perplexity against length: log-x, one line per variant, the trained length marked."""
        # The object API with the Agg canvas draws off-screen without touching pyplot's global backend.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FixedLocator, NullLocator

        fig = Figure(figsize=(7.5, 4.8), dpi=120)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        markers = "osD^vP*X"
        for i, variant in enumerate(self.variants):
            ys = [self.ppl(variant.name, n) for n in self.lengths]
            ax.plot(
                self.lengths,
                ys,
                marker=markers[i % len(markers)],
                # Variants that coincide (all of them at 1x) would hide each other: later lines are drawn
                # thinner with smaller markers, so the earlier ones still show around them.
                markersize=max(4.0, 9.0 - 0.8 * i),
                linewidth=max(1.2, 2.6 - 0.25 * i),
                linestyle="--" if variant.streaming else "-",
                label=variant.name,
            )
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(self.lengths))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([self._length_label(n).replace(" ", "\n") for n in self.lengths])
        values = [r.ppl for r in self.rows if math.isfinite(r.ppl)]
        if values and max(values) / min(values) > 4:  # an exploding baseline would flatten the others
            ax.set_yscale("log")
        if self.train_length:
            ax.axvline(self.train_length, color="0.4", linestyle=":", linewidth=1.2)
            ax.annotate(
                "trained length",
                (self.train_length, 1),
                xycoords=("data", "axes fraction"),
                xytext=(4, -4),
                textcoords="offset points",
                va="top",
                fontsize=9,
                color="0.3",
            )
        ax.set_xlabel("evaluation length L (tokens)")
        ax.set_ylabel("perplexity (lower is better)")
        ax.set_title(title or "Held-out perplexity against evaluation length")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(frameon=False)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        return path


def sweep(
    model: nn.Module,
    documents: Sequence[torch.Tensor],
    lengths: Sequence[int],
    variants: Sequence[Variant],
    *,
    names: Sequence[str] | None = None,
    max_documents: int | None = None,
    train_length: int | None = None,
    chunk_size: int = 512,
    progress: bool | None = None,
) -> SweepResult:
    """Perplexity of each variant at each length over tokenized documents (definition: module docstring).

    Args:
        model: a causal LM in eval mode; it is patched per variant and left unpatched on return.
        documents: token ids of each document, 1-D tensors.
        lengths: evaluation lengths in tokens; each must divide ``max(lengths)`` (e.g. powers of two).
        variants: how to run the model; names must be unique.
        names: a name per document (for the JSON); defaults to ``doc0, doc1, ...``.
        max_documents: use at most this many of the documents long enough (in the order given).
        train_length: the model's trained length, only for labels and the plot.
        chunk_size: tokens per model call within a segment (memory, not results).
        progress: tqdm bars (None: only on a terminal).

    Raises:
        ValueError: bad lengths or variants, or no document of at least ``max(lengths)`` tokens.
    """
    lengths = _check_lengths(lengths)
    longest = lengths[-1]
    if not variants:
        raise ValueError("Pass at least one variant.")
    seen_names = [v.name for v in variants]
    if len(set(seen_names)) != len(seen_names):
        raise ValueError(f"Variant names must be unique, got {seen_names}.")
    names = list(names) if names is not None else [f"doc{i}" for i in range(len(documents))]
    if len(names) != len(documents):
        raise ValueError(f"Got {len(names)} names for {len(documents)} documents.")
    chosen = [(n, d[:longest]) for n, d in zip(names, documents) if d.numel() >= longest]
    if not chosen:
        most = max((d.numel() for d in documents), default=0)
        raise ValueError(
            f"No document has at least {longest} tokens (the longest length asked for); the longest of the "
            f"{len(documents)} documents has {most}. Ask for lengths up to {most} tokens, or use longer data."
        )
    if max_documents is not None:
        if max_documents < 1:
            raise ValueError(f"max_documents must be at least 1, got {max_documents}.")
        chosen = chosen[:max_documents]
    _check_variants(model, variants)

    rows: list[SweepRow] = []
    seconds: dict[str, float] = {}
    try:
        for variant in variants:
            variant.apply(model)
            start = time.perf_counter()
            nll_sum = dict.fromkeys(lengths, 0.0)
            counts = dict.fromkeys(lengths, 0)
            total = len(chosen) * sum(longest - longest // n for n in lengths)
            disable = None if progress is None else not progress
            with tqdm(total=total, desc=variant.name, unit="tok", disable=disable) as bar:
                for _, ids in chosen:
                    for length in lengths:
                        for segment in ids.view(-1, length):
                            result = perplexity(
                                model,
                                segment,
                                cache=variant.new_cache(),
                                chunk_size=chunk_size,
                                progress=False,
                            )
                            nll_sum[length] += result.nll.double().sum().item()
                            counts[length] += result.nll.numel()
                            bar.update(result.nll.numel())
                    bar.set_postfix(ppl=f"{math.exp(nll_sum[longest] / counts[longest]):.2f}")
            seconds[variant.name] = time.perf_counter() - start
            for length in lengths:
                mean = nll_sum[length] / counts[length]
                rows.append(SweepRow(variant.name, length, math.exp(mean), mean, counts[length], len(chosen)))
    finally:
        unpatch(model)
    return SweepResult(
        rows=rows,
        variants=list(variants),
        lengths=lengths,
        documents=[n for n, _ in chosen],
        train_length=train_length,
        seconds=seconds,
        info={"chunk_size": chunk_size, "versions": _versions()},
    )


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    if not lengths:
        raise ValueError("Pass at least one evaluation length.")
    bad = [n for n in lengths if isinstance(n, bool) or not isinstance(n, int) or n < 2]
    if bad:
        raise ValueError(f"Lengths must be ints >= 2 (tokens), got {bad}.")
    lengths = sorted(set(lengths))
    longest = lengths[-1]
    uneven = [n for n in lengths if longest % n]
    if uneven:
        raise ValueError(
            f"Every length must divide the longest ({longest}) so that all lengths score the same tokens; "
            f"{uneven} do not. Powers of two (e.g. 1k,2k,4k,8k) always do."
        )
    return lengths


def _check_variants(model: nn.Module, variants: Sequence[Variant]) -> None:
    """Raise before any work if the model cannot run one of the variants (it is left unpatched)."""
    from .streaming import check_streaming_model

    try:
        for variant in variants:
            variant.apply(model)
            if variant.streaming:
                check_streaming_model(model)
    except ValueError as err:
        raise ValueError(f"Variant {variant.name!r}: {err}") from err
    finally:
        unpatch(model)


def parse_lengths(text: str) -> list[int]:
    """``"256,512,1k,2k"`` -> ``[256, 512, 1024, 2048]`` (``k`` is 1024)."""
    lengths = []
    for item in filter(None, (part.strip().lower() for part in text.split(","))):
        match = re.fullmatch(r"(\d+)(k?)", item)
        if match is None:
            raise ValueError(f"Bad length {item!r} in {text!r}; write token counts such as 512,1k,2k,4k.")
        lengths.append(int(match[1]) * (1024 if match[2] else 1))
    if not lengths:
        raise ValueError(f"No lengths in {text!r}; write token counts such as 512,1k,2k,4k.")
    return lengths


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
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"{path}:{number} has no string field {text_field!r} (found {keys}); pick the field "
                    "with --text-field."
                )
            documents.append(Document(f"{path.name}:{number}", record[text_field]))
    if not documents:
        raise ValueError(f"Data file {str(path)!r} holds no text.")
    return documents


def resolve_model_path(name: str) -> str:
    """``builtin:tiny-llama-stdlib`` -> the shipped checkpoint's directory; anything else unchanged."""
    if not name.startswith("builtin:"):
        return name
    if name != DEFAULT_MODEL:
        raise ValueError(f"Unknown built-in model {name!r}; the shipped one is {DEFAULT_MODEL!r}.")
    return str(default_model_path())


def _versions() -> dict[str, str]:
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
