"""RoPE rescaling on a loaded model (``rope_parameters``): the model's rotary embedding rebuilt by transformers
from its own config, with the given ``rope_parameters`` in place of the model's (its ``rope_theta`` and
``partial_rotary_factor`` kept unless given), so the patched model equals the checkpoint loaded with them
(YaRN, dynamic NTK, linear, llama3, LongRoPE). The model's own rotary embedding
is kept on the new one and put back by `unpatch`; the model's config is left as it is (the patch records the
parameters)."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from hf_attnscale.core.compat import nested_rope_keys

ORIGINAL_ATTR = "_hfa_original_rotary"
"""Where a rebuilt rotary embedding keeps the model's own (in its ``__dict__``: no submodule, no state)."""
RotarySlot = tuple[nn.Module, str, nn.Module]
"""A rotary embedding in a model: ``(parent, attribute name, the module)``."""


def rotary_slots(root: nn.Module) -> list[RotarySlot]:
    """Every rotary embedding of ``root`` (a module holding a ``rope_type``), where it sits."""
    return [
        (parent, name, child)
        for parent in root.modules()
        for name, child in parent._modules.items()
        if child is not None and hasattr(child, "rope_type")
    ]


def own_rotary(rotary: nn.Module) -> nn.Module:
    """The model's own rotary embedding: ``rotary``, or the one a rebuilt ``rotary`` replaced."""
    return rotary.__dict__.get(ORIGINAL_ATTR, rotary)


def rescaled(rotary: nn.Module, rope_parameters: dict[str, Any]) -> nn.Module:
    """A rotary embedding of ``rotary``'s class, built by transformers from the model's config with
    ``rope_parameters`` in place of its own (by layer type where the model has several); raises ValueError,
    saying what is valid, where transformers refuses them."""
    original = own_rotary(rotary)
    config = copy.deepcopy(original.config)
    own = copy.deepcopy(config.rope_parameters or {})
    nested = nested_rope_keys(config, own)
    if nested and not set(rope_parameters) <= set(nested):
        raise ValueError(
            f"rope_parameters: this model's RoPE is set per layer type ({', '.join(nested)}); give them by "
            f"layer type, e.g. {{{nested[0]!r}: {{'rope_type': 'yarn', 'factor': 4.0}}}}."
        )
    for given in rope_parameters.values() if nested else [rope_parameters]:
        kind = given.get("rope_type", "default") if isinstance(given, dict) else None
        if kind not in ("default", *ROPE_INIT_FUNCTIONS):
            raise ValueError(
                f"rope_parameters: unknown rope_type {kind!r}; transformers' are "
                f"{', '.join(('default', *ROPE_INIT_FUNCTIONS))}."
            )
    if nested:
        merged = {
            kind: _given(own[kind], rope_parameters[kind]) if kind in rope_parameters else own[kind]
            for kind in own
        }
    else:
        merged = _given(own, rope_parameters)
    config.rope_parameters = merged
    try:
        config.standardize_rope_params()
        config.validate_rope()
        built = type(original)(config=config)
    except (KeyError, ValueError, TypeError, AttributeError, RuntimeError) as error:
        reason = error.args[0] if isinstance(error, KeyError) and error.args else str(error)  # no repr quotes
        raise ValueError(f"rope_parameters {rope_parameters}: {str(reason).splitlines()[0]}") from None
    built.to(original.inv_freq.device if hasattr(original, "inv_freq") else None)
    for kind in rope_parameters if nested else [None]:
        own_shape = _cos_shape(original, kind)
        if own_shape is not None and (shape := _cos_shape(built, kind)) != own_shape:
            where = "" if kind is None else f" for {kind!r} layers"
            raise ValueError(
                f"rope_parameters {rope_parameters}: transformers builds this model's rotary embedding{where} at "
                f"{shape[-1]} rotary dims where its attention takes {own_shape[-1]} (a RoPE of its own, such as "
                "'proportional'); keep this layer type's own."
            )
    built.__dict__[ORIGINAL_ATTR] = original
    return built


def _cos_shape(rotary: nn.Module, kind: str | None) -> torch.Size | None:
    """The shape of what ``rotary`` gives two positions (its cos, or its complex frequencies where it gives one
    tensor, as DeepSeek-V2's and Llama 4's do), of a layer type ``kind`` where it has several; None where it
    computes none for that kind (a layer type the model's layers do not have). A copy is asked, as dynamic and
    LongRoPE rotaries change their frequencies with the length they are called at."""
    rotary = copy.deepcopy(rotary)
    buffer = next(iter(rotary.buffers()), None)
    probe = torch.zeros(1, 2, 1, device=None if buffer is None else buffer.device)
    with torch.no_grad(), contextlib.suppress(KeyError, AttributeError):
        given = rotary(
            probe,
            torch.arange(2, device=probe.device)[None],
            **({} if kind is None else {"layer_type": kind}),
        )
        return (given[0] if isinstance(given, tuple) else given).shape
    return None


KEPT = ("rope_theta", "partial_rotary_factor")
"""What of the model's own RoPE a rescaling keeps unless it gives its own: the base and the rotary share."""


def _given(own: dict[str, Any] | None, given: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of a layer type: ``given``, with the model's own base and rotary share."""
    return {**{k: v for k, v in (own or {}).items() if k in KEPT}, **given}


def put(slot: RotarySlot) -> None:
    """Put a rotary embedding in its place."""
    parent, name, module = slot
    parent._modules[name] = module
