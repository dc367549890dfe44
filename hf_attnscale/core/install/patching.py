"""`patch` / `unpatch`: apply a config to one model instance, atomically and reversibly.

Patching a model, in named steps: resolve the config (the options, or the one saved in the model's config),
find the attention modules (`hf_attnscale.core.install.families`), build their states, fill in learned values saved
with the model, then install everything or nothing. What is installed on each attention module:

* a child module ``hfa`` (`AttnScaleState`): options and learnable parameters;
* ``module.config``: a `PatchedConfigView`, which routes its attention calls to the hfa wrapper;
* for RoPE decoders, a forward that lets a `SinkCache` run the attention step (`hf_attnscale.core.install.routing`);
  for families that bypass the AttentionInterface (RoFormer), their replacement forward.

On a model dispatched by accelerate (a ``device_map``, CPU or disk offload) the parameters live on each module's
execution device and a forward goes under the module's accelerate hook (`hf_attnscale.core.install.offload`).

The model's config records the patch under ``hf_attnscale``, so ``save_pretrained`` persists it; a task model
first gets a private copy of its config, so that models built from one config object keep separate records.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from hf_attnscale.core.call.backends import check_backend
from hf_attnscale.core.call.dispatch import PatchedConfigView, routed_config
from hf_attnscale.core.call.state import STATE_NAME, AttnScaleState, state_of
from hf_attnscale.core.install.families import (
    Rotary,
    Rule,
    attention_modules,
    gate_features,
    query_heads,
    rotary_for,
    rule_for,
    takes_position_embeddings,
)
from hf_attnscale.core.install.gate_hooks import has_gate_hooks, set_gate_hooks
from hf_attnscale.core.install.installed import get_config, patched_modules
from hf_attnscale.core.install.offload import (
    forward_slot,
    parameter_device,
    restore_forward,
    set_forward,
)
from hf_attnscale.core.install.parts import parts_rotaries
from hf_attnscale.core.install.rescaling import RotarySlot, own_rotary, put, rescaled, rotary_slots
from hf_attnscale.core.install.routing import ROTARY_ATTR, cache_routed_forward
from hf_attnscale.core.install.weights import CheckpointNotFound, read_tensors, safetensors_files
from hf_attnscale.core.install.wrappers import unwrap
from hf_attnscale.core.options.config import (
    CONFIG_KEY,
    AttnScaleConfig,
    checkpoint_dual_chunk,
    read_saved_config,
)
from hf_attnscale.core.options.methods import method_of

M = TypeVar("M", bound=nn.Module)
"""Where a patched RoPE attention module keeps ``(the model's rotary embedding, its layer type)``: in its
``__dict__``, not as a submodule, so the state dict is unchanged and ``deepcopy`` / ``.to()`` follow the model."""


def patch(model: M, *, config: AttnScaleConfig | None = None, **options: Any) -> M:
    """Change the attention of ``model`` (this instance only) and return it.

    With no options, applies the patch saved in ``model.config`` (after ``from_pretrained``), its learned
    parameters included, read from the checkpoint the model was loaded from (see `hfa.from_pretrained`,
    which also works when that folder has moved); with none saved, the Dual Chunk Attention the checkpoint's
    ``dual_chunk_attention_config`` asks for (Qwen2.5-1M's; with a one-line note), else the identity patch (what
    `SinkCache` streaming needs). Patching with the patch already in force changes nothing; another patch
    replaces it (it never stacks). The model is never left half-patched: on any error it stays as it was.
    Any wrapper is accepted (PEFT, DataParallel / DDP, torch.compile), and so is an inner model
    (``model.model``): the patch belongs to the attention modules, whichever object is passed. A model loaded
    with a ``device_map`` (layers on several devices, offloaded to CPU or disk) is patched the same way; one
    built under ``init_empty_weights`` takes the learnable options only once its weights are loaded.

    The options are `AttnScaleConfig`'s fields but ``version`` (``scale``, ``train_length``, ``zero_kv``... see it
    for each), by keyword, or one ``config=``; an unknown one is an error that lists them.

    Example:
        >>> hfa.patch(model, scale="logn", train_length=4096, zero_kv=True)
        >>> hfa.patch(model, rerope_window=2048, scale="logn", train_length=8192)  # ReRoPE + logn, past 8k
        >>> hfa.patch(model, rope_parameters={"rope_type": "yarn", "factor": 4.0})  # YaRN on a loaded model
        >>> hfa.patch(model, self_extend_group=4, self_extend_window=1024)  # Self-Extend
        >>> hfa.patch(model, dual_chunk_size=6144, dual_chunk_local=512)  # Dual Chunk Attention
        >>> hfa.patch(model, string_shift=8320, string_local=128)  # STRING
    """
    requested = AttnScaleConfig.from_options(**options)
    if config is not None and requested is not None:
        raise ValueError(
            "Pass either config= or the individual options (scale, train_length, ...), not both."
        )
    if config is not None and not isinstance(config, AttnScaleConfig):
        raise ValueError(f"config must be an hfa.AttnScaleConfig, got {type(config).__name__}.")
    apply(unwrap(model), requested or config)
    return model


def apply(root: nn.Module, requested: AttnScaleConfig | None, checkpoint: list[Path] | None = None) -> None:
    """Patch ``root`` with ``requested``, or with its saved patch when None (see `patch`).

    ``checkpoint``: the weight files the saved patch's learned values are read from (default: those of
    ``root.config._name_or_path``).
    """
    saved = read_saved_config(root.config)
    asked = None if requested or saved else checkpoint_dual_chunk(root.config)
    target = requested or saved or (asked[0] if asked else AttnScaleConfig())
    if get_config(root) == target and all(state_of(m) is not None for m in attention_modules(root)):
        return  # already in force: keep the live (possibly trained) parameters
    installation = _installation(root, target)
    if target == saved and installation.has_parameters:
        _fill_learned(root, installation, checkpoint, required=requested is None)
    _install(root, installation)
    if asked is not None:
        warnings.warn(asked[1], UserWarning, stacklevel=3)


@dataclass
class _Installation:
    """What `_install` puts on each attention module."""

    config: AttnScaleConfig
    rule: Rule
    modules: list[nn.Module]
    states: list[AttnScaleState]
    rotary: list[Rotary | None] = field(default_factory=list)
    rotaries: list[RotarySlot] = field(default_factory=list)  # the rotary embeddings to put in place

    @property
    def has_parameters(self) -> bool:
        return any(True for state in self.states for _ in state.parameters())


def _installation(root: nn.Module, config: AttnScaleConfig) -> _Installation:
    """Validate ``config`` for ``root`` and build fresh states; touches nothing on the model."""
    modules = attention_modules(root)
    rule = rule_for(root)
    held = [m._modules.get(STATE_NAME) for m in modules]
    if any(state is not None and not isinstance(state, AttnScaleState) for state in held):
        # PEFT's modules_to_save wraps the state; a new state would be neither trained nor saved with it.
        raise ValueError(
            "This model's patch state is held by PEFT (modules_to_save=['hfa']); patching it again would "
            "detach the parameters PEFT trains and saves. Patch the base model before get_peft_model, or "
            "load the adapter onto a freshly patched base with hfa.load_adapter."
        )
    missing = [
        type(m).__name__ for m in modules if getattr(m, "config", None) is None and rule.forward is None
    ]
    if missing:
        raise ValueError(f"Attention modules {sorted(set(missing))} have no config to route their calls by.")
    if config.has_exit and rule.no_exit:
        raise ValueError(f"zero_kv / sink_logit: {rule.no_exit}. Use the scale options alone.")
    # Where the exit can run is checked at each call, on its tensors' device: a model patched on the CPU may be
    # moved to a GPU before it runs.
    check_backend(root.config._attn_implementation)
    states = [_new_state(config, m, root.config) for m in modules]
    if config.rope_parameters is not None and not rotary_slots(root):
        raise ValueError(
            f"rope_parameters: {type(root).__name__} has no rotary embedding module for transformers to rebuild (no "
            "RoPE, or a rotation of its own): there is nothing to rescale."
        )
    rotaries = [
        (
            parent,
            name,
            own_rotary(module)
            if config.rope_parameters is None
            else rescaled(module, config.rope_parameters),
        )
        for parent, name, module in rotary_slots(root)
    ]
    new = {id(module): placed for (_, _, module), (_, _, placed) in zip(rotary_slots(root), rotaries)}
    rotary = [rotary_for(root, m) if takes_position_embeddings(m) else None for m in modules]
    rotary = [None if r is None else (new.get(id(r[0]), r[0]), r[1]) for r in rotary]
    if (method := method_of(config)) is not None:
        rotary = parts_rotaries(root, modules, rotary, method)
    return _Installation(config, rule, modules, states, rotary, rotaries)


def _new_state(config: AttnScaleConfig, module: nn.Module, model_config: Any) -> AttnScaleState:
    """A state whose parameters live where the module runs (`parameter_device`: its accelerate execution
    device, else its weights' device), in the module's dtype (float32 for half-precision models)."""
    gate = gate_features(module, model_config) if config.gate else None
    state = AttnScaleState(config, query_heads(module, model_config), gate)
    ref = next(module.parameters(), None)
    if ref is not None and any(True for _ in state.parameters()):
        dtype = ref.dtype if ref.dtype == torch.float64 else torch.float32
        state.to(device=parameter_device(module), dtype=dtype)
    return state


def _fill_learned(
    root: nn.Module, installation: _Installation, checkpoint: list[Path] | None, required: bool
) -> None:
    """Copy the saved patch's learned values into the new states; raise if they are required but missing."""
    names = {id(m): n for n, m in root.named_modules()}
    wanted = {
        f"{names[id(m)]}.{STATE_NAME}.{p}" if names[id(m)] else f"{STATE_NAME}.{p}": (state, p)
        for m, state in zip(installation.modules, installation.states)
        for p, _ in state.named_parameters()
    }
    try:
        files = checkpoint if checkpoint is not None else safetensors_files(root.config._name_or_path or "")
    except CheckpointNotFound as err:
        if not required:
            return  # the options were given explicitly: a fresh patch is what was asked for
        raise ValueError(
            f"This model's config records an hf_attnscale patch with learned parameters "
            f"({installation.config}), but they cannot be loaded: {err}. Load the model with "
            "hfa.from_pretrained(ModelClass, path), which reads them with the weights; or, to start from "
            "freshly initialised values, pass the options explicitly: hfa.patch(model, config=...)."
        ) from None
    learned = read_tensors(files, wanted)
    absent = sorted(k for k in wanted if k not in learned)
    if absent and required:
        raise ValueError(
            f"This model's config records an hf_attnscale patch with learned parameters ({installation.config}), but the "
            f"checkpoint lacks {len(absent)} of them (e.g. {absent[0]!r}); it was not saved from the patched model."
        )
    with torch.no_grad():
        for key, tensor in learned.items():
            if key in wanted:
                state, name = wanted[key]
                getattr(state, name).copy_(tensor)


def _install(root: nn.Module, installation: _Installation) -> None:
    """Put the planned states, config views and forwards on the modules: all of them, or none."""
    snapshot = _snapshot(root, installation.modules)
    try:
        record = _record_config(root)
        setattr(record, CONFIG_KEY, installation.config.to_dict())
        for slot in installation.rotaries:
            put(slot)
        for module, state, rotary in zip(installation.modules, installation.states, installation.rotary):
            module._modules[STATE_NAME] = state
            set_gate_hooks(module, installation.config.gate is not None)
            if installation.rule.forward is not None:
                set_forward(module, installation.rule.forward)
                continue
            module.config = routed_config(module.config)
            if takes_position_embeddings(module):
                set_forward(module, cache_routed_forward)
                module.__dict__[ROTARY_ATTR] = rotary
    except BaseException:
        _restore(root, snapshot)
        raise


def _record_config(root: nn.Module) -> Any:
    """The config object the patch is recorded in: ``root``'s own, made private first for a task model.

    A task model (``...ForCausalLM``) gets a private copy, so that models sharing one config object keep
    separate records. A base model (``model.model``) is recorded in place, so that the task model around it,
    which shares its config, saves the patch too.
    """
    shared = root.config
    is_task_model = getattr(root, "base_model", root) is not root
    already_private = getattr(shared, CONFIG_KEY, None) is not None and get_config(root) is not None
    if not is_task_model or already_private:
        return shared
    memo: dict[int, Any] = {}
    private = copy.deepcopy(shared, memo)
    for module in root.modules():
        held = module.__dict__.get("config")
        if isinstance(held, PatchedConfigView):
            held = held.model_config
            if id(held) in memo:
                object.__setattr__(module.config, "model_config", memo[id(held)])
        elif held is not None and id(held) in memo:
            module.config = memo[id(held)]
    return private


def _snapshot(root: nn.Module, modules: list[nn.Module]) -> dict[str, Any]:
    configs = {id(m): m.__dict__.get("config") for m in root.modules() if "config" in m.__dict__}
    return {
        "record": (root.config, copy.deepcopy(getattr(root.config, CONFIG_KEY, None))),
        "configs": configs,
        "rotaries": rotary_slots(root),
        "modules": [
            (
                m,
                m._modules.get(STATE_NAME),
                forward_slot(m),
                m.__dict__.get(forward_slot(m)),
                m.__dict__.get(ROTARY_ATTR),
                has_gate_hooks(m),
            )
            for m in modules
        ],
    }


def _restore(root: nn.Module, snapshot: dict[str, Any]) -> None:
    for module in root.modules():
        if id(module) in snapshot["configs"]:
            module.__dict__["config"] = snapshot["configs"][id(module)]
    for slot in snapshot["rotaries"]:
        put(slot)
    config, record = snapshot["record"]
    if record is None:
        config.__dict__.pop(CONFIG_KEY, None)
    else:
        setattr(config, CONFIG_KEY, record)
    for module, state, slot, forward, rotary, gated in snapshot["modules"]:
        set_gate_hooks(module, gated)
        _put(module._modules, STATE_NAME, state)
        _put(module.__dict__, slot, forward)
        _put(module.__dict__, ROTARY_ATTR, rotary)


def _put(mapping: dict, key: str, value: Any) -> None:
    if value is None:
        mapping.pop(key, None)
    else:
        mapping[key] = value


@contextlib.contextmanager
def patched(model: M, config: AttnScaleConfig | None) -> Iterator[M]:
    """Patch ``model`` with ``config`` (None: unpatch it) for the ``with`` block, then restore it exactly.

    Unlike `patch` followed by `unpatch`, everything comes back: an earlier patch and its trained
    parameters, the config object and the patch it records. Patching with the patch already in force
    changes nothing, so a trained patch runs as trained.

    Example:
        >>> with hfa.patched(model, hfa.AttnScaleConfig(scale="logn", train_length=4096)):
        ...     logits = model(ids).logits
    """
    root = unwrap(model)
    # Unpatching needs only the patched modules (an unsupported model has none); patching needs them all.
    modules = [m for _, m in patched_modules(root)] if config is None else attention_modules(root)
    snapshot = _snapshot(root, modules)
    try:
        if config is None:
            unpatch(root)
        else:
            apply(root, config)
        yield model
    finally:
        _restore(root, snapshot)


def unpatch(model: M) -> M:
    """Restore the model's original attention exactly (bitwise-equal outputs) and return it."""
    root = unwrap(model)
    modules = [m for _, m in patched_modules(root)]
    for module in modules:
        if isinstance(module.__dict__.get("config"), PatchedConfigView):
            module.config = module.config.model_config
        restore_forward(module)
        set_gate_hooks(module, False)
        module._modules.pop(STATE_NAME, None)
        module.__dict__.pop(ROTARY_ATTR, None)
    for parent, name, rotary in rotary_slots(root):
        put((parent, name, own_rotary(rotary)))
    if modules:
        root.config.__dict__.pop(CONFIG_KEY, None)
    return model
