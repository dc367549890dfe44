"""The transformers versions this package supports, checked at import, and the shims that widen them.

`check_transformers` runs first thing in ``import hf_attnscale``: a transformers outside the supported range
stops the import with one line naming the installed and the supported versions, instead of an ImportError
from deep inside a later import. The range has one home, the transformers requirement in pyproject.toml;
docs/COMPATIBILITY.md says which releases in it were tested and why the floor is where it is.
`supported_range` reads it from the installed package's metadata, and the installed transformers' version
is read from its own, so the check costs no import of transformers. ``packaging`` parses and compares.

The shims, each named with the transformers versions that need it:

* `create_position_bias_mask`: a copy of transformers' function of that name in
  ``transformers.integrations.sdpa_attention``, new in 5.14; transformers 5.13 lacks it (so do 5.0 to 5.12).
  ``core.call.backends`` folds a relative position bias (Inkling's) into the mask with transformers' own where
  the installed version has it, and with this copy only where it does not (tests/core/test_compat.py checks
  the copy against transformers' own). It is written with tensor methods only, so that this module imports
  neither torch nor transformers.
* `nested_rope_keys`: transformers' ``config.nested_rope_parameter_keys`` where it has it (5.24 does; 5.13 and
  5.17 do not), else the same rule: the keys of ``rope_parameters`` that name one of the config's RoPE labels
  (``_rope_type_labels``, DeepSeek-V4's "main" and "compress"), or else of its ``layer_types``.
  ``core.install.rescaling`` reads a model's RoPE through it.

This module is imported by ``hf_attnscale/__init__.py``: keep it free of heavy imports.
"""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING, Any

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

if TYPE_CHECKING:
    import torch

DISTRIBUTION = "hf_attnscale"
"""The distribution whose metadata states the supported range."""


class UnsupportedVersionError(ImportError):
    """The installed transformers is outside the range this package supports."""


def supported_range() -> SpecifierSet | None:
    """The supported transformers releases: the transformers requirement of the installed package's metadata
    (pyproject.toml's, as installed); None where the package is not installed (imported from a source folder
    on the path), which then checks nothing: install it (``pip install -e .``) for the check."""
    try:
        requirements = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return None
    for text in requirements:
        requirement = Requirement(text)
        if canonicalize_name(requirement.name) == "transformers" and requirement.marker is None:
            return requirement.specifier
    return None


def supported_transformers() -> str:
    """The supported range as a requirement specifier, lower bounds first: '>=5.13.0,<6'."""
    specifiers = supported_range() or SpecifierSet()
    return ",".join(
        sorted((str(s) for s in specifiers), key=lambda s: (not s.startswith((">", "~", "=")), s))
    )


def check_transformers(installed: str | None = None) -> None:
    """Raise UnsupportedVersionError, one line naming both versions, where the installed transformers (or
    ``installed``) is outside `supported_range`. With no transformers installed there is nothing to check:
    the import that needs it says so.

    A pre-release, development or local version counts as its release ('5.24.0.dev0' as 5.24.0), so a
    source build of the next transformers passes the check and its 6.0 pre-releases do not. A version that
    is no version raises packaging's InvalidVersion (a ValueError)."""
    if installed is None:
        try:
            installed = metadata.version("transformers")
        except metadata.PackageNotFoundError:
            return
    specifiers = supported_range()
    if specifiers is not None and not specifiers.contains(Version(installed).base_version):
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
    """A copy of transformers 5.14's function of the same name, for 5.13: an additive float mask for sdpa,
    ``position_bias`` where a query may attend and the lowest finite value of the key's dtype where it may
    not (a boolean ``attention_mask``, or causality when there is no mask and ``is_causal``); a float
    ``attention_mask`` is added to the bias."""
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


def nested_rope_keys(config: Any, rope_parameters: dict[str, Any]) -> list[str]:
    """The keys ``rope_parameters`` is nested under (a layer type or RoPE label each, with its own dict of RoPE
    parameters), or [] where it is one flat dict: transformers' ``config.nested_rope_parameter_keys`` where it
    exists, else the same rule, for the versions without it."""
    own = getattr(config, "nested_rope_parameter_keys", None)
    if own is not None:
        return own(rope_parameters)
    labels = getattr(config, "_rope_type_labels", None) or getattr(config, "layer_types", None) or ()
    return [key for key in rope_parameters if key in labels]
