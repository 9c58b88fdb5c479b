"""Refuses bare imports of the project's folders (`import engine` instead of `import pdserve.engine`).

The checkout's root is on `sys.path` when tests run from it, so a bare import would quietly load a second
copy of a module beside the installed `pdserve.*` one. `-p testing.pytest_hygiene` installs the guard in
every test process."""

from __future__ import annotations

import importlib.abc
import sys

PROJECT_FOLDERS = frozenset({"engine", "kernels", "kv_transfer", "registry", "rpc", "node_common", "prefill_node",
                             "decode_node", "frontend", "deploy", "planner"})


class BareImportGuard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 (the finder protocol)
        if path is None and name in PROJECT_FOLDERS:
            raise ImportError(f"import pdserve.{name}, not the bare {name!r} (the checkout's folder)")
        return None


def install() -> None:
    if not any(isinstance(f, BareImportGuard) for f in sys.meta_path):
        sys.meta_path.insert(0, BareImportGuard())
