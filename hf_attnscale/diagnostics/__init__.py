"""Diagnostics on any supported model, patched or not: what its attention and activations look like.

* `attention_statistics`: per layer, head and query, the entropy of the attention distribution, the mass on
  the first tokens (the sink detector), the size of the softmax gradient, and the mass on the exit;
* `activation_outliers`: kurtosis and largest magnitude of the attention blocks' outputs and hidden states;
* `fake_quantized`: the model's linear layers in simulated W8A8, to measure what the outliers cost.

The first two return tensors and draw a plot, and `layer_table` sets them side by side, a row per layer;
``hf-attnscale diagnose`` runs them on a model and text from the CLI.
"""

from .attention import AttentionStatistics, attention_statistics
from .outliers import OutlierStatistics, activation_outliers
from .quantization import fake_quantized
from .table import layer_table

__all__ = [
    "AttentionStatistics",
    "OutlierStatistics",
    "activation_outliers",
    "attention_statistics",
    "fake_quantized",
    "layer_table",
]
