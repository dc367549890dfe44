"""Models to evaluate: the shipped checkpoint, the real checkpoints, and a user's model (a folder, a Hub id or a
GGUF file), with its saved patch.

The shipped checkpoint is trained by this repo (`hf_attnscale.training.lm`; see ``benchmarks/PRETRAIN.md``)
and ships inside the package, so demos and tests run offline. The real checkpoints (``smollm2-135m``,
``gemma3-270m``, ``minilm-l6``) come from the package registry (`hf_attnscale.checkpoints.real`).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import huggingface_hub
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MASKED_LM_MAPPING
from transformers.utils import cached_file

from hf_attnscale.core.install.weights import is_local_path

from .loading import fetch, from_pretrained
from .real import REAL_CHECKPOINTS, check_gguf_file, real_checkpoint_name

DEFAULT_MODEL_NAME = "tiny-llama-stdlib"
DEFAULT_MODEL = f"builtin:{DEFAULT_MODEL_NAME}"
"""Name of the shipped checkpoint wherever a model path or Hub id is taken."""
PRETRAIN_COMMAND = "see benchmarks/PRETRAIN.md (python -m hf_attnscale.training.lm ...)"
HUB_PROBE_SECONDS = 3


def default_model_path() -> Path:
    """Directory of the shipped checkpoint (it may be missing from a stripped install)."""
    return Path(__file__).resolve().parents[1] / "assets" / DEFAULT_MODEL_NAME


def resolve_model_path(name: str, *, progress: bool = True) -> str:
    """A model name as the commands take it -> what ``from_pretrained`` takes.

    ``builtin:tiny-llama-stdlib`` -> the shipped checkpoint's directory; the name of a real checkpoint
    (`hf_attnscale.checkpoints.real.real_checkpoint_name`: ``smollm2-135m``, also ``smollm2-135M``) -> its
    folder in the cache, fetched first if it is not there yet
    (`hf_attnscale.checkpoints.loading.fetch`, with progress bars unless ``progress`` is False);
    anything else (a path, a Hub id) unchanged. A local folder that has one of those names is named
    ``./smollm2-135m``.

    Raises:
        ValueError: an unknown ``builtin:`` name, or a near miss of a real checkpoint's name (the message
            lists the known names).
        FetchError: a real checkpoint could not be fetched (the registry unreachable, a corrupt download).
    """
    real = real_checkpoint_name(name)
    if real is not None:
        return str(fetch(real, progress=progress))
    if not name.startswith("builtin:"):
        return name
    if name != DEFAULT_MODEL:
        raise ValueError(f"Unknown built-in model {name!r}; the shipped one is {DEFAULT_MODEL!r}.")
    return str(default_model_path())


def load_default_model(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the shipped model (in eval mode) and its tokenizer from disk, never from the network."""
    path = default_model_path()
    missing = [
        name for name in ("config.json", "model.safetensors", "tokenizer.json") if not (path / name).is_file()
    ]
    if missing:
        raise FileNotFoundError(
            f"The shipped checkpoint at {path} lacks {', '.join(missing)}. Recreate it from a source "
            f"checkout: {PRETRAIN_COMMAND}"
        )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = from_pretrained(AutoModelForCausalLM, str(path), dtype=dtype, local_files_only=True).to(device)
    return model.eval(), tokenizer


HEAD_KINDS = {
    "ForCausalLM": "causal",
    "LMHeadModel": "causal",
    "ForMaskedLM": "masked",
    "ForPreTraining": "pretraining",
    "ForConditionalGeneration": "conditional-generation",
    "ForSequenceClassification": "sequence-classification",
    "ForTokenClassification": "token-classification",
    "ForQuestionAnswering": "question-answering",
    "Model": "base",  # last: "LMHeadModel" also ends so
}
"""How transformers names a model class by its head: the end of the class name -> the head."""


def head_kind(class_name: str) -> str | None:
    """The head that a model class's name (or a saved architecture) says it has, a value of `HEAD_KINDS`
    (``"causal"``, ``"masked"``, ``"base"``...); None where the name says nothing."""
    return next((kind for suffix, kind in HEAD_KINDS.items() if class_name.endswith(suffix)), None)


