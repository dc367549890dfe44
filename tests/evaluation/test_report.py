"""The sweep's plot (hf_attnscale.evaluation.figure, drawn by report.SweepResult.figure; its lengths named by
hf_attnscale.evaluation.lengths): it says what is true. The trained length names where it came from, the x axis
follows the lengths swept, tick labels read well, every point lies under a tick, the legend covers no line, and
an estimate from few tokens is drawn and labelled as one."""

from __future__ import annotations

import math
import re
from itertools import pairwise

import numpy as np
import pytest

from hf_attnscale.evaluation.figure import x_limits
from hf_attnscale.evaluation.lengths import LengthMark, length_label, length_marks, multiple
from hf_attnscale.evaluation.report import SweepResult, SweepRow
from hf_attnscale.evaluation.variants import Variant

RECOMPUTE = "re-computation (16; 1 token in 8)"
COMPARE = {  # hf-attnscale compare --caches 16 --lengths 16,32,64 --documents 1 --recompute-every 8
    "unpatched": [70.18, 57.58, 54.49],
    "window-only (16)": [70.18, 68.27, 70.11],
    "sink+window (4+12)": [70.18, 56.49, 54.98],
    RECOMPUTE: [33.48, 32.96, 30.48],
}


def result(
    values: dict[str, list[float]],
    lengths: list[int],
    train_length: int | None = None,
    marks: list[LengthMark] | None = None,
    estimates: dict[str, int] | None = None,
) -> SweepResult:
    variants = [
        Variant(name, sink_tokens=4, window=12) if "window" in name else Variant(name) for name in values
    ]
    rows = [
        SweepRow(name, n, ppl, math.log(ppl), 64, 1)
        for name, ppls in values.items()
        for n, ppl in zip(lengths, ppls)
    ]
    return SweepResult(
        rows,
        variants,
        lengths,
        ["doc0"],
        train_length,
        marks=marks or [],
        estimates=estimates or {},
    )


def legend_texts(fig) -> list[str]:
    (ax,) = fig.axes
    legends = [*fig.legends, *([ax.get_legend()] if ax.get_legend() else [])]
    assert len(legends) == 1
    return [t.get_text() for t in legends[0].get_texts()]


def the_legend(fig):
    (ax,) = fig.axes
    return ax.get_legend() or fig.legends[0]


def assert_no_text_is_clipped(fig) -> None:
    """Every label, tick label, title and legend entry lies within the figure."""
    from matplotlib.text import Text

    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    canvas = fig.bbox
    for text in fig.findobj(Text):
        if not text.get_visible() or not text.get_text().strip():
            continue
        box = text.get_window_extent(renderer)
        inside = (
            box.x0 >= canvas.x0 - 1
            and box.x1 <= canvas.x1 + 1
            and box.y0 >= canvas.y0 - 1
            and box.y1 <= canvas.y1 + 1
        )
        assert inside, f"{text.get_text()!r} is cut off at the figure's edge: {box} outside {canvas}"


def tick_labels(fig) -> list[str]:
    (ax,) = fig.axes
    fig.draw_without_rendering()
    return [t.get_text() for t in ax.get_xticklabels() if t.get_text()]


# Where the trained length comes from -------------------------------------------------------------------------


def test_the_trained_length_is_the_configs_and_another_train_length_is_the_patchs_L():
    # SmolLM2 with --train-length 256: its config says 8,192, and 256 is only the L the patch scales from.
    trained, patch = length_marks(8192, 256)
    assert trained.label == "trained length 8,192 (config's max_position_embeddings)"
    assert patch.label == "L of the patch 256 (--train-length)"
    assert [m.label for m in length_marks(8192, None)] == [trained.label]
    assert [m.label for m in length_marks(8192, 8192)] == [trained.label]  # the same number: one mark
    # A config without max_position_embeddings: the length given stands for the trained length, and says so.
    assert [m.label for m in length_marks(None, 256)] == ["trained length 256 (--train-length)"]
    assert length_marks(None, None) == []


