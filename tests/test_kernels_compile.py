"""Ahead-of-time compilation of every Triton kernel for a Hopper GPU (sm_90), on a machine without one.

Triton ships ptxas, so lowering to a cubin needs no driver: this catches code that the CPU interpreter
accepts but the compiler rejects (tile shapes, dot operand layouts, precisions) before the GPU check.

The compile runs in a subprocess (tests/aot_compile.py) because this session runs kernels in Triton's
interpreter (TRITON_INTERPRET=1, chosen once in conftest.py) and Triton fixes that choice per process.
The subprocess gets no TRITON_* variables from this one, a private empty TRITON_CACHE_DIR, its own
TRITON_HOME and HOME, and TRITON_ALWAYS_COMPILE=1: a kernel cached by an earlier run, here or in ~/.triton,
cannot stand in for a compile that would fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

triton = pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("aot_compile.py")
NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

pytestmark = pytest.mark.skipif(not (NVIDIA_BIN / "ptxas").exists(),
                                reason="this Triton build has no bundled ptxas")


def clean_compile_env(tmp: Path) -> dict[str, str]:
    """This process's environment without any TRITON_* variable, with Triton's cache, home and the user's
    home pointed at fresh directories under `tmp` (created here) and every kernel compiled anew."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
    for name in ("cache", "home"):
        (tmp / name).mkdir()
    env.update(TRITON_CACHE_DIR=str(tmp / "cache"), TRITON_HOME=str(tmp / "home"), HOME=str(tmp / "home"),
               TRITON_ALWAYS_COMPILE="1")
    return env


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The subprocess's compile report for every case (one process for the module: a few seconds)."""
    tmp = tmp_path_factory.mktemp("aot")
    env = clean_compile_env(tmp)
    res = subprocess.run([sys.executable, str(SCRIPT)], env=env, cwd=SCRIPT.parents[1], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, f"aot_compile.py exited {res.returncode}:\n{res.stderr[-4000:]}"
    assert any((tmp / "cache").iterdir()), "the compiles did not go through the private cache"
    return json.loads(res.stdout)


def case(report: dict[str, Any], name: str) -> dict[str, dict[str, Any]]:
    """The kernels of one case, failing the test with the compiler's traceback if it did not compile."""
    entry = report[name]
    if entry["error"]:
        pytest.fail(f"{name} failed to compile for sm_90:\n{entry['error']}", pytrace=False)
    for kernel, info in entry["kernels"].items():
        assert info["cubin_bytes"] > 0, f"{kernel}: no cubin"
    return entry["kernels"]


@pytest.mark.parametrize("head_dim", [128, 64])
def test_decode_kernels_compile_without_spills(report: dict[str, Any], head_dim: int) -> None:
    kernels = case(report, f"decode_hd{head_dim}")
    assert set(kernels) == {"decode_split", "merge_splits"}
    assert kernels["decode_split"]["mma"]  # the score and value products run on tensor cores
    assert kernels["decode_split"]["stack"] in (0, None)


def test_prefill_kernel_compiles_without_spills(report: dict[str, Any]) -> None:
    kernels = case(report, "prefill")
    assert kernels["prefill"]["mma"]
    assert kernels["prefill"]["stack"] in (0, None)


def test_cache_and_block_kernels_compile(report: dict[str, Any]) -> None:
    kernels = case(report, "cache_and_blocks")
    assert set(kernels) == {"store_kv", "copy_blocks_to_buffer=True", "copy_blocks_to_buffer=False"}


def test_compile_refuses_the_interpreter(tmp_path: Path) -> None:
    """The script must not report an interpreter run as a compile."""
    env = clean_compile_env(tmp_path)
    env["TRITON_INTERPRET"] = "1"
    res = subprocess.run([sys.executable, str(SCRIPT)], env=env, cwd=SCRIPT.parents[1], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
