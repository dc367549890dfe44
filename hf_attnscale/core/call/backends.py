"""What each attention backend does under the patch, decided once per backend, when its wrapper is made.

A `Backend` names the backend's conventions (how it aligns a causal prefill, whether it soft-caps scores) and
how the exit runs on it, so that the per-call path (`hf_attnscale.core.call.scaled`) reads fields and never
tests the backend's name. The exits: flash and flex take one row of sink logits natively (``s_aux``); sdpa takes
the exit on extra channels (`hf_attnscale.core.call.exit`, the CPU's fused kernel first where it has passed its
check, `hf_attnscale.core.call.fused_exit`); eager takes it as a zero key whose logit is a mask column.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.integrations import sdpa_attention
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_attnscale.core import compat
from hf_attnscale.core.call.exit import (
    AttentionFn,
    ExitCall,
    ExitFn,
    combined_exit_logits,
    extra_key_attention,
)
from hf_attnscale.core.call.fused_exit import exit_attention

EAGER_SUFFIX = "eager_attention_forward"
create_position_bias_mask = getattr(
    sdpa_attention, "create_position_bias_mask", compat.create_position_bias_mask
)
"""transformers' own (5.14 and later); `hf_attnscale.core.compat`'s copy where the installed one lacks it."""


@dataclass(frozen=True)
class Backend:
    """One attention backend as the patch runs it.

    Attributes:
        name: transformers' name of the backend (``config._attn_implementation``).
        bottom_right: a causal prefill with more keys than queries is aligned bottom-right (flash), not top-left.
        soft_caps: the backend applies a family's ``softcap`` to the scores (sdpa ignores it).
        exit: how the exit (zero_kv / sink logit) runs on it.
        exit_on_cpu: whether the exit can run on the CPU (flex's sinks need CUDA: transformers' own limit).
        fused_parts: a method's key parts may take a fused kernel in place of the backend, PyTorch's flash kernel
            on the CPU (`hf_attnscale.core.parts.key_parts`) and flex_attention on CUDA
            (`hf_attnscale.core.parts.flex_parts`): the backend is sdpa, whose kernels these are.
        dense_masks: it takes a dense 4D mask of any pattern, which a method of key parts (each key shown its part)
            and a `SinkCache` (its band of sinks and window) need.
    """

    name: str
    bottom_right: bool
    soft_caps: bool
    exit: ExitFn
    exit_on_cpu: bool = True
    fused_parts: bool = False
    dense_masks: bool = False

    def function(self, module: nn.Module) -> AttentionFn:
        """The backend's attention function for ``module``: eager is the one of the module's own modeling file."""
        return eager_function(module) if self.name == "eager" else ALL_ATTENTION_FUNCTIONS[self.name]

    def check_exit(self, device: torch.device) -> None:
        """Raise ValueError where the exit cannot run on ``device``."""
        if device.type == "cpu" and not self.exit_on_cpu:
            raise ValueError(
                f"zero_kv / sink_logit under {self.name} need a GPU (transformers runs its sinks via its CUDA "
                "logsumexp); on CPU use attn_implementation='sdpa' or 'eager'."
            )


def native_exit(call: ExitCall) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The exit as the backend's own row of sink logits (``s_aux``). A family with sinks of its own passes its
    row already: two exits whose values are zero are one exit, of logit ``logaddexp(s1, s2)``."""
    kwargs = dict(call.kwargs)
    sinks = combined_exit_logits(call.exit_logits, kwargs.pop("s_aux", None))
    return call.backend_fn(call.module, call.query, call.key, call.value, call.mask, s_aux=sinks, **kwargs)


def _bias_folded(exit_fn: ExitFn) -> ExitFn:
    """``exit_fn`` with a relative position bias (Inkling's ``position_bias``) folded into its mask first."""

    def with_bias_folded(call: ExitCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        if call.kwargs.get("position_bias") is None:
            return exit_fn(call)
        kwargs = dict(call.kwargs)
        mask = create_position_bias_mask(
            kwargs.pop("position_bias"), call.mask, call.causal, call.query, call.key
        )
        return exit_fn(call._replace(mask=mask, kwargs=kwargs))

    return with_bias_folded


def _sdpa_exit(call: ExitCall) -> tuple[torch.Tensor, None]:
    return exit_attention(call), None


BACKENDS: dict[str, Backend] = {
    backend.name: backend
    for backend in (
        Backend(
            "eager",
            bottom_right=False,
            soft_caps=True,
            exit=_bias_folded(extra_key_attention),
            dense_masks=True,
        ),
        Backend(
            "sdpa",
            bottom_right=False,
            soft_caps=False,
            exit=_bias_folded(_sdpa_exit),
            fused_parts=True,
            dense_masks=True,
        ),
        Backend("flash_attention_2", bottom_right=True, soft_caps=True, exit=native_exit),
        Backend("flash_attention_3", bottom_right=True, soft_caps=True, exit=native_exit),
        Backend("flex_attention", bottom_right=False, soft_caps=True, exit=native_exit, exit_on_cpu=False),
    )
}
SUPPORTED_BACKENDS = tuple(BACKENDS)
DENSE_MASK_BACKENDS = tuple(name for name, backend in BACKENDS.items() if backend.dense_masks)
"""The backends a method of key parts and a `SinkCache` run on."""


def check_backend(
    backend: str | None, allowed: Iterable[str] = SUPPORTED_BACKENDS, needs: str = "hf_attnscale"
) -> str:
    """``backend`` (None counts as eager) if it is one of ``allowed``; else ValueError saying that ``needs``
    (what asks) takes only those, and how to switch."""
    backend = backend or "eager"
    allowed = tuple(allowed)
    if backend not in allowed:
        raise ValueError(
            f"{needs} needs {_either(allowed)} attention; this model uses {backend!r}. "
            "Switch with model.set_attn_implementation('sdpa')."
        )
    return backend


def _either(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


_EAGER: dict[type, AttentionFn] = {}


def eager_function(module: nn.Module) -> AttentionFn:
    """The eager attention function of ``module``'s own modeling file: the default its forward passes."""
    cls = type(module)
    if cls not in _EAGER:
        names = getattr(getattr(cls.forward, "__code__", None), "co_names", ())
        wanted = [n for n in names if n.endswith(EAGER_SUFFIX)] or [EAGER_SUFFIX]
        namespace = vars(sys.modules[cls.__module__])
        found = next((namespace[n] for n in wanted if n in namespace), None)
        if found is None:
            raise ValueError(f"{cls.__name__} has no eager attention function ({EAGER_SUFFIX}) to wrap.")
        _EAGER[cls] = found
    return _EAGER[cls]
