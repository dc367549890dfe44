"""The result of a length sweep: its rows, and the table, JSON and plot that present them."""

from __future__ import annotations

import json
import math
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import tokenizers
import torch
import transformers

from .variants import Variant

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.legend import Legend
    from matplotlib.ticker import Locator

DEFINITIONS = {
    "perplexity": "ppl at length L: documents of >= max(lengths) tokens, each cut to its first max(lengths) "
    "tokens, split into non-overlapping L-token segments read from scratch; exp(token-weighted mean NLL) over "
    "every predicted token",
    "pseudo-perplexity": "at length L: documents of >= max(lengths) tokens cut into non-overlapping L-token "
    "windows; pseudo-perplexity: exp(mean NLL) of sampled tokens, each masked alone with the rest of its window "
    "visible; accuracy: top-1 accuracy with 15% of each window masked at once (the same tokens at every L)",
}


LEGEND_INSIDE = 6
"""Up to this many entries the legend sits inside the plot where it covers no line (else below the plot); more
go beside it."""
NEAR = 2
"""A marked length (the trained length, a patch's L) within this factor of the lengths swept is drawn, the x
axis widened to it; one further away is only named in the legend, so that the axis follows the data."""
FRACTIONS = 4
"""Below the length multiples are of, a length reads as a multiple only as a fraction with a denominator up to
this (1/2x, 1/4x, 3/4x); shorter lengths read as plain token counts, never as 0.03125x."""
TRAINED = "trained length"
PATCH_L = "L of the patch"
CONFIG_LENGTH = "config's max_position_embeddings"


@dataclass(frozen=True)
class LengthMark:
    """A length the plot marks: what it is (`TRAINED`, the model's trained length, or `PATCH_L`, the length a
    patch's scale starts from) and where the number came from (a config field, a flag)."""

    length: int
    what: str
    source: str

    @property
    def label(self) -> str:
        """E.g. ``trained length 8,192 (config's max_position_embeddings)``."""
        return f"{self.what} {self.length:,} ({self.source})"


