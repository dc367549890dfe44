"""Argument checks shared by every layer of the package (it imports nothing else of it)."""

from __future__ import annotations

import numbers
from typing import Any


def as_int(value: Any) -> int | None:
    """``value`` as an int if it is an integer (Python, NumPy or a 0-d torch integer tensor), else None.

    Booleans are not integers here, and neither are floats, even integer-valued ones.
    """
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    is_tensor_scalar = hasattr(value, "dim") and hasattr(value, "is_floating_point") and value.dim() == 0
    if is_tensor_scalar and not value.is_floating_point() and not value.is_complex():
        return int(value.item())
    return None


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int ``>= minimum``; raises ValueError naming ``name``, the value and its type."""
    number = as_int(value)
    if number is None:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r} of type {type(value).__name__}.")
    if number < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {number}.")
    return number
