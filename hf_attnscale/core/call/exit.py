"""The exit (zero_kv / sink logit): one more key whose value is zero and whose logit is ``s``, per head.

Two formulations, both plain attention that PyTorch differentiates by itself:

* `sdpa_exit_attention`, for the sdpa backend on every device: the exit's logit rides on extra channels, so
  public ``F.scaled_dot_product_attention`` computes it as an ordinary ``q·k`` (shapes per head; W is
  ``D + 2`` rounded up to a multiple of 8 on accelerators, whose fused kernels want one, and ``D + 2`` on the
  CPU, whose kernels take any width: 8 more channels would cost the CPU 12% more attention time and memory)::

      q' = [q, hi, lo, 0…]          (T, W)   hi + lo = s / scale, split so that bf16 keeps s to ~2^-16
      k' = [exit; k, 0, 0, 0…]      (1 + T, W)   exit key = [0…, 1, 1, 0…]
      v' = [0; v, 0…]               (1 + T, W)

  Without a mask, a causal call stays square and ``is_causal``: a dummy query row goes first, so row i + 1
  sees the exit and keys 0..i (sdpa's top-left alignment), and the dummy row (which sees only the exit) is
  dropped. With a mask, the exit is one more visible column; the queries then go in chunks of at most
  `MASK_CHUNK` mask entries, so the widened copy of the mask (and the float copy sdpa makes of a bool one) is
  a chunk's, never the whole mask's. No mask is made where the model had none, and a per-head learnable sink
  costs two channels, never a column per head: memory stays O(T·W) per head.
* `extra_key_attention`, for the eager backend: a zero key and value first, whose logit comes from a mask
  column, so the family's own eager maths (soft-capping, sinks, biases) runs on the keys and never on the exit.

`combined_exit_logits` merges the patch's exit with a family's own sinks (``s_aux``): two exits whose values
are zero are one exit of logit ``logaddexp(s₁, s₂)``.

**One name.** In code this is *the exit*, and its per-head logit ``exit_logits``. Its other names, said here
once: the options ``zero_kv`` (logit 0: softmax-off-by-one) and ``sink_logit`` (a fixed logit, or
``"learnable"``) name it as users know it; the learnable logit is the parameter ``hfa.sink``, the name saved
checkpoints hold; flash and flex take it as ``s_aux``, transformers' name for a row of sink logits. Elsewhere
"sinks" are StreamingLLM's sink tokens (`hf_attnscale.streaming`) or a family's own exit (gpt-oss' ``sinks``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hf_attnscale.core.call.masks import additive_mask

AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
"""A transformers attention function: ``(module, q, k, v, mask, **kwargs) -> (output, weights or None)``."""


class ExitCall(NamedTuple):
    """One attention call with the exit, as every formulation of it takes it.

    q ``(B, H, Tq, D)``, k ``(B, Hkv, Tk, D)``, v ``(B, Hkv, Tk, Dv)``; ``mask`` None or 4D (bool or additive);
    ``exit_logits`` ``(H,)``; ``causal``: the call's own causality, used as the backend uses it (only without a
    mask); ``kwargs``: the backend's other keyword arguments (``scaling``, ``dropout``...)."""

    backend_fn: AttentionFn
    module: nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    exit_logits: torch.Tensor
    causal: bool
    kwargs: dict[str, Any]

    @property
    def scaling(self) -> float | None:
        return self.kwargs.get("scaling")


ExitFn = Callable[[ExitCall], tuple[torch.Tensor, torch.Tensor | None]]
"""One way to run the exit: an `ExitCall` in, what a backend returns out: the output ``(B, Tq, H, Dv)`` and the
weights over the real keys (or None)."""

EXIT_CHANNELS = 2  # the logit in two parts: hi = round(s / scale), lo = the rest
MASK_CHUNK = 2**25
"""Mask entries per call with a mask (queries × keys): 32 MiB of a bool mask, 2,048 queries at 16k keys."""


def width_multiple(device: torch.device) -> int:
    """The head dims sdpa's fused kernels take on ``device``: multiples of 8 on accelerators, any on the CPU."""
    return 1 if device.type == "cpu" else 8


