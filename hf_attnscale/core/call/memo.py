"""`memoize`: ``functools.cache`` for the helpers a patched forward calls in every layer, made safe to compile.

TorchDynamo does not run a ``functools.cache`` wrapper: it traces the function the wrapper holds, and warns of
a potential silent incorrectness at each such call. Under torch.compile, a `memoize` function therefore calls
the function itself, which is what the graph would have run anyway; outside it, the cache answers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

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
