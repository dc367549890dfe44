"""`SinkCache`: StreamingLLM's attention sinks plus a sliding window, with keys cached before RoPE.

What a query sees (the token-by-token definition, as in mit-han-lab/streaming-llm with pos-shift): the first
``sink_tokens`` real tokens of its row, plus its own last ``window`` real tokens (itself included), numbered
``0..n-1`` in stream order, with the query at ``n-1``. Keys are stored un-rotated and rotated by those slot
numbers on every read, so nothing is ever re-rotated in place and nothing drifts, however long the stream.

One model call may bring many tokens (a prefill or a perplexity chunk). Each of them must see what it would
have seen token by token. A window key's distance to its query is then its true distance; only a sink's
distance is special: ``min(a_q, S+W-1) - i`` for sink ``i`` and query rank ``a_q``. `StepPlan` gets both in
one attention call by doubling the head dim: query ``[R(a_q)q, R(m_q)q]``, window keys ``[R(a_k)k, 0]``,
sink keys ``[0, R(i)k]``, under a band mask (see ``_build_plan``). Values are zero-padded to the doubled
width so that sdpa keeps its fused kernel; the core's ``output_hook`` drops the padding.

Every key is addressed by its rank in the stream (``SinkCacheLayer.rank``), never by its slot: eviction only
marks a slot free, and the next decoded token is written into it, so decoding copies nothing. The plan
(masks, positions, eviction) is the same for every layer of one model call, so it is built once per call and
shared; each layer only rotates and evicts its own keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

RopeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""A family's ``apply_rotary_pos_emb(q, k, cos, sin)``."""

UNPATCHED_MESSAGE = (
    "This attention module cannot stream with a SinkCache. SinkCache needs a model patched with "
    "hfa.patch(model) (with no options it changes nothing else) from a RoPE decoder family (llama, mistral, "
    "qwen2, qwen3, gemma, phi3) using eager or sdpa attention; unpatched models, encoders and models "
    "without RoPE cannot stream."
)


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
    return value