def has_lm_head(config: Any) -> bool:
    """Whether the saved model has its language-model head: False for a bare encoder saved as its base class
    (a sentence encoder such as all-MiniLM-L6-v2 is saved as ``BertModel``), whose head transformers would
    initialise at random. True when the config names no architecture."""
    architectures = getattr(config, "architectures", None) or []
    heads = {"causal", "masked", "pretraining", "conditional-generation"}
    return not architectures or any(head_kind(a) in heads for a in architectures)


def model_kind(config: Any) -> str:
    """``"causal"`` or ``"masked"``: which head a saved model is evaluated with.

    Read from the architecture it was saved as, else from whether transformers has a causal-LM or masked-LM
    head for its type (BERT-like types have both: ``is_decoder`` decides). Raises ValueError for anything else.
    """
    architectures = getattr(config, "architectures", None) or []
    for kind in ("causal", "masked"):
        if any(head_kind(a) == kind for a in architectures):
            return kind
    causal = type(config) in MODEL_FOR_CAUSAL_LM_MAPPING
    masked = type(config) in MODEL_FOR_MASKED_LM_MAPPING
    if causal and (not masked or getattr(config, "is_decoder", False)):
        return "causal"
    if masked:
        return "masked"
    raise ValueError(
        f"model_type {config.model_type!r} ({', '.join(architectures) or 'no saved architecture'}) is neither a "
        "causal nor a masked language model; hf-attnscale evaluates language models."
    )


def split_gguf(name: str, gguf_file: str | None = None) -> tuple[str, str | None]:
    """(folder or Hub id, GGUF file name or None) of a model named with or without a GGUF file.

    A path to a ``.gguf`` file, as ``name`` (with no ``gguf_file``) or as ``gguf_file``, is split into its
    folder and file name; a bare ``gguf_file`` name is a file inside ``name`` (a folder or a Hub repo).
    """
    if gguf_file is None:
        path = Path(name).expanduser()
        if name.endswith(".gguf") and path.is_file():
            return str(path.parent), path.name
        return name, None
    path = Path(gguf_file).expanduser()
    if path.name != gguf_file and path.is_file():
        return str(path.parent), path.name
    return name, gguf_file


