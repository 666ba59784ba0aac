#!/usr/bin/env bash
# Prepare, on a machine with package registries, what the GPU machine lacks, so that
# scripts/device_check.sh can run there with no registry at all.
#
# The GPU machine (Python 3.12, torch with CUDA, numpy, grpcio, protobuf, xxhash,
# transformers, pytest, hypothesis, httpx, rich, ...) has no lmdb, aetcd, starlette,
# uvicorn or redis-py, and no etcd or redis-server binaries. This script puts them in
# .device/ (git-ignored), which the device call names in `carry`:
#   .device/wheels/  Python 3.12 manylinux wheels, installed there with
#                    `pip install --no-index --no-deps --target`
#   .device/root/    Debian's etcd-server and redis-server unpacked with `dpkg -x`; their
#                    binaries go on PATH and their libraries on LD_LIBRARY_PATH there
#
# Usage: bash scripts/device_prep.sh      (then: device run, carry [".device"],
#                                          command "bash scripts/device_check.sh")
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=.device
rm -rf "$DEV"
mkdir -p "$DEV/wheels" "$DEV/debs" "$DEV/root"

# grpcio and protobuf travel too: kvstore/_proto was generated for grpcio >= 1.85.1 and
# protobuf >= 7.35.1, and the generated code refuses an older runtime.
# The router's HTTP stack (httpx and what it needs), /metrics and psutil serve issue 32's
# 16-core run (DEVICE_CHECK_CORES=1); a wheel the machine already has is only shadowed.
WHEELS=(lmdb aetcd starlette uvicorn "redis>=5" hiredis "grpcio==1.85.1" "protobuf>=7.35.1,<8"
    prometheus-client psutil httpx httpcore h11 anyio sniffio certifi idna pytest-timeout)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEV/wheels" "${WHEELS[@]}"

# etcd and Redis from Debian; their .debs are unpacked here, never on the GPU machine's /.
(cd "$DEV/debs" && apt-get download etcd-server redis-server redis-tools liblzf1 libjemalloc2 \
    >/dev/null)
for deb in "$DEV"/debs/*.deb; do dpkg -x "$deb" "$DEV/root"; done
rm -rf "$DEV/debs" "$DEV/root/usr/share/doc" "$DEV/root/usr/share/man"
# benchmarks/bench_router.py replays the shared conversation trace, which lives beside
# the checkout here and not on that machine.
mkdir -p "$DEV/traces"
cp ../shared/traces/conversation_trace.jsonl "$DEV/traces/"
du -sh "$DEV" "$DEV"/*
