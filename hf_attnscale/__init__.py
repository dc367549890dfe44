"""hf_attnscale: length-extrapolating attention for HuggingFace transformers.

>>> import hf_attnscale as hfa
>>> hfa.patch(model, scale="logn", train_length=4096, zero_kv=True)

The package in layers, each importing only the ones above it in this list:

* `hf_attnscale.core`: the patch itself (options, laws, the attention function, discovery, patching);
* `hf_attnscale.streaming`: StreamingLLM's `SinkCache` and its pos-shift step;
* `hf_attnscale.evaluation`: perplexity, the length sweep, encoders' MLM measures, corpus and models;
* `hf_attnscale.diagnostics`: attention entropy, sink mass, softmax gradients, activation outliers;
* `hf_attnscale.integrations`: PEFT and lm-eval; `hf_attnscale.training`: the trainers; `hf_attnscale.cli`.
"""

from .core.config import AttnScaleConfig
from .core.families import supported_model_types
from .core.loading import from_pretrained
from .core.patching import patch, unpatch
from .core.state import get_config
from .evaluation.perplexity import PerplexityResult, perplexity
from .evaluation.report import SweepResult
from .evaluation.sweep import sweep
from .evaluation.variants import Variant
from .integrations.peft_adapters import adapter_patch_config, load_adapter, lora_config, trainable_parameters
from .streaming.cache import SinkCache

__all__ = [
    "AttnScaleConfig",
    "PerplexityResult",
    "SinkCache",
    "SweepResult",
    "Variant",
    "adapter_patch_config",
    "from_pretrained",
    "get_config",
    "load_adapter",
    "lora_config",
    "patch",
    "perplexity",
    "supported_model_types",
    "sweep",
    "trainable_parameters",
    "unpatch",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The lm-eval model type is imported on first use, so `import hf_attnscale` works without lm-eval. It is
    # left out of __all__ for the same reason (a star import would need lm-eval).
    if name == "HFAttnScaleLM":
        from .integrations.lm_eval_harness import HFAttnScaleLM

        return HFAttnScaleLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
