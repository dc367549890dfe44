"""StreamingLLM pos-shift attention forward (placeholder until the SinkCache lands)."""

from torch import nn


def install_streaming_forward(module: nn.Module, model: nn.Module) -> None:
    """Route calls that carry a `SinkCache` through the pos-shift forward (not yet implemented)."""
