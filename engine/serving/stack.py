"""A whole serving stack on one machine, as child processes: what the demo and the
router benchmark start.

etcd and the store nodes come from kvstore/cli/local_cluster.py's :class:`LocalCluster`;
then prefill and decode workers (``python -m engine.serving.worker``) and one or more
routers (``python -m engine.serving.router``), each printing one JSON ready line.
Everything binds 127.0.0.1 on ports the children pick. Authentication is a fresh
random token in a private tokens file (nodes) handed to workers and routers through
their environment, never a flag.

Ownership: :meth:`ServingStack.stop` stops exactly what :meth:`start` started, by PID
(routers, then workers, then nodes and etcd); every child also gets SIGTERM from the
kernel if this process dies first (``PR_SET_PDEATHSIG`` on Linux).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.errors import Unavailable

__all__ = ["Proc", "ServingStack", "WorkerSpec", "etcd_available"]

READY_S = 120.0
STOP_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1


def etcd_available() -> bool:
    """Whether an etcd binary can be started here (the live stack needs one)."""
    from kvstore.directory.etcd_process import etcd_binary

    return etcd_binary() is not None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Proc:
    """One child process, its log and the facts of its JSON ready line."""

    name: str
    proc: subprocess.Popen[str]
    log: Path
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM by PID, SIGKILL after ``grace``; idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5.0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@dataclass(frozen=True)
class WorkerSpec:
    """One worker to start: id, role, the store node beside it, extra flags."""

    worker_id: str
    role: str
    store_node: str
    flags: tuple[str, ...] = ()


def _wait_ready(procs: list[Proc], deadline: float) -> None:
    waiting = {p.proc.stdout: p for p in procs if p.proc.stdout is not None}
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            names = ", ".join(p.name for p in waiting.values())
            raise Unavailable(f"not ready in time: {names}")
        ready, _, _ = select.select(list(waiting), [], [], min(left, 0.2))
        for stream in ready:
            p = waiting[stream]
            line = stream.readline()
            if line.startswith("{"):
                p.facts = json.loads(line)
                del waiting[stream]
            elif not line and p.proc.poll() is not None:
                raise Unavailable(f"{p.name} exited at start; its log ends:\n{p.tail()}")


class ServingStack:
    """etcd + ``nodes`` store nodes + workers + routers, all children of this process.

    ``workers`` defaults to ``prefill`` prefill workers spread over the nodes (p0 beside
    n0, p1 beside n1, ...) and ``decode`` decode workers beside n0. One router per
    entry of ``policies`` (all on the same workers: a benchmark can take turns).
    """

    def __init__(
        self,
        *,
        model: str = "tiny",
        nodes: int = 2,
        prefill: int = 2,
        decode: int = 1,
        workers: list[WorkerSpec] | None = None,
        policies: tuple[str, ...] = ("cache_aware",),
        dram: str = "64MiB",
        ssd: str = "",
        worker_flags: tuple[str, ...] = (),
        router_flags: tuple[str, ...] = (),
        cluster: str = "live",
        root: Path | None = None,
    ) -> None:
        self.model, self.n_nodes = model, nodes
        self.specs = workers or [
            *(WorkerSpec(f"p{i}", "prefill", f"n{i % nodes}") for i in range(prefill)),
            *(WorkerSpec(f"d{i}", "decode", f"n{i % nodes}") for i in range(decode)),
        ]
        self.policies = policies
        self.dram, self.ssd = dram, ssd
        self.worker_flags, self.router_flags = worker_flags, router_flags
        self.cluster_name = cluster
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="kvstore-live-")) if root is None else root
        self.token = secrets.token_hex(16)
        self.cluster: Any = None
        self.workers: dict[str, Proc] = {}
        self.routers: dict[str, Proc] = {}
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        self.env.update(KVSTORE_TOKEN=self.token, PYTHONUNBUFFERED="1")

    # -- lifecycle -------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> Proc:
        log = self.root / f"{name}.log"
        with open(log, "ab") as fh:
            proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=fh,
                env=self.env,
                text=True,
                start_new_session=True,  # Ctrl-C reaches only us: we stop them in order
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        return Proc(name, proc, log)

    def start(self, timeout: float = READY_S) -> ServingStack:
        """Start everything; returns when every router sees every worker."""
        from kvstore.cli.local_cluster import LocalCluster

        deadline = time.monotonic() + timeout
        try:
            tokens = self.root / "tokens.toml"
            tokens.write_text(
                f'[[tokens]]\ntoken = "{self.token}"\ntenant = "default"\nadmin = true\n'
            )
            tokens.chmod(0o600)
            self.cluster = LocalCluster(
                self.n_nodes, dram=self.dram, ssd=self.ssd, cluster=self.cluster_name,
                tokens_file=str(tokens), root=self.root / "cluster",
            ).start()  # fmt: skip
            etcd = self.cluster.etcd_endpoint
            for s in self.specs:
                argv = [sys.executable, "-m", "engine.serving.worker", "--role", s.role,
                        "--model", self.model, "--etcd", etcd, "--cluster", self.cluster_name,
                        "--worker-id", s.worker_id, "--store-node", s.store_node,
                        "--port", "0", "--lease-ttl-s", "5",
                        *self.worker_flags, *s.flags]  # fmt: skip
                self.workers[s.worker_id] = self._spawn(s.worker_id, argv)
            _wait_ready(list(self.workers.values()), deadline)
            for pol in self.policies:
                argv = [sys.executable, "-m", "engine.serving.router", "--etcd", etcd,
                        "--cluster", self.cluster_name, "--port", "0", "--policy", pol,
                        *self.router_flags]  # fmt: skip
                self.routers[pol] = self._spawn(f"router-{pol}", argv)
            _wait_ready(list(self.routers.values()), deadline)
            for url in self.urls().values():
                self._wait_workers(url, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_workers(self, url: str, deadline: float) -> None:
        """Until the router's watch holds every worker."""
        want = len(self.specs)
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError, ValueError),
                urllib.request.urlopen(url + "/health", timeout=5) as r,
            ):
                if sum(json.loads(r.read())["workers"].values()) >= want:
                    return
            time.sleep(0.1)
        raise Unavailable(f"router {url} did not see {want} workers in time")

    def stop(self) -> None:
        """Routers, then workers, then nodes and etcd, each by PID; idempotent."""
        procs = [*self.routers.values(), *self.workers.values()]
        for p in procs:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in procs:
            p.stop()
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> ServingStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- facts -----------------------------------------------------------------------------

    def urls(self) -> dict[str, str]:
        """policy -> the router's base URL."""
        return {pol: str(p.facts["url"]) for pol, p in self.routers.items()}

    def url(self, policy: str | None = None) -> str:
        return self.urls()[policy or self.policies[0]]

    def pids(self) -> dict[str, int]:
        """Every process this stack started (etcd and nodes included), by name."""
        out: dict[str, int] = {}
        if self.cluster is not None:
            if self.cluster.etcd is not None and self.cluster.etcd.pid is not None:
                out["etcd"] = int(self.cluster.etcd.pid)
            out.update({n.node_id: n.pid for n in self.cluster.nodes})
        out.update({w: p.pid for w, p in self.workers.items()})
        out.update({f"router-{pol}": p.pid for pol, p in self.routers.items()})
        return out

    def worker_stats(self) -> dict[str, dict[str, Any]]:
        """Each worker's /health (counters, load)."""
        out = {}
        for wid, p in self.workers.items():
            with (
                contextlib.suppress(OSError, ValueError),
                urllib.request.urlopen(p.facts["address"] + "/health", timeout=5) as r,
            ):
                out[wid] = json.loads(r.read())
        return out

    def node_stats(self) -> dict[str, dict[str, Any]]:
        """Each store node's stats, asked over its control service."""
        from kvstore import StoreClient

        out: dict[str, dict[str, Any]] = {}
        if self.cluster is None:
            return out
        for n in self.cluster.nodes:
            addr = n.describe()["address"]
            with contextlib.suppress(Exception), StoreClient.connect(addr, token=self.token) as c:
                out[n.node_id] = dict(c.stats())
        return out
