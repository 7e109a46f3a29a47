#!/usr/bin/env bash
# Engine benchmark on the bundled model (one core, bf16): installs the bench extra, then runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh bench
exec .venv/bin/python -m bench.engine "$@"
