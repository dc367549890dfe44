"""The package's one place for caching what a patched forward would otherwise compute in every layer, two ways,
each keyed by exactly what its value depends on:

* `memoize`: ``functools.lru_cache`` for pure functions of hashable values (lengths, dtypes, devices, a
  config), made safe to compile. TorchDynamo does not run an ``lru_cache`` wrapper: it traces the function the
  wrapper holds, and warns of a potential silent incorrectness at each such call. Under torch.compile, a
  `memoize` function therefore calls the function itself, which is what the graph would have run anyway.
* `shared_by_layers`: what one forward's layers compute alike from the call's tensors (its ``position_ids``,
  its mask, the rotary's ``inv_freq``), keyed by those tensors' identity, held weakly, and by hashable values:
  made by the first layer that asks, read by the later ones of the same forward, never by another forward.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


def memoize(maxsize: int | None = None) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """``functools.lru_cache(maxsize)`` outside torch.compile; the function itself, uncached, under it. The
    wrapper keeps the cache's ``cache_info`` and ``cache_clear``."""

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        cached = functools.lru_cache(maxsize)(function)

        @functools.wraps(function)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            return function(*args, **kwargs) if torch.compiler.is_compiling() else cached(*args, **kwargs)

        call.cache_info, call.cache_clear = cached.cache_info, cached.cache_clear
        return call

    return decorate


class _SharedByLayers:
    """The last few values of `shared_by_layers`, each with the ``static`` key and the tensors (held weakly) it was
    made for and the last layer that read it; replaced as one tuple, so that threads only ever make one again."""

    KEPT = 4

    def __init__(self) -> None:
        self._entries: tuple[tuple[tuple, tuple, int, Any], ...] = ()

    def get(self, layer: int | None, static: tuple, tensors: tuple, make: Callable[[], Any]) -> Any:
        if layer is None or torch.compiler.is_compiling():
            return make()  # a graph computes it itself (it fuses it), as a layer with no index does
        entries = self._entries
        for index, (kept, held, last, value) in enumerate(entries):
            if kept == static and all(
                (ref is None and t is None) or (ref is not None and ref() is t)
                for ref, t in zip(held, tensors)
            ):
                if layer > last:  # a later layer of the same forward
                    self._entries = ((kept, held, layer, value), *entries[:index], *entries[index + 1 :])
                    return value
                entries = entries[:index] + entries[index + 1 :]  # another forward: made again
                break
        value = make()
        held = tuple(None if t is None else weakref.ref(t) for t in tensors)
        self._entries = ((static, held, layer, value), *entries[: self.KEPT - 1])
        return value


_SHARED = _SharedByLayers()


def shared_by_layers(layer: int | None, static: tuple, tensors: tuple, make: Callable[[], Any]) -> Any:
    """``make()``, which depends only on ``static`` (hashable: lengths, dtype, device...) and on ``tensors`` (the
    call's ``position_ids`` or mask, the rotary's ``inv_freq``; None where absent), made by the first layer of a
    forward that asks and read by its later ones (``layer``: the asking layer's index; None: made for it alone).

    A forward's layers pass the same tensor objects, and run in the order of their indices; an entry serves a
    layer after the last one that read it, for the same ``static`` and the same tensor objects (compared by
    identity: no value is read, so nothing waits on the device). A layer at or before it starts another
    forward, which makes it again: so a new step, a tensor changed in place between forwards (an inference
    tensor counts no changes), a rotary replaced, or another model's rotary, never reads what was made before.
    The tensors are held weakly (a mask the model has let go of is not kept alive here). Under torch.compile the
    graph computes it in each layer (it fuses it into its kernels). Kept: the last `_SharedByLayers.KEPT`."""
    return _SHARED.get(layer, static, tensors, make)
