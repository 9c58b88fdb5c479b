"""Dependencies point one way: engine and kernels know nothing of nodes, nodes nothing of HTTP, the
frontend and the launcher need no torch, and every project import goes through the `pdserve` namespace."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# The folders the wheel installs as `pdserve.<folder>`.
PACKAGES = ("engine", "kernels", "kv_transfer", "registry", "rpc", "node_common", "prefill_node", "decode_node",
            "frontend", "deploy", "planner")
# Folders of the checkout that are never installed.
UNPACKAGED = ("testing", "bench", "tests", "scripts")

_NODES = {"node_common", "prefill_node", "decode_node"}
_HTTP = {"fastapi", "starlette", "uvicorn", "httpx"}
# package -> what its modules must never import (project packages by folder name, or third-party modules)
FORBIDDEN: dict[str, set[str]] = {
    "kernels": {"engine", "kv_transfer", "registry", "rpc", *_NODES, "frontend", "deploy", "planner", "testing"},
    "engine": {"kv_transfer", "registry", "rpc", *_NODES, "frontend", "deploy", "planner", "testing"},
    "kv_transfer": {"engine", "rpc", *_NODES, "frontend", "deploy", "planner", "testing"},
    # The registry's placement rule hashes prompts as the engine's prefix cache does (engine.prefix_hash,
    # torch-free: checked below); nothing else of the engine.
    "registry": {"kernels", "kv_transfer", "rpc", *_NODES, "frontend", "deploy", "planner", "testing", "torch"},
    "rpc": {"engine", "kernels", "kv_transfer", "registry", *_NODES, "frontend", "deploy", "planner", "testing",
            "torch"},
    "node_common": {"prefill_node", "decode_node", "frontend", "deploy", "planner", "testing", *_HTTP},
    "prefill_node": {"decode_node", "frontend", "deploy", "planner", "testing", *_HTTP},
    "decode_node": {"prefill_node", "frontend", "deploy", "planner", "testing", *_HTTP},
    "frontend": {"kernels", "kv_transfer", *_NODES, "deploy", "planner", "testing", "torch"},
    # The planner reads metrics over HTTP and simulates; only planner.measure runs the engine (checked below).
    "planner": {*_NODES, "frontend", "registry", "rpc", "testing"},
}
# Modules of a package allowed one import its package otherwise forbids.
ALLOWED = {("registry/placement.py", "engine"): "pdserve.engine.prefix_hash"}
# rpc.tracing knows nothing of the project nor of gRPC; the frontend and the nodes call it.
TRACING_FORBIDDEN = {"engine", "kernels", "kv_transfer", "registry", *_NODES, "frontend", "deploy", "planner",
                     "testing", "torch", "fastapi", "starlette", "grpc"}


def imports(path: Path) -> set[str]:
    """Dotted names a module imports (absolute imports only; the project uses no relative ones)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def package_of(name: str) -> str:
    """The folder (for `pdserve.X...`) or top-level module an import names."""
    parts = name.split(".")
    return parts[1] if parts[0] == "pdserve" and len(parts) > 1 else parts[0]


def _py_files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (REPO_ROOT / f).rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package: str) -> None:
    bad = {}
    for path in _py_files(package):
        rel = str(path.relative_to(REPO_ROOT))
        wrong = sorted(name for name in imports(path) if package_of(name) in FORBIDDEN[package]
                       and ALLOWED.get((rel, package_of(name))) != name)
        if wrong:
            bad[rel] = wrong
    assert not bad, f"{package} imports what it must not: {bad}"


def test_only_the_planners_measure_module_runs_the_engine() -> None:
    engine_side = {"engine", "kernels", "kv_transfer", "torch"}
    bad = {str(p.relative_to(REPO_ROOT)): sorted(n for n in imports(p) if package_of(n) in engine_side)
           for p in _py_files("planner") if p.name != "measure.py"}
    assert not any(bad.values()), bad


def test_tracing_imports_nothing_of_the_project() -> None:
    bad = {str(p.relative_to(REPO_ROOT)): sorted(n for n in imports(p) if package_of(n) in TRACING_FORBIDDEN)
           for p in _py_files("rpc/tracing")}
    assert not any(bad.values()), bad


