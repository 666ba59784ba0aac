"""Start a local serving pool as processes: workers beside store nodes, then a router.

What ``kvstore up --prefill N --decode M --router`` runs on top of its store nodes
(kvstore/procs/local_cluster.py). Each child is ``python -m kvstore.cli worker|router``
and prints one JSON ready line; this object waits for every line, then for the router
to see every worker in etcd, so that a caller handed the URL can send requests at
once. It stops exactly what it started, by PID: the router first (no new requests),
then the workers (SIGTERM revokes each one's lease; SIGKILL after a grace period).
Children also get SIGTERM if this process dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.config import child_env
from kvstore.errors import ConfigError, Unavailable
from kvstore.procs.children import Child, spawn, stop_group, wait_ready

__all__ = ["Child", "PoolSpec", "ServingPool", "WorkerSpec", "pool_for_cluster"]

READY_TIMEOUT_S = 180.0  # loading SmolLM2 and timing its prefill on 2 busy cores
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class WorkerSpec:
    """One worker to start: id, role, the store node beside it, extra flags."""

    worker_id: str
    role: str
    store_node: str
    flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class PoolSpec:
    """The serving processes to start over a running store cluster: the workers, and one
    router per entry of ``policies`` (all over the same workers; none when empty)."""

    workers: tuple[WorkerSpec, ...]
    model: str = "tiny"
    policies: tuple[str, ...] = ("cache_aware",)
    router_port: int = 8000  # the first router's; any others pick a free port
    host: str = "127.0.0.1"
    dtype: str = "fp32"
    worker_flags: tuple[str, ...] = ()
    router_flags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        roles = [w.role for w in self.workers]
        if self.policies and not {"prefill", "both"} & set(roles):
            raise ConfigError("a router needs at least one prefill (or both-role) worker")
        if self.policies and not {"decode", "both"} & set(roles):
            raise ConfigError("a router needs at least one decode (or both-role) worker")
        if len({w.worker_id for w in self.workers}) != len(self.workers):
            raise ConfigError("worker ids must be unique")

    @staticmethod
    def spread(
        node_ids: Sequence[str], *, prefill: int = 0, decode: int = 0, both: int = 0
    ) -> tuple[WorkerSpec, ...]:
        """Workers p0.., d0.., b0.. placed round-robin beside the nodes."""
        if min(prefill, decode, both) < 0:
            raise ConfigError("--prefill, --decode, --both: counts must be >= 0")
        specs, i = [], 0
        for role, prefix, count in (("prefill", "p", prefill), ("decode", "d", decode),
                                    ("both", "b", both)):  # fmt: skip
            for j in range(count):
                specs.append(WorkerSpec(f"{prefix}{j}", role, node_ids[i % len(node_ids)]))
                i += 1
        return tuple(specs)


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
        self.workers: dict[str, Child] = {}
        self.routers: dict[str, Child] = {}  # policy -> router

    def urls(self) -> dict[str, str]:
        """policy -> that router's base URL (``http://host:port``)."""
        return {pol: str(c.facts["url"]) for pol, c in self.routers.items()}

    def url(self, policy: str | None = None) -> str:
        """The base URL of the router of ``policy`` (default: the first)."""
        return self.urls()[policy or self.spec.policies[0]]

    def start(self, timeout: float = READY_TIMEOUT_S) -> ServingPool:
        """Start every worker (in parallel), then the routers; wait until they serve."""
        deadline = time.monotonic() + timeout
        s = self.spec
        try:
            for w in s.workers:
                argv = [
                    "worker", "--role", w.role, "--worker-id", w.worker_id,
                    "--store-node", w.store_node, "--model", s.model, "--dtype", s.dtype,
                    "--etcd", self.etcd, "--cluster", self.cluster,
                    "--host", s.host, "--port", "0", *s.worker_flags, *w.flags,
                ]  # fmt: skip
                self.workers[w.worker_id] = self._spawn(w.worker_id, argv)
            wait_ready(list(self.workers.values()), deadline)
            for i, policy in enumerate(s.policies):
                port = s.router_port if i == 0 else 0
                argv = [
                    "router", "--etcd", self.etcd, "--cluster", self.cluster,
                    "--host", s.host, "--port", str(port), "--policy", policy,
                    *s.router_flags,
                ]  # fmt: skip
                name = "router" if len(s.policies) == 1 else f"router-{policy}"
                self.routers[policy] = self._spawn(name, argv)
            wait_ready(list(self.routers.values()), deadline)
            for url in self.urls().values():
                self._wait_router_sees_workers(url, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, argv: list[str]) -> Child:
        return spawn(
            name, [sys.executable, "-m", "kvstore.cli", *argv],
            log=self.root / f"{name}.log", env=self._env,
        )  # fmt: skip

    def _wait_router_sees_workers(self, url: str, deadline: float) -> None:
        import httpx

        want = len(self.workers)
        seen = 0
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                health = httpx.get(f"{url}/health", timeout=5).json()
                seen = sum(int(n) for n in health.get("workers", {}).values())
                if seen >= want:
                    return
            time.sleep(0.1)
        raise Unavailable(f"the router at {url} sees {seen} of {want} workers")

    def exited(self) -> list[str]:
        """Names of children whose process has ended."""
        every = [*self.workers.values(), *self.routers.values()]
        return [c.name for c in every if c.proc.poll() is not None]

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """Routers first, then workers: SIGTERM, SIGKILL after ``grace``; idempotent."""
        routers, workers = list(self.routers.values()), list(self.workers.values())
        self.routers, self.workers = {}, {}
        stop_group(routers, grace)
        stop_group(workers, grace)

    def describe(self) -> dict[str, Any]:
        """What a caller needs: each router's URL, each worker's id, role, node, address."""
        return {
            "routers": [
                {"policy": pol, **c.facts, "log": str(c.log)} for pol, c in self.routers.items()
            ],
            "workers": [
                {"worker_id": c.name, "pid": c.pid, "log": str(c.log), **c.facts}
                for c in self.workers.values()
            ],
        }

    def pids(self) -> dict[str, int]:
        """Every process this pool started, by name."""
        return {c.name: c.pid for c in [*self.workers.values(), *self.routers.values()]}

    def __enter__(self) -> ServingPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def pool_for_cluster(args: Any, cluster: Any, etcd_auth: Any) -> ServingPool:
    """The serving pool ``kvstore up --prefill/--decode/--both/--router`` starts beside a
    :class:`~kvstore.procs.local_cluster.LocalCluster`: worker i on node i mod N, and the
    router. The console script reaches it by module path (kvstore/cli/extensions.py)."""
    node_ids = [n.node_id for n in cluster.nodes]
    spec = PoolSpec(
        PoolSpec.spread(node_ids, prefill=args.prefill, decode=args.decode, both=args.both),
        model=args.model,
        policies=(args.policy,) if args.router else (),
        router_port=args.router_port,
        host=args.host,
        worker_flags=("--save-decode",) if getattr(args, "save_decode", False) else (),
    )
    settings: dict[str, Any] = {"token": cluster.token} if cluster.token is not None else {}
    settings.update(etcd_auth.settings())
    return ServingPool(
        spec,
        etcd=cluster.etcd_endpoint,
        cluster=cluster.cluster,
        node_ids=node_ids,
        root=cluster.root / "serving",
        settings=settings,
    )
