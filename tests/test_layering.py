"""Dependencies point one way: engine and kernels know nothing of nodes, nodes nothing of HTTP, the
frontend and the launcher need no torch, and `protos` is only the protocol."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# package -> top-level packages its modules must never import
FORBIDDEN: dict[str, set[str]] = {
    "kernels": {"engine", "kv_transfer", "registry", "node", "frontend", "deploy", "protos", "testing"},
    "engine": {"kv_transfer", "registry", "node", "frontend", "deploy", "protos", "testing"},
    "kv_transfer": {"engine", "node", "frontend", "deploy", "protos", "testing"},
    "registry": {"engine", "kernels", "kv_transfer", "node", "frontend", "deploy", "protos", "testing", "torch"},
    "protos": {"engine", "kernels", "kv_transfer", "registry", "node", "frontend", "deploy", "testing", "torch"},
    "node": {"frontend", "deploy", "testing", "fastapi", "starlette", "uvicorn", "httpx"},
    "frontend": {"kernels", "kv_transfer", "node", "deploy", "testing", "torch"},
    # The planner reads metrics over HTTP and simulates; only planner.measure runs the engine (checked below).
    "planner": {"node", "frontend", "registry", "placement", "protos", "rpc", "testing"},
    "rpc": {"engine", "kernels", "kv_transfer", "registry", "node", "frontend", "deploy", "protos", "testing", "torch"},
    # Tracing knows nothing of the project; the frontend and the nodes call it.
    "tracing": {"engine", "kernels", "kv_transfer", "registry", "placement", "node", "frontend", "deploy", "protos",
                "rpc", "testing", "torch", "fastapi", "starlette", "grpc"},
}


def imported_packages(path: Path) -> set[str]:
    """Top-level packages a module imports (absolute imports only; the project uses no relative ones)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package: str) -> None:
    bad = {}
    for path in sorted((REPO_ROOT / package).rglob("*.py")):
        wrong = imported_packages(path) & FORBIDDEN[package]
        if wrong:
            bad[str(path.relative_to(REPO_ROOT))] = sorted(wrong)
    assert not bad, f"{package} imports what it must not: {bad}"


def test_protos_holds_only_the_protocol() -> None:
    names = {p.name for p in (REPO_ROOT / "protos").iterdir() if not p.name.startswith("__pycache__")}
    assert names <= {"__init__.py", "pdserve.proto", "pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py"}


@pytest.mark.parametrize("module", ["frontend.server", "frontend.app", "deploy.launcher", "engine.prefix_hash",
                                    "engine.model_config", "engine.tokenizer", "engine.structured_spec",
                                    "tracing", "tracing.tracer"])
def test_imports_without_torch_in_a_fresh_interpreter(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"importing {module} imported torch: {out.stdout.strip()[:300]}"


def test_the_frontend_builds_its_model_catalog_without_torch(tiny_llama_dir: Path) -> None:
    """Beyond imports: loading a served model (tokenizer, config.json) must not pull torch in either."""
    code = (
        "import sys\n"
        "from frontend.config import ModelSpec\n"
        "from frontend.models import ModelCatalog\n"
        f"catalog = ModelCatalog((ModelSpec(name='tiny', path={str(tiny_llama_dir)!r}),))\n"
        "assert catalog.models[0].max_context > 0\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
