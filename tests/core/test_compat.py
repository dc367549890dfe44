"""The supported transformers range: checked at import with a one-line error, stated alike in pyproject.toml;
and the compatibility shims, against transformers' own functions where it has them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import InvalidVersion

from hf_attnscale.core import compat

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "version", ["5.13.0", "5.13", "5.13.1", "5.23.0", "5.99.3", "5.24.0.dev0", "5.30.0rc1", "5.24.0+cpu"]
)
def test_supported_versions_pass(version):
    compat.check_transformers(version)


@pytest.mark.parametrize(
    "version", ["5.0.0", "5.10.4", "5.12.1", "4.57.6", "6.0.0", "6", "6.0.0.dev0", "7.1.0"]
)
def test_unsupported_versions_get_one_line_naming_both(version):
    with pytest.raises(compat.UnsupportedVersionError) as caught:
        compat.check_transformers(version)
    message = str(caught.value)
    assert "\n" not in message
    assert f"transformers {version} is installed" in message
    assert "transformers>=5.13.0,<6" in message
    assert isinstance(caught.value, ImportError)


def test_the_installed_transformers_is_supported():
    import transformers

    compat.check_transformers()  # the suite runs on a supported version
    compat.check_transformers(transformers.__version__)


def test_no_transformers_installed_is_left_to_the_import_that_needs_it(monkeypatch):
    def missing(name):
        raise compat.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(compat.metadata, "version", missing)
    compat.check_transformers()


def test_the_range_is_the_installed_packages_transformers_requirement(monkeypatch):
    """The range is read from hf_attnscale's metadata (pyproject.toml as installed), not written in the
    module: another requirement there is another range, in the message too."""
    requires = ["torch<3,>=2.13", "transformers<5.30,>=5.20", 'transformers<5; extra == "old"', "tqdm"]
    monkeypatch.setattr(
        compat.metadata, "requires", lambda name: requires if name == "hf_attnscale" else None
    )
    assert compat.supported_transformers() == ">=5.20,<5.30"
    for version in ("5.20", "5.20.0.dev0", "5.29.9", "5.29.0rc1+local"):
        compat.check_transformers(version)
    for version in ("5.19.9", "5.13.0", "5.30.0rc1", "5.30"):
        with pytest.raises(compat.UnsupportedVersionError, match=r"transformers>=5\.20,<5\.30, but"):
            compat.check_transformers(version)


def test_a_source_folder_that_is_not_installed_checks_nothing(monkeypatch):
    def missing(name):
        raise compat.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(compat.metadata, "requires", missing)
    assert compat.supported_range() is None
    compat.check_transformers("4.57.6")


def test_a_version_that_is_no_version_is_refused():
    with pytest.raises(InvalidVersion, match="main"):
        compat.check_transformers("main")
    assert issubclass(InvalidVersion, ValueError)


def test_pyproject_states_the_checked_range():
    stated = re.findall(r'"transformers([^"]*)"', (ROOT / "pyproject.toml").read_text())
    assert [s.replace(" ", "") for s in stated] == [compat.supported_transformers()]


def test_import_stops_at_an_unsupported_transformers_with_one_line(tmp_path):
    """A fresh interpreter whose first transformers distribution on the path says 5.10.4 (one that lacks
    create_position_bias_mask): ``import hf_attnscale`` ends in the one line, before anything imports
    transformers."""
    info = tmp_path / "transformers-5.10.4.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 5.10.4\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    code = "import sys\ntry:\n    import hf_attnscale\nfinally:\n    print('transformers' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 1
    assert result.stdout.strip() == "False"  # stopped before any import of transformers
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        "hf_attnscale.core.compat.UnsupportedVersionError: hf_attnscale supports transformers>=5.13.0,<6, "
        "but transformers 5.10.4 is installed: pip install 'transformers>=5.13.0,<6'"
    )
    assert "cannot import name" not in result.stderr


def _position_bias_cases():
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for q_len, k_len in ((5, 5), (3, 7)):
            query = torch.randn(2, 4, q_len, 8, generator=generator).to(dtype)
            key = torch.randn(2, 4, k_len, 8, generator=generator).to(dtype)
            bias = torch.randn(1, 4, q_len, k_len, generator=generator).to(dtype)
            boolean = torch.rand(2, 1, q_len, k_len, generator=generator) > 0.3
            additive = torch.zeros(2, 1, q_len, k_len, dtype=dtype).masked_fill(~boolean, -1e4)
            for mask, causal in ((None, True), (None, False), (boolean, True), (additive, False)):
                yield bias, mask, causal, query, key


def test_position_bias_mask_copy_matches_transformers():
    sdpa_attention = pytest.importorskip("transformers.integrations.sdpa_attention")
    if not hasattr(sdpa_attention, "create_position_bias_mask"):
        pytest.skip("this transformers has no create_position_bias_mask (before 5.14)")
    cases = list(_position_bias_cases())
    assert len(cases) == 24
    for bias, mask, causal, query, key in cases:
        ours = compat.create_position_bias_mask(bias, mask, causal, query, key)
        theirs = sdpa_attention.create_position_bias_mask(bias, mask, causal, query, key)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert torch.equal(ours, theirs), (bias.dtype, None if mask is None else mask.dtype, causal)


def test_the_patch_uses_transformers_position_bias_mask_where_it_has_one():
    """The copy is only for a transformers without its own (5.13): on 5.14 and later the patch folds a
    position bias into the mask with transformers' function itself."""
    from transformers.integrations import sdpa_attention

    from hf_attnscale.core.call import backends

    theirs = getattr(sdpa_attention, "create_position_bias_mask", None)
    expected = compat.create_position_bias_mask if theirs is None else theirs
    assert backends.create_position_bias_mask is expected


