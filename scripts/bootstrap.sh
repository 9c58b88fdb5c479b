#!/usr/bin/env bash
# Idempotent environment bootstrap: .venv with the CPU build of torch installed first,
# then the project (editable) with its extras. Re-runs are no-ops unless pyproject.toml changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3
venv="$root/.venv"
stamp="$venv/.pdserve-bootstrap"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
if [[ ! -x "$venv/bin/python" ]]; then
  echo "[bootstrap] creating $venv" >&2
  "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade pip >&2
# torch first: the CPU build lies on local disk; anything resolving torch later sees it satisfied
# instead of pulling a multi-GB CUDA build.
"$venv/bin/python" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null \
  || "${pip[@]}" install "torch==2.13.0" >&2
"${pip[@]}" install -e ".[dev]" >&2
echo "$want" > "$stamp"
