"""`AttnScaleConfig`: the validated patch options, and their round trip through `model.config`."""

from __future__ import annotations

import inspect
import math
import textwrap
from collections.abc import Callable
from dataclasses import Field, asdict, dataclass, field, fields
from typing import Any, Literal, get_args

from hf_attnscale.core.options.methods import METHOD_OPTIONS, check_methods, entry_of
from hf_attnscale.core.options.text import (
    read_bool,
    read_clip_bounds,
    read_length,
    read_rope_parameters,
    read_sink_logit,
)
from hf_attnscale.core.options.validation import check_int

CONFIG_KEY = "hf_attnscale"
"""Attribute of `model.config` that holds the patch, so `save_pretrained` writes it to config.json."""
LEGACY_CONFIG_KEY = "attn_scale"
"""Where earlier versions saved the patch. Read only when it holds a dict: Llama-4's own config has an
``attn_scale`` float (its attention temperature), which is not a patch."""

ScaleName = Literal["none", "logn", "ssmax", "gradmax", "llama4", "ministral3"]
SCALES: tuple[str, ...] = get_args(ScaleName)
SinkLogit = float | Literal["learnable"] | None
ClippedSoftmax = tuple[float, float] | Literal["learnable"] | None
GateKind = Literal["head", "element"]
GATES: tuple[str, ...] = get_args(GateKind)
STEP_LAWS = ("llama4", "ministral3")
"""The laws of 2026, ``1 + β·ln(1 + ⌊·/L⌋)``: they take ``beta`` and never need a clamp (they are at least 1)."""
DEFAULT_BETA = 0.1
"""β of the step laws when not given: Llama 4's ``attn_scale`` and Ministral 3's ``llama_4_scaling_beta``."""


def _option(
    help: str,
    *,
    parse: Callable[[str], Any] = str,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    head: bool = False,
) -> dict[str, Any]:
    """A patch option's metadata: one line of help, how its text (a CLI flag, an lm-eval model_arg) is read,
    and whether it acts on what a head may output (``head``: the trainers of the shipped encoder leave those
    out). `hfa.patch`, the CLI's flags and the lm-eval model type all read these fields."""
    return {"help": help, "parse": parse, "choices": choices, "metavar": metavar, "head": head}


def _with_method_options(cls: type) -> type:
    """``cls`` with a field for each option of the registered methods (`hf_attnscale.core.options.methods`),
    before ``rope_parameters``, and their entries in its docstring: so that each is declared once, there."""
    annotations: dict[str, Any] = {}
    for name, kind in inspect.get_annotations(cls).items():
        if name == "rope_parameters":
            for option in METHOD_OPTIONS:
                annotations[option.name] = f"{option.kind.__name__} | None"
                metadata = _option(option.help, parse=option.kind, metavar=option.metavar)
                setattr(cls, option.name, field(default=None, metadata=metadata))
        annotations[name] = kind
    cls.__annotations__ = annotations
    docs = [
        textwrap.fill(
            f"{option.name}: {option.doc}",
            116,
            initial_indent=" " * 8,
            subsequent_indent=" " * 12,
            break_on_hyphens=False,
        )
        for option in METHOD_OPTIONS
    ]
    cls.__doc__ = cls.__doc__.replace("{methods}", "\n".join(docs))
    return cls


