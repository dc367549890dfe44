"""How an option's text is read (a CLI flag, an lm-eval model_arg): each reader gives the value or raises
ValueError saying what it expected."""

from __future__ import annotations

import json
from typing import Any


def read_bool(text: str) -> bool:
    """A yes/no option's text: true/false, 1/0, yes/no."""
    words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    if text.lower() not in words:
        raise ValueError(f"expected true or false, got {text!r}")
    return words[text.lower()]


def read_length(text: str) -> int:
    """A length in tokens, at least 2."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a whole number of tokens, got {text!r}") from None
    if value < 2:
        raise ValueError(f"must be at least 2, got {value}")
    return value


def read_sink_logit(text: str) -> float | str:
    """A sink logit: a number, or ``learnable``."""
    if text == "learnable":
        return text
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected a number or 'learnable', got {text!r}") from None


def read_rope_parameters(text: str) -> dict[str, Any]:
    """transformers' ``rope_parameters`` as JSON, or ``key=value`` pairs joined by ``;`` (lm-eval's model_args
    are comma-separated): ``rope_type=yarn;factor=4``."""
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"expected a JSON object, got {text!r} ({error.msg})") from None
    pairs = [part.split("=", 1) for part in text.split(";") if part.strip()]
    if not pairs or any(len(pair) != 2 for pair in pairs):
        raise ValueError(
            f"expected KEY=VALUE pairs joined by ';' (e.g. rope_type=yarn;factor=4), got {text!r}"
        )
    return {key.strip(): _number_or_text(value.strip()) for key, value in pairs}


def _number_or_text(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def read_clip_bounds(text: str) -> tuple[float, float] | str:
    """``GAMMA,ZETA`` or ``GAMMA;ZETA`` (lm-eval's model_args are comma-separated), or ``learnable``."""
    if text == "learnable":
        return text
    try:
        gamma, zeta = (float(part) for part in text.replace(";", ",").split(","))
    except ValueError:
        raise ValueError(f"expected GAMMA,ZETA (e.g. -0.03,1) or 'learnable', got {text!r}") from None
    return gamma, zeta
