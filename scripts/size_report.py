"""Lists product files over 400 lines and functions over 50 lines (generated protobuf code aside).

    .venv/bin/python scripts/size_report.py [--all]   # --all: bench/, testing/ and tests/ too
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("engine", "kernels", "kv_transfer", "registry", "rpc", "node_common", "prefill_node", "decode_node", "frontend",
           "deploy", "planner")
EXTRA = ("bench", "testing", "tests", "scripts")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 50


def report(packages: tuple[str, ...]) -> list[str]:
    out = []
    for pkg in packages:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            rel = path.relative_to(ROOT)
            text = path.read_text(encoding="utf-8")
            n = len(text.splitlines())
            if n > MAX_FILE_LINES:
                out.append(f"file {rel}: {n} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = (node.end_lineno or node.lineno) - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        out.append(f"function {rel}:{node.lineno} {node.name}: {length} lines")
    return out


if __name__ == "__main__":
    lines = report(PRODUCT + (EXTRA if "--all" in sys.argv else ()))
    print("\n".join(lines) or "none")
