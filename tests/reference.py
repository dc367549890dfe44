"""A plain, obviously correct eager implementation of every attention variant, for the tests.

It materialises the scores, multiplies them by the law of n (n = visible keys counted from a dense mask),
appends the exit column, and takes a softmax. `rerotated_stream_logits` is StreamingLLM by definition: the
kept keys re-rotated into a plain DynamicCache at every step, the model's own masks. It shares no attention code
with hf_attnscale; it takes one fact from it, `families.query_heads` (which field holds a module's number of query
heads), to size its per-head parameters (see `make_reference`).
"""

from __future__ import annotations

import functools
import inspect
import math
import sys

import torch
from transformers import DynamicCache
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.modeling_utils import AttentionInterface

from hf_attnscale.core.install.families import query_heads

REF_NAME = "hfa_test_reference"


def law(
    scale: str,
    n: torch.Tensor,
    train_length: int,
    clamp: bool,
    slope: torch.Tensor | None,
    beta: float | None = None,
) -> torch.Tensor:
    """Query multiplier written straight from the formulas (n: (B,1,Tq) -> (B,1|H,Tq))."""
    n = n.clamp_min(1.0)
    if scale == "llama4":  # Llama 4: 1 + beta * log(1 + floor(n / F))
        m = 1 + beta * torch.log(1 + torch.div(n, train_length, rounding_mode="floor"))
    elif scale == "ministral3":  # Ministral 3: 1 + beta * log(1 + floor(position / L)), position = n - 1
        m = 1 + beta * torch.log(1 + torch.div(n - 1, train_length, rounding_mode="floor"))
    elif scale == "logn":
        m = torch.log(n) / math.log(train_length)
    elif scale == "gradmax":
        m = torch.sqrt(torch.log(n) / math.log(train_length))
    elif scale == "ssmax":
        m = slope.view(1, -1, 1) * torch.log(n)
    else:
        return torch.ones_like(n)
    return torch.maximum(m, torch.ones_like(m)) if clamp else m


