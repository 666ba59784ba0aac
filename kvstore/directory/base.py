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

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from kvstore.directory.records import MUTABLE_FIELDS, NodeInfo, Replica, check_name
from kvstore.events import BlockEvent
from kvstore.tier_kinds import TierKind

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

BlockSnapshot = Mapping[bytes, tuple[TierKind, "int | None"]]
"""A node's full block list for :meth:`Directory.sync`: key -> (tier, size); a size of
None means "unknown": the size published before is kept (0 if none was)."""


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
