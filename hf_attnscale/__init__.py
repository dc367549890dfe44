"""hf_attnscale: length-extrapolating attention for HuggingFace transformers.

>>> import hf_attnscale as hfa
>>> hfa.patch(model, scale="logn", train_length=4096, zero_kv=True)
"""

from .cache import SinkCache
from .config import AttnScaleConfig
from .families import supported_model_types
from .patching import get_config, patch, unpatch
from .perplexity import PerplexityResult, perplexity

__all__ = [
    "AttnScaleConfig",
    "PerplexityResult",
    "SinkCache",
    "get_config",
    "patch",
    "perplexity",
    "supported_model_types",
    "unpatch",
]
__version__ = "0.1.0"
