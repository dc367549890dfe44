"""`Variant`: one way of running a model in a length sweep (unpatched, patched, streamed)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from hf_attnscale.core.install.patching import patched
from hf_attnscale.core.options.config import AttnScaleConfig
from hf_attnscale.streaming.cache import DEFAULT_SINK_TOKENS, SinkCache, cache_settings


def cache_label(sink_tokens: int, window: int) -> str:
    """How tables name a streaming cache: ``window-only (W)``, or ``sink+window (S+W)`` with sink tokens."""
    return f"sink+window ({sink_tokens}+{window})" if sink_tokens else f"window-only ({window})"


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
        return {
            "name": self.name,
            "patch": None if self.patch is None else dict(self.patch),
            "sink_tokens": self.sink_tokens if self.streaming else None,
            "window": self.window,
        }


def demo_variants(
    train_length: int, sink_tokens: int = DEFAULT_SINK_TOKENS, bos: bool = False
) -> list[Variant]:
    """The variants of ``hf-attnscale demo`` for a model trained at ``train_length`` tokens (L below).

    unpatched; logn (``max(1, log_L(n))``); window-only and sink+window streaming with a cache of L tokens,
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
