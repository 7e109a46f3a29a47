#!/usr/bin/env bash
# One prepared GPU check (a lent NVIDIA machine: Python 3.12, CUDA torch, cupy, transformers;
# no Ray). Under 8 minutes on an H200:
#   1. tests/gpu/test_gpu.py but the cluster test: the engine on the GPU against model.generate
#      (CUDA graphs captured and replayed, and eager), cuda_ipc between two processes
#      (bit-exact, a corrupted copy caught);
#   2. bench/engine.py --device cuda on random weights of the bundled model's shape: decode
#      step against HBM read bandwidth, prefill FLOP/s against the GPU's matmul peak.
# Missing Python packages (pytest, grpcio, protobuf) install from the wheels in $WHEELS
# (default ./wheels; fill it here with: pip download -d wheels --only-binary :all:
#  --python-version 3.12 --platform manylinux2014_x86_64 pytest grpcio protobuf), no index.
# Writes $OUT (default bench/out/gpu): tests.txt, engine.txt, engine.json.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for mod in pytest grpc google.protobuf; do
  if ! "$PY" -c "import $mod" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --find-links "${WHEELS:-wheels}" pytest grpcio protobuf || echo "cannot install $mod from ${WHEELS:-wheels}"
    break
  fi
done
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" | tee "$OUT/device.txt"
rc=0
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -rs -m gpu -k "not cluster" tests/gpu/test_gpu.py 2>&1 | tee "$OUT/tests.txt" || rc=1
timeout 240 "$PY" -m bench.engine --device cuda --model random:smollm2 --dtype bfloat16 --batches 1,8,32,64 \
  --prompt-lengths 512,2048 --repeats 5 --no-plot --out "$OUT" 2>&1 | tee "$OUT/engine.txt" || rc=1
exit $rc
