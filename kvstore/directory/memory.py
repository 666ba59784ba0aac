"""The embedded directory: the same interface as etcd, served in process.

For single-process use (``kvstore demo``, several nodes in one process) and for the
hermetic test run. It is a real implementation, not a mock: leases expire on their
TTL (a background thread reaps them, so a node whose keepalive stopped vanishes
whether or not anyone else writes), node ids are claimed create-if-absent, every
change bumps a revision, and mirrors are fed whole batches in revision order.

:class:`MemoryBackend` plays the etcd server; each :class:`MemoryDirectory` is a
client of one. Directories that should see the same cluster share a backend, passed
explicitly (no process-wide singleton).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.directory.base import NodeInfo
from kvstore.directory.mirror import (
    DEL_BLOCK,
    DEL_NODE,
    PUT_BLOCK,
    PUT_NODE,
    Mirror,
    MirrorSnapshot,
    Op,
)
from kvstore.directory.registration import LeasedDirectory, Value, WriteOp
from kvstore.errors import LeaseExpired

__all__ = ["MemoryBackend", "MemoryDirectory"]


@dataclass(slots=True)
class _Lease:
    ttl: float
    deadline: float
    cluster: str = ""
    nodes: set[str] = field(default_factory=set)
    blocks: set[tuple[bytes, str]] = field(default_factory=set)


@dataclass(slots=True)
class _Cluster:
    nodes: dict[str, tuple[NodeInfo, int]] = field(default_factory=dict)
    blocks: dict[bytes, dict[str, Value]] = field(default_factory=dict)
    mirrors: list[Mirror] = field(default_factory=list)


class MemoryBackend:
    """In-process directory state with leases, revisions and change fan-out.

    Concurrency contract: ``_lock`` guards every field. Mirrors are fed while it is
    held (lock order: backend, then mirror), which keeps batches in revision order;
    so mirror listeners must not call back into the backend. The reaper thread
    (started with the first lease, gone when none are left) takes the same lock.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._revision = 0
        self._clusters: dict[str, _Cluster] = {}
        self._leases: dict[int, _Lease] = {}
        self._ids = itertools.count(secrets.randbits(40) << 16)
        self._reaper: threading.Thread | None = None
        self._closed = False

    @property
    def revision(self) -> int:
        """The last revision written."""
        return self._revision

    def close(self) -> None:
        """Stop the reaper thread (leases stop expiring); idempotent."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        if self._reaper is not None:
            self._reaper.join(5.0)

    # -- leases ----------------------------------------------------------------------------

    def grant(self, ttl: float) -> int:
        with self._lock:
            lease = next(self._ids)
            self._leases[lease] = _Lease(ttl, self._clock() + ttl)
            if self._reaper is None and not self._closed:
                self._reaper = threading.Thread(
                    target=self._reap, name="kvstore-memdir-reaper", daemon=True
                )
                self._reaper.start()
            self._wake.notify_all()
            return lease

    def refresh(self, lease: int) -> bool:
        with self._lock:
            self._expire_locked()
            entry = self._leases.get(lease)
            if entry is None:
                return False
            entry.deadline = self._clock() + entry.ttl
            return True

    def revoke(self, lease: int) -> None:
        with self._lock:
            self._drop_lease_locked(lease)

    def _reap(self) -> None:
        with self._lock:
            while not self._closed and self._leases:
                now = self._clock()
                self._expire_locked()
                nxt = min((e.deadline for e in self._leases.values()), default=now + 1.0)
                self._wake.wait(max(0.005, min(nxt - now, 1.0)))
            self._reaper = None

    def _expire_locked(self) -> None:
        now = self._clock()
        for lease in [k for k, e in self._leases.items() if e.deadline <= now]:
            self._drop_lease_locked(lease)

    def _drop_lease_locked(self, lease: int) -> None:
        """Delete everything under a lease in one revision, as etcd does."""
        entry = self._leases.pop(lease, None)
        if entry is None or not (entry.nodes or entry.blocks):
            return
        c = self._clusters[entry.cluster]
        ops: list[Op] = []
        for key, node_id in entry.blocks:
            holders = c.blocks.get(key)
            if holders is not None and holders.pop(node_id, None) is not None:
                ops.append((DEL_BLOCK, key, node_id))
                if not holders:
                    del c.blocks[key]
        for node_id in entry.nodes:
            if c.nodes.pop(node_id, None) is not None:
                ops.append((DEL_NODE, node_id))
        self._commit_locked(c, ops)

    def _commit_locked(self, c: _Cluster, ops: list[Op]) -> int:
        self._revision += 1
        for m in c.mirrors:
            m.apply(ops, self._revision)
        return self._revision

    # -- records ----------------------------------------------------------------------------

    def create_node(self, cluster: str, info: NodeInfo, lease: int) -> NodeInfo | None:
        with self._lock:
            self._expire_locked()
            c = self._clusters.setdefault(cluster, _Cluster())
            held = c.nodes.get(info.node_id)
            if held is not None:
                return held[0]
            entry = self._leases.get(lease)
            if entry is None:
                raise LeaseExpired(f"lease {lease:x} not found")
            entry.cluster = cluster
            entry.nodes.add(info.node_id)
            c.nodes[info.node_id] = (info, lease)
            self._commit_locked(c, [(PUT_NODE, info)])
            return None

    def update_node(self, cluster: str, info: NodeInfo, lease: int) -> int:
        """Replace a node's record, only while ``lease`` holds it (as etcd's guarded put)."""
        with self._lock:
            self._expire_locked()
            c = self._clusters.get(cluster)
            held = c.nodes.get(info.node_id) if c is not None else None
            if c is None or held is None or held[1] != lease:
                raise LeaseExpired(f"node {info.node_id!r} is not held by lease {lease:x}")
            c.nodes[info.node_id] = (info, lease)
            return self._commit_locked(c, [(PUT_NODE, info)])

    def has_node(self, cluster: str, node_id: str) -> bool:
        with self._lock:
            self._expire_locked()
            c = self._clusters.get(cluster)
            return c is not None and node_id in c.nodes

    def list_nodes(self, cluster: str) -> list[NodeInfo]:
        with self._lock:
            self._expire_locked()
            c = self._clusters.get(cluster)
            return [] if c is None else [info for info, _ in c.nodes.values()]

    def write(self, cluster: str, node_id: str, lease: int, ops: list[WriteOp]) -> int:
        """Apply one node's block writes atomically, in one revision."""
        with self._lock:
            self._expire_locked()
            entry = self._leases.get(lease)
            if entry is None:
                raise LeaseExpired(f"lease {lease:x} not found (expired or revoked)")
            entry.cluster = cluster
            c = self._clusters.setdefault(cluster, _Cluster())
            out: list[Op] = []
            for key, val in ops:
                holders = c.blocks.get(key)
                if val is None:
                    if holders is not None and holders.pop(node_id, None) is not None:
                        out.append((DEL_BLOCK, key, node_id))
                        entry.blocks.discard((key, node_id))
                        if not holders:
                            del c.blocks[key]
                    continue
                if holders is None:
                    holders = c.blocks[key] = {}
                holders[node_id] = val
                entry.blocks.add((key, node_id))
                out.append((PUT_BLOCK, key, node_id, val[0], val[1]))
            if not out:
                return self._revision
            return self._commit_locked(c, out)

    def attach(self, cluster: str, mirror: Mirror) -> None:
        """Load a mirror with the cluster's current state and feed it from now on."""
        with self._lock:
            self._expire_locked()
            c = self._clusters.setdefault(cluster, _Cluster())
            snap = MirrorSnapshot(revision=self._revision)
            snap.nodes = {nid: info for nid, (info, _) in c.nodes.items()}
            for key, holders in c.blocks.items():
                for node_id, (tier, size) in holders.items():
                    snap.add_block(key, node_id, tier, size)
            mirror.reset(snap)
            c.mirrors.append(mirror)

    def detach(self, cluster: str, mirror: Mirror) -> None:
        with self._lock:
            c = self._clusters.get(cluster)
            if c is not None and mirror in c.mirrors:
                c.mirrors.remove(mirror)