def test_position_bias_mask_blocks_with_the_lowest_finite_value():
    query = torch.zeros(1, 1, 3, 4)
    key = torch.zeros(1, 1, 4, 4, dtype=torch.bfloat16)
    bias = torch.arange(12.0).view(1, 1, 3, 4)
    out = compat.create_position_bias_mask(bias, None, True, query, key)
    lowest = torch.finfo(torch.bfloat16).min
    expected = torch.tensor([[0, lowest, lowest, lowest], [4, 5, lowest, lowest], [8, 9, 10, lowest]])
    assert torch.equal(out, expected.view(1, 1, 3, 4))
    assert out.is_contiguous()


NESTED_CASES = {  # (layer_types, RoPE labels, rope_parameters, the nested keys)
    "flat": (None, None, {"rope_type": "yarn", "factor": 4.0}, []),
    "flat, with layer types": (["full_attention", "sliding_attention"], None, {"rope_theta": 1e4}, []),
    "by layer type": (
        ["full_attention", "sliding_attention"],
        None,
        {
            "full_attention": {"rope_type": "linear", "factor": 8.0},
            "sliding_attention": {"rope_type": "default"},
        },
        ["full_attention", "sliding_attention"],
    ),
    "mixed": (
        ["full_attention"],
        None,
        {"full_attention": {"rope_type": "default"}, "rope_theta": 1e4},
        ["full_attention"],
    ),
    "by label (DeepSeek-V4)": (
        ["sliding_attention", "compressed_sparse_attention"],
        ("main", "compress"),
        {"main": {"rope_type": "default"}, "compress": {"rope_type": "yarn", "factor": 4.0}},
        ["main", "compress"],
    ),
    "empty": (["full_attention"], None, {}, []),
}


class _Bare:
    """A config without ``nested_rope_parameter_keys``, as transformers 5.13 and 5.17 have them."""

    def __init__(self, layer_types, labels):
        self.layer_types = layer_types
        if labels is not None:
            self._rope_type_labels = labels


@pytest.mark.parametrize("case", list(NESTED_CASES))
def test_nested_rope_keys(case):
    """The rule where transformers has none (5.13, 5.17) gives the expected keys, and so does transformers' own
    where it has one (5.24)."""
    from transformers import PreTrainedConfig

    layer_types, labels, rope_parameters, nested = NESTED_CASES[case]
    assert compat.nested_rope_keys(_Bare(layer_types, labels), rope_parameters) == nested
    config = PreTrainedConfig()
    config.layer_types = layer_types
    if labels is not None:
        config._rope_type_labels = labels
    assert compat.nested_rope_keys(config, rope_parameters) == nested
