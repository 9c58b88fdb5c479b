"""A pytest plugin (`-p testing.pytest_hygiene`, loaded by tests/conftest.py): no cluster process
outlives the test module that started it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testing.procs import reap_cluster_processes


@pytest.fixture(autouse=True, scope="module")
def _no_process_outlives_its_module() -> Iterator[None]:
    """Torn down after every other fixture of the module: a node, frontend or etcd process still running
    then was left behind (e.g. by a fixture whose setup failed half-way, before its cleanup could be
    armed); it is killed, and the module errors naming it."""
    yield
    leaked = reap_cluster_processes()
    assert not leaked, f"processes left running after this module: {leaked}"
