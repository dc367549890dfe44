"""`SinkCache`: StreamingLLM's attention sinks plus a sliding window, as a transformers Cache.

Each query sees the first ``sink_tokens`` real tokens of its row and its own last ``window`` real tokens
(itself included), at positions inside the cache (pos-shift), exactly as mit-han-lab/streaming-llm computes
token by token. How calls are planned and keys stored: `hf_attnscale.streaming.plan`. How the attention step
runs with identity RoPE so that the cache sees the keys before rotation: `hf_attnscale.streaming.pos_shift`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_attnscale.core.gate import gate_input
from hf_attnscale.core.hooks import CallHooks
from hf_attnscale.core.routing import cache_argument, forward_with_hooks, rotary_of
from hf_attnscale.core.state import state_of
from hf_attnscale.core.validation import check_int

from .plan import (
    AttentionMode,
    LayerGeometry,
    Rotations,
    SlotRecord,
    StepPlan,
    WriteMode,
    build_plan,
    layer_geometry,
)
from .pos_shift import (
    UNPATCHED_MESSAGE,
    check_streaming_backend,
    layer_rotates,
    new_token_validity,
    no_rotation,
    own_sliding_window,
    per_token_slice,
    streaming_refusal,
)
from .rope import (
    CosSin,
    RopeFn,
    RopeTable,
    first_dims_rope,
    pair_rope,
    rotate_keys,
    rotate_queries,
    rotation_basis,
)

DEFAULT_SINK_TOKENS = 4
"""StreamingLLM's number of attention sinks, the default wherever a sink count is taken."""
PIECE_TOKENS = 1024
"""Calls with more new tokens than this (long prompts) are processed in pieces inside each layer."""


def cache_settings(
    sink_tokens: int | None, window: int | None, default_sinks: int = DEFAULT_SINK_TOKENS
) -> tuple[int, int] | None:
    """``(sink_tokens, window)`` of a streaming cache from optional settings, or None for no streaming.

    ``sink_tokens`` defaults to ``default_sinks`` when only a window is given, and needs a window.
    """
    if window is None:
        if sink_tokens:
            raise ValueError(
                f"sink_tokens={sink_tokens} needs a window: pass window=W (the cache holds sink_tokens + W tokens)."
            )
        return None
    sinks = default_sinks if sink_tokens is None else sink_tokens
    return check_int("sink_tokens", sinks, 0), check_int("window", window, 1)


@dataclass(frozen=True)
class PendingWrite:
    """What a layer's next `SinkCacheLayer.update` does: the call's plan, the family's rotation, the layer's
    RoPE table, and whether the module hands over its new keys already rotated at the plan's new positions."""

    plan: StepPlan
    rope: RopeFn
    table: RopeTable
    keys_rotated: bool


class SinkRotation:
    """The sinks' keys rotated at any cos/sin while decoding (no autograd).

    From a basis ``a·cos + b·sin`` found once (`rotation_basis`) when the family's rotation has that form,
    checked bitwise; otherwise by the family's own function each time.
    """

    def __init__(self, rope: RopeFn, sink_keys: torch.Tensor, cos_sin: CosSin) -> None:
        self.rope, self.sink_keys = rope, sink_keys
        self.basis = rotation_basis(rope, sink_keys, cos_sin)

    def __call__(self, cos_sin: CosSin) -> torch.Tensor:
        if self.basis is None:
            return rotate_keys(self.rope, self.sink_keys, cos_sin)
        (a, b), (cos, sin) = self.basis, cos_sin
        return a * cos.unsqueeze(1) + b * sin.unsqueeze(1)