def length_marks(
    config_length: int | None, given: int | None, flag: str = "--train-length"
) -> list[LengthMark]:
    """The one rule for what a plot calls the trained length.

    The model config's ``max_position_embeddings`` (``config_length``) where it has one: that is the length
    the model was trained at. A length the user gave (``given``, by ``flag``) that differs from it is not the
    model's trained length but the L a patch scales from, and is marked as that. Where the config has none,
    the given length stands for the trained length, marked as given by ``flag``. The trained length comes
    first.
    """
    if config_length is None:
        return [] if given is None else [LengthMark(given, TRAINED, flag)]
    marks = [LengthMark(config_length, TRAINED, CONFIG_LENGTH)]
    if given is not None and given != config_length:
        marks.append(LengthMark(given, PATCH_L, flag))
    return marks


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
    variants: list[Variant]
    lengths: list[int]
    documents: list[str]
    train_length: int | None = None
    """The length the table's and the plot's multiples (``2x``) are of: the trained length, or the patch's L
    where one was given."""
    seconds: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
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
        """The plot of perplexity against length: log-x over the lengths swept, one line per variant (dashed:
        streamed; dotted with hollow markers: an estimate from few tokens), the trained length and a patch's L
        drawn where they are near the data and named in the legend where they are not."""
        # The object API with the Agg canvas draws off-screen without touching pyplot's global backend.
        # matplotlib takes about a second to import and only plots need it.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.ticker import FixedLocator, LogLocator, NullLocator, ScalarFormatter

        panels = 1 if self.positions is None else 2
        fig = Figure(figsize=(7.5 * panels, 4.8), dpi=120, layout="constrained")
        FigureCanvasAgg(fig)
        ax, *by_position = fig.subplots(1, panels, squeeze=False).flat
        for i, variant in enumerate(self.variants):
            style = variant_style(i, variant)
            tokens = self.estimates.get(variant.name)
            if tokens is not None:  # a noisy estimate must not read as a measurement like the others
                style.update(
                    linestyle=":",
                    markerfacecolor="none",
                    markeredgewidth=1.5,
                    markersize=max(7.0, style["markersize"]),  # hollow markers need the size to show
                    linewidth=max(1.6, style["linewidth"]),
                    label=f"{variant.name}: estimate from {tokens:,} tokens",
                )
            ax.plot(self.lengths, [self.ppl(variant.name, n) for n in self.lengths], **style)

        drawn, away = split_marks(self.lengths, self.plot_marks())
        for mark in drawn:
            trained = mark.what == TRAINED
            ax.axvline(
                mark.length,
                color="0.35" if trained else "0.55",
                linestyle=":" if trained else "-.",
                linewidth=1.3,
                label=mark.label,
            )
        ax.set_xscale("log", base=2)
        ax.set_xlim(*x_limits(self.lengths, [m.length for m in drawn]))
        # A tick at each length, and at each mark drawn clear of them (half an octave), so its line is read.
        ticks = sorted(
            {*self.lengths}
            | {m.length for m in drawn if all(abs(math.log2(m.length / n)) >= 0.5 for n in self.lengths)}
        )
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([length_label(n, self.train_length).replace(" ", "\n") for n in ticks])
        reference = self.train_length
        if reference and any(multiple(n, reference) for n in self.lengths):
            what = self._what_is(reference)
            ax.set_xlabel(f"evaluation length in tokens (Nx: N times the {what}, {reference:,})")
        else:
            ax.set_xlabel("evaluation length (tokens)")

        values = [r.ppl for r in self.rows if math.isfinite(r.ppl)]
        if values and max(values) / min(values) > 4:  # an exploding baseline would flatten the others
            ax.set_yscale("log")
            # Plain numbers (2, 3, 5, 10, 20, ...), not powers of ten, on a range of a few decades at most.
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0, 7.0)))
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_locator(NullLocator())
        if values:  # every point within the axis, a tick below the lowest and above the highest
            heights = y_ticks(
                ax.yaxis.get_major_locator(), min(values), max(values), ax.get_yscale() == "log"
            )
            ax.set_ylim(heights[0], heights[-1])
            ax.yaxis.set_major_locator(FixedLocator(heights))
        ax.set_ylabel("perplexity (lower is better)")
        ax.set_title(title or "Held-out perplexity against evaluation length")
        ax.grid(True, which="major", alpha=0.3)

        handles, labels = ax.get_legend_handles_labels()
        for mark in away:  # named, not drawn: a line there would stretch the axis far past the data
            handles.append(Line2D([], [], linestyle="none"))
            side = "past" if mark.length > max(self.lengths) else "below"
            labels.append(f"{mark.label}: {side} the lengths shown")
        place_legend(ax, handles, labels)
        if by_position:
            self._draw_positions(by_position[0], [line.get_color() for line in ax.get_lines()])
        return fig

    def _what_is(self, length: int) -> str:
        """What the plot says ``length`` is (the trained length, a patch's L), from its marks."""
        return next((m.what for m in self.plot_marks() if m.length == length), TRAINED)

    def _draw_positions(self, ax: Axes, colours: list[str]) -> None:
        """Perplexity by position bucket within the longest segments, a line per variant in its colour and
        style; the trained length drawn where it is a bucket edge."""
        from matplotlib.ticker import FixedLocator

        positions = self.positions
        x = range(len(positions.buckets))
        for i, (variant, colour) in enumerate(zip(self.variants, colours)):
            ax.plot(x, positions.ppl[variant.name], color=colour, **variant_style(i, variant))
        if self.train_length in positions.starts[1:]:  # the buckets from here on are past it
            boundary = positions.starts.index(self.train_length) - 0.5
            what = self._what_is(self.train_length)
            ax.axvline(boundary, color="0.35", linestyle=":", linewidth=1.3)
            ax.text(
                boundary + 0.05,
                0.98,
                f"past the {what}",
                va="top",
                transform=ax.get_xaxis_transform(),
                fontsize=8,
                color="0.35",
            )
        ax.xaxis.set_major_locator(FixedLocator(list(x)))
        ax.set_xticklabels(positions.buckets)
        values = [v for ppl in positions.ppl.values() for v in ppl if math.isfinite(v)]
        if values and max(values) / min(values) > 4:
            ax.set_yscale("log")
        ax.set_xlabel(
            f"position in the {max(self.lengths):,}-token segments (tokens before the predicted one)"
        )
        ax.set_ylabel("perplexity (lower is better)")
        ax.set_title("By position, within the longest segments")
        ax.grid(True, which="major", alpha=0.3)

    def plot(self, path: str | Path, title: str | None = None) -> Path:
        """Write `figure` as a PNG to ``path`` (parent directories are created)."""
        fig = self.figure(title)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        return path


def variant_style(index: int, variant: Variant) -> dict[str, Any]:
    """How the ``index``-th variant's line is drawn: its marker; dashed if streamed. Variants that coincide
    (all of them at 1x) would hide each other: later lines are drawn thinner with smaller markers, so the
    earlier ones still show around them."""
    markers = "osD^vP*X"
    return {
        "marker": markers[index % len(markers)],
        "markersize": max(4.0, 9.0 - 0.8 * index),
        "linewidth": max(1.2, 2.6 - 0.25 * index),
        "linestyle": "--" if variant.streaming else "-",
        "label": variant.name,
    }


