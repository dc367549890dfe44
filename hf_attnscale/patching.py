"""`patch` / `unpatch` / `get_config`: apply a config to one model instance, atomically and reversibly."""

from __future__ import annotations

import copy
import json
import types
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from .attention import STATE_NAME, AttnScaleState, backend_name, inner_backend, register_backend
from .config import CONFIG_KEY, AttnScaleConfig, ScaleName, SinkLogit, read_saved_config
from .families import attention_modules, family_for

M = TypeVar("M", bound=nn.Module)
SUPPORTED_BACKENDS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper, or the model itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _own_config(model: nn.Module) -> None:
    """Give ``model`` a private config object, so patching it never touches a model that shares the config."""
    shared = model.config
    private = copy.deepcopy(shared)
    for module in model.modules():
        if getattr(module, "config", None) is shared:
            module.config = private


def patch(
    model: M,
    scale: ScaleName | None = None,
    train_length: int | None = None,
    clamp: bool | None = None,
    zero_kv: bool | None = None,
    sink_logit: SinkLogit = None,
    *,
    config: AttnScaleConfig | None = None,
) -> M:
    """Change the attention of ``model`` (this instance only) and return it.

    With no options, re-applies the config saved in ``model.config`` (after ``from_pretrained``), including
    learned sink/SSMax parameters found in the checkpoint; with none saved, installs an identity patch
    (useful for `SinkCache` streaming). Patching again reconfigures; it never stacks. The model is never
    left half-patched: on any error it is restored as it was.

    Example:
        >>> hfa.patch(model, scale="logn", train_length=4096, zero_kv=True)
    """
    requested = AttnScaleConfig.from_options(
        scale=scale, train_length=train_length, clamp=clamp, zero_kv=zero_kv, sink_logit=sink_logit
    )
    if config is not None and requested is not None:
        raise ValueError(
            "Pass either config= or the individual options (scale, train_length, ...), not both."
        )
    base = _base_model(model)
    reload_saved = config is None and requested is None
    if config is None:
        config = requested or read_saved_config(base.config) or AttnScaleConfig()

    family = family_for(base.config.model_type)
    modules = attention_modules(base, family)
    if not modules:
        raise ValueError(
            f"No attention modules of {family.attention_classes} found in this {type(base).__name__}."
        )
    if reload_saved and get_config(base) == config:
        return model  # already patched as saved: keep the live (possibly trained) parameters
    held = [m._modules.get(STATE_NAME) for m in modules]
    if any(state is not None and not isinstance(state, AttnScaleState) for state in held):
        # PEFT's modules_to_save wraps the state; a new state would be neither trained nor saved with it.
        raise ValueError(
            "This model's patch state is held by PEFT (modules_to_save=['hfa']); patching it again would "
            "detach the parameters PEFT trains and saves. Patch the base model before get_peft_model, or "
            "load the adapter onto a freshly patched base with hfa.load_adapter."
        )
    inner = inner_backend(base.config._attn_implementation or "eager")
    if inner not in SUPPORTED_BACKENDS:
        raise ValueError(
            f"Attention backend {inner!r} is not supported; supported: {', '.join(SUPPORTED_BACKENDS)}."
        )

    device = next(base.parameters()).device
    if inner == "flex_attention" and config.has_exit and device.type == "cpu":
        raise ValueError(
            "zero_kv / sink_logit under flex_attention need a GPU (transformers runs flex sinks via its CUDA "
            "logsumexp); on CPU load the model with attn_implementation='sdpa' or 'eager'."
        )
    num_heads = base.config.num_attention_heads
    states = [_new_state(config, num_heads, m) for m in modules]
    if reload_saved:
        _load_saved_parameters(base, modules, states)

    if get_config(base) is None:
        _own_config(base)
    snapshot = _snapshot(base, modules)
    try:
        base.config._attn_implementation = register_backend(inner)
        setattr(base.config, CONFIG_KEY, config.to_dict())
        for module, state in zip(modules, states):
            module._modules[STATE_NAME] = state
            if family.forward is not None:
                module.forward = types.MethodType(family.forward, module)
            elif family.decoder and family.rope:
                from .streaming import install_streaming_forward

                install_streaming_forward(module, base)
    except BaseException:
        _restore(base, modules, snapshot)
        raise
    return model


