"""Scale laws: the number of visible keys n -> the multiplier applied to the query."""

from __future__ import annotations

import math

import torch

from hf_attnscale.core.options.config import AttnScaleConfig


def ssmax_init(train_length: int) -> float:
    """Initial SSMax slope s, chosen so that s·ln(n) equals log_L(n)."""
    return 1.0 / math.log(train_length)


def query_multiplier(
    config: AttnScaleConfig, n: torch.Tensor, ssmax_slope: torch.Tensor | None = None
) -> torch.Tensor:
    """Multiplier for each query row, on top of the model's own 1/sqrt(d).

    Args:
        config: the patch configuration (``config.scale`` must not be ``"none"``).
        n: visible-key counts, float, shape ``(B, 1, Tq)``; values below 1 (fully masked rows) count as 1.
        ssmax_slope: per-head slopes ``(H,)`` for ``scale="ssmax"``.

    Returns:
        ``(B, 1, Tq)`` for fixed laws, ``(B, H, Tq)`` for ssmax; float32.
    """
    if config.scale == "none":
        raise ValueError("No multiplier for scale='none'.")
    if config.scale in ("llama4", "ministral3"):
        n = n.float().clamp_min(1.0)
        steps = torch.floor((n if config.scale == "llama4" else n - 1) / config.train_length)
        mult = 1 + config.beta * torch.log1p(steps)
        return mult.clamp_min(1.0) if config.clamp else mult
    log_n = n.float().clamp_min(1.0).log()
    if config.scale == "ssmax":
        mult = ssmax_slope.float().view(1, -1, 1) * log_n
    else:
        mult = log_n / math.log(config.train_length)
        if config.scale == "gradmax":
            mult = mult.sqrt()
    return mult.clamp_min(1.0) if config.clamp else mult
