"""The result of a length sweep: its rows, and the table and JSON that present them; its plot is drawn by
`hf_attnscale.evaluation.figure`."""

from __future__ import annotations

import json
import math
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
import torch
import transformers

from .figure import sweep_figure
from .lengths import TRAINED, LengthMark, length_label
from .variants import Variant

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DEFINITIONS = {
    "perplexity": "ppl at length L: documents of >= max(lengths) tokens, each cut to its first max(lengths) "
    "tokens, split into non-overlapping L-token segments read from scratch; exp(token-weighted mean NLL) over "
    "every predicted token",
    "pseudo-perplexity": "at length L: documents of >= max(lengths) tokens cut into non-overlapping L-token "
    "windows; pseudo-perplexity: exp(mean NLL) of sampled tokens, each masked alone with the rest of its window "
    "visible; accuracy: top-1 accuracy with 15% of each window masked at once (the same tokens at every L)",
}


@dataclass(frozen=True)
class SweepRow:
    """One variant at one length: perplexity (pseudo-perplexity for a masked LM), and MLM accuracy if any."""

    variant: str
    length: int
    ppl: float
    nll: float
    tokens: int
    documents: int
    accuracy: float | None = None


@dataclass(frozen=True)
class PositionTable:
    """Perplexity by position within a sweep's longest segments (each read from its start): the buckets'
    labels (``"0-1k"``...) and first positions, and each variant's perplexity per bucket."""

    buckets: list[str]
    starts: list[int]
    ppl: dict[str, list[float]]

    def table(self) -> str:
        """A Markdown table: one row per variant, one column per position bucket."""
        header = ["variant", *[f"positions {b}" for b in self.buckets]]
        lines = [
            "| " + " | ".join(header) + " |",
            "|" + "|".join(["---"] + ["---:"] * len(self.buckets)) + "|",
        ]
        lines += [
            "| " + " | ".join([name, *[f"{p:.2f}" for p in ppl]]) + " |" for name, ppl in self.ppl.items()
        ]
        return "\n".join(lines)