@dataclass(frozen=True)
@_with_method_options
class AttnScaleConfig:
    """What `hfa.patch` does to a model's attention.

        The methods of key parts (ReRoPE, Self-Extend, DCA...) are declared in `hf_attnscale.core.options.methods`, whose
        options are fields here too (in its order, before ``rope_parameters``); one method at a time.

        Args:
            scale: the query multiplier as a function of n, the number of keys a query sees.
                ``"none"``; ``"logn"``: ``log_L(n)`` (Su's Attention-E), clamped to ``max(1, ·)`` by default
                as in Qwen's logn attention; ``"ssmax"``: learnable per-head ``s·ln(n)`` (Scalable-Softmax),
                initialised to ``1/ln(L)`` so it starts equal to ``log_L(n)``; ``"gradmax"``: ``sqrt(ln n / ln L)``,
                the score scale ``≈ 0.84·sqrt(ln n)`` that maximises the softmax gradient (Su, "Attention's scale
                from gradient maximisation"), normalised to 1 at the trained length; ``"llama4"``:
                ``1 + β·ln(1 + ⌊n / L⌋)``, Llama 4's attention temperature tuning (L its ``floor_scale``, 8192);
                ``"ministral3"``: ``1 + β·ln(1 + ⌊(n − 1) / L⌋)``, Ministral 3's and Mistral 4's query scaling
                (L their ``original_max_position_embeddings``).
            train_length: L, the model's trained length (required with a scale, at least 2).
            clamp: apply ``max(1, ·)`` so lengths up to L are untouched. Defaults to True for ``logn`` and
                ``gradmax``, False for the others. Only valid with a scale.
            beta: β of ``llama4`` and ``ministral3`` (default 0.1, the families' own); only valid with them.
            clipped_softmax: ``(γ, ζ)``: attention probabilities ``clip((ζ − γ)·softmax + γ, 0, 1)`` (Bondarenko
                et al., 2023; γ ≤ 0 lets a head give a token exactly zero weight, their γ = −α/T), with γ ≤ 0 and
                ζ ≥ 1; or ``"learnable"``: per-head γ and ζ, initialised to 0 and 1 (the unpatched softmax). Runs
                the eager formula on every backend. Not with an exit: each is a way for a head to do nothing.
            gate: a sigmoid gate on each head's output from the token's input hidden state, before the output
                projection (Bondarenko et al. 2023; Qiu et al. 2025): ``"head"``, one per head, or ``"element"``,
                one per channel; ``2·sigmoid(x·W + b)`` with ``W = b = 0`` at first, so the patched model starts
                equal to the original. Learnable, saved and trained with PEFT like the exit's logit.
            zero_kv: an exit: a zero key and zero value every query sees (softmax-off-by-one).
            sink_logit: an exit with this logit: a per-head column whose value is zero; a fixed float, or
                ``"learnable"`` (an ``nn.Parameter`` per head, initialised to 0, which equals ``zero_kv``).
            shifted_sparse_group: G, LongLoRA's shifted sparse attention (S²-Attn, Chen et al. 2024) while the
                model trains (``model.train()``): half the heads attend causally within groups of G tokens, the
                other half within groups shifted by G/2; dense in ``model.eval()`` and ``generate``. An even int
                >= 2; not with an exit, clipped softmax or a method of key parts.
    {methods}
            rope_parameters: RoPE rescaling on the loaded model: transformers' own ``rope_parameters`` dict
                (``{"rope_type": "yarn", "factor": 4.0}``; dynamic, linear, llama3, longrope), in place of the model's
                (its ``rope_theta`` kept unless given); the model then equals the checkpoint loaded with them.
            version: the format of the record saved in a model's config (1); not an option.
    """

    scale: ScaleName = field(
        default="none", metadata=_option("query scale law (default none)", choices=SCALES)
    )
    train_length: int | None = field(
        default=None,
        metadata=_option(
            "L, the model's trained length (on the command line: default max_position_embeddings)",
            parse=read_length,
            metavar="N",
        ),
    )
    clamp: bool | None = field(default=None, metadata=_option("clamp the scale to >= 1", parse=read_bool))
    zero_kv: bool = field(
        default=False,
        metadata=_option("an exit: a zero key and value (softmax-off-by-one)", parse=read_bool, head=True),
    )
    sink_logit: SinkLogit = field(
        default=None,
        metadata=_option("an exit with this logit, or 'learnable'", parse=read_sink_logit, head=True),
    )
    beta: float | None = field(
        default=None,
        metadata=_option(f"beta of --scale llama4 / ministral3 (default {DEFAULT_BETA})", parse=float),
    )
    clipped_softmax: ClippedSoftmax = field(
        default=None,
        metadata=_option(
            "clip((zeta - gamma) * softmax + gamma, 0, 1), e.g. -0.03,1 (or -0.03;1); or 'learnable'",
            parse=read_clip_bounds,
            metavar="GAMMA,ZETA",
            head=True,
        ),
    )
    gate: GateKind | None = field(
        default=None,
        metadata=_option("a learnable sigmoid gate on each head's output", choices=GATES, head=True),
    )
    shifted_sparse_group: int | None = field(
        default=None,
        metadata=_option(
            "S2-Attn while training: attention in groups of G tokens, half the heads shifted by G/2",
            parse=read_length,
            metavar="G",
        ),
    )
    rope_parameters: dict[str, Any] | None = field(
        default=None,
        hash=False,  # a dict: the rest of the options hash the config (equality still compares it)
        metadata=_option(
            "RoPE rescaling: transformers' rope_parameters, JSON or rope_type=yarn;factor=4",
            parse=read_rope_parameters,
            metavar="PARAMS",
        ),
    )
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
                    f"scale={self.scale!r} needs train_length, an int >= 2 (the model's trained length)."
                )
            object.__setattr__(self, "train_length", check_int("train_length", self.train_length, 2))
            if self.clamp is None:
                object.__setattr__(self, "clamp", self.scale in ("logn", "gradmax"))
            elif not isinstance(self.clamp, bool):
                raise ValueError(f"clamp must be True or False, got {self.clamp!r}.")
        if self.scale in STEP_LAWS:
            beta = DEFAULT_BETA if self.beta is None else self.beta
            if (
                isinstance(beta, bool)
                or not isinstance(beta, (int, float))
                or not math.isfinite(beta)
                or beta < 0
            ):
                raise ValueError(f"beta must be a finite float >= 0, got {self.beta!r}.")
            object.__setattr__(self, "beta", float(beta))
        elif self.beta is not None:
            raise ValueError(f"beta only applies with scale={STEP_LAWS[0]!r} or {STEP_LAWS[1]!r}.")
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

        clip = self.clipped_softmax
        if clip is not None and clip != "learnable":
            if (
                isinstance(clip, str)
                or not isinstance(clip, (tuple, list))
                or len(clip) != 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in clip)
                or not all(math.isfinite(x) for x in clip)
                or not clip[0] <= 0 < 1 <= clip[1]
            ):
                raise ValueError(
                    f"clipped_softmax must be (gamma, zeta) with gamma <= 0 and zeta >= 1 (finite floats), "
                    f"'learnable' or None, got {clip!r}."
                )
            object.__setattr__(self, "clipped_softmax", (float(clip[0]), float(clip[1])))
        if self.gate is not None and self.gate not in GATES:
            raise ValueError(f"gate must be {' or '.join(map(repr, GATES))} or None, got {self.gate!r}.")
        for name, value in check_methods({name: getattr(self, name) for name in METHOD_NAMES}).items():
            object.__setattr__(self, name, value)
        rope = self.rope_parameters
        if rope is not None and (
            not isinstance(rope, dict) or not rope or not all(isinstance(key, str) for key in rope)
        ):
            raise ValueError(
                "rope_parameters must be transformers' rope_parameters dict, e.g. {'rope_type': 'yarn', "
                f"'factor': 4.0}}, got {rope!r}."
            )
        if clip is not None and self.has_exit:
            raise ValueError(
                "clipped_softmax cannot be combined with zero_kv / sink_logit: each lets a head attend to "
                "nothing; pass one."
            )
        group = self.shifted_sparse_group
        if group is not None:
            group = check_int("shifted_sparse_group", group, 2)
            object.__setattr__(self, "shifted_sparse_group", group)
            if group % 2:
                raise ValueError(f"shifted_sparse_group must be even (its groups shift by G/2), got {group}.")
            others = [name for name, on in self._shifted_sparse_conflicts().items() if on]
            if others:
                raise ValueError(
                    f"shifted_sparse_group cannot be combined with {', '.join(others)}: S2-Attn trains plain "
                    "attention in groups; pass it with a scale, a gate or rope_parameters only."
                )

    def _shifted_sparse_conflicts(self) -> dict[str, bool]:
        return {
            "zero_kv / sink_logit": self.has_exit,
            "clipped_softmax": self.clipped_softmax is not None,
            str(self.key_parts): self.key_parts is not None,
        }

    @property
    def key_parts(self) -> str | None:
        """The option of the method of key parts in force (``rerope_window``, ``self_extend_group``...), or None."""
        entry = entry_of({name: getattr(self, name) for name in METHOD_NAMES})
        return None if entry is None else entry.option

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
        return (
            self.scale == "none"
            and not self.has_exit
            and self.clipped_softmax is None
            and self.gate is None
            and self.key_parts is None
            and self.rope_parameters is None
            and self.shifted_sparse_group is None
        )

    @classmethod
    def from_options(cls, **options: Any) -> AttnScaleConfig | None:
        """A config from the patch options that are not None, or None when every option is None."""
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(
                f"Unknown patch option(s) {', '.join(unknown)}; the options are {', '.join(OPTIONS)}."
            )
        given = {name: value for name, value in options.items() if value is not None}
        return cls(**given) if given else None

    @classmethod
    def from_text(cls, **options: Any) -> AttnScaleConfig | None:
        """`from_options`, where a value given as text (an lm-eval model_arg) is read as its flag reads it."""
        return cls.from_options(**{name: _from_text(name, value) for name, value in options.items()})

    def to_dict(self) -> dict[str, Any]:
        """Every field, as saved in a model's config (``config.hf_attnscale``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttnScaleConfig:
        """The config `to_dict` wrote; an unknown key raises ValueError, listing the known ones."""
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(
                f"Unknown attn_scale config keys {unknown}; known keys: {sorted(cls.__dataclass_fields__)}."
            )
        return cls(**known)


OPTIONS: dict[str, Field] = {f.name: f for f in fields(AttnScaleConfig) if f.name != "version"}
"""The patch's options (`AttnScaleConfig`'s fields, with their help and text reading in ``metadata``), as
`hfa.patch`, the CLI and the lm-eval model type name them."""
OPTION_NAMES: tuple[str, ...] = tuple(OPTIONS)
METHOD_NAMES: tuple[str, ...] = tuple(option.name for option in METHOD_OPTIONS)
"""The methods' options, in the registry's order."""


def default_train_length(given: int | None, model_config: Any) -> int | None:
    """The one rule for a scale's L where the user may leave it out (the CLI's ``--train-length``, the lm-eval
    model type's ``train_length=``): the length given, else the model config's ``max_position_embeddings``;
    None where there is neither (recurrent_gemma's config, for one, has no such field)."""
    return given if given is not None else getattr(model_config, "max_position_embeddings", None)


def _from_text(name: str, value: Any) -> Any:
    """``value`` of option ``name`` read as the option reads text, if it is text (else as given)."""
    option = OPTIONS.get(name)
    if option is None:
        return value  # from_options names it
    if not isinstance(value, str) or option.metadata["choices"] is not None:
        return value
    try:
        return option.metadata["parse"](value)
    except ValueError as err:
        raise ValueError(f"{name}: {err}.") from None


def read_saved_config(model_config: Any) -> AttnScaleConfig | None:
    """The `AttnScaleConfig` stored in a transformers config (e.g. after `from_pretrained`), if any."""
    data = getattr(model_config, CONFIG_KEY, None)
    if data is None and isinstance(getattr(model_config, LEGACY_CONFIG_KEY, None), dict):
        data = getattr(model_config, LEGACY_CONFIG_KEY)
    return None if data is None else AttnScaleConfig.from_dict(dict(data))


def replaced_patch_note(saved: AttnScaleConfig | None, given: AttnScaleConfig) -> str | None:
    """The one-line note that options ``given`` replace the patch ``saved`` with a model; None where there is
    nothing to replace (no patch saved, the identity patch, or the same patch)."""
    if saved is None or saved.is_identity or saved == given:
        return None
    return f"note: the patch options given replace the patch saved with the model ({saved})."


DUAL_CHUNK_KEY = "dual_chunk_attention_config"
"""Where a checkpoint's config asks for Dual Chunk Attention (Qwen2.5-7B/14B-Instruct-1M), which transformers
ignores: ``chunk_size``, ``local_size``, ``original_max_position_embeddings`` and MInference's sparse keys."""
DUAL_CHUNK_USED = ("chunk_size", "local_size")


def checkpoint_dual_chunk(model_config: Any) -> tuple[AttnScaleConfig, str] | None:
    """The DCA a checkpoint's config asks for (its ``dual_chunk_attention_config``), and the one-line note that
    says so, naming the keys not implemented; None where it asks for none."""
    asked = getattr(model_config, DUAL_CHUNK_KEY, None)
    if asked is None and hasattr(model_config, "get_text_config"):
        asked = getattr(model_config.get_text_config(), DUAL_CHUNK_KEY, None)
    if not isinstance(asked, dict) or not all(key in asked for key in DUAL_CHUNK_USED):
        return None
    config = AttnScaleConfig(dual_chunk_size=asked["chunk_size"], dual_chunk_local=asked["local_size"])
    unused = sorted(key for key in asked if key not in DUAL_CHUNK_USED)
    note = (
        f"hf_attnscale: this checkpoint's {DUAL_CHUNK_KEY} asks for Dual Chunk Attention: patched with "
        f"dual_chunk_size={config.dual_chunk_size}, dual_chunk_local={config.dual_chunk_local}"
        + (f"; not implemented, so not applied: {', '.join(unused)}" if unused else "")
        + " (explicit options replace it)."
    )
    return config, note
