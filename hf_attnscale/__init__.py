"""hf_attnscale: length-extrapolating attention for HuggingFace transformers.

>>> import hf_attnscale as hfa
>>> hfa.patch(model, scale="logn", train_length=4096, zero_kv=True)

The package in layers, each importing only the ones below it in this list:

* `hf_attnscale.cli`, `hf_attnscale.training`: the command line, and the trainers of the shipped models;
* `hf_attnscale.integrations`: PEFT fine-tuning and the lm-eval harness;
* `hf_attnscale.diagnostics`: attention entropy, sink mass, softmax gradients, activation outliers;
* `hf_attnscale.evaluation`: perplexity, the length sweep, encoders' MLM measures, corpus and models (and
  `fetch`, the real checkpoints from the package registry);
* `hf_attnscale.streaming`: StreamingLLM's `SinkCache` and its pos-shift step;
* `hf_attnscale.core`: the patch itself (options, laws, the attention function, discovery, patching).

The public names below are imported on first use, so that ``import hf_attnscale`` (and the command line's
``--help``) does not pay for torch and transformers until something needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .core.compat import check_transformers

check_transformers()  # first: an unsupported transformers is one line here, not an ImportError later

__version__ = "0.1.0"

_EXPORTS = {
    "AttnScaleConfig": "core.config",
    "supported_model_types": "core.families",
    "from_pretrained": "core.loading",
    "patch": "core.patching",
    "patched": "core.patching",
    "unpatch": "core.patching",
    "get_config": "core.state",
    "PerplexityResult": "evaluation.perplexity",
    "perplexity": "evaluation.perplexity",
    "SweepResult": "evaluation.report",
    "sweep": "evaluation.sweep",
    "Variant": "evaluation.variants",
    "fetch": "evaluation.real_checkpoints",
    "adapter_patch_config": "integrations.peft_adapters",
    "load_adapter": "integrations.peft_adapters",
    "lora_config": "integrations.peft_adapters",
    "trainable_parameters": "integrations.peft_adapters",
    "SinkCache": "streaming.cache",
}
# Needs lm-eval, so it is not in __all__ (a star import would need it).
_OPTIONAL = {"HFAttnScaleLM": "integrations.lm_eval_harness"}
__all__ = [  # the names of _EXPORTS, spelt out for tools that read __all__
    "AttnScaleConfig",
    "PerplexityResult",
    "SinkCache",
    "SweepResult",
    "Variant",
    "adapter_patch_config",
    "fetch",
    "from_pretrained",
    "get_config",
    "load_adapter",
    "lora_config",
    "patch",
    "patched",
    "perplexity",
    "supported_model_types",
    "sweep",
    "trainable_parameters",
    "unpatch",
]

if TYPE_CHECKING:
    from .core.config import AttnScaleConfig
    from .core.families import supported_model_types
    from .core.loading import from_pretrained
    from .core.patching import patch, patched, unpatch
    from .core.state import get_config
    from .evaluation.perplexity import PerplexityResult, perplexity
    from .evaluation.real_checkpoints import fetch
    from .evaluation.report import SweepResult
    from .evaluation.sweep import sweep
    from .evaluation.variants import Variant
    from .integrations.peft_adapters import (
        adapter_patch_config,
        load_adapter,
        lora_config,
        trainable_parameters,
    )
    from .streaming.cache import SinkCache


_SUBPACKAGES = ("cli", "core", "diagnostics", "evaluation", "integrations", "streaming", "training")


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)
    module = _EXPORTS.get(name) or _OPTIONAL.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_OPTIONAL})
