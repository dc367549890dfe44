"""Activation outliers: kurtosis and largest magnitude of the attention blocks' outputs and hidden states.

The measures of Bondarenko et al. (2023), "Quantizable Transformers": heavy tails in the residual stream,
which they trace to heads that must "attend to nothing" and which an exit removes. Kurtosis is taken over
all elements of a layer's tensor (a Gaussian has 3); ``max_abs`` is its largest absolute value.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hf_attnscale.core.install.families import attention_modules
from hf_attnscale.core.install.offload import run_device
from hf_attnscale.core.install.wrappers import backbone, unwrap


@dataclass(frozen=True)
class OutlierStatistics:
    """Per layer ``(layers,)``: kurtosis and max |x| of the attention output, and of the hidden state after it."""

    attention_kurtosis: torch.Tensor
    attention_max_abs: torch.Tensor
    hidden_kurtosis: torch.Tensor
    hidden_max_abs: torch.Tensor

    def plot(self, path: str | Path, title: str | None = None) -> Path:
        """A PNG of both measures per layer, for the attention outputs and the hidden states."""
        from .plots import plot_outliers  # matplotlib is only needed to draw

        return plot_outliers(self, Path(path), title)


def kurtosis(x: torch.Tensor) -> torch.Tensor:
    """Kurtosis ``E[(x - mean)^4] / Var(x)^2`` over all elements (3 for a Gaussian)."""
    x = x.double().flatten()
    centred = x - x.mean()
    return (centred.pow(4).mean() / centred.pow(2).mean().pow(2)).float()


@torch.no_grad()
def activation_outliers(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> OutlierStatistics:
    """Kurtosis and max |x| of every attention block's output and every layer's hidden state.

    Padding positions (``attention_mask == 0``) are left out. Works on any supported model, patched or not. The
    model runs without its head (no logits), and each attention output is measured as it is made rather than
    kept, so long inputs cost little more than the hidden states themselves.
    """
    root = unwrap(model)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    keep = None if attention_mask is None else attention_mask.bool()
    attention: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(module, args, output) -> None:
        out = output[0] if isinstance(output, tuple) else output
        out = out if keep is None else out[keep.to(out.device)]
        attention.append((kurtosis(out), out.abs().max().float().cpu()))

    hooks = [m.register_forward_hook(record) for m in attention_modules(root)]
    try:
        result = backbone(root)(
            input_ids=input_ids.to(run_device(root)),
            attention_mask=attention_mask,
            output_hidden_states=True,
        )
    finally:
        for hook in hooks:
            hook.remove()
    hidden = [h if keep is None else h[keep.to(h.device)] for h in result.hidden_states[1:]]
    return OutlierStatistics(
        attention_kurtosis=torch.stack([k for k, _ in attention]),
        attention_max_abs=torch.stack([m for _, m in attention]),
        hidden_kurtosis=torch.stack([kurtosis(x) for x in hidden]),
        hidden_max_abs=torch.stack([x.abs().max().float().cpu() for x in hidden]),
    )
