"""Debian packages the tests need (real servers, a real browser): installed on first use when we are root
with apt-get (and PDSERVE_NO_APT is unset), else the calling test is skipped with what to install."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable

import pytest


def require_package(package: str, find: Callable[[], str | None], what: str) -> str:
    """What `find` returns (a path), installing Debian's `package` first when it returns None; skips the
    calling test when it cannot be installed or still finds nothing. `what` names the thing sought."""
    found = find()
    if found:
        return found
    if os.environ.get("PDSERVE_NO_APT") or os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"needs {what} (Debian: apt-get install {package}), and is not root with apt-get to install it")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=300", package]
    if subprocess.run(install, env=env, capture_output=True, timeout=900).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=900)
        result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            pytest.skip(f"apt-get install {package} failed: {result.stderr[-500:]}")
    found = find()
    if not found:
        pytest.skip(f"the {package} package installed no {what}")
    return found
