"""The first-use check that guards each fast path: the CPU's fused exit and key parts (their private kernel,
`hf_attnscale.core.call.cpu_flash`; the key parts' in `hf_attnscale.core.parts.key_parts`) and CUDA's flex key
parts (`hf_attnscale.core.parts.flex_parts`).

Each combination of shapes and options a path would serve runs once, at its first use, forward and backward on a
sharp input (`Sampler`) against a reference (`against`; the exit: its public formulation; key parts and bands:
the plain formula in float64). A mismatch or an error gives one warning, and that combination takes the public
formulation for the rest of the process. Each path says only what its sample holds and what its reference is.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Hashable

import torch


def may_serve(query: torch.Tensor, env_switch: str, device_types: tuple[str, ...]) -> bool:
    """What every fast path asks first: a tensor on one of ``device_types``, eager (a model compiled whole takes
    the public formulation), no autocast, and the path's switch not off."""
    device = query.device.type
    return (
        device in device_types
        and not torch.compiler.is_compiling()
        and os.environ.get(env_switch, "1") != "0"
        and not torch.is_autocast_enabled(device)
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


class Sampler:
    """The checks' input: ``sample(*shape, spread=1.0)`` draws a leaf taking gradients, normal times ``spread``,
    in ``dtype`` on ``device``, from one generator seeded 0 (``generator``: masks draw from it too), so a check
    is the same at every run. Queries and keys take ``spread=sharp(head_dim)``, so that the softmax is far from
    uniform and a wrong score shows."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.dtype, self.device = dtype, device
        self.generator = torch.Generator().manual_seed(0)

    def __call__(self, *shape: int, spread: float = 1.0) -> torch.Tensor:
        drawn = torch.randn(*shape, generator=self.generator) * spread
        return drawn.to(self.device, self.dtype).requires_grad_()


def sharp(head_dim: int) -> float:
    """The spread of a check's queries and keys: scores of about 3 standard deviations at ``head_dim``."""
    return 3 / head_dim**0.25


def against(
    run: Callable[[], torch.Tensor | None],
    reference: Callable[[], torch.Tensor],
    leaves: tuple[torch.Tensor, ...],
    names: tuple[str, ...],
    tolerance: float,
) -> str | None:
    """Every fast path's check: ``run()`` against ``reference()``, forward and backward through ``leaves`` with
    one seeded cotangent; None if each output and gradient is within ``tolerance`` of its size, else why not
    (``run()`` returning None: torch.compile gave up; any error of the kernel or the compiler included)."""

    def compared() -> str | None:
        got = run()
        if got is None:
            return "torch.compile's recompile limit was reached"
        want = reference()
        cotangent = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
        got_grads = torch.autograd.grad(got, leaves, cotangent.to(got))
        want_grads = torch.autograd.grad(want, leaves, cotangent.to(want))
        return compare((got, *got_grads), (want, *want_grads), names[: 1 + len(leaves)], tolerance)

    return reason(compared)


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


def reason(check: Callable[[], str | None]) -> str | None:
    """``check()``, or why it failed where it raised: any failure of a kernel or the compiler means do not use
    it (the one wording of every check's error)."""
    try:
        return check()
    except Exception as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def tolerance(dtype: torch.dtype) -> float:
    """How far a fast path may be from its reference, relative to its size: float32's, else half precision's
    (TF32 matmuls, where PyTorch is set to them, count as half)."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return 1e-5
    return 3e-3 if dtype == torch.float32 else 3e-2
