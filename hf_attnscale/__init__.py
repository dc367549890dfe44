"""hf_attnscale: length-extrapolating attention for HuggingFace transformers.

>>> import hf_attnscale as hfa
>>> hfa.patch(model, scale="logn", train_length=4096, zero_kv=True)

The package in layers, each importing only the ones below it in this list:

* `hf_attnscale.cli`, `hf_attnscale.training`: the command line, and the trainers of the shipped models;
* `hf_attnscale.integrations`: PEFT fine-tuning and the lm-eval harness;
* `hf_attnscale.diagnostics`: attention entropy, sink mass, softmax gradients, activation outliers;
* `hf_attnscale.evaluation`: perplexity, the length sweep, encoders' MLM measures, the corpus;
* `hf_attnscale.streaming`: StreamingLLM's `SinkCache` and its pos-shift step;
* `hf_attnscale.checkpoints`: getting a model (``hfa.from_pretrained``, ``hfa.fetch``: folders, Hub ids, GGUF
  files, the real checkpoints from the package registry);
* `hf_attnscale.core`: the patch itself (options, laws, the attention function, discovery, patching).

The public API is declared once, in ``__init__.pyi``: type checkers read it, and lazy_loader imports each name
on first use, so that ``import hf_attnscale`` (and the command line's ``--help``) does not pay for torch and
transformers until something needs them.
"""

from __future__ import annotations

import lazy_loader

from .core.compat import check_transformers

check_transformers()  # first: an unsupported transformers is one line here, not an ImportError later

__version__ = "0.1.0"

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
# A star import needs no extra: HFAttnScaleLM needs lm-eval (pip install "hf_attnscale[eval]").
__all__ = [name for name in __all__ if name != "HFAttnScaleLM"]
