"""Attention entropy, sink mass and softmax-gradient size, from the queries and keys the model computes.

The measures are computed inside the patched attention function (a probe carried by the call, `hf_attnscale.core.call.hooks`),
from the very query (after any scale law), keys, mask and exit logit the backend receives, so they describe the
attention the model actually runs, whatever its backend. For each query row with distribution ``p`` over its
``n`` visible keys (plus the exit, if any):

* entropy ``H = -sum p log p`` (nats; uniform attention over n keys has ``ln n``: the articles' quantity);
* sink mass: ``p`` summed over the first ``sink_tokens`` keys;
* gradient size ``2 (1 - sum p^2)``: the L1 norm of the softmax Jacobian, the measure Su maximises;
* exit mass: the weight on the exit column (zero_kv / sink logit), 0 without one.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hf_attnscale.core.call.hooks import CallHooks, using_hooks
from hf_attnscale.core.call.masks import visible_keys
from hf_attnscale.core.install.installed import get_config, patched_modules
from hf_attnscale.core.install.offload import run_device
from hf_attnscale.core.install.patching import patched
from hf_attnscale.core.install.wrappers import backbone, unwrap
from hf_attnscale.core.options.config import AttnScaleConfig
from hf_attnscale.core.options.validation import check_int

QUERY_CHUNK = 256
"""Query rows scored at a time: memory is O(chunk x keys) per head."""
MEASURES = ("entropy", "sink_mass", "gradient", "exit_mass")


@dataclass(frozen=True)
class AttentionStatistics:
    """Per-query attention measures, averaged over the batch: each ``(layers, heads, queries)``.

    Attributes:
        entropy, sink_mass, gradient, exit_mass: see the module docstring.
        visible: ``(layers, queries)`` the number of keys each query sees (n), averaged over the batch.
        sink_tokens: how many first keys `sink_mass` sums over.
    """

    entropy: torch.Tensor
    sink_mass: torch.Tensor
    gradient: torch.Tensor
    exit_mass: torch.Tensor
    visible: torch.Tensor
    sink_tokens: int

    def summary(self, skip: int = 0) -> dict[str, torch.Tensor]:
        """Each measure per layer and head ``(layers, heads)``, averaged over the queries after the first ``skip``."""
        return {name: getattr(self, name)[..., skip:].mean(-1) for name in MEASURES}

    def plot(self, path: str | Path, title: str | None = None) -> Path:
        """A PNG: entropy and gradient size against n (per layer, with ln n for reference), and sink mass per
        layer and head."""
        from .plots import plot_attention  # matplotlib is only needed to draw

        return plot_attention(self, Path(path), title)


class _Collector:
    """Sums the measures of every probed call, per (layer, head, query position)."""

    def __init__(self, sink_tokens: int, modules: list[nn.Module]) -> None:
        self.sink_tokens = sink_tokens
        self.layers = {id(module): layer for layer, module in enumerate(modules)}
        self.sums: dict[int, dict[str, torch.Tensor]] = {}

    def record(self, module, query, key, attention_mask, *, causal, exit_logits, backend, **kwargs) -> None:
        """The probe (`hf_attnscale.core.call.hooks.CallHooks`): add one attention call's measures to its layer's."""
        layer = self.layers[id(module)]
        measures = _measures(
            query, key, attention_mask, causal, exit_logits, backend, self.sink_tokens, kwargs
        )
        self.sums[layer] = (
            {k: self.sums[layer][k] + v for k, v in measures.items()} if layer in self.sums else measures
        )


@torch.no_grad()
def _measures(
    query, key, attention_mask, causal, exit_logits, backend, sink_tokens, kwargs
) -> dict[str, torch.Tensor]:
    """The measures of one attention call, summed over the batch: each ``(heads, queries)``."""
    batch, heads, q_len, _ = query.shape
    k_len = key.shape[2]
    key = key.float().repeat_interleave(heads // key.shape[1], dim=1)
    scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
    softcap = kwargs.get("softcap") if backend.soft_caps else None
    visible = visible_keys(
        q_len,
        k_len,
        attention_mask,
        causal=causal,
        sliding_window=kwargs.get("sliding_window"),
        bottom_right=backend.bottom_right,
        device=query.device,
    ).expand(batch, heads, q_len, k_len)
    out = {name: torch.zeros(heads, q_len) for name in (*MEASURES, "visible")}
    for start in range(0, q_len, QUERY_CHUNK):
        rows = slice(start, start + QUERY_CHUNK)
        logits = torch.matmul(query[:, :, rows].float(), key.transpose(-1, -2)) * scaling
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        logits = logits.masked_fill(~visible[:, :, rows], -math.inf)
        if exit_logits is not None:
            column = exit_logits.float().view(1, -1, 1, 1).expand(batch, heads, logits.shape[2], 1)
            logits = torch.cat([logits, column], dim=-1)
        p = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row that sees nothing attends nowhere
        plogp = torch.where(p > 0, p * p.clamp_min(1e-30).log(), torch.zeros_like(p))
        keys_p = p[..., :k_len]
        part = {
            "entropy": -plogp.sum(-1),
            "sink_mass": keys_p[..., :sink_tokens].sum(-1),
            "gradient": 2 * (1 - (p * p).sum(-1)),
            "exit_mass": p[..., k_len:].sum(-1),
            "visible": visible[:, :, rows].sum(-1).float(),
        }
        for name, value in part.items():
            out[name][:, rows] = value.sum(0).cpu()
    return out


@contextlib.contextmanager
def _probed(model: nn.Module, sink_tokens: int) -> Iterator[_Collector]:
    """Probe this thread's calls of every patched attention module of ``model`` (patched with the identity for
    the block if it was not)."""
    with contextlib.ExitStack() as stack:
        if get_config(model) is None:
            stack.enter_context(patched(model, AttnScaleConfig()))
        collector = _Collector(sink_tokens, [m for _, m in patched_modules(model)])
        with using_hooks(CallHooks(probe=collector.record)):
            yield collector


@torch.no_grad()
def attention_statistics(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    sink_tokens: int = 1,
) -> AttentionStatistics:
    """Attention entropy, sink mass, softmax-gradient size and exit mass of every layer, head and query.

    Args:
        model: any supported model, patched or not (an unpatched one is patched with the identity for the call
            and restored after).
        input_ids: ``(B, T)`` token ids (one forward pass of the model without its head; memory O(T x chunk)
            per head, not O(T^2)).
        attention_mask: padding mask, as the model takes it.
        sink_tokens: how many first keys count as the sink.

    Example:
        >>> stats = hfa.diagnostics.attention_statistics(model, ids)
        >>> stats.summary(skip=16)["sink_mass"]  # (layers, heads)
        >>> stats.plot("attention.png")
    """
    sink_tokens = check_int("sink_tokens", sink_tokens, 1)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    root = unwrap(model)
    with _probed(root, sink_tokens) as collector:
        # The attention runs in the backbone: the head's logits would only cost memory (GBs on long inputs).
        backbone(root)(input_ids=input_ids.to(run_device(root)), attention_mask=attention_mask)
    if not collector.sums:
        raise ValueError("No attention call was probed: the model ran none of its patched attention modules.")
    batch = input_ids.shape[0]
    layers = [collector.sums[i] for i in sorted(collector.sums)]
    stacked = {
        name: torch.stack([layer[name] for layer in layers]) / batch for name in (*MEASURES, "visible")
    }
    return AttentionStatistics(
        entropy=stacked["entropy"],
        sink_mass=stacked["sink_mass"],
        gradient=stacked["gradient"],
        exit_mass=stacked["exit_mass"],
        visible=stacked["visible"][:, 0],
        sink_tokens=sink_tokens,
    )
