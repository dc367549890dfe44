"""PyTorch's CPU flash-attention kernel, which returns its log-sum-exp, and the first-use check that guards it.

Two fast CPU paths use the kernel: the exit (`hf_attnscale.core.call.fused_exit`) and keys in parts
(`hf_attnscale.core.call.key_parts`, ReRoPE's near and far keys). The kernel is private, so neither trusts it
unchecked: each combination of shapes and options a path would serve runs once, at its first use, forward and
backward on a sharp input against a reference (the exit: its public formulation; key parts: the plain formula in
float64), in a `FirstUseCheck`. A mismatch or an
error gives one warning, and that combination takes the public formulation for the rest of the process. Each
path has its own switch in the environment (``=0`` turns it off).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Hashable

import torch


def flash_forward(query, key, value, is_causal, mask, scale):
    """The kernel: ``(output (B, H, Tq, D), log-sum-exp (B, H, Tq))`` over the keys; q/k/v ``(B, H, T, D)``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=mask, scale=scale
    )


def flash_backward(grad_out, query, key, value, out, lse, is_causal, mask, scale):
    """The kernel's backward: ``(grad_query, grad_key, grad_value)``. It recomputes the probabilities as
    ``exp(scores − lse)`` and its row term as ``rowsum(grad_out · out)``, from the ``out`` and ``lse`` given."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale
    )


def serves_cpu(query: torch.Tensor, env_switch: str) -> bool:
    """What every fast CPU path asks first: a CPU tensor, eager (a compiled graph takes the public formulation
    whole), no autocast, and its switch not off."""
    return (
        query.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and os.environ.get(env_switch, "1") != "0"
        and not torch.is_autocast_enabled("cpu")
    )


class FirstUseCheck:
    """One verdict per combination a fast path serves, found by running its check once, at first use."""

    def __init__(self, path: str, env_switch: str) -> None:
        self.path, self.env_switch = path, env_switch
        self.verdicts: dict[Hashable, bool] = {}
        self._lock = threading.Lock()

    def passes(self, combination: Hashable, check: Callable[[], str | None]) -> bool:
        """Whether ``combination`` has passed; ``check`` (None if the fast path agrees with its reference, else
        the reason) runs at its first use, with gradients on whatever mode the caller is in."""
        verdict = self.verdicts.get(combination)
        if verdict is None:
            with self._lock:
                verdict = self.verdicts.get(combination)
                if verdict is None:
                    with torch.inference_mode(False), torch.enable_grad():
                        reason = check()
                    verdict = self.verdicts[combination] = reason is None
                    if reason is not None:
                        warnings.warn(
                            f"hf_attnscale: the {self.path} failed its check for {combination} ({reason}); that "
                            f"combination uses the public sdpa formulation from now on ({self.env_switch}=0 skips "
                            "the check).",
                            RuntimeWarning,
                            stacklevel=3,
                        )
        return verdict


def compare(
    got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], names: tuple[str, ...], tolerance: float
):
    """None where each of ``got`` is within ``tolerance`` of its size from ``want``, else which one differs."""
    for name, a, b in zip(names, got, want, strict=True):
        scale = b.float().abs().max().item() + 1e-6
        error = (a.float() - b.float()).abs().max().item() / scale
        if not error <= tolerance:  # NaN fails too
            return f"{name} differs by {error:.2g} of its size"
    return None
