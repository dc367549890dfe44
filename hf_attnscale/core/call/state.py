"""The patch state each patched attention module carries, and the patch in force on a model.

A module is patched when it has a child module named ``hfa`` (`AttnScaleState`): the attention function finds
its options and learnable parameters there, and a module without one runs exactly as before. So "is this model
patched, and how" is answered by its modules, never by a name in a shared config.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_attnscale.core.call.gate import make_gate
from hf_attnscale.core.call.resident import is_offloaded, keep_resident
from hf_attnscale.core.options.config import AttnScaleConfig
from hf_attnscale.core.options.laws import ssmax_init

STATE_NAME = "hfa"
"""Name of the child module that holds a patched attention module's state (and learnable parameters)."""


class AttnScaleState(nn.Module):
    """Per-attention-module patch state: the config and the learnable exit / SSMax / clipping / gate parameters.

    Being a child module named ``hfa``, its parameters appear as ``...self_attn.hfa.sink`` and
    ``...self_attn.hfa.ssmax`` in the state dict, so ``save_pretrained`` writes them, and PEFT can train them
    via ``modules_to_save=["hfa"]``. (The exit's parameter keeps the name ``sink``, the name saved checkpoints
    hold.) It holds nothing per call: the module is shared by every caller (`hf_attnscale.core.call.hooks`).
    """

    def __init__(self, config: AttnScaleConfig, num_heads: int, gate_features: tuple[int, int] | None = None):
        """``gate_features``: the gated module's input width and value head dim (needed with ``config.gate``)."""
        super().__init__()
        self.config = config
        self.num_heads = num_heads
        self.sink = nn.Parameter(torch.zeros(num_heads)) if config.sink_logit == "learnable" else None
        self.ssmax = (
            nn.Parameter(torch.full((num_heads,), ssmax_init(config.train_length)))
            if config.scale == "ssmax"
            else None
        )
        learnable_clip = config.clipped_softmax == "learnable"
        self.clip_gamma = nn.Parameter(torch.zeros(num_heads)) if learnable_clip else None
        self.clip_zeta = nn.Parameter(torch.ones(num_heads)) if learnable_clip else None
        self.output_gate = (
            make_gate(config.gate, gate_features[0], num_heads, gate_features[1]) if config.gate else None
        )

    def exit_logits(self, device: torch.device) -> torch.Tensor:
        """The exit logit of each head, float32 ``(H,)``."""
        if self.sink is not None:
            return self.sink.float()
        return torch.full((self.num_heads,), self.config.fixed_sink_logit, device=device)

    def clip_bounds(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """γ and ζ of the clipped softmax for each head, float32 ``(H,)`` each."""
        if self.clip_gamma is not None:
            return self.clip_gamma.float(), self.clip_zeta.float()
        gamma, zeta = self.config.clipped_softmax
        return torch.full((self.num_heads,), gamma, device=device), torch.full(
            (self.num_heads,), zeta, device=device
        )

    def extra_repr(self) -> str:
        return f"{self.config}"


def active_state(child: nn.Module | None) -> AttnScaleState | None:
    """The `AttnScaleState` the attention function reads through a module's ``hfa`` child.

    That is the child itself, or, when PEFT trains it (``modules_to_save=["hfa"]``), the copy of the active
    adapter (the original when adapters are disabled).
    """
    if child is None or isinstance(child, AttnScaleState):
        return child
    copies = getattr(child, "modules_to_save", None)
    if copies is not None and not getattr(child, "disable_adapters", False):
        for adapter in getattr(child, "active_adapters", None) or []:
            if adapter in copies:
                return copies[adapter]
    original = getattr(child, "original_module", None)
    return original if isinstance(original, AttnScaleState) else None


def state_of(module: nn.Module) -> AttnScaleState | None:
    """The state in force on one attention module, ready to run, or None.

    Its parameters are on the module's execution device: those accelerate offloaded (a model dispatched after
    it was patched) are first taken back (`keep_resident`).
    """
    child = module._modules.get(STATE_NAME)
    state = active_state(child)
    if state is not None and is_offloaded(state):
        keep_resident(child)
    return state