class SinkCacheLayer(CacheLayerMixin):
    """One layer of a `SinkCache`: keys, values and the sinks' un-rotated keys, at most ``geometry.capacity``
    slots (``S + W``; a layer with a shorter sliding window of its own holds only that, see `LayerGeometry`).

    Slots ``0..S-1`` hold the sinks (rotated afresh for every call); the others hold window keys rotated at
    their index minus the row's base (see `hf_attnscale.streaming.plan`).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, geometry: LayerGeometry):
        super().__init__()
        self.geometry = geometry
        self.slots: SlotRecord | None = None
        self.sink_keys: torch.Tensor | None = None  # (B, Hkv, S, D), before RoPE
        self._sink_rotation: SinkRotation | None = (
            None  # built at the first decoding step after the sinks came
        )

    @property
    def token_index(self) -> torch.Tensor | None:
        """``(B, C)``: the stream index of the token in each slot, -1 for a free slot (None before any token)."""
        return None if self.slots is None else self.slots.index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        sinks = self.geometry.sinks
        self.keys = key_states.new_zeros(batch, heads, sinks, dim)
        self.values = value_states.new_zeros(batch, value_states.shape[1], sinks, value_states.shape[-1])
        self.sink_keys = key_states.new_zeros(batch, heads, sinks, dim)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        *args,
        write: PendingWrite | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys (pre-RoPE, unless ``write`` says they are rotated) and values; return every key
        and value the new queries read."""
        if write is None:
            raise ValueError(UNPATCHED_MESSAGE)
        plan, rope = write.plan, write.rope
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        sinks = self.geometry.sinks
        rotations = plan.rotations(write.table)
        keys, values, sink_keys = self.keys, self.values, self.sink_keys
        if rotations.rebase is not None:  # the base moved: rotate the stored window keys back by the move
            window = rotate_keys(rope, keys[:, :, sinks:], rotations.rebase)
            keys = torch.cat([keys[:, :, :sinks], window], dim=2)
        if plan.has_new_sinks:
            sink_keys, values = _store_sinks(plan.new_sink_index, key_states, value_states, sink_keys, values)
            self._sink_rotation = None
        new_keys = key_states if write.keys_rotated else rotate_keys(rope, key_states, rotations.new)
        if plan.write is WriteMode.IN_PLACE:  # one token into a free slot, nothing copied
            _write(keys, new_keys, plan.write_slot)
            _write(values, value_states, plan.write_slot)
            if self._sink_rotation is None:
                self._sink_rotation = SinkRotation(rope, sink_keys, rotations.sinks)
            keys[:, :, :sinks] = self._sink_rotation(rotations.sinks)
        else:
            keys, values = torch.cat([keys, new_keys], dim=2), torch.cat([values, value_states], dim=2)
            keys = torch.cat([rotate_keys(rope, sink_keys, rotations.sinks), keys[:, :, sinks:]], dim=2)
        read = (keys, values)
        if plan.mode is AttentionMode.DOUBLED:
            read = _doubled(rope, keys, values, sink_keys, rotations)
        if plan.write is WriteMode.APPEND:
            keys, values = _gather_slots(keys, plan.keep_index), _gather_slots(values, plan.keep_index)
        self.keys, self.values, self.sink_keys, self.slots = keys, values, sink_keys, plan.after
        return read

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # transformers then builds a mask over the new tokens only; the pos-shift step reads their padding
        # from its diagonal and builds the real mask itself (the cache's slots are not a contiguous range).
        return query_length, self.get_seq_length()

    def get_seq_length(self) -> int:
        return 0 if self.slots is None else self.slots.seen

    def get_max_length(self) -> int:
        return -1  # the stream is unbounded; the memory is not (see `SinkCache.capacity`)

    def reset(self) -> None:
        self.keys = self.values = self.sink_keys = self.slots = self._sink_rotation = None
        self.is_initialized = False

    def state_dict(self) -> dict[str, Any]:
        """The layer's geometry, tensors and slot record, as tensors and plain values."""
        geometry = self.geometry
        state: dict[str, Any] = {"geometry": [geometry.sinks, geometry.window, geometry.local]}
        if self.slots is not None:
            state.update(keys=self.keys, values=self.values, sink_keys=self.sink_keys)
            state.update(index=self.slots.index, real_tokens=self.slots.real_tokens, base=self.slots.base)
            state["seen"] = self.slots.seen
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Hold what `state_dict` gave (the layer's geometry must match)."""
        self.reset()
        if "keys" in state:
            self.keys, self.values, self.sink_keys = state["keys"], state["values"], state["sink_keys"]
            self.slots = SlotRecord(state["index"], state["real_tokens"], state["base"], int(state["seen"]))
            self.dtype, self.device, self.is_initialized = self.keys.dtype, self.keys.device, True

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            "SinkCache cannot be cropped: evicted tokens are gone, so it cannot roll back. Assisted or "
            "speculative decoding needs a cache that can; use DynamicCache for it."
        )

    def _select_rows(self, select: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._sink_rotation = None
        for name in ("keys", "values", "sink_keys"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, select(tensor))
        if self.slots is not None:
            self.slots = self.slots.select_rows(select)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(lambda t: t[indices])


def _store_sinks(new_sink_index, key_states, value_states, sink_keys, values):
    """Keep the pre-RoPE keys and the values of new tokens that are sinks, in their reserved slots."""
    batch, heads, _, dim = key_states.shape
    sinks = sink_keys.shape[2]
    # Scatter every new token; non-sinks go to a spare slot past the end, which is dropped.
    index = new_sink_index.masked_fill(new_sink_index < 0, sinks)[:, None, :, None]
    spare_keys = torch.cat([sink_keys, sink_keys[:, :, :1]], dim=2)
    sink_keys = spare_keys.scatter(2, index.expand(batch, heads, -1, dim), key_states)[:, :, :sinks]
    head_values = torch.cat([values[:, :, :sinks], values[:, :, :1]], dim=2)
    vindex = index.expand(batch, values.shape[1], -1, values.shape[-1])
    sink_values = head_values.scatter(2, vindex, value_states)[:, :, :sinks]
    return sink_keys, torch.cat([sink_values, values[:, :, sinks:]], dim=2)


def _write(buffer: torch.Tensor, new: torch.Tensor, slot: torch.Tensor) -> None:
    """Write each row's one new token ``(B, H, 1, D)`` into its slot of ``buffer``, in place."""
    if buffer.shape[0] == 1:
        buffer.index_copy_(2, slot, new)
        return
    index = slot.view(-1, 1, 1, 1).expand(-1, buffer.shape[1], 1, buffer.shape[3])
    buffer.scatter_(2, index, new)


def _doubled(rope: RopeFn, keys, values, sink_keys, rotations: Rotations):
    """DOUBLED mode's keys ``[k, 0]`` then sinks ``[0, R(i) k]``; values zero-padded to the same width."""
    batch, heads, slots, dim = keys.shape
    if values.shape[-1] != dim:
        raise ValueError("SinkCache's chunked path needs keys and values of the same head size.")
    sinks = sink_keys.shape[2]
    wide_keys = keys.new_zeros(batch, heads, slots + sinks, 2 * dim)
    wide_keys[:, :, :slots, :dim] = keys
    wide_keys[:, :, slots:, dim:] = rotate_keys(rope, sink_keys, rotations.sink_copies)
    wide_values = values.new_zeros(batch, values.shape[1], slots + sinks, 2 * dim)
    wide_values[:, :, :slots, :dim] = values
    wide_values[:, :, slots:, :dim] = values[:, :, :sinks]
    return wide_keys, wide_values


def _gather_slots(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if index.dim() == 1:
        return x.index_select(2, index)
    batch, heads, _, dim = x.shape
    return x.gather(2, index.view(batch, 1, -1, 1).expand(batch, heads, index.shape[1], dim))


@dataclass
class _CallState:
    """What one model call through the cache works out and shares between its layers; made afresh when the
    call reaches its first attention layer, so nothing of it outlives the call."""

    first_layer: int
    plans: dict[tuple[LayerGeometry, int], StepPlan] = field(
        default_factory=dict
    )  # by the layers' geometry and the tokens seen before them (prompt pieces)
    validity: dict[int, tuple[Any, torch.Tensor, bool]] = field(default_factory=dict)  # by id(mask)
    pending: tuple[int, PendingWrite] | None = None  # (layer, its write) while a layer's forward runs


@dataclass
class _StreamMemo:
    """What a stream works out once and keeps: its RoPE tables, each module's rotation, the model it checked."""

    tables: dict[tuple, RopeTable] = field(default_factory=dict)
    module_ropes: dict[tuple, tuple[nn.Module, RopeFn, LayerGeometry]] = field(
        default_factory=dict
    )  # the module held too
    checked_config: Any = None


class SinkCache(Cache):
    """StreamingLLM cache: ``sink_tokens`` first tokens plus a ``window`` of recent ones.

    Each query sees the first ``sink_tokens`` real tokens of its row and its own last ``window`` real tokens,
    **itself included**, at positions ``0..n-1``; at most ``sink_tokens + window`` tokens are held per layer,
    however long the stream. In the terms of mit-han-lab/streaming-llm and attention_sinks (``start_size``,
    ``recent_size``, where the query comes on top of the recent tokens): ``SinkCache(S, W)`` equals
    ``start_size=S, recent_size=W-1``; build the paper's "4+1020" with
    ``SinkCache.from_start_recent(4, 1020)``. Use it with a model patched by `hf_attnscale.patch`:

        >>> cache = hfa.SinkCache(sink_tokens=4, window=1020)
        >>> out = model.generate(ids, past_key_values=cache, max_new_tokens=10_000)

    Passing the same cache to the next ``generate`` call continues the stream. Beam search works; assisted
    decoding raises (a sink cache cannot roll back). One model serves many streams at once, from several
    threads too: each stream needs a cache of its own, and everything a call needs lives in its cache.

    On models with sliding-window layers (Gemma-2/3, Mistral, Cohere-2), each layer sees what its own mask lets
    it see in the cache: a local layer of window ``w`` sees its last ``w`` tokens and keeps only those (see
    `hf_attnscale.streaming.plan`), so any cache size works.

    ``get_seq_length()`` counts the tokens streamed so far (what ``generate()`` expects), not the keys held; each
    layer's ``keys`` hold at most `capacity` of them.

    Args:
        sink_tokens: number of initial tokens kept for good (StreamingLLM uses 4); 0 gives window attention.
        window: number of most recent tokens each query sees, itself included (at least 1).
    """

    def __init__(self, sink_tokens: int = DEFAULT_SINK_TOKENS, window: int = 1020):
        self.sink_tokens = check_int("sink_tokens", sink_tokens, 0)
        self.window = check_int("window", window, 1)
        super().__init__(layers=[])
        self._call: _CallState | None = None
        self._memo = _StreamMemo()

    @classmethod
    def from_start_recent(cls, start_size: int, recent_size: int) -> SinkCache:
        """The cache of mit-han-lab/streaming-llm's ``StartRecentKVCache(start_size, recent_size)``.

        There each query sees ``start_size`` initial tokens, ``recent_size`` recent ones and itself:
        ``SinkCache(start_size, recent_size + 1)``.
        """
        return cls(check_int("start_size", start_size, 0), check_int("recent_size", recent_size, 0) + 1)

    def __repr__(self) -> str:
        return (
            f"SinkCache(sink_tokens={self.sink_tokens}, window={self.window}, seen={self.get_seq_length()})"
        )

    @property
    def capacity(self) -> int:
        """The most tokens one layer ever holds: ``sink_tokens + window`` (a layer whose own sliding window is
        shorter than ``window`` holds only its own window, see `hf_attnscale.streaming.plan`)."""
        return self.sink_tokens + self.window

    def layer(self, layer_idx: int, geometry: LayerGeometry | None = None) -> SinkCacheLayer:
        """The layer ``layer_idx``, created on first use; ``geometry``: what that layer holds and reads (by
        default, what a global layer does)."""
        while len(self.layers) <= layer_idx:
            self.layers.append(SinkCacheLayer(geometry or LayerGeometry(self.sink_tokens, self.window)))
        layer = self.layers[layer_idx]
        if geometry is not None and layer.geometry != geometry and layer.slots is None:
            self.layers[layer_idx] = layer = SinkCacheLayer(geometry)  # made before its module was first seen
        return layer

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pending = self._call.pending if self._call is not None else None
        if pending is None or pending[0] != layer_idx:
            raise ValueError(UNPATCHED_MESSAGE)
        return self.layers[layer_idx].update(key_states, value_states, write=pending[1])

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, self.get_seq_length(layer_idx)

    def reset(self) -> None:
        super().reset()
        self._call = None

    def state_dict(self) -> dict[str, Any]:
        """Everything the stream holds, as tensors and plain values (``torch.save`` writes it; ``torch.load`` reads
        it back with ``weights_only=True``). A fresh ``SinkCache`` of the same size given it by `load_state_dict`
        continues the stream exactly: a server can keep a conversation on disk, a long run can resume."""
        return {
            "sink_tokens": self.sink_tokens,
            "window": self.window,
            "layers": [layer.state_dict() for layer in self.layers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream `state_dict` saved, in place of whatever this cache held."""
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

    def attention_step(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        position_embeddings: CosSin | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: SinkCache | None = None,
        **kwargs,
    ):
        """One attention module's step over ``hidden_states`` (B, q, hidden), with pos-shift through this cache.

        Called by a patched RoPE attention module's forward (`hf_attnscale.core.routing`) in place of its own.
        What does not change between calls is worked out once: per model call (the checks on the model, the
        plan, which new tokens are padding) and per stream (each module's rotation, its RoPE table).
        """
        if state_of(module) is None or rotary_of(module) is None:
            raise ValueError(UNPATCHED_MESSAGE)
        if self._call is None or module.layer_idx <= self._call.first_layer:
            self._call = self._begin_call(module)  # a layer at or before the call's first: a new model call
        batch, q_len = hidden_states.shape[:2]
        new_valid, all_valid = self._new_validity(attention_mask, batch, q_len, hidden_states.device)
        rope, table, geometry = self._module_rotation(module, hidden_states, position_embeddings, kwargs)
        self.layer(module.layer_idx, geometry)
        outputs, weights = [], None
        pieces = q_len > PIECE_TOKENS
        for start in range(0, q_len, PIECE_TOKENS):
            # A long prompt: this layer's queries in pieces, each reading the cache the previous piece left.
            # Exact (a token's output depends only on earlier tokens); memory stays O(piece x (S + W + piece)).
            piece = slice(start, start + PIECE_TOKENS)
            plan = self.plan(
                module.layer_idx, new_valid[:, piece] if pieces else new_valid, hidden_states.dtype, all_valid
            )
            out, weights = self._run_piece(
                module,
                hidden_states[:, piece] if pieces else hidden_states,
                PendingWrite(plan, rope, table, keys_rotated=_rotates_itself(plan)),
                per_token_slice(kwargs, q_len, piece) if pieces else kwargs,
            )
            outputs.append(out)
        return (outputs[0], weights) if len(outputs) == 1 else (torch.cat(outputs, dim=1), None)

    def _begin_call(self, module: nn.Module) -> _CallState:
        """A new model call (its first attention layer): check the model as it is now."""
        model_config = module.config.model_config
        check_streaming_backend(model_config._attn_implementation)
        if model_config is not self._memo.checked_config:  # a family's refusal depends on its config alone
            reason = streaming_refusal(model_config)
            if reason:
                raise ValueError(reason)
            self._memo.checked_config = model_config
        return _CallState(first_layer=module.layer_idx)

    def _new_validity(
        self, attention_mask: torch.Tensor | None, batch: int, q_len: int, device: torch.device
    ) -> tuple[torch.Tensor, bool]:
        """``(B, q)`` bool of the real new tokens, and whether all are real; read once per mask of the call."""
        seen = self._call.validity.get(id(attention_mask))
        if seen is not None:
            return seen[1], seen[2]
        new_valid = new_token_validity(attention_mask, batch, q_len, device)
        all_valid = attention_mask is None or bool(new_valid.all())
        if not all_valid and not bool(new_valid.any()):
            raise ValueError(
                "The attention_mask marks every new token as padding. With a cache, pass a 2D attention_mask "
                "that covers the past and the new tokens, (batch, past + new), as generate() does; or none."
            )
        # The mask is held, so that its identity is not reused by another object during the call.
        self._call.validity[id(attention_mask)] = (attention_mask, new_valid, all_valid)
        return new_valid, all_valid

    def _module_rotation(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        position_embeddings: CosSin | None,
        kwargs: dict,
    ) -> tuple[RopeFn, RopeTable, LayerGeometry]:
        """The module's rotation (its family's RoPE, over its rotary dims, or none), its RoPE table, and what its
        layer holds and reads (its own sliding window applied to the cache)."""
        rotary, layer_type = rotary_of(module)
        table = self.rope_table(rotary, layer_type, hidden_states)
        key = (id(module), table)
        if key not in self._memo.module_ropes:
            if position_embeddings is None:
                q_len = hidden_states.shape[1]
                position_embeddings = table(
                    torch.zeros(1, q_len, dtype=torch.long, device=hidden_states.device)
                )
            if not (isinstance(position_embeddings, tuple) and len(position_embeddings) == 2):
                raise ValueError(
                    f"SinkCache cannot stream {type(module).__name__}: its RoPE is not a (cos, sin) pair "
                    "(complex frequencies, as in Llama-4 and DeepSeek-V2), so pos-shift cannot re-place its keys."
                )
            cos, sin = position_embeddings
            rotates = layer_rotates(module, hidden_states, position_embeddings, _identity(cos, sin), **kwargs)
            family_rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
            rope = pair_rope(family_rope) if rotates else no_rotation
            geometry = layer_geometry(self.sink_tokens, self.window, own_sliding_window(module))
            self._memo.module_ropes[key] = (module, first_dims_rope(rope, cos.shape[-1]), geometry)
        _, rope, geometry = self._memo.module_ropes[key]
        return rope, table, geometry

    def _run_piece(self, module: nn.Module, hidden_states: torch.Tensor, write: PendingWrite, kwargs: dict):
        """One call of the module's class forward, with ``write`` pending on its layer.

        When the module rotates its queries and new keys itself (`_rotates_itself`), it gets the plan's
        positions, as in a plain forward; otherwise it rotates by the identity (cos = 1, sin = 0 in the real
        shapes, so partial rotary stays right), and the call's hooks and the cache rotate after it.
        """
        plan, rope = write.plan, write.rope
        rotations = plan.rotations(write.table)
        self.layer(module.layer_idx)
        self._call.pending = (module.layer_idx, write)
        arguments = {
            "hidden_states": hidden_states,
            "position_embeddings": rotations.new if write.keys_rotated else _identity(*rotations.new),
            "attention_mask": plan.mask,
            cache_argument(module): self,
            **kwargs,
        }
        try:
            if write.keys_rotated:
                with gate_input(module, hidden_states):
                    return type(module).forward(module, **arguments)
            return forward_with_hooks(module, _pos_shift_hooks(plan.mode, rope, rotations), **arguments)
        finally:
            self._call.pending = None

    def rope_table(self, rotary: nn.Module, layer_type: str | None, like: torch.Tensor) -> RopeTable:
        """The RoPE table of one rotary embedding (and layer type) for this stream, built on first use."""
        key = (id(rotary), layer_type, like.dtype, like.device)
        if key not in self._memo.tables:
            self._memo.tables[key] = RopeTable(rotary, layer_type, like, self.capacity)
        return self._memo.tables[key]

    def plan(self, layer_idx: int, new_valid: torch.Tensor, dtype: torch.dtype, all_valid: bool) -> StepPlan:
        """The `StepPlan` for the next call of layer ``layer_idx``; built once per model call and shared.

        Args:
            new_valid: ``(B, q)`` bool, False for padding among the new tokens.
            dtype: the query dtype (of the mask).
            all_valid: whether ``new_valid`` is all True.
        """
        layer = self.layer(layer_idx)
        geometry = layer.geometry
        slots = layer.slots or SlotRecord.empty(new_valid.shape[0], geometry.sinks, new_valid.device)
        if slots.real_tokens.shape[0] != new_valid.shape[0]:
            raise ValueError(
                f"This SinkCache holds a batch of {slots.real_tokens.shape[0]} streams but got "
                f"{new_valid.shape[0]}; use one cache per batch (or cache.reset())."
            )
        # Writing into the cache in place would break autograd's saved tensors; it only pays off when decoding.
        in_place = not torch.is_grad_enabled()
        plans = self._call.plans
        plan = plans.get((geometry, slots.seen))
        if plan is None or not plan.matches(slots, new_valid, dtype, in_place):
            plan = build_plan(slots, new_valid, geometry, dtype, in_place, all_valid)
            plans[geometry, slots.seen] = plan
        return plan


def _rotates_itself(plan: StepPlan) -> bool:
    """Whether the module can rotate this call's queries and new keys itself, at the plan's new positions: they
    share one rotation (SINGLE), and no new token is a sink (the sinks are stored before RoPE). That is decoding,
    and every chunk of a stream past its first tokens."""
    return plan.mode is AttentionMode.SINGLE and not plan.has_new_sinks


def _pos_shift_hooks(mode: AttentionMode, rope: RopeFn, rotations: Rotations) -> CallHooks:
    """The hooks of a call whose module rotated nothing: rotate its queries (DOUBLED: both halves), and drop
    the DOUBLED output's padding."""
    if mode is AttentionMode.SINGLE:
        return CallHooks(query=lambda q: rotate_queries(rope, q, rotations.new))
    return CallHooks(
        query=lambda q: torch.cat(
            [rotate_queries(rope, q, rotations.new), rotate_queries(rope, q, rotations.mid)], dim=-1
        ),
        # values were zero-padded to 2D; contiguous, as some families .view() the output
        output=lambda out: out[..., : out.shape[-1] // 2].contiguous(),
    )


def _identity(cos: torch.Tensor, sin: torch.Tensor) -> CosSin:
    """RoPE as the identity, in the real cos/sin shapes (Phi-3 rotates only part of the head)."""
    return torch.ones_like(cos), torch.zeros_like(sin)
