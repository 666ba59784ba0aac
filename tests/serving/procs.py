"""Real serving processes for tests: store nodes, workers and a router on loopback.

Everything binds 127.0.0.1 with port 0 (the child reports its port on a JSON ready
line) and is stopped by PID by the :class:`ServingCluster` that started it. Workers
load the tiny random-weight model, so a whole cluster starts in seconds.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support.server_process import ALPHA, ServerProcess, base_flags

__all__ = ["Child", "ServingCluster"]

READY_S = 90.0


class Child:
    """One child process and the facts of its ready line."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        with open(log, "ab") as fh:
            self.proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=fh, env=env, text=True, cwd=os.getcwd()
            )
        self.facts: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, deadline: float) -> Child:
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if ready:
                line = self.proc.stdout.readline()
                if line.startswith("{"):
                    self.facts = json.loads(line)
                    return self
            if self.proc.poll() is not None:
                break
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"{self.name} did not start; its log:\n{self.log.read_text()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class ServingCluster:
    """Store nodes, workers and routers of one cluster name on a given etcd."""

    def __init__(self, root: Path, etcd: str, cluster: str) -> None:
        self.root, self.etcd, self.cluster = root, etcd, cluster
        self.nodes: dict[str, ServerProcess] = {}
        self.workers: dict[str, Child] = {}
        self.routers: list[Child] = []
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        self.env.update(KVSTORE_TOKEN=ALPHA.token, PYTHONUNBUFFERED="1")

    def add_node(self, node_id: str) -> ServerProcess:
        wd = self.root / node_id
        wd.mkdir(parents=True, exist_ok=True)
        flags = base_flags(wd)
        flags.update(etcd=self.etcd, cluster=self.cluster, node_id=node_id, dram_bytes="32MiB")
        self.nodes[node_id] = node = ServerProcess(wd, flags).start()
        return node

    def add_workers(self, specs: list[dict[str, Any]]) -> None:
        """Start workers in parallel; each spec: id, role, node, and optional extra flags."""
        started = []
        for s in specs:
            argv = [sys.executable, "-m", "engine.serving.worker", "--role", s["role"],
                    "--etcd", self.etcd, "--cluster", self.cluster, "--worker-id", s["id"],
                    "--store-node", s.get("node", ""), "--model", s.get("model", "tiny"),
                    "--lease-ttl-s", "3", *s.get("flags", [])]  # fmt: skip
            child = Child(s["id"], argv, self.env, self.root / f"{s['id']}.log")
            self.workers[s["id"]] = child
            started.append(child)
        deadline = time.monotonic() + READY_S
        for c in started:
            c.wait_ready(deadline)

    def add_router(self, *flags: str, expect_workers: int | None = None) -> str:
        argv = [sys.executable, "-m", "engine.serving.router", "--etcd", self.etcd,
                "--cluster", self.cluster, "--port", "0", *flags]  # fmt: skip
        n = len(self.routers)
        child = Child(f"router{n}", argv, self.env, self.root / f"router{n}.log")
        self.routers.append(child)
        url = str(child.wait_ready(time.monotonic() + READY_S).facts["url"])
        want = len(self.workers) if expect_workers is None else expect_workers
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:  # the router's watch has every worker
            h = httpx.get(url + "/health", timeout=5).json()
            if sum(h["workers"].values()) >= want:
                break
            time.sleep(0.1)
        return url

    def worker_health(self, wid: str) -> dict[str, Any]:
        addr = self.workers[wid].facts["address"]
        return dict(httpx.get(addr + "/health", timeout=5).json())

    def stop(self) -> None:
        for c in [*self.routers, *self.workers.values()]:
            c.stop()
        for n in self.nodes.values():
            n.stop()
