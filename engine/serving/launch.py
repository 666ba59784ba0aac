"""Start a local serving pool as processes: workers beside store nodes, then a router.

What ``kvstore up --prefill N --decode M --router`` runs on top of its store nodes
(kvstore/cli/local_cluster.py). Each child is ``python -m kvstore.cli worker|router``
and prints one JSON ready line; this object waits for every line, then for the router
to see every worker in etcd, so that a caller handed the URL can send requests at
once. It stops exactly what it started, by PID: the router first (no new requests),
then the workers (SIGTERM revokes each one's lease; SIGKILL after a grace period).
Children also get SIGTERM if this process dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.config import child_env
from kvstore.errors import ConfigError, Unavailable

__all__ = ["PoolSpec", "ServingPool"]

READY_TIMEOUT_S = 180.0  # loading SmolLM2 and timing its prefill on 2 busy cores
STOP_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True)
class PoolSpec:
    """The serving processes to start over a running store cluster."""

    model: str = "tiny"
    prefill: int = 0
    decode: int = 0
    both: int = 0  # workers that do prefill and decode (short prompts, or no pools)
    router: bool = True
    router_port: int = 8000
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    dtype: str = "fp32"
    worker_flags: tuple[str, ...] = ()
    router_flags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.both) < 0:
            raise ConfigError("--prefill, --decode: counts must be >= 0")
        if self.router and self.prefill + self.both == 0:
            raise ConfigError("a router needs at least one prefill (or both-role) worker")
        if self.router and self.decode + self.both == 0:
            raise ConfigError("a router needs at least one decode (or both-role) worker")


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen[str]
    log: Path
    facts: dict[str, Any] = field(default_factory=dict)


class ServingPool:
    """Workers and a router for the store nodes ``node_ids`` of one cluster."""

    def __init__(
        self,
        spec: PoolSpec,
        *,
        etcd: str,
        cluster: str,
        node_ids: Sequence[str],
        root: Path,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        if not node_ids:
            raise ConfigError("a serving pool needs at least one store node")
        self.spec, self.etcd, self.cluster = spec, etcd, cluster
        self.node_ids = list(node_ids)
        self.root = root
        # KVSTORE_TOKEN and friends reach the children through their environment,
        # never their command line (flags show up in ps).
        self._env = child_env(dict(settings or {}))
        self._env["PYTHONUNBUFFERED"] = "1"
        self.workers: list[_Child] = []
        self.router: _Child | None = None

    @property
    def url(self) -> str | None:
        """The router's base URL (``http://host:port``), once started."""
        return None if self.router is None else str(self.router.facts["url"])

    def start(self, timeout: float = READY_TIMEOUT_S) -> ServingPool:
        """Start every worker (in parallel), then the router; wait until it serves."""
        deadline = time.monotonic() + timeout
        s = self.spec
        roles = [("prefill", "p", s.prefill), ("decode", "d", s.decode), ("both", "b", s.both)]
        i = 0
        try:
            for role, prefix, count in roles:
                for j in range(count):
                    node = self.node_ids[i % len(self.node_ids)]
                    i += 1
                    argv = [
                        "worker", "--role", role, "--worker-id", f"{prefix}{j}",
                        "--store-node", node, "--model", s.model, "--dtype", s.dtype,
                        "--etcd", self.etcd, "--cluster", self.cluster,
                        "--host", s.host, "--port", "0", *s.worker_flags,
                    ]  # fmt: skip
                    self.workers.append(self._spawn(f"{prefix}{j}", argv))
            self._wait_ready(self.workers, deadline)
            if s.router:
                argv = [
                    "router", "--etcd", self.etcd, "--cluster", self.cluster,
                    "--host", s.host, "--port", str(s.router_port), "--policy", s.policy,
                    *s.router_flags,
                ]  # fmt: skip
                self.router = self._spawn("router", argv)
                self._wait_ready([self.router], deadline)
                self._wait_router_sees_workers(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, argv: list[str]) -> _Child:
        self.root.mkdir(parents=True, exist_ok=True)
        log = self.root / f"{name}.log"
        with open(log, "ab") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvstore.cli", *argv],
                stdout=subprocess.PIPE,
                stderr=fh,
                env=self._env,
                text=True,
                start_new_session=True,  # Ctrl-C reaches only us: we stop them in order
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        return _Child(name, proc, log)

    @staticmethod
    def _tail(child: _Child) -> str:
        text = child.log.read_text(errors="replace").strip()
        return f"[{child.name}] " + (text.splitlines()[-1] if text else "(no output)")

    def _wait_ready(self, children: Sequence[_Child], deadline: float) -> None:
        waiting = {c.proc.stdout: c for c in children if c.proc.stdout is not None}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                tails = "; ".join(self._tail(c) for c in waiting.values())
                raise Unavailable(f"serving processes not ready in time: {tails}")
            ready, _, _ = select.select(list(waiting), [], [], min(left, 0.2))
            for stream in ready:
                child = waiting[stream]
                line = stream.readline()
                if line.startswith("{"):
                    child.facts = json.loads(line)
                    del waiting[stream]
                elif not line and child.proc.poll() is not None:
                    raise Unavailable(f"{child.name} exited: {self._tail(child)}")

    def _wait_router_sees_workers(self, deadline: float) -> None:
        import httpx

        want = len(self.workers)
        seen = 0
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                health = httpx.get(f"{self.url}/health", timeout=5).json()
                seen = sum(int(n) for n in health.get("workers", {}).values())
                if seen >= want:
                    return
            time.sleep(0.1)
        raise Unavailable(f"the router sees {seen} of {want} workers")

    def exited(self) -> list[str]:
        """Names of children whose process has ended."""
        every = [*self.workers, *([self.router] if self.router else [])]
        return [c.name for c in every if c.proc.poll() is not None]

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """Router first, then workers: SIGTERM, SIGKILL after ``grace``; idempotent."""
        order = [[self.router] if self.router else [], self.workers]
        self.router, self.workers = None, []
        for group in order:
            for c in group:
                if c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
            end = time.monotonic() + grace
            for c in group:
                try:
                    c.proc.wait(max(end - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait(5.0)
                if c.proc.stdout is not None:
                    c.proc.stdout.close()

    def describe(self) -> dict[str, Any]:
        """What a caller needs: the router URL, each worker's id, role, node, address."""
        return {
            "router": None
            if self.router is None
            else {**self.router.facts, "log": str(self.router.log)},
            "workers": [
                {"worker_id": c.name, "pid": c.proc.pid, "log": str(c.log), **c.facts}
                for c in self.workers
            ],
        }

    def __enter__(self) -> ServingPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