def combined_exit_logits(exit_logits: torch.Tensor, own_sinks: torch.Tensor | None) -> torch.Tensor:
    """The one exit equal to the patch's (``exit_logits``) beside a family's own sinks (``s_aux``), per head."""
    if own_sinks is None:
        return exit_logits
    return torch.logaddexp(exit_logits.float(), own_sinks.float().to(exit_logits.device))


def sdpa_exit_attention(call: ExitCall) -> torch.Tensor:
    """``call.backend_fn`` (transformers' sdpa wrapper) with the exit on extra channels; ``(B, Tq, H, Dv)``."""
    backend_fn, module, query, key, value, mask, exit_logits, causal, kwargs = call
    kwargs = {name: given for name, given in kwargs.items() if name != "scaling"}
    if torch.is_autocast_enabled(query.device.type):  # build the channels in the dtype the kernel will see
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    dim, dim_v, q_len = query.shape[-1], value.shape[-1], query.shape[2]
    multiple = width_multiple(query.device)
    width = -(-max(dim + EXIT_CHANNELS, dim_v) // multiple) * multiple
    # sdpa's default would read the padded width
    scaling = dim**-0.5 if call.scaling is None else call.scaling
    dummy = int(causal and mask is None and q_len > 1)

    logit = exit_logits.float().view(1, -1, 1) / scaling  # (1, H, 1)
    hi = logit.to(query.dtype)
    lo = (logit - hi.float()).to(query.dtype)
    query = F.pad(query, (0, width - dim, dummy, 0))
    query[:, :, dummy:, dim] = hi
    query[:, :, dummy:, dim + 1] = lo
    key = F.pad(key, (0, width - dim, 1, 0))
    key[:, :, 0, dim : dim + EXIT_CHANNELS] = 1
    value = F.pad(value, (0, width - dim_v, 1, 0))
    if mask is None:
        out, _ = backend_fn(module, query, key, value, None, scaling=scaling, **kwargs)
        return out[:, dummy:, :, :dim_v].contiguous()
    mask = mask[..., : key.shape[2] - 1]
    visible = True if mask.dtype == torch.bool else 0.0
    rows = max(1, MASK_CHUNK // key.shape[2])
    outs = []
    for start in range(0, q_len, rows):
        part = slice(start, start + rows)
        chunk_mask = F.pad(mask[..., part, :] if mask.shape[-2] > 1 else mask, (1, 0), value=visible)
        out, _ = backend_fn(module, query[:, :, part], key, value, chunk_mask, scaling=scaling, **kwargs)
        outs.append(out[..., :dim_v])
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0].contiguous()


def extra_key_attention(call: ExitCall) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``call.backend_fn`` (a family's eager attention) over a zero key and value first, whose logit ``s`` comes
    from a mask column; returns the backend's output and its weights over the real keys.

    The mask is materialised (eager materialises the scores anyway): one column shared by the heads when every
    head has the same constant logit, a column per head otherwise.
    """
    backend_fn, module, query, key, value, mask, exit_logits, causal, kwargs = call
    num_heads, q_len = query.shape[1:3]
    k_len = key.shape[2]
    dtype = query.dtype
    key = F.pad(key, (0, 0, 1, 0))
    value = F.pad(value, (0, 0, 1, 0))
    neg = torch.finfo(dtype).min
    if mask is None:
        body = torch.zeros(1, 1, q_len, k_len, dtype=dtype, device=query.device)
        if causal and q_len > 1:
            body.masked_fill_(torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).triu(1), neg)
    elif mask.dtype == torch.bool:
        body = additive_mask(mask, dtype)
    else:
        body = mask[..., :k_len].to(dtype)
    uniform = not exit_logits.requires_grad and bool((exit_logits == exit_logits[0]).all())
    heads = 1 if uniform and body.shape[1] == 1 else num_heads
    body = body.expand(body.shape[0], heads, q_len, k_len)
    column = exit_logits.to(dtype).view(1, -1, 1, 1)[:, :heads].expand(body.shape[0], heads, q_len, 1)
    out, weights = backend_fn(module, query, key, value, torch.cat([column, body], dim=-1), **kwargs)
    return out, (weights[..., 1:] if weights is not None else None)
