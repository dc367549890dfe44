"""PEFT fine-tuning of patched models: LoRA on the attention projections, the patch's own parameters
(learnable sink logits, SSMax slopes, clip bounds, gates) trained and saved alongside, and adapters that remember
their patch.

    >>> hfa.patch(model, scale="logn", train_length=256, sink_logit="learnable")
    >>> peft_model = peft.get_peft_model(model, hfa.lora_config(model, r=8))
    >>> ...train...; peft_model.save_pretrained("adapter")   # also writes adapter/attn_scale.json
    >>> peft_model = hfa.load_adapter(fresh_base_model, "adapter")  # patches it as saved, then loads

What each patch option means for fine-tuning:

=================================  ===========================================================================
``sink_logit="learnable"``         per-head sink logits (``hfa.sink``), trained and saved with the adapter
``scale="ssmax"``                  per-head SSMax slopes (``hfa.ssmax``), trained and saved with the adapter
``clipped_softmax="learnable"``    per-head clip bounds (``hfa.clip_gamma``, ``hfa.clip_zeta``), likewise
``gate="head"`` / ``"element"``    the gate's projection (``hfa.output_gate``), likewise; it starts at 1
the other scales                   no parameters: a fixed function of n; LoRA adapts the model around it
``zero_kv`` / a float sink         no parameters: a fixed exit
=================================  ===========================================================================

``lora_config(model, train_patch=False)`` freezes the patch's parameters. Whatever the options, the adapter
records them (``attn_scale.json``), and `load_adapter` refuses a model patched differently.

The patch state of an attention module is its child module ``hfa`` (`AttnScaleState`), so PEFT trains and
saves it through ``modules_to_save=["hfa"]``: PEFT swaps the child for a ``ModulesToSaveWrapper`` whose
attribute reads fall through to the active copy, which the attention function uses unchanged.
``merge_and_unload()`` puts the trained copy back as a plain `AttnScaleState`, so the merged model stays
patched, and ``save_pretrained`` + ``hfa.patch(from_pretrained(...))`` restore it with its learned values.
Gradient checkpointing, bf16 autocast, torch.compile, DDP and FSDP2 work (tests/integrations/test_peft_adapters.py,
tests/training/test_distributed.py; examples/DISTRIBUTED.md).

peft is imported lazily, so ``import hf_attnscale`` works without it.
"""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from hf_attnscale.checkpoints.models import head_kind
from hf_attnscale.core.call.resident import is_offloaded
from hf_attnscale.core.call.state import STATE_NAME, active_state
from hf_attnscale.core.install.families import attention_modules
from hf_attnscale.core.install.installed import get_config
from hf_attnscale.core.install.patching import patch
from hf_attnscale.core.install.weights import is_local_path
from hf_attnscale.core.install.wrappers import unwrap
from hf_attnscale.core.options.config import AttnScaleConfig

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel

ADAPTER_PATCH_FILE = "attn_scale.json"
"""Written next to ``adapter_config.json``: the patch the adapter was trained under."""

# A model's head (`head_kind`) -> PEFT task type, so the PEFT wrapper matches the model (labels, generate, ...).
_TASK_TYPES = {
    "causal": "CAUSAL_LM",
    "sequence-classification": "SEQ_CLS",
    "token-classification": "TOKEN_CLS",
    "question-answering": "QUESTION_ANS",
    "base": "FEATURE_EXTRACTION",
}


