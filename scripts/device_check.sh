#!/usr/bin/env bash
# The GPU machine's checks, in one call: the tests marked `cuda` and benchmarks/bench_gpu.py
# (about 5 minutes), then with DEVICE_CHECK_CORES=1 issue 32's 16-core figures:
# benchmarks/bench_scaling.py (1-8 client processes, 1 and 8 shards, Redis beside) and
# benchmarks/bench_router.py with 4 prefill and 2 decode workers (about 5 more minutes).
# DEVICE_CHECK_GPU=0 skips the GPU part (a cores-only call). Every figure goes to one
# file, $OUT/device_figures.md, beside the logs.
#
# That machine has no package registry. Prepare what it lacks first, on a machine that
# has one (it writes the git-ignored .device/):
#     bash scripts/device_prep.sh
# then run this there with .device carried:
#     device run: command "bash scripts/device_check.sh", carry [".device"], timeout_s 420
#
# .device/wheels holds Python 3.12 manylinux wheels (lmdb, aetcd, starlette, uvicorn,
# redis, hiredis, grpcio and protobuf at the versions kvstore/_proto was generated for),
# installed here with `pip install --no-index --no-deps --target`; .device/root holds
# Debian's etcd-server and redis-server unpacked with `dpkg -x` (binaries on PATH, their
# libraries on LD_LIBRARY_PATH). Nothing is installed outside /tmp.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device-check}
mkdir -p "$OUT"
FIGURES="$OUT/device_figures.md"
SITE=/tmp/kvstore-site
START=$SECONDS

step() { echo "== $* ($((SECONDS - START)) s)" | tee -a "$FIGURES"; }

if [ ! -d .device/wheels ]; then
    echo "no .device/: run 'bash scripts/device_prep.sh' on a machine with a registry and carry .device" >&2
    exit 2
fi
# DEVICE_CHECK_SKIP_INSTALL=1: a dry run of the script on a machine that has them all.
if [ "${DEVICE_CHECK_SKIP_INSTALL:-0}" != "1" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .device/wheels/*.whl || exit 3
fi
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo
export PATH="$PWD/.device/root/usr/bin:$PATH"
export LD_LIBRARY_PATH="$PWD/.device/root/usr/lib/x86_64-linux-gnu:$PWD/.device/root/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"

{
    echo "# device check, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
        --format=csv,noheader 2>&1
    echo "cores: $(nproc)"
    df -h /dev/shm | tail -1 | awk '{print "/dev/shm: " $2 " (" $4 " free)"}'
    python3 -c "import pytest_timeout" 2>/dev/null && echo "pytest-timeout: yes" || echo "pytest-timeout: no"
    python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
} | tee -a "$FIGURES"

if [ "${DEVICE_CHECK_GPU:-1}" = "1" ]; then
    step "tests marked cuda"
    # -v names each test as it runs and faulthandler dumps every thread's stack after 40 s
    # in one test (built into pytest), so a hang says where; pytest-timeout may be absent
    PER_TEST=""
    python3 -c "import pytest_timeout" 2>/dev/null && PER_TEST="--timeout=60"
    timeout 150 python3 -m pytest -v -rfE -m cuda -p no:cacheprovider -o addopts="" \
        -o faulthandler_timeout=40 $PER_TEST tests/gpu \
        2>&1 | tee "$OUT/cuda_tests.log" | tail -40
    grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/cuda_tests.log" | tail -60 >> "$FIGURES"
    tail -3 "$OUT/cuda_tests.log" >> "$FIGURES"

    step "benchmarks/bench_gpu.py"
    # each row reaches $FIGURES as it is measured; servers' stderr stays in $OUT
    KVSTORE_BENCH_LOGS="$OUT" timeout 150 python3 benchmarks/bench_gpu.py --runs 5 \
        --out "$FIGURES" 2>&1 | tee "$OUT/bench_gpu.log" | tail -30
fi

if [ "${DEVICE_CHECK_CORES:-0}" = "1" ]; then
    step "benchmarks/bench_scaling.py: 1-8 client processes, 1 and 8 shards, Redis beside (issue 32)"
    timeout 200 python3 benchmarks/bench_scaling.py --runs 1 --shards 1,8 --clients 1,2,4,8 \
        2>&1 | tee "$OUT/bench_scaling.log" | tail -30 | tee -a "$FIGURES"
    step "benchmarks/bench_router.py: 4 prefill, 2 decode workers (issue 32)"
    timeout 150 python3 benchmarks/bench_router.py --prefill 4 --decode 2 --rounds 1 \
        --policies cache_aware,round_robin --json "$OUT/bench_router.json" \
        --trace .device/traces/conversation_trace.jsonl \
        2>&1 | tee "$OUT/bench_router.log" | tail -30 | tee -a "$FIGURES"
fi
step "done"
