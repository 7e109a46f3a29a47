#!/usr/bin/env bash
# The GPU integration tests (tests/gpu/test_gpu.py, markers gpu and multi_gpu) on a node with
# CUDA devices: cuda_ipc between processes, the engine on a GPU, the cluster on GPUs.
# Installs the dev and gpu extras (cupy-cuda12x) unless PDSERVE_NO_INSTALL=1, with
# TORCH_SPEC naming a CUDA build of torch (e.g. TORCH_SPEC=torch). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${PDSERVE_NO_INSTALL:-0}" = 1 ] || bash scripts/install.sh dev,gpu
export RAY_USAGE_STATS_ENABLED=0
exec "${PYTHON:-.venv/bin/python}" -m pytest -q -p no:cacheprovider -rs -m "gpu or multi_gpu" "$@" tests/gpu/test_gpu.py
