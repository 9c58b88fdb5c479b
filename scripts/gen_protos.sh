#!/usr/bin/env bash
# Regenerates protos/*_pb2*.py from protos/pdserve.proto (imports rewritten to be package-relative).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
"${PYTHON:-.venv/bin/python}" -m grpc_tools.protoc -I protos --python_out=protos --pyi_out=protos \
  --grpc_python_out=protos protos/pdserve.proto
sed -i 's/^import pdserve_pb2 as/from protos import pdserve_pb2 as/' protos/pdserve_pb2_grpc.py
