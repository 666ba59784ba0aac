"""The nodes a ClusterClient talks to: one NodeClient each, liveness, write choice.

Kept apart from :mod:`kvstore.client.cluster`, which decides *what* to ask (which
replica, in what order); this module decides *whom*, and whether they are worth
asking right now:

- node clients are opened on first use, after a probe of the node's address (a TCP
  connect, see connector.py: an unreachable node costs a refused connect, not a
  connect timeout), and reopened
  when the node restarts (its record shows a new boot id);
- a node that fails a call is *suspect*: skipped for ``SUSPECT_S``, then used again
  only if a probe connects (or it restarted);
- the write node is chosen once and kept while it lives: the ``node_id`` asked for,
  else a node on this kernel (same boot id), else any, ties broken by rendezvous
  hashing of this process's identity, so clients spread but each stays put;
- a node sharded across processes (``kvstore serve --shards N``) is one choice, its
  group (kvstore/client/groups.py): chosen while some shard of it is usable, each key
  then going to its ``shard_of`` shard, a down shard's keys to the next choice;
- a node whose record says ``draining`` (``kvstore drain``) is never chosen for
  writes, the ``node_id`` asked for included, nor is the group of a draining shard;
  it is still read from, until empty;
- the tenant scope of directory keys (tenant and scope key, kvstore/tenants.py) is
  learned from the first node that opens, and every other node must agree.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import logging
import os
import threading
import time

from kvstore._proto import store_pb2 as pb
from kvstore.client.connector import Connector, SocketConnector
from kvstore.client.groups import WriteUnit, write_units
from kvstore.client.store import NodeClient
from kvstore.config import ClientConfig
from kvstore.directory.base import NodeInfo
from kvstore.directory.mirror import Mirror
from kvstore.errors import (
    ClosedError,
    ConfigError,
    TimeoutError_,
    TransportError,
    Unavailable,
)
from kvstore.keys import Namespace
from kvstore.observe.counters import NodeCounters
from kvstore.tenants import Principal
from kvstore.wire.locality import host_id, hostname

__all__ = ["NODE_FAILURES", "MemberClient", "Members"]

log = logging.getLogger(__name__)

SUSPECT_S = 1.0
NODE_FAILURES = (Unavailable, TransportError, TimeoutError_, ClosedError)
"""Errors that say "this node, now" rather than "this request": try another node."""


def _principal_of(client: NodeClient) -> Principal:
    """The tenant and scope key a node's INFO reply gave this client's token (the admin
    flag is left out: only the scoping is compared between nodes)."""
    info = client.server_info
    key = base64.b64decode(info.get("scope_key", ""))  # MessageToDict writes bytes as base64
    return Principal(str(info.get("tenant", "")), scope_key=key)


class MemberClient(NodeClient):
    """A NodeClient for one cluster member: when its data socket is gone, asking the
    node where it moved fails at once instead of waiting for it within the deadline
    (in a cluster, the next replica is a better use of the deadline)."""

    def _locate(self, deadline: float) -> pb.InfoResponse:
        assert self._control is not None
        self._info = self._control.call("Info", pb.InfoRequest(), deadline, wait=False)
        return self._info


@functools.lru_cache(maxsize=4096)
def _rendezvous(seed: bytes, node_id: str) -> bytes:
    return hashlib.blake2b(seed + node_id.encode(), digest_size=8).digest()


class Members:
    """Per-node clients and liveness for one ClusterClient. Thread-safe.

    Concurrency contract: ``_lock`` guards ``_clients``, ``_retired``, ``_suspects``,
    ``_writer``, ``_principal``, ``_closed`` and ``_warned``; no I/O happens under it.
    ``_open_lock`` serializes opening node clients (network I/O, rare).
    """

    def __init__(
        self,
        mirror: Mirror,
        config: ClientConfig,
        counters: NodeCounters,
        *,
        namespace: Namespace | None = None,
        node_id: str | None = None,
        connector: Connector | None = None,
    ) -> None:
        self.mirror = mirror
        self.connector = connector if connector is not None else SocketConnector()
        self.counters = counters
        self.namespace = namespace
        self.node_id = node_id
        self._config = config
        self._lock = threading.Lock()
        self._open_lock = threading.Lock()
        self._clients: dict[str, tuple[str, MemberClient]] = {}  # node -> (boot id, client)
        self._retired: list[MemberClient] = []
        self._suspects: dict[str, tuple[float, str]] = {}  # node -> (until, boot id)
        self._writer: str | None = None  # a write unit's name: a node id or a group
        self._warned: set[str] = set()  # groups whose shards disagree, said once
        self._principal: Principal | None = None
        self._closed = False
        self._seed = f"{hostname()}/{os.getpid()}".encode()
        self._host_id = host_id()

    @property
    def writer(self) -> str | None:
        """The node puts go to now, a group's name for a sharded one (None before the
        first put or with no node)."""
        return self._writer

    def close(self) -> None:
        """Close every node client (ones still lent finish on a closed client)."""
        with self._lock:
            self._closed = True
            clients = [c for _, c in self._clients.values()] + self._retired
            self._clients, self._retired = {}, []
        for c in clients:
            c.close()

    # -- choosing nodes --------------------------------------------------------------------

    def write_order(self) -> list[str]:
        """The names of :meth:`write_plan`'s units, best first."""
        return [u.name for u in self.write_plan()]

    def write_plan(self) -> list[WriteUnit]:
        """Usable write units, best first: the current writer while it lives and
        nothing better appeared, the ``node_id`` asked for (a node, a group, or a shard
        of the group), units on this kernel, the rest (rendezvous order). Draining
        units are left out, and so are groups whose shards are all unusable."""
        skipped: list[str] = []
        units = write_units(self.mirror.nodes(), skipped)
        self._warn(skipped)
        units = {n: u for n, u in units.items() if not u.draining}

        def rank(n: str) -> tuple[bool, bool, bytes]:
            u = units[n]
            local = bool(self._host_id) and u.host_id == self._host_id
            asked = n == self.node_id or (u.sharded and self.node_id in u.shards)
            return (not asked, not local, _rendezvous(self._seed, n))

        order = sorted(units, key=rank)
        writer = self._writer
        if writer in units and order and rank(writer)[:2] <= rank(order[0])[:2]:
            order.remove(writer)
            order.insert(0, writer)  # stay put while the writer lives
        plan = [units[n] for n in order if self._usable_unit(units[n])]
        with self._lock:
            self._writer = plan[0].name if plan else None
        return plan

    def _usable_unit(self, unit: WriteUnit) -> bool:
        if not unit.sharded:
            return self.usable(unit.name)
        return any(self.usable(n) for n in unit.shards if n)

    def _warn(self, groups: list[str]) -> None:
        with self._lock:
            new = [g for g in groups if g not in self._warned]
            self._warned.update(new)
        for g in new:
            log.warning("node %s: its shards disagree on how many it has; not written to", g)

    def live(self) -> list[str]:
        """Nodes that are not suspect and accept a TCP connection now: control calls
        (remove, stats) would otherwise wait out their deadline on a dead node."""
        nodes = self.mirror.nodes()
        reachable = self.connector.reachable
        return [n for n in sorted(nodes) if self.usable(n) and reachable(nodes[n].address)]

    def suspects(self) -> set[str]:
        """Nodes skipped right now (no probing: for answers served from memory)."""
        now = time.monotonic()
        with self._lock:
            return {n for n, (until, _) in self._suspects.items() if until > now}

    def usable(self, node_id: str) -> bool:
        """False while a node is suspect; afterwards a TCP probe (or a restart with a
        new boot id) clears it."""
        with self._lock:
            s = self._suspects.get(node_id)
        if s is None:
            return True
        info = self.mirror.node(node_id)
        if info is None:
            return False
        until, boot = s
        if info.boot_id == boot:  # not restarted since it failed
            if time.monotonic() < until:
                return False
            if not self.connector.reachable(info.address):
                self.suspect(node_id, None)  # still down: skip it a while longer
                return False
        with self._lock:
            self._suspects.pop(node_id, None)
        return True

    def suspect(self, node_id: str, exc: BaseException | None) -> None:
        """Skip ``node_id`` for a while (``exc``: the failure that says why)."""
        info = self.mirror.node(node_id)
        boot = info.boot_id if info is not None else ""
        with self._lock:
            self._suspects[node_id] = (time.monotonic() + SUSPECT_S, boot)
            if self._writer == node_id:
                self._writer = None
        if exc is not None:
            self.counters.inc("node_failures")
            log.info("node %s failed a call, trying others: %s", node_id, exc)

    # -- clients -------------------------------------------------------------------------

    def client(self, node_id: str) -> NodeClient:
        """The open client of a live node, opened (after a TCP probe) on first use and
        reopened when the node restarted (new boot id)."""
        if self._closed:
            raise ClosedError("ClusterClient is closed")
        info = self.mirror.node(node_id)
        if info is None:
            raise Unavailable(f"node {node_id!r} is not in the cluster (any more)")
        with self._lock:
            held = self._clients.get(node_id)
        if held is not None and held[0] == info.boot_id:
            return held[1]
        with self._open_lock:
            with self._lock:
                held = self._clients.get(node_id)
            if held is not None and held[0] == info.boot_id:
                return held[1]
            client = self._open(info)
            with self._lock:
                if self._closed:
                    client.close()
                    raise ClosedError("ClusterClient is closed")
                if held is not None:
                    self._retired.append(held[1])  # may be in use: closed at close()
                self._clients[node_id] = (info.boot_id, client)
            return client

    def _open(self, info: NodeInfo) -> MemberClient:
        if not self.connector.reachable(info.address):
            raise Unavailable(f"node {info.node_id!r} does not answer at {info.address}")
        client = MemberClient(
            info.address, namespace=self.namespace, config=self._config, connector=self.connector
        )
        client.open()
        seen = _principal_of(client)
        with self._lock:
            if self._principal is None:
                self._principal = seen
            elif self._principal != seen:
                client.close()
                raise ConfigError(
                    f"this token scopes keys as {self._principal} on one node but as {seen} "
                    f"on {info.node_id!r} (tenant or scope secret differ): nodes must share "
                    "one tokens file"
                )
        return client

    def principal(self) -> Principal | None:
        """The tenant scope of directory keys, learned from the first node that opens
        (None while no node can be reached)."""
        if self._principal is not None:
            return self._principal
        writable = [n for u in self.write_plan() for n in u.shards if n and self.usable(n)]
        rest = sorted(set(self.mirror.nodes()) - set(writable))  # draining ones
        for node_id in writable + [n for n in rest if self.usable(n)]:
            try:
                self.client(node_id)
            except NODE_FAILURES as exc:
                self.suspect(node_id, exc)
                continue
            return self._principal
        return None
