"""How a sweep names its lengths: as multiples of the trained length (the table's columns, the plot's ticks), and
the lengths its plot marks (the trained length, a patch's L), each with where its number came from."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

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
