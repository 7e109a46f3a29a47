#!/usr/bin/env bash
# Regenerate the Python stubs in pdserve/rpc/ from proto/. Needs the grpcio-tools pinned
# (in the `dev` extra). tests/unit/test_packaging.py checks the committed stubs are current.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. \
  proto/pdserve/rpc/generate.proto proto/pdserve/rpc/kv.proto