def load_model(
    name: str,
    device: torch.device,
    dtype: Any,
    attn_implementation: str = "sdpa",
    gguf_file: str | None = None,
    *,
    progress: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """A language model (in eval mode, on ``device``, with the patch saved with it), its tokenizer and kind.

    ``name`` is anything `resolve_model_path` takes (a folder, a Hub id, the shipped model, a real checkpoint's
    name), or a path to a ``.gguf`` file. ``gguf_file`` names a GGUF file in that folder or Hub repo (or is a
    path to one); its weights are de-quantised (`hf_attnscale.from_pretrained`). ``progress``: progress bars
    while a real checkpoint is fetched. The kind is "causal" or
    "masked" (`model_kind`). Fails fast, saying why, when the model is neither a local directory nor in the
    Hugging Face cache and the Hub cannot be reached.

    Raises:
        FileNotFoundError: no such local directory or GGUF file, or the Hub cannot provide it (offline,
            unknown id).
        ValueError: not a language model, an attention backend that cannot run here, a truncated GGUF file or
            one without the ``gguf`` package, or a near miss of a real checkpoint's name.
        FetchError: a real checkpoint could not be fetched.
    """
    name, gguf_file = split_gguf(name, gguf_file)
    source = checked_source(name, gguf_file, progress=progress)
    if gguf_file:  # checked before transformers reads it (a local file only)
        check_gguf_file(Path(source).expanduser() / gguf_file)
    gguf = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        config = AutoConfig.from_pretrained(source, **gguf)
        kind = model_kind(config)
        tokenizer = AutoTokenizer.from_pretrained(source, **gguf)
        model_class = AutoModelForCausalLM if kind == "causal" else AutoModelForMaskedLM
        model = from_pretrained(
            model_class, source, dtype=dtype, attn_implementation=attn_implementation, **gguf
        )
    except OSError as err:
        raise cannot_load(name, err) from err
    except ImportError as err:
        if gguf_file and "gguf" in str(err).lower():
            raise ValueError(
                f"Loading {gguf_file} needs the gguf package (pip install gguf): {err}"
            ) from None
        raise ValueError(
            f"attn_implementation={attn_implementation!r} cannot run here: {err} Use sdpa (or eager) instead."
        ) from None
    return model.to(device).eval(), tokenizer, kind


def checked_source(name: str, gguf_file: str | None = None, *, progress: bool = True) -> str:
    """What ``from_pretrained`` loads for a model named as the commands take it (after `split_gguf`): a local
    folder, or a Hub id that is cached or can be fetched. Checked before anything is loaded, so that a name
    that is nothing is one line at once, not a minute of Hub retries.

    `resolve_model_path` first (the shipped model, a real checkpoint fetched on first use). Then anything that
    cannot be a Hub id (a path starting with ``.``, ``/`` or ``~``, or with more than one ``/``) or that
    exists is a local folder, which must hold ``config.json`` (or ``gguf_file``); anything else is a Hub id,
    which must be in the Hugging Face cache or the Hub must be usable (`_check_hub_reachable`: not with
    ``HF_HUB_OFFLINE``, nor where the Hub does not answer within a few seconds). A Hub id that the Hub does not
    have is left to the loader, whose OSError `cannot_load` words in one line.

    Raises:
        FileNotFoundError: no such local folder (or it lacks the file), or an uncached Hub id while the Hub is
            off or unreachable.
        ValueError: a near miss of a real checkpoint's name, or an unknown ``builtin:`` name.
        FetchError: a real checkpoint could not be fetched.
    """
    resolved = resolve_model_path(name, progress=progress)
    path = Path(resolved).expanduser()
    looks_local = is_local_path(resolved)  # never sent to the Hub
    needed = gguf_file or "config.json"
    if looks_local and not (path / needed).is_file():
        what = "does not exist" if not path.exists() else f"has no {needed}"
        raise FileNotFoundError(
            f"Model directory {resolved!r} {what}; pass a saved model directory, a Hub id or a GGUF file."
        )
    if looks_local:
        return str(path)
    _check_hub_reachable(resolved, needed)
    return resolved


def cannot_load(name: str, err: OSError) -> FileNotFoundError:
    """The one-line error for a model that transformers could not load from ``name`` (its OSError, often
    several lines, joined into one)."""
    reason = " ".join(str(err).split())
    return FileNotFoundError(
        f"Cannot load model {name!r}: it is not a local directory or a real checkpoint's name "
        f"({', '.join(REAL_CHECKPOINTS)}), and the Hugging Face Hub could not provide it (offline, "
        f"private, or no such id). {reason}"
    )


def _check_hub_reachable(repo: str, filename: str = "config.json") -> None:
    """Fail fast for a Hub id that is not cached when the Hub is off (instead of retrying for a minute)."""
    if cached_file(repo, filename, local_files_only=True, _raise_exceptions_for_missing_entries=False):
        return
    reason = hub_unavailable()
    if reason is not None:
        raise FileNotFoundError(
            f"Model {repo!r} is not a local directory and is not in the Hugging Face cache, and the Hub cannot "
            f"be used: {reason}. Pass a saved model directory or a real checkpoint's name "
            f"({', '.join(REAL_CHECKPOINTS)}), or download the model where the Hub is reachable."
        )


def hub_unavailable() -> str | None:
    """Why the Hugging Face Hub cannot be used now (``HF_HUB_OFFLINE`` set, or no answer within
    `HUB_PROBE_SECONDS`), or None where it answers."""
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    endpoint = huggingface_hub.constants.ENDPOINT
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=HUB_PROBE_SECONDS)
    except urllib.error.HTTPError:
        pass  # the Hub answered
    except (OSError, ValueError) as err:
        return f"{endpoint} cannot be reached ({type(err).__name__})"
    return None