def trainable_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Yield ``(name, parameter)`` for the patch's own parameters that are in force on ``model``.

    These are the per-head learnable sink logits (``...hfa.sink``), SSMax slopes (``...hfa.ssmax``), clip
    bounds (``...hfa.clip_gamma``, ``...hfa.clip_zeta``) and gates (``...hfa.output_gate``). On a PEFT model
    they are the copies of the active adapter (``...hfa.modules_to_save.<adapter>.sink``): the ones the forward
    uses and the optimizer should update. Yields nothing when the patch has no parameters.
    """
    for name, module in model.named_modules():
        child = module._modules.get(STATE_NAME)
        state = active_state(child)
        if state is None:
            continue
        prefix = f"{name}.{STATE_NAME}" if name else STATE_NAME
        inner = next(n for n, m in child.named_modules() if m is state)
        yield from state.named_parameters(prefix=f"{prefix}.{inner}" if inner else prefix)


def attention_projections(model: nn.Module) -> list[str]:
    """LoRA ``target_modules`` naming the linear projections of every patched attention block.

    The block is the family's attention module, or its parent when that is an ``...Attention`` wrapper (BERT's
    ``attention.self`` + ``attention.output.dense``). Names keep the block's own name as a prefix
    (``self_attn.q_proj``, ``attention.self.query``) so that no other ``dense`` or ``query`` layer matches.
    """
    base = unwrap(model)
    names = {id(m): n for n, m in base.named_modules()}
    targets: set[str] = set()
    for module in attention_modules(base):
        name = names[id(module)]
        parent_name = name.rpartition(".")[0]
        parent = base.get_submodule(parent_name)
        block, block_name = (
            (parent, parent_name) if type(parent).__name__.endswith("Attention") else (module, name)
        )
        short = block_name.rpartition(".")[2]
        for sub_name, sub in block.named_modules():
            parts = sub_name.split(".")
            if STATE_NAME in parts or "base_layer" in parts or any(p.startswith("lora_") for p in parts):
                continue  # the patch state, or the insides of a LoRA layer PEFT already put there
            if isinstance(getattr(sub, "base_layer", sub), nn.Linear):
                targets.add(f"{short}.{sub_name}")
    return sorted(targets)


def lora_config(
    model: nn.Module, *, train_patch: bool = True, long_context: bool = False, **lora_kwargs: Any
) -> LoraConfig:
    """A ``peft.LoraConfig`` for ``model`` that also trains and saves the patch's parameters.

    Defaults, each overridable through ``lora_kwargs``: ``target_modules`` = the attention projections
    (`attention_projections`), ``task_type`` from the model's head (``CAUSAL_LM`` for ``...ForCausalLM``).
    When the patch has parameters (``sink_logit="learnable"``, ``scale="ssmax"``,
    ``clipped_softmax="learnable"``, ``gate=``) and ``train_patch`` is True,
    ``"hfa"`` is added to ``modules_to_save``. With ``long_context``, LongLoRA's LoRA+ (Chen et al. 2024: LoRA
    alone does not learn a longer context): the input embeddings and every normalization layer are trained and
    saved too (`long_context_modules`, added to ``modules_to_save``), tied output embeddings kept tied
    (PEFT's ``ensure_weight_tying``). The returned config records the patch in force (None for an unpatched
    model); ``PeftModel.save_pretrained`` then writes it to ``attn_scale.json`` beside the adapter, and
    `load_adapter` checks it.

    Example:
        >>> peft_model = peft.get_peft_model(model, hfa.lora_config(model, r=8, lora_alpha=16))
    """
    base = unwrap(model)
    patch_config = get_config(base)
    kwargs = dict(lora_kwargs)
    if "target_modules" not in kwargs and "layers_to_transform" not in kwargs:
        _check_not_offloaded(base)
    kwargs.setdefault("target_modules", attention_projections(base))
    task_type = _task_type(base)
    if task_type is not None:
        kwargs.setdefault("task_type", task_type)
    saved = list(kwargs.get("modules_to_save") or [])
    if train_patch and any(True for _ in trainable_parameters(base)):
        saved.append(STATE_NAME)
    if long_context:
        saved += long_context_modules(base)
        if getattr(base.config.get_text_config(), "tie_word_embeddings", False):
            kwargs.setdefault("ensure_weight_tying", True)
    if saved:
        kwargs["modules_to_save"] = list(dict.fromkeys(saved))
    config = _lora_config_class()(**kwargs)
    config.attn_scale = None if patch_config is None else patch_config.to_dict()
    return config


def long_context_modules(model: nn.Module) -> list[str]:
    """The names PEFT's ``modules_to_save`` takes for LongLoRA's LoRA+: the input embeddings' and every
    normalization layer's (a module whose class name holds ``Norm``), each as its last name component."""
    names = {id(m): n for n, m in model.named_modules()}
    embeddings = model.get_input_embeddings()
    found = [names[id(embeddings)].rpartition(".")[2]]
    found += [n.rpartition(".")[2] for n, m in model.named_modules() if "Norm" in type(m).__name__ and n]
    return list(dict.fromkeys(found))


