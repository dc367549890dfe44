"""Every figure the README and the docs quote appears in the file it cites, so that a number that moves in its
source fails the suite instead of going stale.

A page marks the figures it quotes just before the paragraph or table that quotes them:

    <!-- figures: experiments/RESULTS.md | 9.22; 11.51; 6/9 -->

Each figure must appear in the cited file as a whole (not inside a longer number) and in the text after the
marker, up to the next marker or heading. In the README, every decimal figure of the prose (code left out) must
be one a marker of its paragraph lists. Text only: this runs in well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "CONTRIBUTING.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- figures: (\S+) \| (.+?) -->", re.MULTILINE)
BOUNDARY = re.compile(r"^#|<!-- figures: ", re.MULTILINE)
DECIMAL = re.compile(r"(?<![\w.,])\d{1,3}(?:,\d{3})*\.\d+|(?<![\w.,])\d+\.\d+")
CODE = re.compile(r"```.*?```|`[^`\n]*`|\]\([^)]*\)", re.DOTALL)


def _whole(figure: str, text: str) -> bool:
    """Whether ``figure`` occurs in ``text`` not as part of a longer number (a line break counts as a space)."""
    pattern = r"(?<![\d.,])" + re.escape(figure).replace(r"\ ", r"\s+") + r"(?!\d|[.,]\d)"
    return re.search(pattern, text) is not None


def quotes(page: str) -> list[tuple[str, list[str], str]]:
    """The page's markers: (cited file, figures, the text the marker covers)."""
    found = []
    for match in MARKER.finditer(page):
        rest = page[match.end() :]
        end = BOUNDARY.search(rest)
        scope = rest[: end.start() if end else len(rest)]
        found.append((match[1], [f.strip() for f in match[2].split(";") if f.strip()], scope))
    return found


def stale(page: str, read) -> list[str]:
    """What is wrong with ``page``'s quotes: a figure missing from its cited file (``read(path)`` gives the file's
    text, None when there is none) or from the text its marker covers."""
    problems = []
    for cited, figures, scope in quotes(page):
        source = read(cited)
        if source is None:
            problems.append(f"{cited}: no such file")
            continue
        problems += [f"{figure!r} is not in {cited}" for figure in figures if not _whole(figure, source)]
        problems += [
            f"{figure!r} is not in the text its marker covers"
            for figure in figures
            if not _whole(figure, scope)
        ]
    return problems


def unsourced(page: str) -> list[str]:
    """The decimal figures of ``page``'s prose that no marker of their paragraph lists."""
    covered = [(scope, figures) for _, figures, scope in quotes(page)]
    prose = CODE.sub(" ", MARKER.sub(" ", page))
    missing = []
    for number in DECIMAL.findall(prose):
        if not any(number in scope and any(_whole(number, f) for f in figures) for scope, figures in covered):
            missing.append(number)
    return missing


def _read(path: str) -> str | None:
    file = ROOT / path
    return file.read_text() if file.is_file() else None


@pytest.mark.parametrize("page", PAGES)
def test_every_quoted_figure_is_in_its_source(page):
    assert stale((ROOT / page).read_text(), _read) == []


def test_every_decimal_figure_of_the_readme_names_its_source():
    readme = (ROOT / "README.md").read_text()
    assert quotes(readme), "the README quotes no figure under a marker"
    assert unsourced(readme) == []


def test_a_moved_figure_is_caught():
    page = "Intro.\n\n<!-- figures: RESULTS.md | 9.22; 6/9 -->\nReRoPE reads 9.22 and finds 6/9 keys.\n\n# Next\n1.5\n"
    assert stale(page, {"RESULTS.md": "| 9.22 | 6/9 |"}.get) == []
    assert stale(page, {"RESULTS.md": "| 19.22 | 6/9 |"}.get) == ["'9.22' is not in RESULTS.md"]
    assert stale(page.replace("reads 9.22", "reads 9.3"), {"RESULTS.md": "9.22 6/9"}.get) == [
        "'9.22' is not in the text its marker covers"
    ]
    assert stale(page, {}.get) == ["RESULTS.md: no such file"]
    assert unsourced(page) == ["1.5"]
