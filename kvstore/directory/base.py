"""The directory seam: who is in the cluster and which node holds which block.

The directory is metadata only: it says where a block lives (node, tier, size) and
never moves bytes (that is the transport's job). Nodes register under a lease and
publish their block events; readers ask a local :class:`~kvstore.directory.mirror.Mirror`,
kept current by one watch, so a lookup or a longest-prefix match never costs a round
trip per block.

Two implementations serve this interface: :class:`~kvstore.directory.memory.MemoryDirectory`
(in process, for single-process use and hermetic tests) and
:class:`~kvstore.directory.etcd.EtcdDirectory` (a real etcd through aetcd). One
conformance suite runs against both.

Lease and epoch contract: a node's record and every block entry it publishes share
one lease. When the node dies its keepalive stops, the lease expires, and everything
it published disappears in one revision. A restarted node gets a new lease (its
epoch) and can only claim its id once the old record is gone, so an entry from a
previous life can never be mistaken for a live one.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from kvstore.errors import ConfigError, DirectoryError
from kvstore.events import BlockEvent
from kvstore.tiers.base import TierKind

if TYPE_CHECKING:
    from kvstore.directory.mirror import Mirror

__all__ = [
    "DEFAULT_TTL",
    "MUTABLE_FIELDS",
    "BlockSnapshot",
    "Directory",
    "NodeInfo",
    "Replica",
    "check_name",
]

_D = TypeVar("_D", bound="Directory")

DEFAULT_TTL = 10
"""Seconds a node's lease lives without a keepalive (refreshed every third of it)."""

_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")

BlockSnapshot = Mapping[bytes, tuple[TierKind, "int | None"]]
"""A node's full block list for :meth:`Directory.sync`: key -> (tier, size); a size of
None means "unknown": the size published before is kept (0 if none was)."""


def check_name(kind: str, value: str) -> str:
    """Cluster names and node ids become etcd key segments: 1-64 of [A-Za-z0-9._-]."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ConfigError(f"{kind} {value!r}: use 1-64 of [A-Za-z0-9._-]")
    return value


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What a node announces about itself; stored under its lease.

    Attributes:
        node_id: unique among live nodes of a cluster.
        host: host name or IP, for locality (same host means shared memory works).
        address: gRPC control-plane address (``host:port``).
        data_address: bulk-transfer address (TCP/UCX), empty when it equals ``address``.
        shm_name: the DRAM tier's shared-memory segment, for same-host clients.
        boot_id: random per process start; tells two lives of one node id apart.
        tiers: capacity in bytes of each tier the node has.
        host_id: the kernel's boot id (kvstore.transport.locality.host_id): equal on
            two nodes exactly when they share a kernel, so a client can tell which
            nodes are local to it ("" when unknown, which never matches).
        epoch: the lease the registration lives under; set by the directory (0 before).
        draining: the node is being emptied (``kvstore drain``): clients stop writing
            to it but may still read what it holds. Changed on a live registration
            with :meth:`Directory.update_node`.
    """

    node_id: str
    host: str
    address: str
    data_address: str = ""
    shm_name: str = ""
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    tiers: Mapping[TierKind, int] = field(default_factory=dict)
    host_id: str = ""
    epoch: int = 0
    draining: bool = False

    def __post_init__(self) -> None:
        check_name("node_id", self.node_id)
        if not self.host:
            raise ConfigError("NodeInfo.host must not be empty")

    def with_epoch(self, epoch: int) -> NodeInfo:
        """A copy stamped with the lease it is registered under."""
        return replace(self, epoch=epoch)

    def to_json(self) -> bytes:
        """The record stored in the directory (JSON, readable with ``etcdctl get``)."""
        doc: dict[str, Any] = {
            "node_id": self.node_id,
            "host": self.host,
            "address": self.address,
            "data_address": self.data_address,
            "shm_name": self.shm_name,
            "boot_id": self.boot_id,
            "tiers": {TierKind(k).value: int(v) for k, v in self.tiers.items()},
            "host_id": self.host_id,
            "epoch": self.epoch,
            "draining": self.draining,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, *, epoch: int | None = None) -> NodeInfo:
        """Parse a stored record; ``epoch`` (the key's actual lease) wins over the body."""
        try:
            doc = json.loads(raw)
            return cls(
                node_id=doc["node_id"],
                host=doc["host"],
                address=doc.get("address", ""),
                data_address=doc.get("data_address", ""),
                shm_name=doc.get("shm_name", ""),
                boot_id=doc.get("boot_id", ""),
                tiers={TierKind(k): int(v) for k, v in doc.get("tiers", {}).items()},
                host_id=doc.get("host_id", ""),
                epoch=int(doc.get("epoch", 0)) if epoch is None else epoch,
                draining=_flag(doc.get("draining", False)),
            )
        except (ValueError, KeyError, TypeError, ConfigError) as exc:
            raise DirectoryError(f"malformed node record: {raw[:200]!r}") from exc


