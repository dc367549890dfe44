"""`AttnScaleConfig`: the validated patch options, and their round trip through `model.config`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

from hf_attnscale.validation import check_int

CONFIG_KEY = "hf_attnscale"
"""Attribute of `model.config` that holds the patch, so `save_pretrained` writes it to config.json."""
LEGACY_CONFIG_KEY = "attn_scale"
"""Where earlier versions saved the patch. Read only when it holds a dict: Llama-4's own config has an
``attn_scale`` float (its attention temperature), which is not a patch."""

ScaleName = Literal["none", "logn", "ssmax", "gradmax"]
SCALES: tuple[str, ...] = get_args(ScaleName)
SinkLogit = float | Literal["learnable"] | None


@dataclass(frozen=True)
class AttnScaleConfig:
    """What `hfa.patch` does to a model's attention.

    Args:
        scale: the query multiplier as a function of n, the number of keys a query sees.
            ``"none"``; ``"logn"``: ``log_L(n)`` (Su's Attention-E), clamped to ``max(1, ·)`` by default
            as in Qwen's logn attention; ``"ssmax"``: learnable per-head ``s·ln(n)`` (Scalable-Softmax),
            initialised to ``1/ln(L)`` so it starts equal to ``log_L(n)``; ``"gradmax"``: ``sqrt(ln n / ln L)``,
            the score scale ``≈ 0.84·sqrt(ln n)`` that maximises the softmax gradient (Su, "Attention's scale
            from gradient maximisation"), normalised to 1 at the trained length.
        train_length: L, the length the model was trained at (required with a scale, at least 2).
        clamp: apply ``max(1, ·)`` so lengths up to L are untouched. Defaults to True for ``logn`` and
            ``gradmax``, False for ``ssmax``. Only valid with a scale.
        zero_kv: add a zero key and zero value every query sees (softmax-off-by-one).
        sink_logit: a per-head sink logit column whose value is zero: a fixed float, or ``"learnable"``
            (an ``nn.Parameter`` per head, initialised to 0, which equals ``zero_kv``).
    """

    scale: ScaleName = "none"
    train_length: int | None = None
    clamp: bool | None = None
    zero_kv: bool = False
    sink_logit: SinkLogit = None
    version: int = field(default=1, repr=False)

    def __post_init__(self) -> None:
        if self.scale not in SCALES:
            raise ValueError(
                f"Unknown scale {self.scale!r}; valid scales are {', '.join(map(repr, SCALES))}."
            )
        if self.scale == "none":
            laws = " or ".join(f"scale={name!r}" for name in SCALES if name != "none")
            if self.train_length is not None:
                raise ValueError(f"train_length only applies with a scale; pass {laws}.")
            if self.clamp is not None:
                raise ValueError(f"clamp only applies with a scale; pass {laws}.")
        else:
            if self.train_length is None:
                raise ValueError(
                    f"scale={self.scale!r} needs train_length, an int >= 2 (the trained context length)."
                )
            object.__setattr__(self, "train_length", check_int("train_length", self.train_length, 2))
            if self.clamp is None:
                object.__setattr__(self, "clamp", self.scale != "ssmax")
            elif not isinstance(self.clamp, bool):
                raise ValueError(f"clamp must be True or False, got {self.clamp!r}.")
        if not isinstance(self.zero_kv, bool):
            raise ValueError(f"zero_kv must be True or False, got {self.zero_kv!r}.")
        sink = self.sink_logit
        if sink is not None and sink != "learnable":
            if isinstance(sink, bool) or not isinstance(sink, (int, float)) or not math.isfinite(sink):
                raise ValueError(f"sink_logit must be a finite float, 'learnable' or None, got {sink!r}.")
            object.__setattr__(self, "sink_logit", float(sink))
        if self.zero_kv and sink is not None:
            what = (
                "a learnable sink (it starts at 0, which is zero_kv)"
                if sink == "learnable"
                else "a sink logit"
            )
            raise ValueError(
                f"zero_kv=True cannot be combined with {what}: zero_kv is sink_logit=0.0; pass one."
            )

    @property
    def has_exit(self) -> bool:
        """Whether queries get the zero-value exit column (zero_kv or a sink logit)."""
        return self.zero_kv or self.sink_logit is not None

    @property
    def fixed_sink_logit(self) -> float | None:
        """The constant exit logit, or None when there is no exit or it is learnable."""
        if self.zero_kv:
            return 0.0
        return self.sink_logit if isinstance(self.sink_logit, float) else None

    @property
    def is_identity(self) -> bool:
        """True when the patch leaves attention outputs unchanged."""
        return self.scale == "none" and not self.has_exit

    @classmethod
    def from_options(cls, **options: Any) -> AttnScaleConfig | None:
        """A config from the patch options that are not None, or None when every option is None."""
        given = {k: v for k, v in options.items() if v is not None}
        return cls(**given) if given else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttnScaleConfig:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(
                f"Unknown attn_scale config keys {unknown}; known keys: {sorted(cls.__dataclass_fields__)}."
            )
        return cls(**known)


def read_saved_config(model_config: Any) -> AttnScaleConfig | None:
    """The `AttnScaleConfig` stored in a transformers config (e.g. after `from_pretrained`), if any."""
    data = getattr(model_config, CONFIG_KEY, None)
    if data is None and isinstance(getattr(model_config, LEGACY_CONFIG_KEY, None), dict):
        data = getattr(model_config, LEGACY_CONFIG_KEY)
    return None if data is None else AttnScaleConfig.from_dict(dict(data))
