"""The registry of methods of key parts (`hf_attnscale.core.options.methods`): every method it holds is a patch
option, a flag and a model_arg by the same names, has a plain reference in the tests, a column of the support
matrix, a row of the README's chooser and a variant of `hf-attnscale compare`; and its checks are one line each."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest
from reference import PAIR_PLACES
from test_engine import METHODS as ENGINE_METHODS

from hf_attnscale.cli.compare import comparison_variants
from hf_attnscale.cli.eval import describe
from hf_attnscale.core.options.config import OPTIONS, AttnScaleConfig
from hf_attnscale.core.options.flags import add_patch_arguments, patch_options
from hf_attnscale.core.options.methods import METHODS, method_of

ROOT = Path(__file__).resolve().parents[2]
KEYS = [entry.key for entry in METHODS]


def _entry(key):
    return next(entry for entry in METHODS if entry.key == key)


def _support_matrix():
    spec = importlib.util.spec_from_file_location("support_matrix", ROOT / "scripts" / "support_matrix.py")
    module = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
    return module


@pytest.mark.parametrize("key", KEYS)
def test_every_method_has_a_reference_and_engine_tests(key):
    """ReRoPE's reference is `rerope_logits` (tests/core/test_rerope.py); every other method's places each pair as
    its paper does (`PAIR_PLACES`), and tests/core/test_engine.py runs it."""
    assert key == "rerope" or (key in PAIR_PLACES and key in ENGINE_METHODS)


@pytest.mark.parametrize("key", KEYS)
def test_every_method_has_a_support_matrix_column(key):
    headings = _support_matrix().POSITION_METHODS
    assert key in headings
    page = (ROOT / "docs" / "SUPPORT.md").read_text()
    table_head = next(line for line in page.splitlines() if line.startswith("| model_type |"))
    assert f"| {headings[key]} |" in table_head, "run scripts/support_matrix.py"


@pytest.mark.parametrize("key", KEYS)
def test_every_method_has_a_row_in_the_readmes_chooser(key):
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| ")]
    title = _entry(key).title
    assert any(row.startswith((f"| {title} ", f"| **{title}", f"| {title} +")) for row in rows), title


@pytest.mark.parametrize("key", KEYS)
def test_every_method_has_a_compare_variant_that_patches(key):
    option = _entry(key).option
    variants = comparison_variants([], 4, train_length=8192, longest=32768)
    (variant,) = [v for v in variants if v.patch and option in v.patch]
    assert method_of(variant.config) is not None


@pytest.mark.parametrize("key", KEYS)
def test_every_methods_options_are_fields_flags_and_model_args(key):
    entry = _entry(key)
    parser = argparse.ArgumentParser()
    add_patch_arguments(parser, "patch")
    given = {}
    for option in entry.options:
        assert (
            option.name in OPTIONS
            and option.help
            and " ".join(option.doc.split()) in " ".join(AttnScaleConfig.__doc__.split())
        )
        flag = "--" + option.name.replace("_", "-")
        assert flag in parser.format_help()
        given[option.name] = option.default
    lead = entry.options[0]
    example = {"rerope": 64, "self_extend": 4, "dca": 64, "string": 256}[key]
    args = [f"--{lead.name.replace('_', '-')}", str(example)]
    for option in entry.options[1:]:
        if option.default is None and not option.optional:
            args += [f"--{option.name.replace('_', '-')}", "8"]
    from_flags = patch_options(parser.parse_args(args))
    from_text = AttnScaleConfig.from_text(**{name: str(value) for name, value in from_flags.items()})
    assert from_text == AttnScaleConfig(**from_flags)
    assert from_text.key_parts == entry.option
    assert method_of(from_text).option == entry.option
    assert describe(from_text.to_dict(), 0, None).startswith(
        entry.label(*(getattr(from_text, o.name) for o in entry.options))
    )


def test_two_methods_contradict_each_other_in_one_line():
    first, second = METHODS[0], METHODS[1]
    with pytest.raises(
        ValueError, match=f"{first.option} and {second.option} contradict each other"
    ) as error:
        AttnScaleConfig(**{first.option: 64, second.option: 4, second.options[1].name: 8})
    assert "\n" not in str(error.value)


def test_the_config_round_trips_every_methods_options():
    for entry in METHODS:
        values = {option.name: option.default for option in entry.options if option.default is not None}
        values[entry.option] = 256
        for option in entry.options[1:]:
            values.setdefault(option.name, 8 if not option.optional else None)
        config = AttnScaleConfig(**{k: v for k, v in values.items() if v is not None})
        assert AttnScaleConfig.from_dict(config.to_dict()) == config
