#!/usr/bin/env bash
# The main job on the embedded default: install, start local Ray with one prefill and
# one decode replica of the bundled model, answer a real prompt, then stop everything.
# Set PDSERVE_KEEP_UP=1 to leave the cluster running for more `pdserve generate` calls.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/pdserve generate --local "${1:-Name the capital of France.}"
if [ "${PDSERVE_KEEP_UP:-0}" != 1 ]; then .venv/bin/pdserve down; else echo "pdserve is still up (stop it with: .venv/bin/pdserve down)"; fi
