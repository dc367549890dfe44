"""The registry of the methods of key parts: each method one `MethodEntry`, its options, the values they refuse,
its declaration of parts, its label and its `hf-attnscale compare` default.

Everything else reads it: `AttnScaleConfig`'s fields and their checks, the CLI's flags and lm-eval's model_args
(`hf_attnscale.core.options.config`), the patch's declaration (`method_of`), describe()'s labels, compare's
variants and the support matrix's columns. A method is declared here in the vocabulary of
`hf_attnscale.core.options.declare`; the engine (`hf_attnscale.core.parts.engine`) runs any declaration. The
methods' definitions (DESIGN.md):

    ReRoPE (Su 2023)          near (0, w): (i, j)             far [w, ∞): (w, 0)
    leaky ReRoPE              near (0, w): (i, j)             far [w, ∞): ((i + w(k − 1)) / k, j / k)
    Self-Extend (Jin 2024)    near (0, w): (i, j)             far [w, ∞): (⌊i/G⌋ + w − ⌊w/G⌋, ⌊j/G⌋)
    DCA (An 2024), c = s − l  same chunk: (i mod c, j mod c)  next: (min(i mod c + c, s), j mod c)
                              older chunks: (min(2c − 1, s), j mod c)
    STRING (An 2024)          near (0, S): (i, j)             far [S, ∞): (i − S + W, j), cos/sin × factor
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hf_attnscale.core.options.declare import At, Method, Part
from hf_attnscale.core.options.validation import check_int


@dataclass(frozen=True)
class MethodOption:
    """One option of a method.

    Attributes:
        name: its keyword (``hfa.patch``, the lm-eval model_arg; ``--name-with-dashes`` on the command line).
        kind: ``int`` or ``float``.
        metavar: its letter in help and errors (``W``).
        help: one line for ``--help``.
        doc: its entry in `AttnScaleConfig`'s docstring.
        least: the least value it takes (``above``: it must exceed it); ``why`` follows the refusal.
        default: the value it takes when its method is asked for without it (None: it must be given, unless
            ``optional``).
        optional: whether the method runs without it (ReRoPE's leak).
    """

    name: str
    kind: type
    metavar: str
    help: str
    doc: str
    least: float = 1
    above: bool = False
    why: str = ""
    default: Any = None
    optional: bool = False

    def checked(self, value: Any) -> Any:
        """``value`` as this option takes it; ValueError in one line where it refuses it."""
        if self.kind is int:
            return check_int(self.name, value, int(self.least))
        number = None
        if not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value):
            number = float(value)
        if number is None or not (number > self.least if self.above else number >= self.least):
            bound = f"{'>' if self.above else '>='} {self.least:g}"
            why = f" ({self.why})" if self.why else ""
            raise ValueError(f"{self.name} must be a finite float {bound}{why}, got {value!r}.")
        return number


@dataclass(frozen=True)
class MethodEntry:
    """A method of key parts, declared once.

    Attributes:
        key: its short name: its column of docs/SUPPORT.md and its tests' id.
        title: how a sentence names it (``Self-Extend``).
        options: its options; the first asks for the method, and the method's errors start with it.
        declare: its parts from its options' values, in ``options``' order.
        label: a short label from those values (`hf-attnscale eval`'s run names, ``Self-Extend(G=4, w=1024)``).
        compare: `hf-attnscale compare`'s variant for a model trained at L read to T tokens: ``(name, options)``.
        relate: refuses, in one line, values that are each valid but not together (None: none).
    """

    key: str
    title: str
    options: tuple[MethodOption, ...]
    declare: Callable[..., Method]
    label: Callable[..., str]
    compare: Callable[[int, int], tuple[str, dict[str, Any]]]
    relate: Callable[..., None] | None = None

    @property
    def option(self) -> str:
        """The option that asks for the method."""
        return self.options[0].name

    def checked(self, given: dict[str, Any]) -> dict[str, Any]:
        """Every option's value from those ``given`` (not None), each checked, the defaults filled in; ValueError in
        one line where an option lacks another or a value is refused."""
        lead = self.options[0]
        for option in self.options[1:]:
            if option.name in given and lead.name not in given:
                if option.optional:
                    raise ValueError(
                        f"{option.name} only applies with {lead.name}; pass {lead.name}={lead.metavar} too."
                    )
                raise ValueError(f"{option.name} needs {lead.name} too; pass {lead.name}=N.")
        for option in self.options[1:]:
            if option.name not in given and option.default is None and not option.optional:
                raise ValueError(f"{lead.name} needs {option.name} too; pass {option.name}=N.")
        values = {}
        for option in self.options:
            value = given.get(option.name, option.default)
            values[option.name] = None if value is None else option.checked(value)
        if self.relate is not None:
            self.relate(*values.values())
        return values


RERoPE_WINDOW_SHARE = 4
"""ReRoPE's window in the comparisons: the trained length over this (Su: 1,024 for a model trained at 4,096)."""


def rerope(window: int, leak: float | None = None) -> Method:
    """ReRoPE (Su 2023, ``bojone/rerope``): distances ``d ≥ w`` scored at w (leaky: at ``w + (d − w) / k``)."""

    near = Part(0, window, At(), At())
    if leak is None:
        return Method(
            "ReRoPE", (near, Part(window, None, At(fixed=window), At(fixed=0))), exact_below=window + 1
        )
    far = Part(window, None, At(shift=window * (leak - 1), slower=leak), At(slower=leak))
    return Method("leaky ReRoPE", (near, far), store=far.key, exact_below=window + 1)


def _rerope_compare(train_length: int, longest: int) -> tuple[str, dict[str, Any]]:
    window = max(1, train_length // RERoPE_WINDOW_SHARE)
    return f"ReRoPE + logn (w={window})", {
        "rerope_window": window,
        "scale": "logn",
        "train_length": train_length,
    }


def self_extend(group: int, window: int) -> Method:
    """Self-Extend (Jin et al. 2024, "LLM Maybe LongLM", ``datamllab/LongLM``): neighbours within ``window`` at
    their own positions, the rest grouped by ``group`` (LongLM's definition); the distance ``window`` itself is
    scored as it is where ``group`` divides it."""

    near = Part(0, window, At(), At())
    far = Part(window, None, At(group=group, shift=window - window // group), At(group=group))
    return Method(
        "Self-Extend", (near, far), store=At(group=group), exact_below=window + (window % group == 0)
    )


def _self_extend_compare(train_length: int, longest: int) -> tuple[str, dict[str, Any]]:
    """Neighbours a quarter of L (ReRoPE's window) and the least group that keeps the largest grouped distance at
    T tokens within L: ``(T − w)/G + w ≤ L`` (LongLM's rule)."""
    window = max(1, train_length // RERoPE_WINDOW_SHARE)
    group = max(2, math.ceil((longest - window) / max(1, train_length - window)))
    return f"Self-Extend (G={group}, w={window})", {"self_extend_group": group, "self_extend_window": window}


def dual_chunk(size: int, local: int) -> Method:
    """Dual Chunk Attention (An et al. 2024, ``HKUNLP/ChunkLlama``; vLLM's): chunks of ``c = size − local``
    positions from 0, keys at ``j mod c``, queries by how many chunks back the key is."""

    c = size - local
    key = At(period=c)
    parts = (
        Part(0, 1, At(period=c), key, unit=c),
        Part(1, 2, At(period=c, shift=c, cap=size), key, unit=c),
        Part(2, None, At(fixed=min(2 * c - 1, size)), key, unit=c),
    )
    return Method("Dual Chunk Attention", parts, store=key, exact_below=min(local + 2, c + 1))


def _dual_chunk_relate(size: int, local: int) -> None:
    if local >= size:
        raise ValueError(f"dual_chunk_local must be below dual_chunk_size ({size}), got {local}.")


def _dual_chunk_compare(train_length: int, longest: int) -> tuple[str, dict[str, Any]]:
    """ChunkLlama's defaults for a model trained at L: chunks of ``3L/4``, local ``L/16``."""
    size, local = max(2, 3 * train_length // 4), max(1, train_length // 16)
    return f"DCA (s={size}, l={local})", {"dual_chunk_size": size, "dual_chunk_local": local}


STRING_FACTOR = 1 + 0.1 * math.log(2)
"""STRING's factor on cos and sin (``HKUNLP/STRING``'s ``attention_factor``: YaRN's at a scale of 2)."""
STRING_LOCAL = 128
"""STRING's W when not given: the authors' (they suggest 128, 256 or 512)."""


def string(shift: int, local: int, factor: float = STRING_FACTOR) -> Method:
    """STRING (An et al. 2024, "Why Does the Effective Context Length of LLMs Fall Short?", ``HKUNLP/STRING``): keys
    at their own positions; a query less than S from its key at its own position, from S on at ``i − S + W``, so
    a distance d is scored at ``d − S + W``; cos and sin times ``factor``. The authors' two flash calls both hold
    the key exactly S back (their near window is inclusive); it is counted once here, in the far part, as their
    decoding step counts it."""

    near = Part(0, shift, At(), At())
    far = Part(shift, None, At(shift=local - shift), At())
    return Method("STRING", (near, far), store=At(), factor=factor, exact_below=shift)


def _string_relate(shift: int, local: int, factor: float) -> None:
    if shift <= local:
        raise ValueError(
            f"string_shift must exceed string_local ({local}), got {shift}: the far part scores a distance d at "
            "d - S + W, which must be nearer than d."
        )


def _string_compare(train_length: int, longest: int) -> tuple[str, dict[str, Any]]:
    """W the authors' 128 (at most L/16, for a small model); S a third of T (the authors' 0.33), or T − L + W where
    that is more, so that no far distance leaves L; where that S itself passes L (T > 2L − W), the S at which the
    near and the far part reach equally far, ``(T + W + 1) / 2``."""
    local = max(1, min(STRING_LOCAL, train_length // 16))
    shift = max(longest // 3, longest - train_length + local, local + 1)
    if shift > train_length:  # past 2L no S keeps both parts inside L: the S that keeps the largest least
        shift = (longest + local + 1) // 2
    return f"STRING (S={shift}, W={local})", {"string_shift": shift, "string_local": local}


METHODS: tuple[MethodEntry, ...] = (
    MethodEntry(
        "rerope",
        "ReRoPE",
        (
            MethodOption(
                "rerope_window",
                int,
                "W",
                "ReRoPE's window: distances >= W scored at W (RoPE decoders)",
                "ReRoPE's window w (Su 2023): a query and a key ``d = i − j`` apart are scored with RoPE at "
                "distance ``d`` when ``d < w`` and at ``w`` from there on, so no distance is ever one the model "
                "did not see. RoPE decoders on eager or sdpa; positions are the cache's, so distances are those "
                "of each row's tokens (left padding included). Costs a second set of scores.",
            ),
            MethodOption(
                "rerope_leak",
                float,
                "K",
                "leaky ReRoPE: distances >= W at W + (d - W) / K, K > 1",
                "k > 1 gives leaky ReRoPE: ``d ≥ w`` is scored at ``w + (d − w) / k`` (Su uses k = 16). Only "
                "with ``rerope_window``.",
                least=1,
                above=True,
                why="Su uses 16",
                optional=True,
            ),
        ),
        rerope,
        lambda w, k: f"ReRoPE(w={w})" if k is None else f"leaky ReRoPE(w={w}, k={k:g})",
        _rerope_compare,
    ),
    MethodEntry(
        "self_extend",
        "Self-Extend",
        (
            MethodOption(
                "self_extend_group",
                int,
                "G",
                "Self-Extend: group distant positions by G (RoPE decoders)",
                'Self-Extend\'s group size G (Jin et al. 2024, "LLM Maybe LongLM"): a pair ``i − j`` apart by '
                "less than ``self_extend_window`` is scored at the model's own positions, every other with the "
                "query at ``⌊i/G⌋ + w − ⌊w/G⌋`` and the key at ``⌊j/G⌋``. Pick G so that ``(T − w)/G + w`` "
                "stays within the trained length at T tokens. Needs ``self_extend_window``.",
            ),
            MethodOption(
                "self_extend_window",
                int,
                "W",
                "Self-Extend: neighbours nearer than W keep their positions",
                "Self-Extend's neighbour window w. Only with ``self_extend_group``.",
            ),
        ),
        self_extend,
        lambda g, w: f"Self-Extend(G={g}, w={w})",
        _self_extend_compare,
    ),
    MethodEntry(
        "dca",
        "Dual Chunk Attention",
        (
            MethodOption(
                "dual_chunk_size",
                int,
                "S",
                "Dual Chunk Attention: chunk size S (RoPE decoders)",
                "Dual Chunk Attention's chunk size s (An et al. 2024, ChunkLlama; Qwen2.5-1M's "
                "``dual_chunk_attention_config``): with ``c = s − l``, keys at ``j mod c``; a query in the key's "
                "chunk at ``i mod c``, in the next at ``min(i mod c + c, s)``, further on at ``min(2c − 1, s)``. "
                "Needs ``dual_chunk_local``. A checkpoint whose config carries ``dual_chunk_attention_config`` "
                "gets it from ``hfa.patch(model)`` with no options.",
                least=2,
            ),
            MethodOption(
                "dual_chunk_local",
                int,
                "L",
                "Dual Chunk Attention: local size L, 0 < L < S",
                "l, DCA's local size (``0 < l < s``). Only with ``dual_chunk_size``.",
            ),
        ),
        dual_chunk,
        lambda size, local: f"DCA(s={size}, l={local})",
        _dual_chunk_compare,
        relate=_dual_chunk_relate,
    ),
    MethodEntry(
        "string",
        "STRING",
        (
            MethodOption(
                "string_shift",
                int,
                "S",
                "STRING: distances >= S scored at d - S + W (RoPE decoders)",
                'STRING\'s shift S (An et al. 2024, "Why Does the Effective Context Length of LLMs Fall Short?"): '
                "keys at their own positions, a query less than S from its key at its own, one at S or more at "
                "``i − S + W``, so a distance d is scored at ``d − S + W``: the rarely trained large distances "
                "replaced by well-trained ones. The authors suggest S from 0.25 to 0.4 of the length read; past "
                "the trained length L, ``S ≥ T − L + W`` keeps every far distance inside it at T tokens. Must "
                "exceed ``string_local``.",
            ),
            MethodOption(
                "string_local",
                int,
                "W",
                f"STRING: where distance S lands, W < S (default {STRING_LOCAL})",
                f"STRING's W, the distance the key S back is scored at (default {STRING_LOCAL}, the authors'; "
                "they suggest 256 or 512 where 128 reads poorly). Only with ``string_shift``.",
                least=0,
                default=STRING_LOCAL,
            ),
            MethodOption(
                "string_factor",
                float,
                "F",
                f"STRING: cos and sin times F (default 1 + 0.1 ln 2 = {STRING_FACTOR:.4f}; 1 turns it off)",
                "STRING's factor on cos and sin, of queries and keys both (so the scores' rotary dims times its "
                "square): by default the authors' ``1 + 0.1·ln 2``, as YaRN's attention factor; ``1.0`` turns it "
                "off. Only with ``string_shift``.",
                least=0,
                above=True,
                default=STRING_FACTOR,
            ),
        ),
        string,
        lambda s, w, f: f"STRING(S={s}, W={w}" + ("" if f == STRING_FACTOR else f", f={f:g}") + ")",
        _string_compare,
        relate=_string_relate,
    ),
)
"""Every method of key parts, in the order flags, help and tables list them; one at a time in a patch."""

METHOD_OPTIONS: tuple[MethodOption, ...] = tuple(option for entry in METHODS for option in entry.options)
"""Every method's options, in the registry's order."""


def entry_of(values: Mapping[str, Any]) -> MethodEntry | None:
    """The entry of the method that patch options ``values`` (name: value, None where not given) ask for."""
    return next((entry for entry in METHODS if values.get(entry.option) is not None), None)


def method_of(config: Any) -> Method | None:
    """The declaration of the method an `AttnScaleConfig` asks for, or None."""
    values = {option.name: getattr(config, option.name) for option in METHOD_OPTIONS}
    entry = entry_of(values)
    if entry is None:
        return None
    declared = entry.declare(*(values[option.name] for option in entry.options))
    return declared._replace(option=entry.option)


def check_methods(given: dict[str, Any]) -> dict[str, Any]:
    """The methods' options among ``given`` (name: value, None where not given), checked, each method's defaults
    filled in; ValueError in one line where one is incomplete or refused, or two are asked for."""
    values: dict[str, Any] = {}
    asked = []
    for entry in METHODS:
        mine = {
            option.name: given[option.name] for option in entry.options if given.get(option.name) is not None
        }
        if mine:
            values |= entry.checked(mine)
            asked.append(entry)
    if len(asked) > 1:
        titles = ", ".join(entry.title for entry in METHODS)
        raise ValueError(
            f"{' and '.join(entry.option for entry in asked)} contradict each other: each is a method of scoring "
            f"every pair ({titles}); pass one."
        )
    return values


def label_of(values: Mapping[str, Any]) -> str | None:
    """The label of the method that patch options ``values`` ask for (None: none)."""
    entry = entry_of(values)
    if entry is None:
        return None
    return entry.label(*(values.get(option.name) for option in entry.options))
