"""W8A8 fake quantisation: how much a model loses when its linear layers run in 8-bit integers.

Bondarenko et al. (2023) measure outliers by what they cost under quantisation: a few huge activations set
a per-tensor scale so coarse that every ordinary value rounds to a handful of levels. `fake_quantized`
simulates that in floating point, on every `nn.Linear` of the model:

* weights: symmetric int8, one scale per output channel (``absmax / 127``), quantised at each call (so that a
  weight accelerate offloads, on ``meta`` between calls, is quantised as loaded);
* inputs: symmetric int8 with one scale per tensor, taken from the tensor's own absmax at each call
  (dynamic per-tensor quantisation: the setting in which an outlier costs every other value its precision).

Embeddings, norms and the attention matmuls stay in floating point; no parameter is modified.

``keep_first=k`` keeps the first ``k`` tokens of every sequence out of it: their inputs stay in floating point and
are left out of the range the others are quantised in. Those are the attention sinks, where pretrained models
put their largest activations, so this measures how much of the loss the sinks' outliers cause.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from hf_attnscale.core.install.offload import forward_slot, set_forward
from hf_attnscale.core.options.validation import check_int

LEVELS = 127
"""Symmetric int8: integers in [-127, 127]."""


def quantize_symmetric(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``x`` rounded to 255 evenly spaced levels in ``[-absmax, absmax]`` (per tensor, or per slice along ``dim``)."""
    if dim is None:
        absmax = x.abs().max()
    else:
        absmax = x.abs().amax(dim=[d for d in range(x.dim()) if d != dim % x.dim()], keepdim=True)
    scale = absmax.clamp_min(torch.finfo(x.dtype).tiny) / LEVELS
    return (x / scale).round().clamp(-LEVELS, LEVELS) * scale


@contextlib.contextmanager
def fake_quantized(model: nn.Module, keep_first: int = 0) -> Iterator[nn.Module]:
    """``with fake_quantized(model):`` runs every linear layer of ``model`` in simulated W8A8 (see the module).

    ``keep_first``: the first tokens of each sequence (dimension -2 of a linear layer's input) whose inputs stay
    in floating point, outside the quantisation range of the rest.

    No parameter is modified (a weight tied to an embedding stays exact there): each linear layer runs a
    quantised copy of its weight for the duration, and its own forward again after.

    Example:
        >>> with fake_quantized(model):
        ...     quantized_loss = model(input_ids=ids, labels=ids).loss
    """
    keep_first = check_int("keep_first", keep_first, 0)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layer to quantise.")
    # The forward goes where the module's own goes (under accelerate's hook, if any), and exactly that comes back.
    saved = [(module, forward_slot(module)) for module in linears]
    saved = [(module, slot, module.__dict__.get(slot)) for module, slot in saved]
    try:
        for module in linears:
            set_forward(module, _w8a8_forward(keep_first))
        yield model
    finally:
        for module, slot, forward in saved:
            if forward is None:
                module.__dict__.pop(slot, None)
            else:
                module.__dict__[slot] = forward


def _w8a8_forward(keep_first: int):
    """A linear layer's forward with its weight and input quantised (the weight as the call finds it)."""

    def forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if keep_first and x.dim() >= 2:
            kept, rest = x[..., :keep_first, :], x[..., keep_first:, :]
            x = torch.cat([kept, quantize_symmetric(rest)], dim=-2) if rest.numel() else kept
        else:
            x = quantize_symmetric(x)
        return F.linear(x, quantize_symmetric(module.weight.detach(), dim=0), module.bias)

    return forward