def test_project_imports_go_through_the_pdserve_namespace() -> None:
    """A bare `import engine` would load a second copy of a module from the checkout's root."""
    bare = {}
    for path in _py_files(*PACKAGES, *UNPACKAGED):
        names = sorted(n for n in imports(path) if n.split(".")[0] in PACKAGES
                       or n.split(".")[0] == "pdserve" and package_of(n) not in PACKAGES)
        if names:
            bare[str(path.relative_to(REPO_ROOT))] = names
    assert not bare, f"import these as pdserve.<folder>, one of {PACKAGES}: {bare}"


_NAMES = "|".join(PACKAGES)
_CODE_IN_STRINGS = re.compile(rf"(?:^|;)\s*(?:from\s+(?:{_NAMES})(?:\.\w+)*\s+import\s|import\s+(?:[\w.]+,\s*)*(?:{_NAMES})\b)",
                              re.M)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions (prose, not code)."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            out.add(id(body[0].value))
    return out


# Trace span names that read like module paths (rpc.tracing spans of the frontend's stages).
_SPAN_NAMES = {"frontend.admission", "frontend.limits", "frontend.routing", "frontend.upstream"}


def _bare_in_string(value: str) -> bool:
    if value in _SPAN_NAMES:
        return False
    head = value.split(".")[0]
    dotted_module = (head in PACKAGES and " " not in value and value.count(".") >= 1
                     and (REPO_ROOT / head / f"{value.split('.')[1]}.py").exists())
    return dotted_module or bool(_CODE_IN_STRINGS.search(value))


def test_code_in_strings_imports_through_the_namespace_too() -> None:
    """Snippets run with `python -c`, and module paths handed to `-m`, importlib or monkeypatch, live in
    string constants, where the checks above do not look; from the checkout's root a bare name there
    would still import, as a second copy of the module."""
    bare = {}
    for path in _py_files(*PACKAGES, *UNPACKAGED):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        prose = _docstrings(tree)
        hits = sorted({node.value[:80] for node in ast.walk(tree) if isinstance(node, ast.Constant)
                       and isinstance(node.value, str) and id(node) not in prose and _bare_in_string(node.value)})
        if hits:
            bare[str(path.relative_to(REPO_ROOT))] = hits
    assert not bare, f"name these pdserve.<folder>...: {bare}"


def test_the_packaged_folders_are_the_listed_packages() -> None:
    """pyproject lists every package of the wheel; a folder with an __init__.py that it misses would be
    left out of installs, and nothing unpackaged may be listed."""
    setuptools = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {"pdserve." + ".".join(p.parent.relative_to(REPO_ROOT).parts)
             for f in PACKAGES for p in (REPO_ROOT / f).rglob("__init__.py")}
    assert set(setuptools["packages"]) == found
    assert setuptools["package-dir"] == {f"pdserve.{f}": f for f in PACKAGES}


def test_rpc_holds_the_protocol_its_security_and_tracing() -> None:
    names = {p.name for p in (REPO_ROOT / "rpc").iterdir() if p.name != "__pycache__"}
    assert names == {"__init__.py", "pdserve.proto", "pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py",
                     "security.py", "enums.py", "tracing"}


@pytest.mark.parametrize("module", ["pdserve.frontend.main", "pdserve.frontend.app", "pdserve.deploy.launcher",
                                    "pdserve.engine.prefix_hash", "pdserve.engine.model_config",
                                    "pdserve.engine.tokenizer", "pdserve.engine.structured_spec",
                                    "pdserve.registry.placement", "pdserve.rpc.tracing", "pdserve.rpc.tracing.tracer"])
def test_imports_without_torch_in_a_fresh_interpreter(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"importing {module} imported torch: {out.stdout.strip()[:300]}"


def test_the_frontend_builds_its_model_catalog_without_torch(tiny_llama_dir: Path) -> None:
    """Beyond imports: loading a served model (tokenizer, config.json) must not pull torch in either."""
    code = (
        "import sys\n"
        "from pdserve.frontend.config import ModelSpec\n"
        "from pdserve.frontend.models import ModelCatalog\n"
        f"catalog = ModelCatalog((ModelSpec(name='tiny', path={str(tiny_llama_dir)!r}),))\n"
        "assert catalog.models[0].max_context > 0\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
