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


def memoize(function: Callable[P, R]) -> Callable[P, R]:
    """``functools.cache(function)`` outside torch.compile; ``function`` itself, uncached, under it."""
    cached = functools.cache(function)

    @functools.wraps(function)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        return function(*args, **kwargs) if torch.compiler.is_compiling() else cached(*args, **kwargs)

    return call