def _flag(value: Any) -> bool:
    """A JSON boolean; anything else is a malformed record (not truthiness)."""
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {value!r}")
    return value


MUTABLE_FIELDS = frozenset(
    {"host", "address", "data_address", "shm_name", "tiers", "host_id", "draining"}
)
"""NodeInfo fields :meth:`Directory.update_node` may change; the rest name the node's
life (node_id, boot_id) or are the directory's to set (epoch)."""


@dataclass(frozen=True, slots=True)
class Replica:
    """One copy of a block: which node, which tier, how many bytes (header + payload).

    Mirrors intern these (there are few distinct ones), so compare with ``==``.
    """

    node_id: str
    tier: TierKind
    size: int


class Directory(ABC):
    """Cluster membership plus the block directory, behind one async interface.

    Lifecycle: unopened -> open (``open()`` or ``async with``) -> closed. Every method
    after ``close()`` raises ClosedError. A Directory is bound to the event loop that
    opened it; its :class:`Mirror` may be read from any thread.

    Writers: ``register_node`` then ``publish`` (or ``sync``) for that node id, from one
    task at a time per node. Readers: ``mirror()`` and the read helpers below.
    """

    cluster: str

    async def __aenter__(self: _D) -> _D:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @abstractmethod
    async def open(self) -> None:
        """Connect (idempotent)."""

    @abstractmethod
    async def close(self, *, deregister: bool = True) -> None:
        """Stop keepalives and the mirror. ``deregister=True`` revokes this directory's
        leases so its nodes vanish now; False leaves them to expire (what a crash does)."""

    @abstractmethod
    async def register_node(
        self, info: NodeInfo, *, ttl: float = DEFAULT_TTL, wait: float = 0.0
    ) -> NodeInfo:
        """Claim ``info.node_id`` under a new lease kept alive in the background.

        Returns ``info`` stamped with its epoch. If a live node holds the id, waits up to
        ``wait`` seconds for that holder's lease to lapse (a restarted node waiting out
        its previous life), then raises ConflictError.
        """

    @abstractmethod
    async def update_node(self, node_id: str, **changes: Any) -> int:
        """Change fields (see ``MUTABLE_FIELDS``) of a node registered here, in place,
        under its lease; returns the revision at which the new record is visible.

        The write is guarded by the lease: it only replaces the record this
        registration holds, never a newer life's. The change is kept as part of the
        registration, so a lease recovery re-registers with it, and on Unavailable it
        is written by the next ``flush`` or keepalive (the call still raises).
        """

    @abstractmethod
    async def deregister(self, node_id: str) -> None:
        """Revoke the node's lease: its record and all its block entries vanish at once."""

    @abstractmethod
    async def publish(self, node_id: str, events: Iterable[BlockEvent]) -> int:
        """Apply a node's block events, batched into transactions; returns the revision
        at which they are visible (``Mirror.wait_for_revision`` takes it).

        Events are coalesced per key first (the last state wins), so a batch costs one
        operation per distinct key. On Unavailable the events are kept and written by
        the next ``publish`` or ``flush``.
        """

    @abstractmethod
    async def sync(self, node_id: str, blocks: BlockSnapshot) -> int:
        """Replace the node's published block list with ``blocks`` (a full re-list,
        after dropped events); only the differences are written. Returns the revision."""

    @abstractmethod
    async def flush(self, node_id: str) -> int:
        """Write whatever an earlier publish could not (after an outage)."""

    @abstractmethod
    def pending(self, node_id: str) -> int:
        """How many keys of this node are waiting to be written."""

    @abstractmethod
    def registration(self, node_id: str) -> NodeInfo:
        """The node's current registration (its epoch changes if its lease was lost)."""

    @abstractmethod
    async def list_nodes(self) -> list[NodeInfo]:
        """Live nodes, read from the directory itself (not the mirror)."""

    @abstractmethod
    async def mirror(self) -> Mirror:
        """The local mirror of the whole cluster, started on first use and returned
        once it holds a consistent snapshot; one per Directory, shared by callers."""

    async def lookup(self, keys: Sequence[bytes]) -> list[tuple[Replica, ...]]:
        """Per key, every replica; served from the mirror."""
        return (await self.mirror()).lookup(keys)

    async def nearest(
        self, key: bytes, local_node_id: str | None = None, local_host: str | None = None
    ) -> Replica | None:
        """The replica to read first (see ``Mirror.nearest``); from the mirror."""
        return (await self.mirror()).nearest(key, local_node_id, local_host)

    async def longest_prefix(self, keys: Sequence[bytes]) -> dict[str, int]:
        """Per node, how many leading ``keys`` it holds; from the mirror."""
        return (await self.mirror()).longest_prefix(keys)