@dataclass
class SweepResult:
    """Rows of a sweep plus what produced them; `table`, `write_json` and `plot` present them."""

    rows: list[SweepRow]
    """One row per variant and length."""
    variants: list[Variant]
    """The variants, in the table's order."""
    lengths: list[int]
    """The lengths read, ascending."""
    documents: list[str]
    """The names of the documents read (each cut to the longest length)."""
    train_length: int | None = None
    """The length the table's and the plot's multiples (``2x``) are of: the trained length, or the patch's L
    where one was given."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Each variant's wall time over every length, for the table's tokens/s."""
    info: dict[str, Any] = field(default_factory=dict)
    """How the sweep ran (chunk size, BOS, versions, the command), written to the JSON as it is."""
    measure: str = "perplexity"
    """What ``ppl`` is: "perplexity" (causal LM) or "pseudo-perplexity" (masked LM, with MLM accuracy)."""
    marks: list[LengthMark] = field(default_factory=list)
    """The lengths the plot marks, each saying what it is and where it came from (see `length_marks`). None
    given: ``train_length``, if any, as a trained length given to the sweep."""
    estimates: dict[str, int] = field(default_factory=dict)
    """Variants whose perplexities are estimates from few tokens: name -> the tokens scored. The plot draws
    them dotted with hollow markers and labels them as estimates."""
    positions: PositionTable | None = None
    """Perplexity by position within the longest length's segments, if the sweep was asked for it; the plot
    draws it in a second panel."""

    def ppl(self, variant: str, length: int) -> float:
        """The perplexity of ``variant`` at ``length``."""
        for row in self.rows:
            if row.variant == variant and row.length == length:
                return row.ppl
        raise KeyError(f"No row for variant {variant!r} at length {length}.")

    @property
    def has_accuracy(self) -> bool:
        """Whether the rows carry MLM accuracy (a masked LM's sweep)."""
        return has_accuracy(self.rows)

    def header(self) -> str:
        """The Markdown table's header (see `table_header`)."""
        return table_header(self.lengths, self.train_length, self.has_accuracy)

    def row(self, variant: str) -> str:
        """One variant's line of the Markdown table (see `table_row`)."""
        rows = {r.length: r for r in self.rows if r.variant == variant}
        return table_row([rows[n] for n in self.lengths], self.seconds.get(variant, 0.0))

    def table(self) -> str:
        """A Markdown table: one row per variant, one column per length (and measure), then tokens/s."""
        return "\n".join([self.header(), *(self.row(v.name) for v in self.variants)])

    def to_dict(self) -> dict[str, Any]:
        """The whole result as `write_json` writes it."""
        return {
            "measure": self.measure,
            "definition": DEFINITIONS[self.measure],
            "lengths": self.lengths,
            "train_length": self.train_length,
            "documents": self.documents,
            "variants": [v.to_dict() for v in self.variants],
            "rows": [vars(r) for r in self.rows],
            "seconds": self.seconds,
            "length_marks": [asdict(m) for m in self.plot_marks()],
            "estimates": self.estimates,
            "positions": None if self.positions is None else asdict(self.positions),
            **self.info,
        }

    def write_json(self, path: str | Path) -> Path:
        """Write `to_dict` as JSON to ``path`` (parent directories are created)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    def plot_marks(self) -> list[LengthMark]:
        """`marks`, else ``train_length`` as a trained length given to the sweep (none without one)."""
        if self.marks or not self.train_length:
            return list(self.marks)
        return [LengthMark(self.train_length, TRAINED, "as given")]

    def figure(self, title: str | None = None) -> Figure:
        """The plot of perplexity against length (`hf_attnscale.evaluation.figure.sweep_figure`): log-x over the
        lengths swept, one line per variant (dashed: streamed; dotted with hollow markers: an estimate from few
        tokens), the trained length and a patch's L drawn where they are near the data and named in the legend
        where they are not; perplexity by position in a second panel, if the sweep measured it."""
        return sweep_figure(
            self.lengths,
            self.variants,
            {v.name: [self.ppl(v.name, n) for n in self.lengths] for v in self.variants},
            train_length=self.train_length,
            marks=self.plot_marks(),
            estimates=self.estimates,
            positions=self.positions,
            title=title,
        )

    def plot(self, path: str | Path, title: str | None = None) -> Path:
        """Write `figure` as a PNG to ``path`` (parent directories are created)."""
        fig = self.figure(title)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        return path


def has_accuracy(rows: Sequence[SweepRow]) -> bool:
    """Whether the rows carry MLM accuracy (a masked LM's sweep)."""
    return any(r.accuracy is not None for r in rows)


def table_header(lengths: Sequence[int], train_length: int | None = None, accuracy: bool = False) -> str:
    """The Markdown table's header: one column per length (perplexity, then MLM accuracy), then tokens/s."""
    labels = [length_label(n, train_length) for n in lengths]
    if accuracy:
        labels = [f"PPPL {x}" for x in labels] + [f"acc {x}" for x in labels]
    header = ["variant", *labels, "tok/s"]
    return "\n".join(
        ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    )


def table_row(rows: Sequence[SweepRow], seconds: float) -> str:
    """One variant's line of the Markdown table, from its rows (one per length, in the header's order) and
    the seconds it took."""
    cells = [f"{r.ppl:.2f}" for r in rows]
    if has_accuracy(rows):
        cells += [f"{100 * r.accuracy:.2f}%" for r in rows]
    tokens = sum(r.tokens for r in rows)
    speed = f"{tokens / seconds:,.0f}" if seconds > 0 else "-"
    return "| " + " | ".join([rows[0].variant, *cells, speed]) + " |"


def versions() -> dict[str, str]:
    """The versions of Python and of the libraries a result depends on, recorded with it."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def rows_from_sums(
    name: str, nll_sum: dict[int, float], counts: dict[int, int], documents: int
) -> list[SweepRow]:
    """A `SweepRow` per length from the summed NLL and the count of scored tokens at each length."""
    return [
        SweepRow(name, n, math.exp(nll_sum[n] / counts[n]), nll_sum[n] / counts[n], counts[n], documents)
        for n in nll_sum
    ]
