#!/usr/bin/env bash
# The image's entry point: `vllm serve ARGS`, with tcmalloc and the OpenMP
# runtime preloaded (unless LD_PRELOAD is already set), listening on
# $HOST:$PORT unless ARGS give --host/--port (the HEALTHCHECK probes $PORT).
# Empty VLLM_CPU_* variables (the image's "not set" build-arg defaults) are
# unset: the host parses e.g. VLLM_CPU_KVCACHE_SPACE="" as int("") and fails.
set -euo pipefail
for name in $(compgen -e | grep '^VLLM_CPU_' || true); do
  [ -n "${!name}" ] || unset "$name"
done
here=$(dirname "$(readlink -f "$0")")
py=$(command -v python3)
if [ -z "${LD_PRELOAD:-}" ]; then
  LD_PRELOAD=$("$here/build_steps.sh" preload "$py")
  export LD_PRELOAD
fi
extra=()
case " $* " in *" --host "*|*" --host="*) ;; *) extra+=(--host "${HOST:-0.0.0.0}") ;; esac
case " $* " in *" --port "*|*" --port="*) ;; *) extra+=(--port "${PORT:-8000}") ;; esac
echo "[entrypoint] LD_PRELOAD=$LD_PRELOAD" >&2
exec "$(dirname "$py")/vllm" serve "$@" "${extra[@]}"
