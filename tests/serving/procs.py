"""Real serving processes for tests: store nodes, workers and a router on loopback.

Everything binds 127.0.0.1 with port 0 (the child reports its port on a JSON ready
line) and is stopped by PID by the :class:`ServingCluster` that started it. Workers
load the tiny random-weight model, so a whole cluster starts in seconds.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvstore.procs import children
from tests.support.server_process import ALPHA, ServerProcess, base_flags

__all__ = ["Child", "ServingCluster"]

READY_S = 90.0


class Child(children.Child):
    """One child process (kvstore/procs/children.py), stoppable with any signal."""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        children.stop_group([self], timeout)


def _start(name: str, argv: list[str], env: dict[str, str], log: Path) -> Child:
    c = children.spawn(name, argv, log=log, env=env)
    return Child(c.name, c.proc, c.log)


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
            child = _start(s["id"], argv, self.env, self.root / f"{s['id']}.log")
            self.workers[s["id"]] = child
            started.append(child)
        children.wait_ready(started, time.monotonic() + READY_S)

    def add_router(self, *flags: str, expect_workers: int | None = None) -> str:
        argv = [sys.executable, "-m", "engine.serving.router", "--etcd", self.etcd,
                "--cluster", self.cluster, "--port", "0", *flags]  # fmt: skip
        n = len(self.routers)
        child = _start(f"router{n}", argv, self.env, self.root / f"router{n}.log")
        self.routers.append(child)
        children.wait_ready([child], time.monotonic() + READY_S)
        url = str(child.facts["url"])
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
