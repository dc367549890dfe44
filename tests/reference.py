"""A plain, obviously correct eager implementation of every attention variant, for the tests.

It materialises the scores, multiplies them by the law of n (n = visible keys counted from a dense mask),
appends the exit column, and takes a softmax. It shares no code with hf_attnscale.
"""

from __future__ import annotations

import math

import torch
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.modeling_utils import AttentionInterface

REF_NAME = "hfa_test_reference"


def law(
    scale: str, n: torch.Tensor, train_length: int, clamp: bool, slope: torch.Tensor | None
) -> torch.Tensor:
    """Query multiplier written straight from the formulas (n: (B,1,Tq) -> (B,1|H,Tq))."""
    n = n.clamp_min(1.0)
    if scale == "logn":
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
    sink=None,
    with_weights=False,
    softcap=None,
    model_sinks=None,
    bias=None,
):
    """q (B,H,Tq,D), k/v (B,Hkv,Tk,D), visible bool broadcastable to (B,H,Tq,Tk). Returns (B,H,Tq,D), and with
    ``with_weights`` also the attention weights over the keys (B,H,Tq,Tk), the exit column dropped.

    The order of a family's eager attention, with the patch: logits x scaling x law(n), then the family's
    logit soft-capping (``softcap``), then the mask; then the model's own sink logits (gpt-oss, ``model_sinks``)
    and the patch's exit, neither scaled nor capped, each a column whose value is zero. ``bias`` (a family's
    relative position bias, or the finite values of an additive mask) is added after the cap, unscaled.
    """
    heads = q.shape[1]
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    v = v.repeat_interleave(heads // v.shape[1], dim=1)
    visible = visible.expand(q.shape[0], heads, q.shape[2], k.shape[2])
    exact = torch.promote_types(q.dtype, torch.float32)  # at least fp32; fp64 models stay fp64
    scores = torch.matmul(q.to(exact), k.to(exact).transpose(-1, -2)) * scaling
    if scale != "none":
        n = visible.to(exact).sum(-1)
        slope = None if slope is None else slope.to(n.device)  # the reference's parameters live on the CPU
        scores = scores * law(scale, n, train_length, clamp, slope).unsqueeze(-1)
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
    out = torch.matmul(probs, values).to(q.dtype)
    return (out, probs[..., : k.shape[2]].to(q.dtype)) if with_weights else out


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
    ):
        self.apply_softcap = (
            apply_softcap  # eager caps the logits; sdpa ignores the cap, and so must its reference
        )
        self.scale, self.train_length = scale, train_length
        self.clamp = (scale != "ssmax") if clamp is None else clamp
        self.slope = torch.nn.Parameter(torch.full((heads,), slope_init or 1 / math.log(train_length or 2)))
        if zero_kv:
            self.sink = torch.zeros(heads)
        elif sink_logit == "learnable":
            self.sink = torch.nn.Parameter(torch.full((heads,), float(sink_init)))
        elif sink_logit is not None:
            self.sink = torch.full((heads,), float(sink_logit))
        else:
            self.sink = None


def reference_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface-compatible reference: reads its options from ``module.hfa_ref``."""
    ref: ReferencePatch = module.hfa_ref
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
        sink=ref.sink,
        with_weights=True,
        softcap=kwargs.get("softcap") if ref.apply_softcap else None,
        model_sinks=kwargs["s_aux"] if kwargs.get("s_aux") is not None else kwargs.get("sinks"),
        bias=bias,
    )
    return out.transpose(1, 2).contiguous(), weights


AttentionInterface.register(REF_NAME, reference_forward)
AttentionMaskInterface.register(REF_NAME, eager_mask)


def _query_heads(module, config) -> int:
    for source in (module, getattr(module, "config", None), config):
        for name in ("num_heads", "num_attention_heads", "n_heads", "n_head"):
            value = getattr(source, name, None)
            if isinstance(value, int) and value > 0:
                return value
    raise ValueError(f"no head count on {type(module).__name__}")


def make_reference(model, attention_classes, **patch_kwargs):
    """Turn ``model`` (unpatched) into the reference: every attention module computes `reference_forward`."""
    model.config._attn_implementation = REF_NAME
    refs = []
    for module in model.modules():
        if type(module).__name__ in attention_classes:
            module.hfa_ref = ReferencePatch(heads=_query_heads(module, model.config), **patch_kwargs)
            refs.append(module.hfa_ref)
    return refs
