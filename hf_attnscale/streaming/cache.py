"""`SinkCache`: StreamingLLM's attention sinks plus a sliding window, as a transformers Cache. It holds one
stream: its layers (each stores, evicts and returns keys and values as the call's plan says), what the stream
knows of its model (`hf_attnscale.streaming.spec`) and the call under way; its step is `streaming.step`'s."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_attnscale.core.call.rope import CosSin, RotateFn
from hf_attnscale.core.options.validation import check_int

from .plan import LayerGeometry, Rotations, SlotRecord, StepPlan
from .rope import rotation_basis
from .spec import UNPATCHED_MESSAGE, StreamSpec
from .step import Call, attention_step

DEFAULT_SINK_TOKENS = 4
"""StreamingLLM's number of attention sinks, the default wherever a sink count is taken."""
STATE_FORMAT = 2  # of `SinkCache.state_dict`: 2 keeps the sinks' keys rotated at their index (1: before RoPE)


def cache_settings(
    sink_tokens: int | None, window: int | None, default_sinks: int = DEFAULT_SINK_TOKENS
) -> tuple[int, int] | None:
    """``(sink_tokens, window)`` of a streaming cache from optional settings, or None for no streaming;
    ``sink_tokens`` defaults to ``default_sinks`` when only a window is given, and needs a window."""
    if window is None:
        if sink_tokens:
            raise ValueError(
                f"sink_tokens={sink_tokens} needs a window: pass window=W (the cache holds sink_tokens + W tokens)."
            )
        return None
    return stream_size(default_sinks if sink_tokens is None else sink_tokens, window)


def stream_size(sink_tokens: int, window: int) -> tuple[int, int]:
    """``(sink_tokens, window)`` checked: integers, at least 0 sinks and a window of at least 1."""
    return check_int("sink_tokens", sink_tokens, 0), check_int("window", window, 1)


