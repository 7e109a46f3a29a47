#!/usr/bin/env bash
# Download the wheels scripts/gpu_wheels.txt lists (Python 3.12, manylinux x86_64) into
# ${WHEELS:-wheels} for a GPU machine, and check they fit the 64 MiB a device call carries.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${WHEELS:-wheels}
mkdir -p "$dest"
grep -v '^#' scripts/gpu_wheels.txt | awk 'NF {print $1}' > "$dest/requirements.txt"
PY=${PYTHON:-.venv/bin/python}
"$PY" -m pip download -q --no-deps --only-binary :all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$dest" -r "$dest/requirements.txt"
total=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
echo "$(ls "$dest"/*.whl | wc -l) wheels, $((total / 1024)) KiB in $dest"
if (( total > 64 * 1024 * 1024 )); then echo "over the 64 MiB a device call carries" >&2; exit 1; fi