def _rotate_keys(rope: RopeFn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # The family's function rotates a (q, k) pair; a one-head stand-in for q keeps the wasted work to 1/H.
    return rope(x[:, :1], x, cos, sin)[1]


def _rotate_queries(rope: RopeFn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return rope(x, x[:, :1], cos, sin)[0]


def _cos_sin(
    rotary: nn.Module, like: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the model's own rotary embedding at ``positions`` ``(B, n)``; one row when rows agree."""
    if positions.shape[0] > 1 and bool((positions == positions[:1]).all()):
        positions = positions[:1]
    return rotary(like, positions)


@dataclass(eq=False)
class StepPlan:
    """Everything one model call needs that does not depend on the layer: masks, rotations and eviction.

    Modes: ``"slot"`` (one new token: keys rotated by their slot ``0..n-1``, exactly the token-by-token
    method), ``"plain"`` (several tokens, every visible key at its true distance: a prefill that fits, or no
    sinks), ``"doubled"`` (several tokens with sinks at their fixed token-by-token distance, see module doc).
    Keys are addressed by their rank, never by their slot, so slots may be reused in any order.
    """

    mode: str
    # Memo key: the layer state and the call this plan was built for.
    pre_rank: torch.Tensor | None
    pre_seen_valid: torch.Tensor | None
    seen: int
    new_valid: torch.Tensor
    dtype: torch.dtype
    rotary: nn.Module
    in_place: bool
    # Where the new keys go: one token written into a free slot of each row (``write_slot`` (B,)), or
    # appended after the cached slots (None).
    write_slot: torch.Tensor | None
    # Attention inputs.
    mask: torch.Tensor  # (B, 1, q, K) additive, in the query dtype
    key_cos: torch.Tensor
    key_sin: torch.Tensor
    query_cos: torch.Tensor
    query_sin: torch.Tensor
    sink_index: torch.Tensor | None = None  # (B, S) slot of sink i among the call's keys ("doubled")
    sink_cos: torch.Tensor | None = None
    sink_sin: torch.Tensor | None = None
    mid_cos: torch.Tensor | None = None  # the query's own slot, for its sink half ("doubled")
    mid_sin: torch.Tensor | None = None
    # Eviction. None: the slots stay where they are and evicted ones are only marked free (``next_rank``
    # -1); 1D: the slots every row keeps; 2D (B, C): per row (left padding). Index lists end with spare
    # slots (pointing at any real slot, marked free) for later tokens to be written into.
    keep_index: torch.Tensor | None = None
    next_rank: torch.Tensor | None = None
    next_seen_valid: torch.Tensor | None = None

    def matches(
        self,
        layer: SinkCacheLayer,
        new_valid: torch.Tensor,
        like: torch.Tensor,
        rotary: nn.Module,
        in_place: bool,
    ) -> bool:
        """Whether this plan was built for ``layer``'s current state and this call (all layers move in step)."""
        return (
            self.seen == layer.seen
            and self.dtype == like.dtype
            and self.rotary is rotary
            and self.in_place == in_place
            and _same(self.pre_rank, layer.rank)
            and _same(self.pre_seen_valid, layer.seen_valid)
            and _same(self.new_valid, new_valid)
        )

    def rotate_query(self, rope: RopeFn, query: torch.Tensor) -> torch.Tensor:
        """The un-rotated query ``(B, H, q, D)`` rotated by its position(s); ``2D`` wide in "doubled" mode."""
        rotated = _rotate_queries(rope, query, self.query_cos, self.query_sin)
        if self.mode != "doubled":
            return rotated
        return torch.cat([rotated, _rotate_queries(rope, query, self.mid_cos, self.mid_sin)], dim=-1)

    def attention_inputs(
        self, rope: RopeFn, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The un-rotated keys/values of every slot ``(B, Hkv, K0, D)`` turned into what the attention reads.

        In "doubled" mode: keys ``[R(a_k)k, 0]`` then the sinks as ``[0, R(i)k]``, and values zero-padded to
        the same width (sdpa's fused CPU kernel needs equal widths; the output hook drops the padding).
        """
        rotated = _rotate_keys(rope, keys, self.key_cos, self.key_sin)
        if self.mode != "doubled":
            return rotated, values
        batch, heads, slots, dim = keys.shape
        if values.shape[-1] != dim:
            raise ValueError("SinkCache's chunked path needs keys and values of the same head size.")
        sinks = self.sink_index.shape[1]
        index = self.sink_index.view(batch, 1, sinks, 1)
        sink_keys = keys.gather(2, index.expand(batch, heads, sinks, dim))
        sink_keys = _rotate_keys(rope, sink_keys, self.sink_cos, self.sink_sin)
        wide_keys = keys.new_zeros(batch, heads, slots + sinks, 2 * dim)
        wide_keys[:, :, :slots, :dim] = rotated
        wide_keys[:, :, slots:, dim:] = sink_keys
        wide_values = values.new_zeros(batch, values.shape[1], slots + sinks, 2 * dim)
        wide_values[:, :, :slots, :dim] = values
        wide_values[:, :, slots:, :dim] = values.gather(2, index.expand(batch, values.shape[1], sinks, dim))
        return wide_keys, wide_values

    def evict(self, x: torch.Tensor) -> torch.Tensor:
        """The slots kept for later calls: ``(B, H, K0, D)`` -> ``(B, H, C, D)``."""
        index = self.keep_index
        if index.dim() == 1:
            return x.index_select(2, index)
        batch, heads, _, dim = x.shape
        return x.gather(2, index.view(batch, 1, -1, 1).expand(batch, heads, index.shape[1], dim))


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a is b or (a.shape == b.shape and torch.equal(a, b))


class SinkCacheLayer(CacheLayerMixin):
    """One layer of a `SinkCache`: pre-RoPE keys and values, and the stream rank of each slot.

    ``rank[b, j]`` is the number of real tokens of row ``b`` before the token in slot ``j``; -1 marks a free
    slot (evicted, spare room for the next tokens, or left padding). The tensors never exceed
    ``sink_tokens + window`` slots.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, sink_tokens: int, window: int):
        super().__init__()
        self.sink_tokens = sink_tokens
        self.window = window
        self.rank: torch.Tensor | None = None
        self.seen_valid: torch.Tensor | None = None  # (B,) real tokens streamed per row
        self.seen = 0  # tokens streamed, padding included: what generate() slices its inputs by
        self._pending: tuple[StepPlan, RopeFn] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new pre-RoPE keys/values, evict, and return everything the new queries read, rotated."""
        if self._pending is None:
            raise ValueError(UNPATCHED_MESSAGE)
        plan, rope = self._pending
        self._pending = None
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if plan.write_slot is not None:  # decoding: write into the slot freed by the last eviction, no copy
            keys, values = self.keys, self.values
            index = plan.write_slot.view(-1, 1, 1, 1)
            keys.scatter_(2, index.expand(-1, keys.shape[1], 1, keys.shape[3]), key_states)
            values.scatter_(2, index.expand(-1, values.shape[1], 1, values.shape[3]), value_states)
        elif self.keys is None:
            keys, values = key_states, value_states
        else:
            keys = torch.cat([self.keys, key_states], dim=-2)
            values = torch.cat([self.values, value_states], dim=-2)
        out = plan.attention_inputs(rope, keys, values)
        if plan.keep_index is not None:
            self.keys, self.values = plan.evict(keys), plan.evict(values)
        self.rank, self.seen_valid = plan.next_rank, plan.next_seen_valid
        self.seen += key_states.shape[-2]
        return out

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # transformers then builds a mask over the new tokens only; the streaming forward reads their padding
        # from its diagonal and builds the real mask itself (the cache's slots are not a contiguous range).
        return query_length, self.seen

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1  # the stream is unbounded; the memory is not (see `SinkCache.capacity`)

    def reset(self) -> None:
        self.keys = self.values = self.rank = self.seen_valid = None
        self.seen = 0
        self._pending = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            "SinkCache cannot be cropped: evicted tokens are gone, so it cannot roll back. Assisted or "
            "speculative decoding needs a cache that can; use DynamicCache for it."
        )

    def _select_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in ("keys", "values", "rank", "seen_valid"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(tensor))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(lambda t: t[indices])


class SinkCache(Cache):
    """StreamingLLM cache: ``sink_tokens`` first tokens plus a ``window`` of recent ones, keys before RoPE.

    Each query sees the first ``sink_tokens`` real tokens of its row and its own last ``window`` real tokens
    (itself included), at positions ``0..n-1``; so at most ``sink_tokens + window`` tokens are held per layer,
    however long the stream. Use it with a model patched by `hf_attnscale.patch` (eager or sdpa attention):

        >>> cache = hfa.SinkCache(sink_tokens=4, window=1020)
        >>> out = model.generate(ids, past_key_values=cache, max_new_tokens=10_000)

    Passing the same cache to the next ``generate`` call continues the stream. Beam search works; assisted
    decoding raises (a sink cache cannot roll back).

    Args:
        sink_tokens: number of initial tokens kept for good (StreamingLLM uses 4); 0 gives window attention.
        window: number of most recent tokens each query sees, itself included (at least 1).
    """

    def __init__(self, sink_tokens: int = 4, window: int = 1020):
        self.sink_tokens = _check_count("sink_tokens", sink_tokens, 0)
        self.window = _check_count("window", window, 1)
        super().__init__(layers=[])
        # Plans of the current model call, by the tokens seen before them (one per piece of a long prompt).
        self._plans: dict[int, StepPlan] = {}
        self._first_layer: int | None = None

    def __repr__(self) -> str:
        return (
            f"SinkCache(sink_tokens={self.sink_tokens}, window={self.window}, seen={self.get_seq_length()})"
        )

    @property
    def capacity(self) -> int:
        """The most tokens one layer ever holds: ``sink_tokens + window``."""
        return self.sink_tokens + self.window

    def layer(self, layer_idx: int) -> SinkCacheLayer:
        """The layer ``layer_idx``, created on first use."""
        while len(self.layers) <= layer_idx:
            self.layers.append(SinkCacheLayer(self.sink_tokens, self.window))
        return self.layers[layer_idx]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx >= len(self.layers) or self.layers[layer_idx]._pending is None:
            raise ValueError(UNPATCHED_MESSAGE)
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, self.get_seq_length(layer_idx)

    def reset(self) -> None:
        super().reset()
        self._plans = {}

    def plan(
        self,
        layer_idx: int,
        new_valid: torch.Tensor,
        like: torch.Tensor,
        rotary: nn.Module,
        *,
        new_call: bool = True,
    ) -> StepPlan:
        """The `StepPlan` for the next call of layer ``layer_idx``; built once per model call and shared.

        Args:
            new_valid: ``(B, q)`` bool, False for padding among the new tokens.
            like: a tensor with the query dtype and device (for the mask and the cos/sin).
            rotary: the model's rotary embedding module.
            new_call: False for the second and later pieces of one layer's call (see streaming.py).
        """
        layer = self.layer(layer_idx)
        if layer.seen_valid is not None and layer.seen_valid.shape[0] != new_valid.shape[0]:
            raise ValueError(
                f"This SinkCache holds a batch of {layer.seen_valid.shape[0]} streams but got "
                f"{new_valid.shape[0]}; use one cache per batch (or cache.reset())."
            )
        if self._first_layer is None or layer_idx < self._first_layer:
            self._first_layer = layer_idx
        if new_call and layer_idx == self._first_layer:
            self._plans = {}  # a new model call: the last call's plans are stale
        # Writing into the cache in place would break autograd's saved tensors; it only pays off when decoding.
        in_place = not torch.is_grad_enabled()
        plan = self._plans.get(layer.seen)
        if plan is None or not plan.matches(layer, new_valid, like, rotary, in_place):
            plan = self._plans[layer.seen] = _build_plan(layer, new_valid, like, rotary, in_place)
        return plan


def _build_plan(
    layer: SinkCacheLayer, new_valid: torch.Tensor, like: torch.Tensor, rotary: nn.Module, in_place: bool
) -> StepPlan:
    """Masks, positions and eviction for one model call. Shapes: B rows, L cached slots, q new tokens."""
    sinks, window = layer.sink_tokens, layer.window
    batch, q_len = new_valid.shape
    device = new_valid.device
    rank = layer.rank if layer.rank is not None else torch.empty(batch, 0, dtype=torch.long, device=device)
    seen_valid = layer.seen_valid
    if seen_valid is None:
        seen_valid = torch.zeros(batch, dtype=torch.long, device=device)

    # Stream rank a of every new token (-1: padding), then of every key slot.
    new_rank = (seen_valid[:, None] + new_valid.long().cumsum(1) - 1).masked_fill(~new_valid, -1)
    next_seen_valid = seen_valid + new_valid.sum(1)
    free = rank < 0
    write_slot = None
    if q_len == 1 and in_place and rank.shape[1] > 0 and bool(free.any(1).all()):
        write_slot = free.to(torch.int8).argmax(1)  # (B,) first free slot of each row
        key_rank = rank.scatter(1, write_slot[:, None], new_rank)
        query_slot = write_slot[:, None]
    else:
        key_rank = torch.cat([rank, new_rank], dim=1)
        query_slot = torch.arange(rank.shape[1], key_rank.shape[1], device=device).expand(batch, q_len)
    key_valid = key_rank >= 0

    a_q, a_k = new_rank[:, :, None], key_rank[:, None, :]
    distance = a_q - a_k  # (B, q, K0)
    real = key_valid[:, None, :] & new_valid[:, :, None]
    in_window = real & (distance >= 0) & (distance < window)
    as_sink = real & (a_k < sinks) & (distance >= window)
    # A padding query sees only itself: its output is discarded, but it must not be NaN (NaN * 0 = NaN later).
    own = torch.zeros_like(in_window).scatter_(2, query_slot[:, :, None], ~new_valid[:, :, None])
    visible = in_window | as_sink | own

    mode = "slot" if q_len == 1 else "plain"
    if q_len > 1 and sinks > 0 and int(new_rank.max()) >= sinks + window:
        mode = "doubled"  # some query sees a sink at a distance other than its true one

    extra: dict[str, torch.Tensor] = {}
    if mode == "slot":
        # The token-by-token definition: the visible keys numbered 0..n-1 in stream order, the query last.
        # Its window starts at rank a_q - W + 1; the sinks before it keep their ranks, the window follows them.
        window_start = (new_rank - window + 1).clamp_min(0)  # (B, 1)
        shift = window_start - window_start.clamp_max(sinks)
        key_pos = torch.where(key_rank < window_start, key_rank, key_rank - shift).clamp_min(0)
        query_pos = (new_rank - shift).clamp_min(0)
    else:
        # True positions relative to a per-row base, so that they stay as small as the token-by-token
        # method's (fp32 cos/sin of a position near 1e5 would cost more than the 1e-4 nats we promise).
        base = (seen_valid - window + 1).clamp_min(0)[:, None]
        if mode == "plain" and sinks > 0:
            base = torch.zeros_like(base)  # sinks are read in the same half, at their true position
        key_pos = (key_rank - base).clamp_min(0)
        query_pos = (new_rank - base).clamp_min(0)
    query_cos, query_sin = _cos_sin(rotary, like, query_pos)
    key_cos, key_sin = _cos_sin(rotary, like, key_pos)

    if mode == "doubled":
        sink_ids = torch.arange(sinks, device=device)
        extra["sink_index"] = (key_rank[:, :, None] == sink_ids).long().argmax(1)  # (B, S)
        sink_exists = next_seen_valid[:, None] > sink_ids  # (B, S)
        sink_visible = sink_exists[:, None, :] & new_valid[:, :, None] & (a_q - sink_ids >= window)
        visible = torch.cat([in_window | own, sink_visible], dim=-1)
        extra["sink_cos"], extra["sink_sin"] = _cos_sin(rotary, like, sink_ids[None])
        mid = new_rank.clamp(0, sinks + window - 1)  # the query's slot when read token by token
        extra["mid_cos"], extra["mid_sin"] = _cos_sin(rotary, like, mid)

    mask = torch.zeros(visible.shape, dtype=like.dtype, device=device)
    mask = mask.masked_fill_(~visible, torch.finfo(like.dtype).min).unsqueeze(1)

    # Eviction: keep what a later query can still see.
    keep = key_valid & ((key_rank < sinks) | (key_rank >= next_seen_valid[:, None] - (window - 1)))
    if write_slot is not None:
        keep_index, next_rank = None, key_rank.masked_fill(~keep, -1)
    else:
        keep_index, next_rank = _keep_index(keep, key_rank, sinks + window)

    return StepPlan(
        mode=mode,
        pre_rank=layer.rank,
        pre_seen_valid=layer.seen_valid,
        seen=layer.seen,
        new_valid=new_valid,
        dtype=like.dtype,
        rotary=rotary,
        in_place=in_place,
        write_slot=write_slot,
        mask=mask,
        key_cos=key_cos,
        key_sin=key_sin,
        query_cos=query_cos,
        query_sin=query_sin,
        keep_index=keep_index,
        next_rank=next_rank,
        next_seen_valid=next_seen_valid,
        **extra,
    )


def _keep_index(
    keep: torch.Tensor, key_rank: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots to copy into the new cache tensors, and their ranks (-1: a spare slot).

    The new tensors get room to grow (double the kept count, at most ``capacity`` = S + W), so that the
    following decoding steps write in place instead of copying the cache every step.
    """
    batch = keep.shape[0]
    kept = int(keep.sum(1).max())
    size = min(capacity, max(kept + 1, 2 * kept))
    if batch == 1 or bool((keep == keep[:1]).all()):
        index = keep[0].nonzero().squeeze(1)
        rank = key_rank.index_select(1, index)
    else:  # rows keep different slots: each row's kept slots first, in order
        index = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :kept]
        rank = key_rank.gather(1, index).masked_fill(~keep.gather(1, index), -1)
    spare = size - index.shape[-1]
    index = torch.nn.functional.pad(index, (0, spare))  # spare slots copy slot 0: finite, and marked free
    rank = torch.nn.functional.pad(rank, (0, spare), value=-1)
    return index, rank
