#!/usr/bin/env bash
# Install with the dev extra (pytest, grpcio-tools) and run the whole test suite:
# unit tests on tiny random-weight models, then end-to-end tests on a real local
# Ray Serve cluster with the real model. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
export RAY_USAGE_STATS_ENABLED=0
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=40 "$@" tests
