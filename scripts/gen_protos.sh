#!/usr/bin/env bash
# Regenerates rpc/*_pb2*.py from rpc/pdserve.proto (the grpc module imports `pdserve.rpc.pdserve_pb2`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
"${PYTHON:-.venv/bin/python}" -m grpc_tools.protoc -I rpc --python_out=rpc --pyi_out=rpc \
  --grpc_python_out=rpc rpc/pdserve.proto
sed -i 's/^import pdserve_pb2 as/from pdserve.rpc import pdserve_pb2 as/' rpc/pdserve_pb2_grpc.py
