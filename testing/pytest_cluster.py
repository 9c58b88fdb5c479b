"""Fixtures the node-cluster test modules share (a pytest plugin loaded by tests/conftest.py):

- `model_dir`: the tiny llama model (module scope; a module may override it);
- `reference`: the single-process fp32 engine the cluster's greedy tokens are compared with;
- `check_integrity_after_each_test`: opt in with `pytestmark = pytest.mark.usefixtures(...)` in a module
  whose `cluster` fixture is a `LocalCluster`: after every test, every live node's KV blocks, engine
  requests, streams and request objects agree (NodeControl/CheckIntegrity).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.tiny import default_model_dir
from testing.cluster import LocalCluster, reference_engine


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_dir("llama")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> LLMEngine:
    return reference_engine(model_dir)


@pytest.fixture
def check_integrity_after_each_test(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    cluster = request.getfixturevalue("cluster")
    assert isinstance(cluster, LocalCluster)
    cluster.check_integrity()