def _new_state(config: AttnScaleConfig, num_heads: int, module: nn.Module) -> AttnScaleState:
    """A state whose parameters live on the module's device and dtype (float32 for half-precision models)."""
    state = AttnScaleState(config, num_heads)
    ref = next(module.parameters(), None)
    if ref is not None:
        state.to(device=ref.device, dtype=ref.dtype if ref.dtype == torch.float64 else torch.float32)
    return state


def _snapshot(model: nn.Module, modules: list[nn.Module]) -> dict:
    return {
        "impl": model.config._attn_implementation,
        "saved": getattr(model.config, CONFIG_KEY, None),
        "states": [m._modules.get(STATE_NAME) for m in modules],
        "forwards": [m.__dict__.get("forward") for m in modules],
    }


def _restore(model: nn.Module, modules: list[nn.Module], snapshot: dict) -> None:
    model.config._attn_implementation = snapshot["impl"]
    if snapshot["saved"] is None:
        if hasattr(model.config, CONFIG_KEY):
            delattr(model.config, CONFIG_KEY)
    else:
        setattr(model.config, CONFIG_KEY, snapshot["saved"])
    for module, state, forward in zip(modules, snapshot["states"], snapshot["forwards"]):
        if state is None:
            module._modules.pop(STATE_NAME, None)
        else:
            module._modules[STATE_NAME] = state
        if forward is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = forward


def unpatch(model: M) -> M:
    """Restore the model's original attention exactly (bitwise-equal outputs) and return it."""
    base = _base_model(model)
    if get_config(base) is None:
        return model
    family = family_for(base.config.model_type)
    modules = attention_modules(base, family)
    _restore(
        base,
        modules,
        {
            "impl": inner_backend(base.config._attn_implementation),
            "saved": None,
            "states": [None] * len(modules),
            "forwards": [None] * len(modules),
        },
    )
    return model


def get_config(model: nn.Module) -> AttnScaleConfig | None:
    """The `AttnScaleConfig` in force on ``model``, or None if it is not patched."""
    base = _base_model(model)
    impl = getattr(base.config, "_attn_implementation", None) or ""
    if impl != backend_name(inner_backend(impl)):
        return None
    return read_saved_config(base.config)


def _load_saved_parameters(model: nn.Module, modules: list[nn.Module], states: list[AttnScaleState]) -> None:
    """Copy learned ``hfa.*`` parameters from the checkpoint the model was loaded from, if there are any."""
    wanted = {
        f"{name}.{STATE_NAME}.{p}": (state, p)
        for name, m in model.named_modules()
        for state, mod in zip(states, modules)
        if mod is m
        for p, _ in state.named_parameters()
    }
    if not wanted:
        return
    tensors = _checkpoint_tensors(getattr(model.config, "_name_or_path", ""), set(wanted))
    with torch.no_grad():
        for key, tensor in tensors.items():
            state, pname = wanted[key]
            getattr(state, pname).copy_(tensor)


def _checkpoint_tensors(path: str, keys: set[str]) -> dict[str, torch.Tensor]:
    """Tensors named ``keys`` (or with a base-model prefix stripped) from a local safetensors checkpoint."""
    from safetensors import safe_open

    directory = Path(path)
    if not directory.is_dir():
        return {}
    index = directory / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    found: dict[str, torch.Tensor] = {}
    for file in files:
        if not (directory / file).exists():
            continue
        with safe_open(str(directory / file), framework="pt") as handle:
            for stored in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                match = next(
                    (k for k in keys if stored == k or stored.endswith("." + k) or k.endswith("." + stored)),
                    None,
                )
                if match is not None:
                    found[match] = handle.get_tensor(stored)
    return found
