"""Shared fixtures: the cached tiny models (created on first use, safe when test processes race)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

# Triton decides at kernel-definition time whether a kernel runs in its CPU interpreter, so the choice
# has to be made once for the whole session, before any test module imports kernels.triton_*.
# A GPU run (PDSERVE_TEST_DEVICE=cuda) compiles the kernels for real instead.
if os.environ.get("PDSERVE_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Every cluster the tests start authenticates its internal calls, as a deployed one does: nodes and
# frontends (in this process or spawned) read the shared token from the environment.
os.environ.setdefault("PDSERVE_CLUSTER_TOKEN", "pdserve-test-" + os.urandom(12).hex())

import pytest  # noqa: E402
import torch  # noqa: E402

from pdserve.engine.tiny import default_model_dir


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Callable[..., Path]:
    """`tiny_model_dir(arch, seed=0)` -> directory of the cached tiny model ("llama" | "qwen2" | "qwen3"),
    created on first use; the files are the same on every machine (tests/test_tiny_pins.py)."""

    def get(arch: str, seed: int = 0) -> Path:
        return default_model_dir(arch, seed)

    return get


@pytest.fixture(scope="session")
def quantized_dirs(tmp_path_factory: pytest.TempPathFactory,
                   tiny_model_dir: Callable[[str], Path]) -> Callable[[str, str], Path]:
    """`quantized_dirs(arch, type)` -> the tiny model of `arch` quantized to GGUF `type` by `pdserve model
    quantize`'s code, made once per session."""
    from pdserve.engine.quantize import quantize_model

    made: dict[tuple[str, str], Path] = {}

    def get(arch: str, kind: str) -> Path:
        if (arch, kind) not in made:
            out = tmp_path_factory.mktemp(f"q-{arch}-{kind}") / "model"
            made[(arch, kind)] = quantize_model(tiny_model_dir(arch), out, kind, log=False)
        return made[(arch, kind)]

    return get


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("qwen3")