class MemoryDirectory(LeasedDirectory):
    """A client of a :class:`MemoryBackend` (a private one unless given)."""

    def __init__(self, backend: MemoryBackend | None = None, cluster: str = "default") -> None:
        super().__init__(cluster)
        self.backend = backend if backend is not None else MemoryBackend()
        self._mirror: Mirror | None = None

    async def _connect(self) -> None:
        return None

    async def _disconnect(self) -> None:
        if self._mirror is not None:
            self.backend.detach(self.cluster, self._mirror)

    async def _grant(self, ttl: int) -> int:
        return self.backend.grant(ttl)

    async def _create_node(self, info: NodeInfo, lease: int) -> NodeInfo | None:
        return self.backend.create_node(self.cluster, info, lease)

    async def _update_node(self, info: NodeInfo, lease: int) -> int:
        return self.backend.update_node(self.cluster, info, lease)

    async def _wait_node_gone(self, node_id: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.backend.has_node(self.cluster, node_id):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def _keepalive_once(self, lease: int) -> bool:
        return self.backend.refresh(lease)

    async def _revoke(self, lease: int) -> None:
        self.backend.revoke(lease)

    async def _write(self, node_id: str, lease: int, ops: list[WriteOp]) -> int:
        return self.backend.write(self.cluster, node_id, lease, ops)

    async def list_nodes(self) -> list[NodeInfo]:
        self._check_open()
        return self.backend.list_nodes(self.cluster)

    async def mirror(self) -> Mirror:
        self._check_open()
        if self._mirror is None:
            self._mirror = Mirror()
            self.backend.attach(self.cluster, self._mirror)
        return self._mirror
