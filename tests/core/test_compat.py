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

from hf_attnscale.core import compat

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version", ["5.13.0", "5.13.1", "5.23.0", "5.99.3", "5.24.0.dev0", "5.30.0rc1"])
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


def test_release_numbers():
    assert compat.release("5.10.4") == (5, 10, 4)
    assert compat.release("5.24.0.dev0") == (5, 24)
    assert compat.release("6") == compat.release("6.0.0")
    assert compat.release("5.13") == compat.release("5.13.0") < compat.release("5.13.1")
    with pytest.raises(ValueError, match="not a version"):
        compat.release("main")


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


def test_position_bias_mask_blocks_with_the_lowest_finite_value():
    query = torch.zeros(1, 1, 3, 4)
    key = torch.zeros(1, 1, 4, 4, dtype=torch.bfloat16)
    bias = torch.arange(12.0).view(1, 1, 3, 4)
    out = compat.create_position_bias_mask(bias, None, True, query, key)
    lowest = torch.finfo(torch.bfloat16).min
    expected = torch.tensor([[0, lowest, lowest, lowest], [4, 5, lowest, lowest], [8, 9, 10, lowest]])
    assert torch.equal(out, expected.view(1, 1, 3, 4))
    assert out.is_contiguous()
