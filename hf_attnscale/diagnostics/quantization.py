"""W8A8 fake quantisation: how much a model loses when its linear layers run in 8-bit integers.

Bondarenko et al. (2023) measure outliers by what they cost under quantisation: a few huge activations set
a per-tensor scale so coarse that every ordinary value rounds to a handful of levels. `fake_quantized`
simulates that in floating point, on every `nn.Linear` of the model:

* weights: symmetric int8, one scale per output channel (``absmax / 127``), quantised once on entry;
* inputs: symmetric int8 with one scale per tensor, taken from the tensor's own absmax at each call
  (dynamic per-tensor quantisation: the setting in which an outlier costs every other value its precision).

Embeddings, norms and the attention matmuls stay in floating point; no parameter is modified.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

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
def fake_quantized(model: nn.Module) -> Iterator[nn.Module]:
    """``with fake_quantized(model):`` runs every linear layer of ``model`` in simulated W8A8 (see the module).

    No parameter is modified (a weight tied to an embedding stays exact there): each linear layer runs a
    quantised copy of its weight for the duration, and its own forward again after.

    Example:
        >>> with fake_quantized(model):
        ...     quantized_loss = model(input_ids=ids, labels=ids).loss
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layer to quantise.")
    try:
        for module in linears:
            module.forward = _w8a8_forward(module)
        yield model
    finally:
        for module in linears:
            module.__dict__.pop("forward", None)


def _w8a8_forward(module: nn.Linear):
    weight = quantize_symmetric(module.weight.detach(), dim=0)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return F.linear(quantize_symmetric(x), weight, module.bias)

    return forward
