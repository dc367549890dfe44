"""hf_attnscale: length-extrapolating attention for HuggingFace transformers.

>>> import hf_attnscale as hfa
>>> hfa.patch(model, scale="logn", train_length=4096, zero_kv=True)
"""

from .cache import SinkCache
from .config import AttnScaleConfig
from .evaluate import SweepResult, Variant, sweep
from .families import supported_model_types
from .finetune import adapter_patch_config, load_adapter, lora_config, trainable_parameters
from .patching import get_config, patch, unpatch
from .perplexity import PerplexityResult, perplexity

__all__ = [
    "AttnScaleConfig",
    "PerplexityResult",
    "SinkCache",
    "SweepResult",
    "Variant",
    "adapter_patch_config",
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
        from .lm_eval import HFAttnScaleLM

        return HFAttnScaleLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
