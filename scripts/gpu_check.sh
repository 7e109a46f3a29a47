#!/usr/bin/env bash
# One prepared GPU check (a lent NVIDIA machine: Python 3.12, CUDA torch, cupy, transformers;
# no Ray). Under 8 minutes on an H200:
#   1. tests/gpu/test_gpu.py but the cluster test: the engine on the GPU against model.generate
#      (CUDA graphs captured and replayed, and eager), cuda_ipc between two processes
#      (bit-exact, a corrupted copy caught);
#   2. bench/engine.py --device cuda on random weights of Llama 3.1 8B's shape (made on the GPU):
#      decode at batch 1 and 64 against HBM read bandwidth, a 2,048-token prefill's FLOP/s
#      against the GPU's matmul peak (targets: 70% and 50%).
# The Python packages it needs beyond the image's (scripts/gpu_wheels.txt: pytest, grpcio, a
# protobuf matching the stubs, xxhash) install from the wheels in $WHEELS (default ./wheels,
# filled here by `bash scripts/gpu_wheels.sh` and carried: ~10 MiB), no index, pinned.
# Writes $OUT (default bench/out/gpu): tests.txt, engine.txt, engine.json.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-bench/out/gpu}
WHEELS=${WHEELS:-wheels}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ ! -f "$WHEELS/requirements.txt" ]]; then
  echo "no wheels in $WHEELS: run bash scripts/gpu_wheels.sh where an index is reachable, and carry $WHEELS" >&2
  exit 1
fi
"$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELS" -r "$WHEELS/requirements.txt" || { echo "cannot install the wheels in $WHEELS" >&2; exit 1; }
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" | tee "$OUT/device.txt"
rc=0
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -rs -m gpu -k "not cluster" tests/gpu/test_gpu.py 2>&1 | tee "$OUT/tests.txt" || rc=1
timeout 240 "$PY" -m bench.engine --device cuda --model random:llama8b --dtype bfloat16 --batches 1,64 \
  --prompt-lengths 2048 --repeats 5 --no-plot --out "$OUT" 2>&1 | tee "$OUT/engine.txt" || rc=1
exit $rc
