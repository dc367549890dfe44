# The public API, declared once: type checkers read it, and __init__.py (lazy_loader) imports each name on first
# use. "X as X" marks a re-export.
from . import (
    checkpoints as checkpoints,
    cli as cli,
    core as core,
    diagnostics as diagnostics,
    evaluation as evaluation,
    integrations as integrations,
    streaming as streaming,
    training as training,
)
from .checkpoints.loading import fetch as fetch, from_pretrained as from_pretrained
from .core.install.families import supported_model_types as supported_model_types
from .core.install.installed import get_config as get_config
from .core.install.patching import patch as patch, patched as patched, unpatch as unpatch
from .core.options.config import AttnScaleConfig as AttnScaleConfig
from .evaluation.passkey import (
    Passkey as Passkey,
    Recall as Recall,
    passkey_prompts as passkey_prompts,
    passkey_recall as passkey_recall,
)
from .evaluation.perplexity import PerplexityResult as PerplexityResult, perplexity as perplexity
from .evaluation.report import SweepResult as SweepResult
from .evaluation.sweep import sweep as sweep
from .evaluation.variants import Variant as Variant
from .integrations.lm_eval_model import HFAttnScaleLM as HFAttnScaleLM
from .integrations.peft_adapters import (
    adapter_patch_config as adapter_patch_config,
    load_adapter as load_adapter,
    lora_config as lora_config,
    trainable_parameters as trainable_parameters,
)
from .integrations.pose import PoSECollator as PoSECollator, pose_position_ids as pose_position_ids
from .streaming.cache import SinkCache as SinkCache

__version__: str
__all__: list[str]
