"""A small disk that fills up, for tests of what a full disk does: a tmpfs of a few hundred KiB mounted in
the test's directory (root only; the calling test is skipped elsewhere)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(parent: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's syntax: "256k") at parent/small, unmounted afterwards."""
    mount = parent / "small"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a full disk is simulated with a small tmpfs, which needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode()[-200:]}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
