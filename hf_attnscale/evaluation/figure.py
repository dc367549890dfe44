"""The sweep's figure: perplexity against length, the marked lengths, the legend where it covers no line, and
perplexity by position in a second panel. `hf_attnscale.evaluation.report.SweepResult.figure` draws it; this
module knows nothing of the result, only the numbers it is given. matplotlib is imported on first use."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .lengths import TRAINED, LengthMark, length_label, multiple
from .variants import Variant

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.legend import Legend
    from matplotlib.ticker import Locator

LEGEND_INSIDE = 6
"""Up to this many entries the legend sits inside the plot where it covers no line (else below the plot); more
go beside it."""
NEAR = 2
"""A marked length (the trained length, a patch's L) within this factor of the lengths swept is drawn, the x
axis widened to it; one further away is only named in the legend, so that the axis follows the data."""


class ByPosition(Protocol):
    """Perplexity by position bucket, as `hf_attnscale.evaluation.report.PositionTable` holds it."""

    @property
    def buckets(self) -> list[str]: ...
    @property
    def starts(self) -> list[int]: ...
    @property
    def ppl(self) -> dict[str, list[float]]: ...


def sweep_figure(
    lengths: Sequence[int],
    variants: Sequence[Variant],
    ppl: Mapping[str, Sequence[float]],
    *,
    train_length: int | None = None,
    marks: Sequence[LengthMark] = (),
    estimates: Mapping[str, int] | None = None,
    positions: ByPosition | None = None,
    title: str | None = None,
) -> Figure:
    """The plot of perplexity against length: log-x over ``lengths``, one line per variant (its perplexity at
    each length in ``ppl``; dashed: streamed; dotted with hollow markers: one of the ``estimates``, from few
    tokens), the ``marks`` drawn where they are near the data and named in the legend where they are not. Tick
    labels read as multiples of ``train_length``. With ``positions``, a second panel: perplexity by position."""
    # The object API with the Agg canvas draws off-screen without touching pyplot's global backend.
    # matplotlib takes about a second to import and only plots need it.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, LogLocator, NullLocator, ScalarFormatter

    estimates = estimates or {}
    panels = 1 if positions is None else 2
    fig = Figure(figsize=(7.5 * panels, 4.8), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax, *by_position = fig.subplots(1, panels, squeeze=False).flat
    for i, variant in enumerate(variants):
        style = variant_style(i, variant)
        tokens = estimates.get(variant.name)
        if tokens is not None:  # a noisy estimate must not read as a measurement like the others
            style.update(
                linestyle=":",
                markerfacecolor="none",
                markeredgewidth=1.5,
                markersize=max(7.0, style["markersize"]),  # hollow markers need the size to show
                linewidth=max(1.6, style["linewidth"]),
                label=f"{variant.name}: estimate from {tokens:,} tokens",
            )
        ax.plot(lengths, list(ppl[variant.name]), **style)

    drawn, away = split_marks(lengths, marks)
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
    ax.set_xlim(*x_limits(lengths, [m.length for m in drawn]))
    # A tick at each length, and at each mark drawn clear of them (half an octave), so its line is read.
    ticks = sorted(
        {*lengths} | {m.length for m in drawn if all(abs(math.log2(m.length / n)) >= 0.5 for n in lengths)}
    )
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([length_label(n, train_length).replace(" ", "\n") for n in ticks])
    if train_length and any(multiple(n, train_length) for n in lengths):
        what = what_is(train_length, marks)
        ax.set_xlabel(f"evaluation length in tokens (Nx: N times the {what}, {train_length:,})")
    else:
        ax.set_xlabel("evaluation length (tokens)")

    values = [p for curve in ppl.values() for p in curve if math.isfinite(p)]
    if values and max(values) / min(values) > 4:  # an exploding baseline would flatten the others
        ax.set_yscale("log")
        # Plain numbers (2, 3, 5, 10, 20, ...), not powers of ten, on a range of a few decades at most.
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0, 7.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_locator(NullLocator())
    if values:  # every point within the axis, a tick below the lowest and above the highest
        heights = y_ticks(ax.yaxis.get_major_locator(), min(values), max(values), ax.get_yscale() == "log")
        ax.set_ylim(heights[0], heights[-1])
        ax.yaxis.set_major_locator(FixedLocator(heights))
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title(title or "Held-out perplexity against evaluation length")
    ax.grid(True, which="major", alpha=0.3)

    handles, labels = ax.get_legend_handles_labels()
    for mark in away:  # named, not drawn: a line there would stretch the axis far past the data
        handles.append(Line2D([], [], linestyle="none"))
        side = "past" if mark.length > max(lengths) else "below"
        labels.append(f"{mark.label}: {side} the lengths shown")
    place_legend(ax, handles, labels)
    if by_position:
        draw_positions(
            by_position[0],
            positions,
            variants,
            [line.get_color() for line in ax.get_lines()],
            longest=max(lengths),
            train_length=train_length,
            marks=marks,
        )
    return fig


def what_is(length: int, marks: Sequence[LengthMark]) -> str:
    """What the plot says ``length`` is (the trained length, a patch's L), from its ``marks``."""
    return next((m.what for m in marks if m.length == length), TRAINED)


def draw_positions(
    ax: Axes,
    positions: ByPosition,
    variants: Sequence[Variant],
    colours: list[str],
    *,
    longest: int,
    train_length: int | None,
    marks: Sequence[LengthMark],
) -> None:
    """Perplexity by position bucket within the ``longest`` segments, a line per variant in its colour and
    style; the trained length drawn where it is a bucket edge."""
    from matplotlib.ticker import FixedLocator

    x = range(len(positions.buckets))
    for i, (variant, colour) in enumerate(zip(variants, colours)):
        ax.plot(x, positions.ppl[variant.name], color=colour, **variant_style(i, variant))
    if train_length in positions.starts[1:]:  # the buckets from here on are past it
        boundary = positions.starts.index(train_length) - 0.5
        what = what_is(train_length, marks)
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
    ax.set_xlabel(f"position in the {longest:,}-token segments (tokens before the predicted one)")
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title("By position, within the longest segments")
    ax.grid(True, which="major", alpha=0.3)


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


def passkey_figure(
    lengths: Sequence[int],
    found: Mapping[str, Sequence[tuple[int, int]]],
    *,
    train_length: int | None = None,
    title: str | None = None,
) -> Figure:
    """Passkeys found, one row per variant and one column per length: each cell ``k/n`` (of the prompts run
    there), coloured from red (none) to green (all); a dashed line after the trained length."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(found)
    fig = Figure(figsize=(1.4 * len(lengths) + 3.2, 0.42 * len(names) + 1.4), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    share = np.array([[k / n if n else np.nan for k, n in found[name]] for name in names])
    ax.imshow(share, cmap="RdYlGn", vmin=-0.4, vmax=1.4, aspect="auto")
    for row, name in enumerate(names):
        for column, (k, n) in enumerate(found[name]):
            ax.text(column, row, f"{k}/{n}" if n else "not run", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [length_label(n, train_length) for n in lengths])
    ax.set_yticks(range(len(names)), names, fontsize=8)
    within = sum(n <= train_length for n in lengths) if train_length is not None else len(lengths)
    if 0 < within < len(lengths):  # a line between the lengths within the trained length and those past it
        ax.axvline(within - 0.5, color="black", lw=1, ls="--")
    note = {0: " (all past the trained length)", len(lengths): ""}.get(
        within, " (dashed: the trained length)"
    )
    ax.set_xlabel("haystack length (tokens)" + note)
    ax.set_title(
        title or "passkeys found (every key token the model's top choice),\nof the prompts run", fontsize=9
    )
    return fig
