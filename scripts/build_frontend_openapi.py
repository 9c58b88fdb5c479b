"""Writes frontend/openapi.json, the OpenAPI document the frontend serves at /openapi.json, from the
vendored OpenAI spec (testing/openai-openapi/). tests/test_frontend_hostile.py checks the file is current.

    .venv/bin/python scripts/build_frontend_openapi.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from testing.openapi import frontend_document  # noqa: E402

TARGET = REPO_ROOT / "frontend" / "openapi.json"


def render() -> str:
    return json.dumps(frontend_document(), indent=1, sort_keys=False) + "\n"


def main() -> int:
    TARGET.write_text(render(), encoding="utf-8")
    print(f"wrote {TARGET} ({TARGET.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