def test_the_plot_says_where_its_trained_length_came_from():
    values = {"unpatched": [12.0, 14.0, 80.0, 900.0], "logn(L=256)": [12.0, 12.5, 13.0, 14.0]}
    sweep = result(values, [256, 512, 1024, 2048], train_length=256, marks=length_marks(8192, 256))
    fig = sweep.figure()
    (ax,) = fig.axes
    labels = legend_texts(fig)
    assert "L of the patch 256 (--train-length)" in labels
    assert "trained length 8,192 (config's max_position_embeddings): past the lengths shown" in labels
    assert not any(label.startswith("trained length 256") for label in labels)
    # 8,192 is named, not drawn: the x axis stays on the data, and the only line drawn is the patch's L.
    low, high = ax.get_xlim()
    assert low <= 256 and 2048 <= high < 4096
    drawn = [line.get_xdata()[0] for line in ax.get_lines() if line.get_label().startswith("L of the patch")]
    assert drawn == [256]
    assert "L of the patch, 256" in ax.get_xlabel()  # what the multiples in the tick labels are of
    assert_no_text_is_clipped(fig)
    saved = sweep.to_dict()["length_marks"]
    assert saved == [
        {"length": 8192, "what": "trained length", "source": "config's max_position_embeddings"},
        {"length": 256, "what": "L of the patch", "source": "--train-length"},
    ]


def test_a_trained_length_near_the_data_is_drawn_and_ticked():
    sweep = result(COMPARE, [16, 32, 64], marks=length_marks(128, None))
    fig = sweep.figure()
    (ax,) = fig.axes
    (line,) = [line for line in ax.get_lines() if line.get_label().startswith("trained length")]
    assert line.get_xdata()[0] == 128 and ax.get_xlim()[1] > 128
    assert "128" in tick_labels(fig)
    assert "trained length 128 (config's max_position_embeddings)" in legend_texts(fig)
    assert_no_text_is_clipped(fig)


def test_without_marks_a_sweeps_train_length_is_marked_as_given():
    sweep = result({"unpatched": [30.0, 20.0]}, [8, 16], train_length=8)
    assert "trained length 8 (as given)" in legend_texts(sweep.figure())


# The x axis --------------------------------------------------------------------------------------------------


def test_a_window_sweep_keeps_the_x_axis_on_its_lengths():
    # eval --window on the shipped model (trained at 128) at 4, 8 and 16 tokens: the axis once ran to 128, with
    # "trained length" cut off at its right edge and ticks reading (0.03125x).
    sweep = result({"sink+window (4+4)": [282.28, 139.18, 116.98]}, [4, 8, 16], 128, length_marks(128, None))
    fig = sweep.figure()
    (ax,) = fig.axes
    low, high = ax.get_xlim()
    assert 2 < low <= 4 and 16 <= high < 32
    assert not [line for line in ax.get_lines() if line.get_label().startswith("trained length")]
    assert "trained length 128 (config's max_position_embeddings): past the lengths shown" in legend_texts(
        fig
    )
    assert tick_labels(fig) == ["4", "8", "16"]
    assert_no_text_is_clipped(fig)


@pytest.mark.parametrize(
    ("length", "reference", "label"),
    [
        (256, 128, "2x"),
        (128, 128, "1x"),
        (64, 128, "1/2x"),
        (96, 128, "3/4x"),
        (32, 128, "1/4x"),
        (16, 128, None),
        (4, 128, None),
        (192, 128, "1.5x"),
        (1000, 128, "7.81x"),
    ],
)
def test_multiples_read_well_or_are_left_out(length, reference, label):
    assert multiple(length, reference) == label
    assert length_label(length, reference) == (f"{length} ({label})" if label else str(length))


def test_no_tick_label_is_a_long_decimal():
    lengths = [4, 8, 16, 32, 64, 128, 256]
    sweep = result(
        {"unpatched": [90.0, 70.0, 60.0, 50.0, 45.0, 44.0, 60.0]}, lengths, 128, length_marks(128, None)
    )
    labels = tick_labels(sweep.figure())
    assert not [label for label in labels if re.search(r"\d\.\d{3,}", label)], labels
    assert labels == ["4", "8", "16", "32\n(1/4x)", "64\n(1/2x)", "128\n(1x)", "256\n(2x)"]