def _check_not_offloaded(model: nn.Module) -> None:
    """Refuse LoRA on attention layers that accelerate offloads: PEFT would create their weights on meta."""
    names = {id(m): n for n, m in model.named_modules()}
    offloaded = [
        names[id(m)] for m in attention_modules(model) if any(is_offloaded(sub) for sub in m.modules())
    ]
    if offloaded:
        raise ValueError(
            f"accelerate offloads {len(offloaded)} attention layers of this model to CPU or disk (e.g. "
            f"{offloaded[0]}); PEFT would create their LoRA weights on the meta device, where they cannot train. "
            "Pass layers_to_transform=[...] naming the layers kept on a device (the patch's parameters still "
            "train on every layer), or load the model without offloading."
        )


def _task_type(model: nn.Module) -> str | None:
    return _TASK_TYPES.get(head_kind(type(model).__name__))


@functools.cache
def _lora_config_class() -> type:
    """`AttnScaleLoraConfig`, built on first use so that peft is only imported when needed."""
    from peft import LoraConfig  # optional dependency (hf_attnscale[peft]): imported on use

    class AttnScaleLoraConfig(LoraConfig):
        """A ``LoraConfig`` that remembers the attention patch and saves it as ``attn_scale.json``.

        ``attn_scale`` is a plain attribute, not a dataclass field, so ``adapter_config.json`` stays a vanilla
        LoRA config that any PEFT version loads without warnings.
        """

        attn_scale: dict[str, Any] | None = None

        def save_pretrained(self, save_directory: str, **kwargs: Any) -> None:
            super().save_pretrained(save_directory, **kwargs)
            save_patch_config(save_directory, self.attn_scale)

    # Picklable by name (hf_attnscale.integrations.peft_adapters.AttnScaleLoraConfig, served by the module
    # __getattr__).
    AttnScaleLoraConfig.__module__ = __name__
    AttnScaleLoraConfig.__qualname__ = "AttnScaleLoraConfig"
    globals()["AttnScaleLoraConfig"] = AttnScaleLoraConfig
    return AttnScaleLoraConfig


def __getattr__(name: str) -> Any:
    if name == "AttnScaleLoraConfig":
        return _lora_config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def save_patch_config(directory: str | Path, attn_scale: AttnScaleConfig | dict | None) -> None:
    """Write ``attn_scale.json`` (the patch an adapter was trained under; None = unpatched) to ``directory``."""
    if isinstance(attn_scale, AttnScaleConfig):
        attn_scale = attn_scale.to_dict()
    path = Path(directory) / ADAPTER_PATCH_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"attn_scale": attn_scale}, indent=2, sort_keys=True) + "\n")


def adapter_patch_config(path: str | Path) -> AttnScaleConfig | None:
    """The patch an adapter directory was trained under (None: trained unpatched).

    Raises FileNotFoundError when ``path`` has no ``attn_scale.json`` (the adapter was not configured with
    `lora_config`, or ``path`` is not a local directory).
    """
    file = Path(path) / ADAPTER_PATCH_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"No {ADAPTER_PATCH_FILE} in {path}: this adapter does not record its attention patch (it was not "
            f"built with hfa.lora_config, or {path} is not a local adapter directory)."
        )
    data = json.loads(file.read_text())["attn_scale"]
    return None if data is None else AttnScaleConfig.from_dict(data)


