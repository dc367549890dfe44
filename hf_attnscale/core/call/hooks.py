"""What one caller adds to the attention calls it makes, carried by the call and never stored on a module.

A model object is shared: a server runs it from many threads, each stream with its own cache. So whatever one
call needs beyond the patch (a `SinkCache`'s sink channels, a diagnostics probe, a method's key parts) travels
with that call. Two carriers, read in this order by `scaled_attention`:

1. the keyword argument ``hfa_hooks`` of the attention module's forward, which transformers passes down to the
   attention function (a cache that runs the step itself passes it there);
2. a context variable, set by `using_hooks` for a block of code: it is private to the thread (and to the
   asyncio task), for callers that run the whole model (diagnostics), or for a module whose forward does not
   pass its keyword arguments on.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

HOOKS_KWARG = "hfa_hooks"
"""Name of the keyword argument that carries `CallHooks` down to the attention function."""


@dataclasses.dataclass(frozen=True)
class CallHooks:
    """Per-call additions to a patched attention call; every field is optional.

    Attributes:
        query: maps the query ``(B, H, Tq, D)`` before the scale law (a SinkCache call with sink channels widens it).
        output: maps the attention output ``(B, Tq, H, Dv)`` (a SinkCache call with sink channels drops its padding).
        probe: called with what the backend is about to compute (`hf_attnscale.diagnostics`).
        parts: runs the call over raw queries and keys, as a method of key parts
            (`hf_attnscale.core.parts.engine.PartsCall`): ``parts(run, q, k, v, mask, sliding_window=...,
            position_ids=...) -> (B, Tq, H, Dv)``, through what the backend runs (`Execution`).
    """

    query: Callable[[torch.Tensor], torch.Tensor] | None = None
    output: Callable[[torch.Tensor], torch.Tensor] | None = None
    probe: Callable[..., None] | None = None
    parts: Callable[..., torch.Tensor] | None = None


ChunkFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]
]
"""The backend's call on one chunk: ``(q, k, v, additive mask) -> ((B, c, H, Dv) output, weights or None)``."""


class Execution(NamedTuple):
    """What a call hands its key parts to run on: the backend's call (with the exit, or the clipped formula), the
    exit's per-head logits and the scale of the scores for the fast paths, and whether they may serve (sdpa,
    with nothing their kernels lack: no dropout, soft-cap, position bias or clipped softmax)."""

    chunk: ChunkFn
    exit_logits: torch.Tensor | None
    scaling: float | None
    fusable: bool


_AMBIENT: contextvars.ContextVar[CallHooks | None] = contextvars.ContextVar("hfa_hooks", default=None)


def ambient_hooks() -> CallHooks | None:
    """The hooks `using_hooks` set for this thread (or task), or None."""
    return _AMBIENT.get()


@contextlib.contextmanager
def using_hooks(hooks: CallHooks) -> Iterator[CallHooks]:
    """Apply ``hooks`` to the patched attention calls this thread makes inside the block."""
    token = _AMBIENT.set(hooks)
    try:
        yield hooks
    finally:
        _AMBIENT.reset(token)


def take_hooks(kwargs: dict[str, Any]) -> CallHooks | None:
    """The hooks of this call: popped from the attention function's ``kwargs``, else the ambient ones."""
    hooks = kwargs.pop(HOOKS_KWARG, None)
    if hooks is not None or torch.compiler.is_compiling():
        # torch.compile cannot trace a context variable; a compiled graph runs no probe or per-call hook.
        return hooks
    return _AMBIENT.get()