def test_x_limits_follow_the_data():
    assert x_limits([16, 32, 64, 128]) == pytest.approx((16 / 2**0.25, 128 * 2**0.25))
    assert x_limits([16, 32], [64]) == pytest.approx((16 / 2**0.25, 64 * 2**0.25))


# The y axis --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        COMPARE,  # compare's top point (70.18) once lay above the last tick (70)
        {"unpatched": [12.0, 14.0, 80.0, 900.0], "logn": [12.0, 12.5, 13.0, 14.0]},  # log scale
        {"flat": [10.0, 10.0, 10.0]},
    ],
)
def test_every_point_lies_within_the_y_axis_under_a_tick(values):
    lengths = [16, 32, 64, 128][: len(next(iter(values.values())))]
    fig = result(values, lengths).figure()
    (ax,) = fig.axes
    points = [p for ppls in values.values() for p in ppls]
    bottom, top = ax.get_ylim()
    ticks = [t for t in ax.get_yticks() if bottom <= t <= top]
    assert bottom < min(points) and max(points) < top
    assert any(t >= max(points) for t in ticks) and any(t <= min(points) for t in ticks)
    assert_no_text_is_clipped(fig)


# The legend and the estimates --------------------------------------------------------------------------------


def display_points(ax, line, per_segment: int = 200) -> np.ndarray:
    """Points along ``line`` (its segments sampled densely), in pixels."""
    xy = line.get_transform().transform(np.asarray(line.get_xydata(), dtype=float))
    steps = np.linspace(0, 1, per_segment)[:, None]
    return np.concatenate([a + steps * (b - a) for a, b in pairwise(xy)] or [xy])


@pytest.mark.parametrize(
    "values",
    [
        COMPARE,  # compare's legend once sat over a line
        {"low": [20.0, 11.0, 10.0], "lower": [19.0, 10.5, 10.2]},  # room inside, top right
        {f"variant {i}": [10.0 + i, 10.0 + i] for i in range(6)},  # lines everywhere
    ],
)
def test_the_legend_covers_no_line(values):
    lengths = [16, 32, 64][: len(next(iter(values.values())))]
    fig = result(values, lengths, marks=length_marks(128, None)).figure()
    (ax,) = fig.axes
    fig.draw_without_rendering()
    box = the_legend(fig).get_window_extent()
    for line in ax.get_lines():
        points = display_points(ax, line)
        covered = (
            (points[:, 0] >= box.x0)
            & (points[:, 0] <= box.x1)
            & (points[:, 1] >= box.y0)
            & (points[:, 1] <= box.y1)
        )
        assert not covered.any(), f"the legend covers {line.get_label()!r}"
    assert_no_text_is_clipped(fig)


def test_a_legend_with_room_stays_inside():
    values = {"low": [20.0, 11.0, 10.0], "lower": [19.0, 10.5, 10.2]}
    fig = result(values, [16, 32, 64]).figure()
    (ax,) = fig.axes
    assert ax.get_legend() is not None and not fig.legends


def test_an_estimate_from_few_tokens_is_drawn_apart_and_labelled():
    sweep = result(COMPARE, [16, 32, 64], marks=length_marks(128, None), estimates={RECOMPUTE: 8})
    fig = sweep.figure()
    (ax,) = fig.axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    estimate = lines[f"{RECOMPUTE}: estimate from 8 tokens"]
    assert estimate.get_linestyle() == ":" and estimate.get_markerfacecolor() == "none"
    for name in ("unpatched", "window-only (16)", "sink+window (4+12)"):
        assert lines[name].get_linestyle() in ("-", "--")
        assert lines[name].get_markerfacecolor() != "none"
    assert f"{RECOMPUTE}: estimate from 8 tokens" in legend_texts(fig)
    assert sweep.to_dict()["estimates"] == {RECOMPUTE: 8}
    assert_no_text_is_clipped(fig)
