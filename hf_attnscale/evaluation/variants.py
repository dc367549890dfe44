"""`Variant`: one way of running a model in a length sweep (unpatched, patched, streamed)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from hf_attnscale.core.install.patching import patched
from hf_attnscale.core.options.config import AttnScaleConfig
from hf_attnscale.core.options.laws import query_multiplier
from hf_attnscale.core.options.methods import METHODS
from hf_attnscale.streaming.cache import DEFAULT_SINK_TOKENS, SinkCache, cache_settings


def cache_label(sink_tokens: int, window: int) -> str:
    """How tables name a streaming cache: ``window-only (W)``, or ``sink+window (S+W)`` with sink tokens."""
    return f"sink+window ({sink_tokens}+{window})" if sink_tokens else f"window-only ({window})"


FACTORS = {
    "logn": "max(1, log_L n)",
    "gradmax": "max(1, sqrt(log_L n))",
    "llama4": "1 + beta·ln(1 + ⌊n / L⌋)",
    "ministral3": "1 + beta·ln(1 + ⌊(n - 1) / L⌋)",
}
"""How a note names each scale law's query factor (n: the keys a query sees; L: train_length)."""


def unchanged_within(config: AttnScaleConfig | None, longest: int) -> str | None:
    """Why the patch ``config`` changes nothing where no query sees more than ``longest`` keys, or None where
    it may change something.

    The one rule for a patch that does nothing at the lengths asked for: `hf-attnscale compare` leaves logn out
    by it, and the lm-eval model type says so by it. Such a patch is a scale law alone whose query factor
    (`hf_attnscale.core.options.laws.query_multiplier`, read here at every n up to ``longest``) is 1: logn and
    gradmax (clamped, as by default) up to their train_length, llama4 below it, ministral3 up to it.
    """
    if config is None or config.scale in ("none", "ssmax"):
        return None
    if not replace(config, scale="none", train_length=None, clamp=None, beta=None).is_identity:
        return None  # a sink, clipping or a gate changes attention at any length
    n = torch.arange(1, longest + 1, dtype=torch.float32).view(1, 1, -1)
    if not bool(query_multiplier(config, n).eq(1).all()):
        return None
    factor = FACTORS[config.scale]
    if longest <= config.train_length:
        return f"every length is within the trained length ({config.train_length}), where its factor {factor} is 1"
    return f"its factor {factor} is 1 at every length up to {longest} (beta={config.beta})"


@dataclass(frozen=True)
class Variant:
    """One way of running a model in a sweep.

    Attributes:
        name: label in tables, JSON and plots.
        patch: options for `hf_attnscale.patch` (``{}``: the identity patch), or None to run it unpatched.
        sink_tokens: sink tokens of the streaming cache (0: window-only).
        window: window of the streaming cache; None reads each segment densely.
    """

    name: str
    patch: Mapping[str, Any] | None = None
    sink_tokens: int = 0
    window: int | None = None
    config: AttnScaleConfig | None = field(init=False, repr=False, compare=False, default=None)
    """The patch as an `AttnScaleConfig` (None: unpatched)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("A variant needs a non-empty name.")
        try:
            settings = cache_settings(self.sink_tokens, self.window, default_sinks=0)
        except ValueError as err:
            raise ValueError(f"Variant {self.name!r}: {err}") from None
        if settings is not None and self.patch is None:
            # Streaming needs the patched attention forward; the identity patch changes nothing else.
            object.__setattr__(self, "patch", {})
        if self.patch is not None:
            object.__setattr__(self, "config", AttnScaleConfig(**self.patch))

    @classmethod
    def streamed(
        cls, cache: int, sink_tokens: int, patch: Mapping[str, Any] | None = None, name: str | None = None
    ) -> Variant:
        """Streaming through a cache of ``cache`` tokens: ``sink_tokens`` sinks and a window of the rest, named
        by `cache_label` unless ``name`` is given."""
        window = cache - sink_tokens
        return cls(
            name or cache_label(sink_tokens, window), patch=patch, sink_tokens=sink_tokens, window=window
        )

    @property
    def streaming(self) -> bool:
        """Whether segments are streamed through a `SinkCache` instead of read densely."""
        return self.window is not None

    def applied(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """``with variant.applied(model):`` runs ``model`` as this variant, then restores it exactly.

        A variant whose patch is the one already in force (a trained patch loaded with the model) runs it as
        it is, learned parameters included.
        """
        return patched(model, self.config)

    def new_cache(self) -> SinkCache | None:
        """A fresh cache for one segment, or None for dense reading."""
        return SinkCache(self.sink_tokens, self.window) if self.streaming else None

    def to_dict(self) -> dict[str, Any]:
        """The variant as a result's JSON records it."""
        return {
            "name": self.name,
            "patch": None if self.patch is None else dict(self.patch),
            "sink_tokens": self.sink_tokens if self.streaming else None,
            "window": self.window,
        }


def method_variant(key: str, train_length: int, longest: int) -> Variant:
    """`hf-attnscale compare`'s variant of the registered method ``key`` (`hf_attnscale.core.options.methods`) for a
    model trained at ``train_length`` read to ``longest`` tokens."""
    entry = next(entry for entry in METHODS if entry.key == key)
    name, patch = entry.compare(train_length, longest)
    return Variant(name, patch=patch)


def method_variants(train_length: int, longest: int) -> list[Variant]:
    """Every registered method's `method_variant`, in the registry's order."""
    return [method_variant(entry.key, train_length, longest) for entry in METHODS]


def demo_variants(
    train_length: int, sink_tokens: int = DEFAULT_SINK_TOKENS, bos: bool = False
) -> list[Variant]:
    """The variants of ``hf-attnscale demo`` for a model trained at ``train_length`` tokens (L below).

    unpatched; logn (``max(1, log_L(n))``); ReRoPE + logn (the registry's, `method_variant`); window-only and sink+window streaming with a cache of L tokens,
    so no token ever sees a position the model was not trained on; and streaming+logn with a cache of 2L,
    next to sink+window with the same 2L cache so the two differ only by logn. (With a cache of at most L,
    the clamped logn factor is 1 everywhere and streaming+logn would equal sink+window exactly.) With ``bos``
    (segments read behind a BOS token, ``L + 1`` positions at 1x) every cache holds one token more, so that
    at the trained length a segment still fits.
    """
    logn = {"scale": "logn", "train_length": train_length}
    capacity = train_length + bos
    wide = Variant.streamed(capacity + train_length, sink_tokens)
    return [
        Variant("unpatched"),
        Variant("logn", patch=logn),
        method_variant("rerope", train_length, train_length),
        Variant.streamed(capacity, 0),
        Variant.streamed(capacity, sink_tokens),
        wide,
        Variant(
            f"streaming+logn ({sink_tokens}+{wide.window})",
            patch=logn,
            sink_tokens=sink_tokens,
            window=wide.window,
        ),
    ]
