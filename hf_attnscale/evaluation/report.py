"""The result of a length sweep: its rows, and the table, JSON and plot that present them."""

from __future__ import annotations

import json
import math
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers
import torch
import transformers

from .variants import Variant

DEFINITIONS = {
    "perplexity": "ppl at length L: documents of >= max(lengths) tokens, each cut to its first max(lengths) "
    "tokens, split into non-overlapping L-token segments read from scratch; exp(token-weighted mean NLL) over "
    "every predicted token",
    "pseudo-perplexity": "at length L: documents of >= max(lengths) tokens cut into non-overlapping L-token "
    "windows; pseudo-perplexity: exp(mean NLL) of sampled tokens, each masked alone with the rest of its window "
    "visible; accuracy: top-1 accuracy with 15% of each window masked at once (the same tokens at every L)",
}


LEGEND_INSIDE = 6
"""Up to this many variants the legend sits inside the plot; more go beside it."""


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
    measure: str = "perplexity"
    """What ``ppl`` is: "perplexity" (causal LM) or "pseudo-perplexity" (masked LM, with MLM accuracy)."""

    def ppl(self, variant: str, length: int) -> float:
        """The perplexity of ``variant`` at ``length``."""
        for row in self.rows:
            if row.variant == variant and row.length == length:
                return row.ppl
        raise KeyError(f"No row for variant {variant!r} at length {length}.")

    @property
    def has_accuracy(self) -> bool:
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
        return {
            "measure": self.measure,
            "definition": DEFINITIONS[self.measure],
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
        # matplotlib takes about a second to import and only plots need it.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FixedLocator, LogLocator, NullLocator, ScalarFormatter

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
        ax.set_xticklabels([length_label(n, self.train_length).replace(" ", "\n") for n in self.lengths])
        values = [r.ppl for r in self.rows if math.isfinite(r.ppl)]
        if values and max(values) / min(values) > 4:  # an exploding baseline would flatten the others
            ax.set_yscale("log")
            # Plain numbers (2, 3, 5, 10, 20, ...), not powers of ten, on a range of a few decades at most.
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0, 7.0)))
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_locator(NullLocator())
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
        if len(self.variants) > LEGEND_INSIDE:  # a long legend would cover the lines: it goes to the right
            fig.set_figwidth(fig.get_figwidth() + 3.2)
            ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        else:
            ax.legend(frameon=False)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        return path


def has_accuracy(rows: Sequence[SweepRow]) -> bool:
    """Whether the rows carry MLM accuracy (a masked LM's sweep)."""
    return any(r.accuracy is not None for r in rows)


def length_label(length: int, train_length: int | None = None) -> str:
    """``"256 (2x)"`` for 256 tokens after a trained length of 128; ``"256"`` without one."""
    return f"{length} ({length / train_length:g}x)" if train_length else str(length)


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