def split_marks(
    lengths: Sequence[int], marks: Sequence[LengthMark]
) -> tuple[list[LengthMark], list[LengthMark]]:
    """The marks to draw (within a factor `NEAR` of the lengths) and those only to name (further away)."""
    low, high = min(lengths) / NEAR, max(lengths) * NEAR
    near = [m for m in marks if low <= m.length <= high]
    return near, [m for m in marks if m not in near]


def x_limits(lengths: Sequence[int], marked: Sequence[int] = ()) -> tuple[float, float]:
    """The x range (log 2) of a plot over ``lengths`` and the marked lengths drawn with them: a quarter octave
    of margin either side, no further."""
    shown = [*lengths, *marked]
    return min(shown) / 2**0.25, max(shown) * 2**0.25


def y_ticks(locator: Locator, low: float, high: float, log: bool) -> list[float]:
    """The y ticks ``locator`` gives for values from ``low`` to ``high`` with a margin: from the last at or
    below them to the first at or above them, so that every point lies within the axis, under a tick."""
    if log:
        margin = (high / low) ** 0.05 if high > low else 1.1
        low, high = low / margin, high * margin
    else:
        margin = 0.05 * (high - low) if high > low else 0.05 * abs(high) or 1.0
        low, high = low - margin, high + margin
    ticks = sorted(float(t) for t in locator.tick_values(low, high))
    bottom = max((t for t in ticks if t <= low), default=low)
    top = min((t for t in ticks if t >= high), default=high)
    return sorted({bottom, top, *(t for t in ticks if bottom < t < top)})


def place_legend(ax: Axes, handles: list, labels: list[str]) -> None:
    """The legend where it covers no line: inside ``ax`` where there is room for it (up to `LEGEND_INSIDE`
    entries), else below the plot at the same figure size; a longer one beside the plot, the figure widened."""
    fig = ax.figure
    if len(handles) > LEGEND_INSIDE:
        fig.set_figwidth(fig.get_figwidth() + 3.2)
        fig.legend(handles, labels, frameon=False, loc="outside right upper", fontsize=8)
        return
    legend = ax.legend(handles, labels, frameon=False, loc="best")
    if not legend_covers_a_line(ax, legend):
        return
    legend.remove()
    for columns in (2, 1):  # two columns if they fit across the figure
        legend = fig.legend(
            handles, labels, frameon=False, loc="outside lower center", ncols=columns, fontsize=9
        )
        fig.draw_without_rendering()
        if columns == 1 or legend.get_window_extent().width <= 0.98 * fig.bbox.width:
            return
        legend.remove()


def legend_covers_a_line(ax: Axes, legend: Legend) -> bool:
    """Whether ``legend``, where the laid-out figure puts it, covers a line of ``ax``: a segment or a marker."""
    from matplotlib.path import Path as PointPath

    figure = ax.figure
    figure.draw_without_rendering()  # lays the figure out and places the legend
    box = legend.get_window_extent()
    for line in ax.get_lines():
        radius = line.get_markersize() / 2 if line.get_marker() not in (None, "", "None", "none") else 0.0
        padded = box.padded(2 + radius * figure.dpi / 72)
        points = line.get_transform().transform(np.asarray(line.get_xydata(), dtype=float))
        points = points[np.isfinite(points).all(axis=1)]
        if len(points) and PointPath(points).intersects_bbox(padded, filled=False):
            return True
    return False


def has_accuracy(rows: Sequence[SweepRow]) -> bool:
    """Whether the rows carry MLM accuracy (a masked LM's sweep)."""
    return any(r.accuracy is not None for r in rows)


def multiple(length: int, reference: int) -> str | None:
    """``length`` as a multiple of ``reference`` where that reads well: ``2x``, ``1.5x``, ``1/2x``, ``3/4x``;
    None for a length shorter than the `FRACTIONS` allow (1/32 of it reads as a token count, not 0.03125x)."""
    ratio = Fraction(length, reference)
    if ratio.denominator == 1:
        return f"{ratio.numerator}x"
    if ratio > 1:
        rounded = f"{float(ratio):.2f}".rstrip("0").rstrip(".")
        return f"{rounded}x" if "." in rounded else f"~{rounded}x"
    if ratio.denominator <= FRACTIONS:
        return f"{ratio.numerator}/{ratio.denominator}x"
    return None


def length_label(length: int, train_length: int | None = None) -> str:
    """``"256 (2x)"`` for 256 tokens after a trained length of 128; ``"256"`` without one, or where the
    multiple would not read well (see `multiple`)."""
    times = multiple(length, train_length) if train_length else None
    return f"{length} ({times})" if times else str(length)


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
