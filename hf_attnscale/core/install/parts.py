"""What a method of key parts (ReRoPE, Self-Extend, DCA) needs of a model, checked when it is patched: a RoPE
decoder on eager or sdpa attention whose layers rotate by their family's ``apply_rotary_pos_emb`` with cos/sin
computed from ``inv_freq``. Layers that apply no RoPE (NoPE layers) are found here and left as they are."""

from __future__ import annotations

import torch
from torch import nn

from hf_attnscale.core.call.rope import ROPE_FUNCTION, RotaryFrequencies, family_rope
from hf_attnscale.core.install.families import Rotary, is_causal_attention
from hf_attnscale.core.install.routing import applies_rope
from hf_attnscale.core.options.declare import Method
from hf_attnscale.core.parts.engine import check_parts_backend


def parts_rotaries(
    root: nn.Module, modules: list[nn.Module], rotaries: list[Rotary | None], method: Method
) -> list[Rotary | None]:
    """``rotaries`` (each module's rotary embedding) with None for the layers that apply no RoPE; raises
    ValueError, saying why, where ``method`` cannot serve the model."""
    name = f"{type(root).__name__} (model_type {root.config.model_type!r})"
    option, title = method.option, method.name
    check_parts_backend(root.config._attn_implementation, method)
    if not all(is_causal_attention(m) for m in modules):
        raise ValueError(
            f"{option}: {name} is an encoder; {title} is for RoPE decoders (an encoder's keys lie on both "
            "sides of each query). Use the scale options alone."
        )
    if all(r is None for r in rotaries):
        raise ValueError(
            f"{option}: {name} has no RoPE that {title} can re-place (no rotary embedding feeds its "
            "attention, or several do). Use the scale options alone."
        )
    found: list[Rotary | None] = []
    for module, rotary in zip(modules, rotaries):
        if rotary is None:
            found.append(None)
            continue
        if family_rope(module) is None:
            raise ValueError(
                f"{option}: {type(module).__name__}'s forward does not rotate by its family's "
                f"{ROPE_FUNCTION}(q, k, cos, sin), through which {title} rotates at its parts' positions."
            )
        found.append(rotary if _rotates(root, module, rotary, method) else None)
    if all(r is None for r in found):
        raise ValueError(
            f"{option}: no layer of {name} rotates its keys' first dims by its RoPE (multi-head latent "
            f"attention keeps its rotary dims apart), so {title} has nothing to re-place. Use the scale options alone."
        )
    return found


def _rotates(root: nn.Module, module: nn.Module, rotary: Rotary, method: Method) -> bool:
    """Whether ``module`` applies RoPE (NoPE layers do not), found by running its rotary and the module itself on
    a probe token; raises ValueError, in one line, where its rotary does not compute cos/sin in the usual way or
    the family's code fails on the probe."""
    weight = next(module.parameters())
    like = torch.zeros(
        1, 1, root.config.get_text_config().hidden_size, dtype=weight.dtype, device=weight.device
    )
    probe = torch.randn(like.shape, generator=torch.Generator().manual_seed(0), device="cpu").to(like)
    position = {"position_ids": torch.zeros(1, 1, dtype=torch.long, device=like.device)}
    try:
        frequencies = RotaryFrequencies.checked(*rotary, like)
        width = None if frequencies is None else frequencies.inv_freq.shape[-1] * 2
        rotates = width is not None and applies_rope(module, probe, width, position)
    except Exception as error:  # the family's own code, run on a probe, failed: say how, in one line
        reason = str(error).splitlines()[0] if str(error) else "no message"
        raise ValueError(
            f"{method.option}: {type(module).__name__} could not be run on a probe token to find its RoPE "
            f"({type(error).__name__}: {reason}); {method.name} cannot serve it. Use the scale options alone."
        ) from error
    if frequencies is None:
        raise ValueError(
            f"{method.option}: {type(rotary[0]).__name__} does not compute cos/sin from inv_freq in the usual "
            f"layout (complex frequencies, or its own), so {method.name} cannot rotate at its parts' positions."
        )
    return rotates