def reference_attention(
    q,
    k,
    v,
    visible,
    scaling,
    *,
    scale="none",
    train_length=None,
    clamp=False,
    slope=None,
    beta=None,
    sink=None,
    clip=None,
    with_weights=False,
    softcap=None,
    model_sinks=None,
    bias=None,
    logits=None,
):
    """q (B,H,Tq,D), k/v (B,Hkv,Tk,D), visible bool broadcastable to (B,H,Tq,Tk). Returns (B,H,Tq,D), and with
    ``with_weights`` also the attention weights over the keys (B,H,Tq,Tk), the exit column dropped.

    The order of a family's eager attention, with the patch: logits x scaling x law(n), then the family's
    logit soft-capping (``softcap``), then the mask; then the model's own sink logits (gpt-oss, ``model_sinks``)
    and the patch's exit, neither scaled nor capped, each a column whose value is zero. ``bias`` (a family's
    relative position bias, or the finite values of an additive mask) is added after the cap, unscaled.
    ``logits`` (B,H,Tq,Tk), where given, are the scores before ``scaling`` in place of ``q·k`` (ReRoPE's).
    """
    heads = q.shape[1]
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    v = v.repeat_interleave(heads // v.shape[1], dim=1)
    visible = visible.expand(q.shape[0], heads, q.shape[2], k.shape[2])
    exact = torch.promote_types(q.dtype, torch.float32)  # at least fp32; fp64 models stay fp64
    if logits is None:
        logits = torch.matmul(q.to(exact), k.to(exact).transpose(-1, -2))
    scores = logits.to(exact) * scaling
    if scale != "none":
        n = visible.to(exact).sum(-1)
        slope = None if slope is None else slope.to(n.device)  # the reference's parameters live on the CPU
        scores = scores * law(scale, n, train_length, clamp, slope, beta).unsqueeze(-1)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias.to(exact)
    scores = scores.masked_fill(~visible, -math.inf)
    values = v.to(exact)
    for column_logits in (model_sinks, sink):
        if column_logits is not None:
            # a logit per head (gpt-oss, the patch), or per batch, head and query (Inkling-2's (B,H,Tq,1))
            shape = (1, -1, 1, 1) if column_logits.dim() == 1 else column_logits.shape
            column = column_logits.to(q.device, exact).reshape(shape).expand(q.shape[0], heads, q.shape[2], 1)
            scores = torch.cat([scores, column], dim=-1)
            values = torch.cat([values, torch.zeros_like(values[:, :, :1])], dim=2)
    probs = torch.softmax(scores, dim=-1).nan_to_num(
        0.0
    )  # a fully masked row without an exit attends nowhere
    if clip is not None:  # Bondarenko's clipped softmax on the keys' probabilities; masked keys stay at zero
        gamma, zeta = (torch.as_tensor(c, dtype=exact, device=q.device).reshape(-1, 1, 1) for c in clip)
        keys = ((zeta - gamma) * probs[..., : k.shape[2]] + gamma).clamp(0, 1).masked_fill(~visible, 0)
        probs = torch.cat([keys, probs[..., k.shape[2] :]], dim=-1)
    out = torch.matmul(probs, values).to(q.dtype)
    return (out, probs[..., : k.shape[2]].to(q.dtype)) if with_weights else out


ROPE_LAYOUTS = {
    "glm": "interleaved",
    "glm4": "interleaved",
    "ernie4_5": "interleaved",
    "helium": "interleaved",
}
ROPE_LAYOUTS |= {"ernie4_5_moe": "interleaved", "nanochat": "reversed"}
"""Families whose ``apply_rotary_pos_emb`` pairs dims other than in halves, read off transformers' code: GLM's
layout pairs dims 2c and 2c + 1 (at frequency c); NanoChat's ``rotate_half`` turns the other way."""


def rotated(x, angle_steps, inv_freq, scale, layout="halves"):
    """RoPE straight from its definition: the first ``2·len(inv_freq)`` dims of ``x`` (..., D) turned by
    ``angle_steps · inv_freq``, pair c being dims c and c + half ("halves"; "reversed": turned the other way) or
    dims 2c and 2c + 1 ("interleaved"), times ``scale``; the rest as they are."""
    half = inv_freq.shape[0]
    angle = angle_steps.to(torch.float64)[..., None] * inv_freq.to(torch.float64)
    cos, sin = angle.cos(), angle.sin() * (-1 if layout == "reversed" else 1)
    x = x.to(torch.float64)
    rotary, rest = x[..., : 2 * half], x[..., 2 * half :]
    if layout == "interleaved":
        x1, x2 = rotary[..., 0::2], rotary[..., 1::2]
    else:
        x1, x2 = rotary[..., :half], rotary[..., half:]
    first, second = (x1 * cos - x2 * sin) * scale, (x2 * cos + x1 * sin) * scale
    pairs = (
        torch.stack([first, second], -1).flatten(-2)
        if layout == "interleaved"
        else torch.cat([first, second], -1)
    )
    return torch.cat([pairs, rest.expand(*pairs.shape[:-1], rest.shape[-1])], dim=-1)


def rerope_logits(q, k, window, leak, inv_freq, scale, layout="halves", positions=None):
    """ReRoPE's scores (B,H,Tq,Tk) from raw ``q`` (B,H,Tq,D) and ``k`` (B,Hkv,Tk,D), the queries the last Tq
    positions: each pair at its distance d = i - j, clamped to ``window`` (leaky: ``window + (d - window) /
    leak``), as ``R(d') q · k``, pair by pair; i and j the places, or each key's own ``positions`` ``(B|1, Tk)``
    (PoSE's, which jump), row by row."""
    if positions is not None and positions.shape[0] > 1:
        rows = [(q[b : b + 1], k[b : b + 1], positions[b : b + 1]) for b in range(q.shape[0])]
        return torch.cat(
            [rerope_logits(*row[:2], window, leak, inv_freq, scale, layout, row[2]) for row in rows]
        )
    heads, q_len, k_len = q.shape[1], q.shape[2], k.shape[2]
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    places = torch.arange(k_len, device=q.device) if positions is None else positions[0]
    i, j = places[k_len - q_len :, None], places[None, :]
    d = (i - j).to(torch.float64)
    far = window + (d - window) / leak if leak else torch.full_like(d, float(window))
    distance = torch.where(d < window, d, far)  # (Tq, Tk)
    out = torch.empty(q.shape[0], heads, q_len, k_len, dtype=torch.float64, device=q.device)
    # R(0): the scale on the rotary dims only.
    k_scaled = rotated(k, torch.zeros((), device=q.device), inv_freq, scale, layout)
    for row in range(q_len):
        q_turned = rotated(q[:, :, row : row + 1], distance[row], inv_freq, scale, layout)  # (B,H,Tk,D)
        out[:, :, row] = (q_turned * k_scaled).sum(-1)
    return out


def _self_extend_places(i, j, group, window):
    """Self-Extend (LongLM): neighbours nearer than w at their own positions, the rest with the query at
    ⌊i/G⌋ + w − ⌊w/G⌋ and the key at ⌊j/G⌋."""
    near = (i - j) < window
    far_q = torch.floor(i / group) + window - window // group
    return torch.where(near, i, far_q), torch.where(near, j, torch.floor(j / group))


def _dual_chunk_places(i, j, size, local):
    """Dual Chunk Attention (ChunkLlama / vLLM): c = s − l, the key at j mod c; the query at i mod c in the key's
    chunk, min(i mod c + c, s) in the next, min(2c − 1, s) further on."""
    c = size - local
    apart = torch.floor(i / c) - torch.floor(j / c)
    inside = torch.remainder(i, c)
    q = torch.where(
        apart == 0,
        inside,
        torch.where(apart == 1, torch.clamp(inside + c, max=size), torch.full_like(i, min(2 * c - 1, size))),
    )
    return q, torch.remainder(j, c)


def _string_places(i, j, shift, local):
    """STRING (HKUNLP/STRING): the key at j; the query at i while i − j < S, from S on at i − S + W."""
    return torch.where((i - j) < shift, i, i - shift + local), j


PAIR_PLACES = {"self_extend": _self_extend_places, "dca": _dual_chunk_places, "string": _string_places}
"""Where each method (by its registry key) scores a pair, by its paper's definition: ``(i, j, *options)`` to the
query's and the key's positions."""
STRING_FACTOR = 1 + 0.1 * math.log(2)
"""STRING's attention factor on cos and sin, as its authors' code sets it (``replace_with_string``)."""


def method_positions(method, i, j):
    """Where a pair of a query at position ``i`` and a key at ``j`` (broadcast, float64) is scored under ``method``
    ``(key, first, second)``, ``(query's, key's)`` (`PAIR_PLACES`)."""
    kind, *options = method
    i, j = torch.broadcast_tensors(i, j)
    return PAIR_PLACES[kind](i, j, *options)


def method_logits(q, k, method, positions, inv_freq, scale, layout="halves"):
    """The scores ``(B,H,Tq,Tk)`` of raw ``q`` (B,H,Tq,D) and ``k`` (B,Hkv,Tk,D) under ``method`` (`method_positions`):
    for each pair, q rotated at its query's position and k at its key's, as each pair's part says, one by one.
    ``positions`` (B|1, Tk): every key's (the queries are the last Tq)."""
    heads, q_len, k_len = q.shape[1], q.shape[2], k.shape[2]
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    positions = positions.to(torch.float64)
    i, j = positions[:, k_len - q_len :, None], positions[:, None, :]  # (B, Tq, 1), (B, 1, Tk)
    at_q, at_k = method_positions(method, i, j)  # (B, Tq, Tk) each
    out = torch.empty(
        max(q.shape[0], at_q.shape[0]), heads, q_len, k_len, dtype=torch.float64, device=q.device
    )
    for row in range(q_len):
        q_turned = rotated(q[:, :, row : row + 1], at_q[:, None, row], inv_freq, scale, layout)  # (B,H,Tk,D)
        k_turned = rotated(k, at_k[:, None, row], inv_freq, scale, layout)
        out[:, :, row] = (q_turned * k_turned).sum(-1)
    return out


class ReferencePatch:
    """Per-layer reference parameters and options for `reference_forward` (set on the module as `hfa_ref`)."""

    def __init__(
        self,
        scale="none",
        train_length=None,
        clamp=None,
        zero_kv=False,
        sink_logit=None,
        heads=4,
        sink_init=0.0,
        slope_init=None,
        apply_softcap=True,
        beta=None,
        clipped_softmax=None,
        gate=None,
        rerope_window=None,
        rerope_leak=None,
        self_extend_group=None,
        self_extend_window=None,
        dual_chunk_size=None,
        dual_chunk_local=None,
        string_shift=None,
        string_local=128,
        string_factor=STRING_FACTOR,
    ):
        self.apply_softcap = (
            apply_softcap  # eager caps the logits; sdpa ignores the cap, and so must its reference
        )
        self.scale, self.train_length = scale, train_length
        self.clamp = scale in ("logn", "gradmax") if clamp is None else clamp
        self.beta = 0.1 if beta is None and scale in ("llama4", "ministral3") else beta
        self.gate = gate  # "head" / "element": its weight and bias are set with `set_gate`, else zero
        # ReRoPE: the reference model's rotary returns the identity, and `rerope_rope` holds the real one's
        # (inv_freq, attention scaling), set by `make_reference` for the layers that rotate.
        self.rerope = (rerope_window, rerope_leak) if rerope_window else None
        self.method = None  # Self-Extend, DCA or STRING: ``(key, first, second)`` for `method_positions`
        self.factor = 1.0  # on cos/sin, of queries and keys: STRING's
        if self_extend_group:
            self.method = ("self_extend", self_extend_group, self_extend_window)
        elif dual_chunk_size:
            self.method = ("dca", dual_chunk_size, dual_chunk_local)
        elif string_shift:
            self.method = ("string", string_shift, string_local)
            self.factor = string_factor
        self.rerope_rope = None
        self.gate_weight = self.gate_bias = None
        if clipped_softmax == "learnable":
            self.clip = (torch.nn.Parameter(torch.zeros(heads)), torch.nn.Parameter(torch.ones(heads)))
        else:
            self.clip = clipped_softmax
        self.slope = torch.nn.Parameter(torch.full((heads,), slope_init or 1 / math.log(train_length or 2)))
        if zero_kv:
            self.sink = torch.zeros(heads)
        elif sink_logit == "learnable":
            self.sink = torch.nn.Parameter(torch.full((heads,), float(sink_init)))
        elif sink_logit is not None:
            self.sink = torch.full((heads,), float(sink_logit))
        else:
            self.sink = None


PLAIN = ReferencePatch()
"""The options of plain attention."""


def reference_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface-compatible reference: reads its options from ``module.hfa_ref`` (a module the patch
    leaves alone, such as an attention residual, has none: plain attention)."""
    ref: ReferencePatch = getattr(module, "hfa_ref", PLAIN)
    q_len, k_len = query.shape[2], key.shape[2]
    if attention_mask is None:
        causal = getattr(module, "is_causal", False) and q_len > 1
        visible = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device)
        visible = visible.tril(k_len - q_len) if causal else visible
        visible = visible.view(1, 1, q_len, k_len)
        bias = None
    elif attention_mask.dtype == torch.bool:
        visible, bias = attention_mask[..., :k_len], None
    else:
        mask = attention_mask[..., :k_len]
        visible = mask > torch.finfo(mask.dtype).min / 2
        bias = mask.masked_fill(~visible, 0.0)  # a family's float mask may carry values (Doge's dynamic mask)
    if kwargs.get("position_bias") is not None:
        bias = kwargs["position_bias"] if bias is None else bias + kwargs["position_bias"]
    logits = None
    if ref.rerope is not None and ref.rerope_rope is not None:
        positions = kwargs.get("position_ids")
        if positions is not None and positions.shape[-1] != k_len:  # a step onto a cache: its places
            positions = None
        logits = rerope_logits(query, key, *ref.rerope, *ref.rerope_rope(), positions=positions)
    if ref.method is not None and ref.rerope_rope is not None:
        positions = kwargs.get("position_ids")
        if positions is None or positions.shape[-1] != k_len:  # the model's default: the cache's places
            positions = torch.arange(k_len, device=query.device)[None]
        inv_freq, scale, layout = ref.rerope_rope()
        logits = method_logits(query, key, ref.method, positions, inv_freq, scale * ref.factor, layout)
    out, weights = reference_attention(
        query,
        key,
        value,
        visible,
        scaling if scaling is not None else query.shape[-1] ** -0.5,
        scale=ref.scale,
        train_length=ref.train_length,
        clamp=ref.clamp,
        slope=ref.slope,
        beta=ref.beta,
        sink=ref.sink,
        clip=ref.clip,
        with_weights=True,
        softcap=kwargs.get("softcap") if ref.apply_softcap else None,
        model_sinks=kwargs["s_aux"] if kwargs.get("s_aux") is not None else kwargs.get("sinks"),
        bias=bias,
        logits=logits,
    )
    out = out.transpose(1, 2)  # (B, Tq, H, Dv)
    if ref.gate is not None:  # out_h * 2 sigmoid(x W + b), x the module's input (taken by `_remember_input`)
        x = module.hfa_ref_input
        if ref.gate_weight is None:
            width = out.shape[2] * (1 if ref.gate == "head" else out.shape[3])
            ref.gate_weight = torch.nn.Parameter(torch.zeros(width, x.shape[-1]))
            ref.gate_bias = torch.nn.Parameter(torch.zeros(width))
        logits = torch.matmul(x.float(), ref.gate_weight.t()) + ref.gate_bias
        gate = 2 * torch.sigmoid(logits).reshape(*out.shape[:3], -1)
        out = (out.float() * gate).to(out.dtype)
    return out.contiguous(), weights


def _remember_input(module, args, kwargs):
    module.hfa_ref_input = args[0] if args else kwargs["hidden_states"]


def set_gate(ref: ReferencePatch, weight: torch.Tensor, bias: torch.Tensor) -> None:
    """Give the reference's gate these values (copies, trainable)."""
    ref.gate_weight = torch.nn.Parameter(weight.detach().clone().float())
    ref.gate_bias = torch.nn.Parameter(bias.detach().clone().float())


AttentionInterface.register(REF_NAME, reference_forward)
AttentionMaskInterface.register(REF_NAME, eager_mask)


def make_reference(model, attention_classes, **patch_kwargs):
    """Turn ``model`` (unpatched) into the reference: every attention module computes `reference_forward`.

    Its per-head parameters are sized by the package's `query_heads`, which reads a family's config fields: a
    lookup, not attention, and not what the reference checks. `reference_attention` takes the heads from the
    queries themselves (``q.shape[1]``); a per-head parameter of another size (but one, which broadcasts) fails
    there. A copy of the lookup here would only have to follow the package's list of field names by hand."""
    model.config._attn_implementation = REF_NAME
    refs, layers = [], []
    for module in model.modules():
        if type(module).__name__ in attention_classes:
            module.hfa_ref = ReferencePatch(heads=query_heads(module, model.config), **patch_kwargs)
            if _sees_only_the_near_part(module, patch_kwargs):
                module.hfa_ref.factor = 1.0
            if module.hfa_ref.gate is not None:
                module.register_forward_pre_hook(_remember_input, with_kwargs=True)
            refs.append(module.hfa_ref)
            layers.append(getattr(module, "layer_idx", len(layers)))
    if any(
        patch_kwargs.get(name)
        for name in ("rerope_window", "self_extend_group", "dual_chunk_size", "string_shift")
    ):
        _raw_rope(model, refs, layers)
    return refs


def _sees_only_the_near_part(module, patch_kwargs) -> bool:
    """Whether STRING leaves the layer as the model has it, its factor too: its own sliding window holds no pair S
    or more apart (the package's rule for any method, `Method.exact_below`; the others' near parts are the model's
    own scores already)."""
    if not patch_kwargs.get("string_shift"):
        return False
    own = getattr(module, "sliding_window", getattr(getattr(module, "config", None), "sliding_window", None))
    return bool(own) and own <= patch_kwargs["string_shift"]


def _raw_rope(model, refs, layers) -> None:
    """ReRoPE's reference: the model's rotary returns the identity, so every attention call gets raw q and k,
    and each layer's reference holds the real frequencies to rotate them by clamped distances. A layer that
    applies no RoPE (``rotates[layer]`` False, from `applies_rope_layers`) keeps plain scores."""
    rotaries = [m for m in model.modules() if hasattr(m, "rope_type")]
    assert len(rotaries) == 1, "the reference takes one rotary embedding"
    rotary = rotaries[0]
    own_forward = rotary.forward
    layer_types = getattr(model.config.get_text_config(), "layer_types", None)
    takes_type = "layer_type" in inspect.signature(own_forward).parameters
    rotates = applies_rope_layers(model)
    for index, ref in zip(layers, refs):  # by decoder layer: hybrids have layers without attention
        if not rotates[index]:
            continue
        prefix = f"{layer_types[index]}_" if takes_type and layer_types else ""
        layout = ROPE_LAYOUTS.get(model.config.get_text_config().model_type, "halves")
        ref.rerope_rope = functools.partial(_frequencies_now, rotary, prefix, layout)

    def identity(x, position_ids, *args, **kwargs):
        cos, _ = own_forward(x, position_ids, *args, **kwargs)
        return torch.ones_like(cos), torch.zeros_like(cos)

    rotary.forward = identity


def _frequencies_now(rotary, prefix, layout):
    """(inv_freq, attention scaling, layout) of ``rotary`` as of this call (a dynamic rope type changes them)."""
    inv_freq = getattr(rotary, f"{prefix}inv_freq").detach().clone()
    scale = getattr(rotary, f"{prefix}attention_scaling", getattr(rotary, "attention_scaling", 1.0))
    return inv_freq, float(scale), layout


def applies_rope_layers(model) -> list[bool]:
    """Whether each decoder layer rotates: all, but those a config marks as NoPE (SmolLM3's ``no_rope_layers``
    of 0, Cohere-2's full-attention layers, Llama-4's ``no_rope_layers`` of 0)."""
    config = model.config.get_text_config()
    layers = config.num_hidden_layers
    no_rope = getattr(config, "no_rope_layers", None)
    if no_rope is not None:
        return [bool(flag) for flag in no_rope[:layers]]
    if config.model_type == "cohere2":
        return [kind == "sliding_attention" for kind in config.layer_types[:layers]]
    return [True] * layers


# ---------------------------------------------------------------------------------------------------------
# StreamingLLM, by definition: the kept keys re-rotated into a plain cache at every step


def rerotated_stream_logits(model, ids: torch.Tensor, sinks: int, window: int, rotates=None) -> torch.Tensor:
    """Logits ``(T, V)`` of ``ids`` ``(1, T)`` streamed token by token as StreamingLLM defines it, with nothing of
    a `SinkCache`.

    Token ``t`` reads a fresh `DynamicCache` holding the tokens a ``SinkCache(sinks, window)`` keeps for it: the
    first ``sinks`` and the ``window - 1`` before it, in order, each layer's stored key re-rotated from the position
    it was computed at to its place ``0..n-1`` (RoPE composes: ``R(a) R(b) = R(a + b)``). The token sits at
    position ``n``, and the model builds its own masks, so each sliding-window layer sees what the model lets it.
    ``rotates(attention_module)`` says whether a layer applies RoPE (default: every layer does).
    """
    attentions = [layer.self_attn for layer in model.model.layers]
    rotary = model.model.rotary_emb
    stored: list[list[tuple[torch.Tensor, torch.Tensor, int]]] = [[] for _ in attentions]
    logits = []
    for t in range(ids.shape[1]):
        kept = [j for j in range(t) if j < sinks or t - j < window]
        cache = DynamicCache()
        for layer, attention in enumerate(attentions):
            if kept:
                keys = [
                    _moved(attention, rotary, stored[layer][j][0], place - stored[layer][j][2], rotates)
                    for place, j in enumerate(kept)
                ]
                values = [stored[layer][j][1] for j in kept]
                cache.update(torch.cat(keys, dim=2), torch.cat(values, dim=2), layer)
        with torch.no_grad():
            logits.append(model(input_ids=ids[:, t : t + 1], past_key_values=cache).logits[0, -1])
        for layer in range(len(attentions)):
            held = cache.layers[layer]
            stored[layer].append((held.keys[:, :, -1:], held.values[:, :, -1:], len(kept)))
    return torch.stack(logits)


def _moved(attention, rotary, key: torch.Tensor, by: int, rotates) -> torch.Tensor:
    """``key`` (rotated at some position) rotated ``by`` positions further, by the family's own RoPE."""
    if by == 0 or (rotates is not None and not rotates(attention)):
        return key
    position = torch.tensor([[by]], device=key.device)
    layer_type = getattr(attention, "layer_type", None)
    takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
    cos, sin = rotary(key, position, layer_type) if takes_type else rotary(key, position)
    rope = sys.modules[type(attention).__module__].apply_rotary_pos_emb
    return rope(key, key, cos, sin)[1]