class SinkCacheLayer(CacheLayerMixin):
    """One layer of a `SinkCache`: keys and values in at most ``geometry.capacity`` slots, and the sinks' keys as
    they came (rotated at their own index). Slots ``0..S-1`` hold the sinks, rotated afresh for every call; the
    others hold window keys rotated at their index minus the row's base (`hf_attnscale.streaming.plan`)."""

    is_sliding = False
    supports_early_init = False

    def __init__(self, geometry: LayerGeometry):
        super().__init__()
        self.geometry = geometry
        self.slots: SlotRecord | None = None
        self.sink_keys: torch.Tensor | None = None  # (B, Hkv, S, D)
        self._basis: tuple[torch.Tensor, torch.Tensor] | None = None  # the sinks' `rotation_basis`, if any

    @property
    def token_index(self) -> torch.Tensor | None:
        """``(B, C)``: the stream index of the token in each slot, -1 for a free slot (None before any token)."""
        return None if self.slots is None else self.slots.index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        (batch, heads, _, dim), sinks = key_states.shape, self.geometry.sinks
        self.keys, self.sink_keys = key_states.new_zeros(2, batch, heads, sinks, dim).unbind()
        self.values = value_states.new_zeros(batch, value_states.shape[1], sinks, value_states.shape[-1])
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        plan: StepPlan,
        rotations: Rotations,
        rope: RotateFn,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys (rotated by the module at the plan's positions) and values, evict what the plan
        drops, and return every key and value the new queries read."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if plan.write_slot is not None:
            return self._decode(key_states, value_states, plan, rotations, rope)
        sinks, keys, values, sink_keys = self.geometry.sinks, self.keys, self.values, self.sink_keys
        if rotations.rebase is not None:  # the base moved: rotate the stored window keys back by the move
            window = rope(keys[:, :, sinks:], *rotations.rebase)
            keys = torch.cat([keys[:, :, :sinks], window], dim=2)
        if plan.new_sink_index is not None:
            sink_keys, values = _store_sinks(plan.new_sink_index, key_states, value_states, sink_keys, values)
        sink_slots = rope(sink_keys, *rotations.sinks)
        keys = torch.cat([sink_slots, keys[:, :, sinks:], key_states], dim=2)
        values = torch.cat([values, value_states], dim=2)
        read = _with_sink_channels(keys, values, sink_keys) if plan.sink_channels else (keys, values)
        keys, values = _gather_slots(keys, plan.keep_index), _gather_slots(values, plan.keep_index)
        self.keys, self.values, self.sink_keys, self.slots = keys, values, sink_keys, plan.after
        if not torch.compiler.is_compiling() and plan.keep_index.shape[-1] == self.geometry.capacity:
            # decoding steps write these in place: a fixed address lets a CUDA graph replay them (as StaticCache)
            for tensor in (self.keys, self.values, self.sink_keys, *self.slots.tensors()):
                torch._dynamo.mark_static_address(tensor)
            if self._basis is None and plan.after.sinks_held:  # once held, the sinks never change
                self._basis = rotation_basis(rope, sink_keys, rotations.sinks)
        return read

    def _decode(self, key_states, value_states, plan: StepPlan, rotations: Rotations, rope: RotateFn):
        """A decoding step (`decode_plan`), all in place and with no host sync: each row's token into its slot,
        the sinks rotated into their slots, the slot record advanced. index_copy_ and index_put_, which inductor
        writes in place (a scatter_ copied whole buffers)."""
        for buffer, new in ((self.keys, key_states), (self.values, value_states)):
            if new.shape[0] == 1:
                buffer.index_copy_(2, plan.write_slot, new)
            else:
                buffer[torch.arange(new.shape[0], device=new.device), :, plan.write_slot] = new[:, :, 0]
        if self.geometry.sinks:
            reserved = torch.arange(self.geometry.sinks, device=self.keys.device)
            self.keys.index_copy_(2, reserved, self._rotated_sinks(rope, rotations.sinks))
        for mine, new in zip(self.slots.tensors(), plan.after.tensors()):
            mine.copy_(new)
        return self.keys, self.values

    def _rotated_sinks(self, rope: RotateFn, cos_sin: CosSin) -> torch.Tensor:
        """The sinks rotated at ``cos_sin``: ``a·cos + b·sin`` from the basis the general path found (three
        operations instead of the family's function), else by the family's function."""
        if self._basis is None:
            return rope(self.sink_keys, *cos_sin)
        (a, b), (cos, sin) = self._basis, cos_sin
        return a * cos.unsqueeze(1) + b * sin.unsqueeze(1)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, self.get_seq_length()  # a mask of the new tokens only (see `SinkCache`)

    def get_seq_length(self) -> int:
        if self.slots is None:
            return 0
        # a tensor while compiling (as StaticCache's), so that a decoding step reads no number off the device
        return self.slots.seen if torch.compiler.is_compiling() else int(self.slots.seen)

    def get_max_length(self) -> int:
        return -1  # the stream is unbounded; the memory is not (see `SinkCache.capacity`)

    def reset(self) -> None:
        self.keys = self.values = self.sink_keys = self.slots = self._basis = None
        self.is_initialized = False

    def state_dict(self) -> dict[str, Any]:
        """The layer's geometry, tensors and slot record, as tensors and plain values."""
        state: dict[str, Any] = {"geometry": [self.geometry.sinks, self.geometry.window, self.geometry.local]}
        if self.slots is not None:
            state.update(
                keys=self.keys, values=self.values, sink_keys=self.sink_keys, seen=int(self.slots.seen)
            )
            state.update(index=self.slots.index, real_tokens=self.slots.real_tokens, base=self.slots.base)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Hold what `state_dict` gave (the layer's geometry must match)."""
        self.reset()
        if "keys" in state:
            self.keys, self.values, self.sink_keys = state["keys"], state["values"], state["sink_keys"]
            seen = torch.tensor(int(state["seen"]), device=state["index"].device)
            held = bool((state["real_tokens"] >= self.geometry.sinks).all())
            self.slots = SlotRecord(state["index"], state["real_tokens"], state["base"], seen, held)
            self.dtype, self.device, self.is_initialized = self.keys.dtype, self.keys.device, True

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            "SinkCache cannot be cropped (evicted tokens are gone): use DynamicCache for assisted decoding."
        )

    def _select_rows(self, select: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.slots is not None:
            self.keys, self.values, self.sink_keys = map(select, (self.keys, self.values, self.sink_keys))
            self._basis = None if self._basis is None else tuple(map(select, self._basis))
            self.slots = self.slots.select_rows(select)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(lambda t: t[indices])


def _store_sinks(new_sink_index, key_states, value_states, sink_keys, values):
    """Keep the keys and values of the new tokens that are sinks in the sinks' slots."""
    sinks = sink_keys.shape[2]
    which = new_sink_index[:, None, :] == torch.arange(sinks, device=sink_keys.device)[:, None]  # (B, S, q)
    came, source = which.any(2)[:, None, :, None], which.to(torch.int8).argmax(2)[:, None, :, None]

    def take(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:  # each slot's new token, where one came
        return torch.where(came, new.gather(2, source.expand(-1, new.shape[1], -1, new.shape[3])), old)

    sink_values = take(value_states, values[:, :, :sinks])
    return take(key_states, sink_keys), torch.cat([sink_values, values[:, :, sinks:]], dim=2)


def _with_sink_channels(keys: torch.Tensor, values: torch.Tensor, sink_keys: torch.Tensor):
    """The keys of a call with sink channels: every slot's ``[k, 0]``, then one copy of each sink, one-hot in a
    channel of its own (where the query carries its logit against that sink, `streaming.step`) and with the
    sink's value; the values zero-padded to the keys' width, so that one call of the backend's fused kernel
    serves it."""
    batch, heads, sinks, dim = sink_keys.shape
    if values.shape[-1] != dim:
        raise ValueError("SinkCache's chunked path needs keys and values of the same head size.")
    one_hot = torch.eye(sinks, dtype=keys.dtype, device=keys.device).expand(batch, heads, sinks, sinks)
    wide_keys = torch.cat([F.pad(keys, (0, sinks)), F.pad(one_hot, (dim, 0))], dim=2)
    return wide_keys, F.pad(torch.cat([values, values[:, :, :sinks]], dim=2), (0, sinks))


def _gather_slots(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if index.dim() == 1:
        return x.index_select(2, index)
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


class SinkCache(Cache):
    """StreamingLLM cache: ``sink_tokens`` first tokens plus a ``window`` of recent ones.

    Each query sees the first ``sink_tokens`` real tokens of its row and its own last ``window`` real tokens,
    **itself included**, at positions ``0..n-1``; at most ``sink_tokens + window`` tokens are held per layer,
    however long the stream. In mit-han-lab/streaming-llm's terms (the query comes on top of the recent tokens)
    ``SinkCache(S, W)`` is ``start_size=S, recent_size=W-1``: the paper's "4+1020" is
    ``SinkCache.from_start_recent(4, 1020)``. Use it with a model patched by `hf_attnscale.patch`:

        >>> cache = hfa.SinkCache(sink_tokens=4, window=1020)
        >>> out = model.generate(ids, past_key_values=cache, max_new_tokens=10_000)

    Passing the same cache to the next ``generate`` call continues the stream; ``get_seq_length()`` counts the
    tokens streamed. Beam search works; assisted decoding raises (a sink cache cannot roll back). One model serves
    many streams at once, from threads too, each with a cache of its own. A layer with a sliding window of its own
    (Gemma-2/3, Mistral, Cohere-2) sees what its own mask lets it see in the cache, and keeps only that.

    Args:
        sink_tokens: number of initial tokens kept for good (StreamingLLM uses 4); 0 gives window attention.
        window: number of most recent tokens each query sees, itself included (at least 1).
    """

    attention_step = attention_step  # one attention module's step through this cache (streaming/step.py)

    def __init__(self, sink_tokens: int = DEFAULT_SINK_TOKENS, window: int = 1020) -> None:
        self.sink_tokens, self.window = stream_size(sink_tokens, window)
        self.geometry = LayerGeometry(self.sink_tokens, self.window)  # what a global layer holds and reads
        super().__init__(layers=[])
        self.spec: StreamSpec | None = None  # what the stream knows of its model, from its first call on
        self.call: Call | None = None  # the model call under way

    @classmethod
    def from_start_recent(cls, start_size: int, recent_size: int) -> SinkCache:
        """mit-han-lab/streaming-llm's ``StartRecentKVCache(start_size, recent_size)``, where each query sees
        ``start_size`` initial tokens, ``recent_size`` recent ones and itself: ``SinkCache(start, recent + 1)``."""
        return cls(check_int("start_size", start_size, 0), check_int("recent_size", recent_size, 0) + 1)

    def __repr__(self) -> str:
        return (
            f"SinkCache(sink_tokens={self.sink_tokens}, window={self.window}, seen={self.get_seq_length()})"
        )

    @property
    def is_compileable(self) -> bool:
        """Whether its decoding step compiles whole: ``generate()`` then compiles it by itself on CUDA, XPU and TPU
        (``generation_config.compile_config`` tunes it, or asks for it on the CPU). Every layer holds fixed shapes
        and writes in place; only a RoPE the stream cannot compute exactly at any position (Cohere's interleaved
        one) keeps the general path, with its host syncs: the cache says so once the stream has met the model."""
        return self.spec is None or all(layer.table.exact for layer in self.spec.layers.values())

    @property
    def capacity(self) -> int:
        """The most tokens one layer ever holds: ``sink_tokens + window`` (a layer whose own sliding window is
        shorter than ``window`` holds only its own window, see `hf_attnscale.streaming.plan`)."""
        return self.geometry.capacity

    def start_call(
        self,
        model_config: Any,
        first_layer: int,
        attention_mask: torch.Tensor | None,
        hidden_states: torch.Tensor,
    ) -> None:
        """A model call through the stream begins, at its first attention layer: the stream's first call finds
        what the stream knows of its model (``model_config``); every call checks its backend, then its mask."""
        if self.spec is None:
            self.spec = StreamSpec(model_config, self.geometry)
        self.spec.check_call()
        self.call = Call.begin(first_layer, attention_mask, hidden_states)

    def layer(self, layer_idx: int, geometry: LayerGeometry) -> SinkCacheLayer:
        """The layer ``layer_idx``, which holds and reads what ``geometry`` says; made on first use."""
        while len(self.layers) <= layer_idx:
            self.layers.append(SinkCacheLayer(geometry))
        if self.layers[layer_idx].geometry != geometry and self.layers[layer_idx].slots is None:
            self.layers[layer_idx] = SinkCacheLayer(geometry)  # made, still empty, with an earlier layer's
        return self.layers[layer_idx]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's new keys and values as the call's plan says; return every key and value its queries
        read. Only the step of a patched module calls it (with the plan pending)."""
        pending = None if self.call is None else self.call.pending
        if pending is None or pending.layer_idx != layer_idx:
            raise ValueError(UNPATCHED_MESSAGE)
        layer = self.layer(layer_idx, pending.plan.geometry)
        return layer.update(key_states, value_states, pending.plan, pending.rotations, pending.rope)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        # A mask of the new tokens only: the step reads their padding from its diagonal; the plan makes the mask.
        return query_length, self.get_seq_length(layer_idx)

    def reset(self) -> None:
        super().reset()
        self.spec = self.call = None

    def state_dict(self) -> dict[str, Any]:
        """Everything the stream holds, as tensors and plain values (``torch.save`` writes it; ``torch.load`` reads
        it back with ``weights_only=True``). A fresh ``SinkCache`` of the same size given it by `load_state_dict`
        continues the stream exactly: a server can keep a conversation on disk, a long run can resume."""
        layers = [layer.state_dict() for layer in self.layers]
        return {
            "format": STATE_FORMAT,
            "sink_tokens": self.sink_tokens,
            "window": self.window,
            "layers": layers,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream `state_dict` saved, in place of whatever this cache held."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError("This state was saved by an earlier hf_attnscale (another layout); restart it.")
        if (state["sink_tokens"], state["window"]) != (self.sink_tokens, self.window):
            raise ValueError(
                f"This state is of a SinkCache({state['sink_tokens']}, {state['window']}); this cache is "
                f"SinkCache({self.sink_tokens}, {self.window}). Load it into a cache of the same size."
            )
        self.reset()
        self.layers = []
        for index, layer_state in enumerate(state["layers"]):
            sinks, window, local = layer_state["geometry"]
            self.layer(index, LayerGeometry(sinks, window, local)).load_state_dict(layer_state)
