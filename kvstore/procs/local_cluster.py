"""A local multi-process cluster: one etcd and N ``kvstore serve`` children.

What ``kvstore up`` runs, and what a test or a demo uses to get a real cluster on
one machine. Everything listens on loopback (unless ``host`` says otherwise); etcd
is started from its binary on free ports with its data in a private temporary
directory, and each node gets its own work directory (log, SSD tier) under it.

Ownership: this object stops exactly what it started, by PID: nodes first (SIGTERM,
so each revokes its lease; SIGKILL after a grace period), then etcd, then the
temporary directory. Children also get SIGTERM from the kernel if this process dies
without stopping them (``PR_SET_PDEATHSIG`` on Linux), so a killed ``kvstore up``
does not leave nodes behind.

Shards: ``shards`` is each node's ``kvstore serve --shards`` (``auto``, the default,
or a number): a node of N shards is N processes under one supervisor, registered as
``n<i>.s<j>``; the node's ready line lists them, and each stays a node to its clients.

Authentication: nodes take a tokens file or ``allow_anonymous`` when asked to; else
the token in the environment (as config.py reads it); else a fresh random token,
handed to the children through their environment (never a flag: flags show in ``ps``)
and reported back so the caller can print it. Credentials for an external etcd
(``etcd_auth``) reach the nodes the same way.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.config import EtcdAuth, ServerConfig, child_env, resolve_config
from kvstore.directory.etcd_process import EtcdProcess
from kvstore.errors import ConfigError
from kvstore.procs.children import serve_argv, spawn, stop_group, wait_ready
from kvstore.shm.index import index_name
from kvstore.wire.shards import MAX_SHARDS

__all__ = ["LocalCluster", "NodeProcess"]

READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0


@dataclass
class NodeProcess:
    """One ``kvstore serve`` child and the facts from its ready line."""

    node_id: str
    workdir: Path
    proc: subprocess.Popen[str]
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def name(self) -> str:
        return self.node_id

    def tail(self) -> str:
        """The last line of the node's log (for error messages)."""
        text = (self.workdir / "server.log").read_text(errors="replace").strip()
        return f"[{self.node_id}] " + (text.splitlines()[-1] if text else "(no output)")

    def describe(self) -> dict[str, Any]:
        """What a caller needs to reach this node (JSON-able)."""
        f = self.facts
        return {
            "node_id": self.node_id,
            "pid": self.pid,
            "address": f.get("address") or f"{f.get('host')}:{f.get('port')}",
            "data_port": f.get("data_port"),
            "shm_name": f.get("shm_name"),
            "log": str(self.workdir / "server.log"),
            "shards": [s["node_id"] for s in f.get("shards", [])],  # [] for a whole node
        }

    def shm_names(self) -> list[str]:
        """The DRAM segments of the node (one per shard of a sharded node)."""
        shards = self.facts.get("shards")
        names = [s.get("shm_name") for s in shards] if shards else [self.facts.get("shm_name")]
        return [n for n in names if n]