def check_adapter_path(path: str | None) -> None:
    """Refuse, in one line, an adapter named as a local folder that holds no PEFT adapter
    (``adapter_config.json``), before any model loads; None and a Hub id pass (PEFT fetches it)."""
    if path is None:
        return
    if not isinstance(path, str) or not path:
        raise ValueError(f"peft= takes an adapter's folder or Hub id, got {path!r}.")
    folder = Path(path).expanduser()
    if (is_local_path(path) or folder.exists()) and not (folder / "adapter_config.json").is_file():
        what = "does not exist" if not folder.exists() else "has no adapter_config.json"
        raise ValueError(
            f"peft={path!r} {what}; pass the folder PeftModel.save_pretrained wrote, or a Hub id."
        )


def load_adapter(
    model: nn.Module,
    path: str | Path,
    adapter_name: str = "default",
    *,
    is_trainable: bool = False,
    strict: bool = True,
    **peft_kwargs: Any,
) -> PeftModel:
    """Load a LoRA adapter saved from a patched model onto ``model``, with the patch it was trained under.

    An unpatched ``model`` is first patched with the adapter's saved config (the patch's learned parameters then
    come from the adapter). ``is_trainable``: load the adapter to train it further (PEFT's own; default
    inference mode). A ``model`` patched differently from the adapter is refused with ValueError
    (``strict=False``: a warning). A ``PeftModel`` gets ``adapter_name`` added. Other keyword arguments go to
    ``PeftModel.from_pretrained``.

    Plain ``PeftModel.from_pretrained`` loads the same files but cannot check the patch: call
    ``hfa.patch(model, config=hfa.adapter_patch_config(path))`` on the base model first.
    """
    from peft import LoraConfig, PeftConfig, PeftModel  # optional dependency, imported on use

    try:
        saved = adapter_patch_config(path)
    except FileNotFoundError as err:
        _mismatch(f"{err} The patch of the model it is loaded onto cannot be checked.", strict=False)
        saved = current = get_config(model)
    else:
        current = get_config(model)
    if current is None and saved is not None:
        patch(model, config=saved)
    elif current != saved:
        _mismatch(
            f"The adapter at {path} was trained with the attention patch {_describe(saved)}, but the model "
            f"it is loaded onto has {_describe(current)}; its outputs would not be the ones the adapter was "
            f"trained for. Load it onto the base model unpatched (load_adapter then patches it as saved), or "
            f"call hfa.patch(model, config=hfa.adapter_patch_config(path)) first"
            + (" (hfa.unpatch(model) for an adapter trained unpatched)." if saved is None else "."),
            strict=strict,
        )

    peft_config = PeftConfig.from_pretrained(str(path))
    if isinstance(peft_config, LoraConfig):  # keep the record, so that saving again writes attn_scale.json
        peft_config = _as_attn_scale_config(peft_config, get_config(model))
    if isinstance(model, PeftModel):
        peft_config.inference_mode = not is_trainable
        model.load_adapter(str(path), adapter_name, is_trainable=is_trainable, **peft_kwargs)
        model.peft_config[adapter_name] = peft_config
        return model
    return PeftModel.from_pretrained(
        model, str(path), adapter_name, is_trainable=is_trainable, config=peft_config, **peft_kwargs
    )


def _as_attn_scale_config(config: LoraConfig, patch_config: AttnScaleConfig | None) -> LoraConfig:
    cls = _lora_config_class()
    converted = cls.__new__(cls)
    converted.__dict__.update(config.__dict__)
    converted.attn_scale = None if patch_config is None else patch_config.to_dict()
    return converted


def _describe(config: AttnScaleConfig | None) -> str:
    return "none (unpatched)" if config is None else repr(config)


def _mismatch(message: str, *, strict: bool) -> None:
    if strict:
        raise ValueError(message)
    warnings.warn(message, UserWarning, stacklevel=3)
