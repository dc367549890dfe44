"""The transformers versions this package supports, checked at import, and the shims that widen them.

`check_transformers` runs first thing in ``import hf_attnscale``: a transformers outside `TRANSFORMERS`
stops the import with one line naming the installed and the supported versions, instead of an ImportError
from deep inside a later import. It reads the installed version from the package metadata, so it costs no
import of transformers.

The shims, each named with the version that needs it:

* `create_position_bias_mask`: transformers' function of that name in ``transformers.integrations.
  sdpa_attention`` (new in 5.11; transformers 5.0 to 5.10 lack it). ``core.attention`` folds a relative
  position bias (Inkling's) into the mask with it. A copy, used on every version, written with tensor
  methods only so that this module imports neither torch nor transformers.

This module is imported by ``hf_attnscale/__init__.py``: keep it free of heavy imports.
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The transformers releases the suite has passed on, as (lowest, first unsupported): pyproject.toml's
# ``transformers>=5.5,<6`` (tests/test_compat.py checks that the two agree).
TRANSFORMERS = ((5, 5), (6,))


class UnsupportedVersionError(ImportError):
    """The installed transformers is outside the range this package supports."""


def release(version: str) -> tuple[int, ...]:
    """The release numbers at the front of a version string: '5.10.4' -> (5, 10, 4), '5.24.0.dev0' ->
    (5, 24, 0). A pre-release counts as its release."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part) for part in match.group().split("."))


def supported_range(bounds: tuple[tuple[int, ...], tuple[int, ...]] = TRANSFORMERS) -> str:
    low, high = bounds
    return f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"


def check_transformers(installed: str | None = None) -> None:
    """Raise UnsupportedVersionError, in one line, where the installed transformers (or ``installed``) is
    outside the supported range. No transformers installed is left to the import that needs it."""
    if installed is None:
        try:
            installed = metadata.version("transformers")
        except metadata.PackageNotFoundError:
            return
    low, high = TRANSFORMERS
    if not low <= release(installed) < high:
        raise UnsupportedVersionError(
            f"hf_attnscale supports transformers{supported_range()}, but transformers {installed} is "
            f"installed: pip install 'transformers{supported_range()}'"
        )


def create_position_bias_mask(
    position_bias: torch.Tensor,
    attention_mask: torch.Tensor | None,
    is_causal: bool,
    query: torch.Tensor,
    key: torch.Tensor,
) -> torch.Tensor:
    """An additive float mask for sdpa: ``position_bias`` where a query may attend, the lowest value of the
    key's dtype where it may not (a boolean ``attention_mask``, or causality when there is no mask); a float
    ``attention_mask`` is added to the bias. transformers 5.11's function of the same name."""
    if attention_mask is None:
        if not is_causal:
            return position_bias.contiguous()
        q_len, k_len = query.shape[2], key.shape[2]
        # Query i sees keys 0..i, counted from the left (the arange comparison of transformers' version).
        attention_mask = key.new_ones((1, 1, q_len, k_len)).tril().bool()
    elif attention_mask.is_floating_point():
        return (position_bias + attention_mask).contiguous()
    # The dtype's lowest finite value: nan_to_num maps -inf to it.
    lowest = key.new_full((), float("-inf")).nan_to_num()
    return position_bias.where(attention_mask, lowest).contiguous()
