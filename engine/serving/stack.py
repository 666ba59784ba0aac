"""A whole serving stack on one machine, as child processes: what the demo and the
router benchmark start.

etcd and the store nodes come from kvstore/procs/local_cluster.py's :class:`LocalCluster`;
the workers and one router per policy from engine/serving/launch.py's
:class:`ServingPool` (what ``kvstore up --prefill/--decode/--router`` runs too).
Everything binds 127.0.0.1 on ports the children pick. Authentication is a fresh random
token in a private tokens file (nodes) handed to workers and routers through their
environment, never a flag.

Ownership: :meth:`ServingStack.stop` stops exactly what :meth:`start` started, by PID
(routers, then workers, then nodes and etcd); every child also gets SIGTERM from the
kernel if this process dies first (``PR_SET_PDEATHSIG`` on Linux).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import tempfile
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.serving.launch import Child, PoolSpec, ServingPool, WorkerSpec

__all__ = ["Child", "ServingStack", "WorkerSpec", "etcd_available"]

READY_S = 120.0


def etcd_available() -> bool:
    """Whether an etcd binary can be started here (the live stack needs one)."""
    from kvstore.directory.etcd_process import etcd_binary

    return etcd_binary() is not None


class ServingStack:
    """etcd + ``nodes`` store nodes + workers + routers, all children of this process.

    ``workers`` defaults to ``prefill`` prefill workers spread over the nodes (p0 beside
    n0, p1 beside n1, ...) and then ``decode`` decode workers. One router per entry of
    ``policies`` (all on the same workers: a benchmark can take turns). ``settings``
    reach the workers and routers as ``KVSTORE_*`` variables (``{"transport": "tcp"}``:
    their store clients skip shared memory).
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
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        self.model, self.n_nodes = model, nodes
        node_ids = [f"n{i}" for i in range(nodes)]
        self.specs = tuple(workers or PoolSpec.spread(node_ids, prefill=prefill, decode=decode))
        self.policies = policies
        self.dram, self.ssd = dram, ssd
        self.worker_flags = ("--lease-ttl-s", "5", *worker_flags)
        self.router_flags = router_flags
        self.cluster_name = cluster
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="kvstore-live-")) if root is None else root
        self.token = secrets.token_hex(16)
        self.settings = {**(settings or {}), "token": self.token}
        self.cluster: Any = None
        self.pool: ServingPool | None = None

    @property
    def workers(self) -> dict[str, Child]:
        return {} if self.pool is None else self.pool.workers

    @property
    def routers(self) -> dict[str, Child]:
        return {} if self.pool is None else self.pool.routers

    def start(self, timeout: float = READY_S) -> ServingStack:
        """Start everything; returns when every router sees every worker."""
        from kvstore.procs.local_cluster import LocalCluster

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
            spec = PoolSpec(
                self.specs, model=self.model, policies=self.policies, router_port=0,
                worker_flags=self.worker_flags, router_flags=self.router_flags,
            )  # fmt: skip
            self.pool = ServingPool(
                spec, etcd=self.cluster.etcd_endpoint, cluster=self.cluster_name,
                node_ids=[n.node_id for n in self.cluster.nodes], root=self.root,
                settings=self.settings,
            ).start(timeout)  # fmt: skip
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Routers, then workers, then nodes and etcd, each by PID; idempotent."""
        if self.pool is not None:
            self.pool.stop()
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
        return {} if self.pool is None else self.pool.urls()

    def url(self, policy: str | None = None) -> str:
        return self.urls()[policy or self.policies[0]]

    def pids(self) -> dict[str, int]:
        """Every process this stack started (etcd and nodes included), by name."""
        out: dict[str, int] = {}
        if self.cluster is not None:
            if self.cluster.etcd is not None and self.cluster.etcd.pid is not None:
                out["etcd"] = int(self.cluster.etcd.pid)
            out.update({n.node_id: n.pid for n in self.cluster.nodes})
        if self.pool is not None:
            out.update(self.pool.pids())
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
