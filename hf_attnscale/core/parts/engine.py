"""The engine: one attention call of a method declared in parts (`hf_attnscale.core.options.declare`).

The patched module's forward rotates its queries and keys at the method's store in place of the model's
positions (`hf_attnscale.core.install.routing`; ReRoPE's store is RAW: the identity), so the model's cache keeps
each key there. Each part turns them from there to its own positions (by cos/sin of the places alone, which
the forward's first layer makes and its later layers read: `hf_attnscale.core.parts.turns`) and scores the pairs
it covers; one softmax runs over every part (with the exit, where there is one). A call runs by the first of its
executions that serves it:

* several queries (a prefill, or a chunk onto the cache; `hf_attnscale.core.parts.prefill`): CUDA's flex bands,
  else the queries in chunks through the key parts (the CPU's fused kernel, or the public joined formulation);
* one query (a decoding step; `hf_attnscale.core.parts.decode`): DCA's rows by key, ReRoPE's keys turned by
  distance, or any method's keys turned from the store.

Positions: a method whose scores depend on the distance alone counts it in the cache, so a row's distances are
those of its tokens whenever its positions run on by one (`prefill.check_positions`). Others place queries and
keys at the model's positions: a row's offset from the cache (its left padding) is read off ``position_ids``,
which must then hold one offset for every real token of the row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_attnscale.core.call.backends import DENSE_MASK_BACKENDS, check_backend
from hf_attnscale.core.call.hooks import Execution
from hf_attnscale.core.options.declare import Method
from hf_attnscale.core.parts.decode import decode
from hf_attnscale.core.parts.prefill import prefill
from hf_attnscale.core.parts.turns import PartsRotation, rotary_times


def check_parts_backend(backend: str | None, method: Method) -> None:
    """Refuse, in one line, a backend the engine cannot run on (checked when patching and at every call, as
    ``set_attn_implementation`` may switch it in between)."""
    check_backend(
        backend,
        DENSE_MASK_BACKENDS,
        f"{method.option}: {method.name} (it shows each key its part by a dense mask)",
    )


@dataclass(frozen=True)
class PartsCall(PartsRotation):
    """One attention call of a method, carried by its hooks (`hf_attnscale.core.call.hooks`): what it turns queries
    and keys by (`PartsRotation`), called as the attention."""

    def __call__(
        self,
        run: Execution,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        *,
        sliding_window: int | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The method over raw ``query`` ``(B, H, Tq, D)`` and ``key`` / ``value`` ``(B, Hkv, Tk, D)``, causal, the
        queries being the last ``Tq`` keys; ``mask`` None (causal, ``sliding_window`` keys at most) or 4D, bool or
        additive; ``position_ids`` the attention call's, where the layer's were not given. ``(B, Tq, H, Dv)``."""
        if (
            self.method.factor != 1.0
        ):  # on cos/sin of queries and keys: the scores' rotary dims times its square
            query = rotary_times(query, self.method.factor**2, self.own[0].shape[-1])
        position_ids = self.positions if self.positions is not None else position_ids
        if position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[-1] != query.shape[2]):
            position_ids = None  # multimodal RoPE's (3, B, T) sections: not a model the engine serves
        if query.shape[2] == 1:
            return decode(self, run, query, key, value, mask, sliding_window, position_ids)
        return prefill(self, run, query, key, value, mask, sliding_window, position_ids)