class LocalCluster:
    """etcd (unless ``etcd`` names one) plus ``nodes`` store nodes on this machine.

    ``start()`` returns when every node printed its ready line (or raises with the
    failing node's log); ``stop()`` is idempotent. Also a context manager.
    """

    def __init__(
        self,
        nodes: int,
        *,
        dram: str = "256MiB",
        ssd: str = "",
        base_port: int = 0,
        etcd: str = "",
        cluster: str = "default",
        host: str = "127.0.0.1",
        tokens_file: str = "",
        allow_anonymous: bool = False,
        node_lease_ttl_s: float | None = None,
        root: Path | None = None,
        etcd_auth: EtcdAuth | None = None,
        shards: str = "",
    ) -> None:
        if not 1 <= nodes <= 64:
            raise ConfigError(f"nodes: {nodes} (use 1-64)")
        if shards not in ("", "auto") and not (shards.isdigit() and 1 <= int(shards) <= MAX_SHARDS):
            raise ConfigError(f"shards {shards!r}: use auto or a number from 1 to {MAX_SHARDS}")
        self.shards = shards  # "": what ``kvstore serve`` does by default
        if base_port and not 1024 <= base_port <= 65535 - 2 * nodes:
            raise ConfigError(f"base_port: {base_port} leaves no room for {nodes} nodes")
        self.n = nodes
        self.dram, self.ssd, self.base_port = dram, ssd, base_port
        self.cluster, self.host = cluster, host
        self.node_lease_ttl_s = node_lease_ttl_s
        self.etcd_endpoint = etcd
        self.etcd: EtcdProcess | None = None
        self.nodes: list[NodeProcess] = []
        self.token: str | None = None  # set when this cluster generated it
        self._auth_flags, self._env = self._auth(tokens_file, allow_anonymous)
        if etcd_auth is not None:  # an etcd with auth/TLS: nodes get it as their parent did
            self._env.update(child_env(etcd_auth.settings(), base={}))
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="kvstore-up-")) if root is None else root

    def _auth(self, tokens_file: str, anonymous: bool) -> tuple[dict[str, Any], dict[str, str]]:
        if tokens_file:
            return {"tokens_file": tokens_file}, child_env({})
        if anonymous:
            return {"allow_anonymous": True}, child_env({})
        if resolve_config(ServerConfig, flags={"allow_anonymous": True}).auth_token:
            return {}, child_env({})  # the children inherit it
        self.token = secrets.token_hex(16)
        return {}, child_env({"auth_token": self.token})

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, timeout: float = READY_TIMEOUT_S) -> LocalCluster:
        """Start etcd (when not given) and every node; wait for all to be ready."""
        try:
            if not self.etcd_endpoint:
                self.etcd = EtcdProcess(self.root / "etcd").start()
                self.etcd_endpoint = self.etcd.endpoint
            for i in range(self.n):
                self.nodes.append(self._spawn(i))
            self._wait_ready(time.monotonic() + timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _argv(self, i: int, workdir: Path) -> list[str]:
        flags: dict[str, Any] = {
            "node_id": f"n{i}",
            "host": self.host,
            "port": self.base_port + 2 * i if self.base_port else 0,
            "data_port": self.base_port + 2 * i + 1 if self.base_port else 0,
            "dram_bytes": self.dram,
            "etcd": self.etcd_endpoint,
            "cluster": self.cluster,
            "node_lease_ttl_s": self.node_lease_ttl_s,
            "shards": self.shards or None,
            **self._auth_flags,
        }
        if self.ssd:
            flags.update(ssd_path=workdir / "ssd", ssd_bytes=self.ssd)
        return serve_argv(flags)

    def _spawn(self, i: int) -> NodeProcess:
        workdir = self.root / f"n{i}"
        workdir.mkdir(parents=True, exist_ok=True)
        child = spawn(f"n{i}", self._argv(i, workdir), log=workdir / "server.log", env=self._env)
        return NodeProcess(f"n{i}", workdir, child.proc)

    def _wait_ready(self, deadline: float) -> None:
        wait_ready(self.nodes, deadline)

    def exited(self) -> list[NodeProcess]:
        """Nodes whose process has ended."""
        return [n for n in self.nodes if n.proc.poll() is not None]

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """Stop the nodes (SIGTERM, SIGKILL after ``grace``), then etcd; idempotent."""
        nodes, self.nodes = self.nodes, []
        stop_group(nodes, grace)
        for n in nodes:
            if n.proc.returncode == 0:
                continue
            for shm in n.shm_names():  # a killed node cannot unlink its segments
                Path("/dev/shm", shm).unlink(missing_ok=True)
                Path("/dev/shm", index_name(shm)).unlink(missing_ok=True)
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def describe(self) -> dict[str, Any]:
        """Everything a caller needs to use the cluster (JSON-able)."""
        doc: dict[str, Any] = {
            "etcd": self.etcd_endpoint,
            "etcd_pid": self.etcd.pid if self.etcd is not None else None,
            "cluster": self.cluster,
            "root": str(self.root),
            "nodes": [n.describe() for n in self.nodes],
        }
        if self.token is not None:
            doc["token"] = self.token
        return doc
