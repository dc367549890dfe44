"""The transformers versions this package supports, checked at import, and the shims that widen them.

`check_transformers` runs first thing in ``import hf_attnscale``: a transformers outside `TRANSFORMERS`
stops the import with one line naming the installed and the supported versions, instead of an ImportError
from deep inside a later import. It reads the installed version from the package metadata, so it costs no
import of transformers. The range is the tested one (README, "Compatibility"); pyproject.toml states the
same (tests/core/test_compat.py checks that they agree).

The shims, each named with the transformers versions that need it:

* `create_position_bias_mask`: transformers' function of that name in
  ``transformers.integrations.sdpa_attention``, new in 5.14; transformers 5.13 lacks it (so do 5.0 to 5.12).
  ``core.attention`` folds a relative position bias (Inkling's) into the mask with it. The copy is used on
  every version (one code path; tests/core/test_compat.py checks it against transformers' own where there is
  one), and is written with tensor methods only, so that this module imports neither torch nor
  transformers.

This module is imported by ``hf_attnscale/__init__.py``: keep it free of heavy imports.
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The supported transformers releases, [lowest, first unsupported): the oldest and newest the suite has
# passed on are 5.13.0 and 5.23.0. Below 5.13 `SinkCacheLayer` is abstract (transformers' cache layers
# had get_max_cache_shape where 5.13 has get_max_length).
TRANSFORMERS = ("5.13.0", "6")


class UnsupportedVersionError(ImportError):
    """The installed transformers is outside the range this package supports."""


def release(version: str) -> tuple[int, ...]:
    """The release numbers at the front of a version: '5.10.4' -> (5, 10, 4), '5.24.0.dev0' -> (5, 24, 0).

    A pre-release or development version counts as its release, so a source build of the next transformers
    passes the check and its 6.0 pre-releases do not."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    numbers = [int(part) for part in match.group().split(".")]
    while len(numbers) > 1 and numbers[-1] == 0:  # 6 == 6.0 == 6.0.0
        numbers.pop()
    return tuple(numbers)


def supported_transformers() -> str:
    """The supported range as a requirement specifier: '>=5.13.0,<6'."""
    low, high = TRANSFORMERS
    return f">={low},<{high}"


def check_transformers(installed: str | None = None) -> None:
    """Raise UnsupportedVersionError, one line naming both versions, where the installed transformers (or
    ``installed``) is outside `TRANSFORMERS`. With no transformers installed there is nothing to check: the
    import that needs it says so."""
    if installed is None:
        try:
            installed = metadata.version("transformers")
        except metadata.PackageNotFoundError:
            return
    low, high = TRANSFORMERS
    if not release(low) <= release(installed) < release(high):
        wanted = supported_transformers()
        raise UnsupportedVersionError(
            f"hf_attnscale supports transformers{wanted}, but transformers {installed} is installed: "
            f"pip install 'transformers{wanted}'"
        )


def create_position_bias_mask(
    position_bias: torch.Tensor,
    attention_mask: torch.Tensor | None,
    is_causal: bool,
    query: torch.Tensor,
    key: torch.Tensor,
) -> torch.Tensor:
    """transformers 5.14's function of the same name: an additive float mask for sdpa, ``position_bias``
    where a query may attend and the lowest finite value of the key's dtype where it may not (a boolean
    ``attention_mask``, or causality when there is no mask and ``is_causal``); a float ``attention_mask``
    is added to the bias."""
    if attention_mask is None:
        if not is_causal:
            return position_bias.contiguous()
        q_len, k_len = query.shape[2], key.shape[2]
        # Query i sees keys 0..i, counted from the left (transformers' arange comparison).
        attention_mask = key.new_ones((1, 1, q_len, k_len)).tril().bool()
    elif attention_mask.is_floating_point():
        return (position_bias + attention_mask).contiguous()
    lowest = key.new_full((), float("-inf")).nan_to_num()  # nan_to_num maps -inf to the dtype's lowest
    return position_bias.where(attention_mask, lowest).contiguous()
