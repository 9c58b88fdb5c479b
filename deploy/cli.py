from __future__ import annotations


def main() -> None:  # replaced below once the engine lands
    raise SystemExit("pdserve: not ready")
