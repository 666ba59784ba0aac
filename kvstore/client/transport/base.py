"""The transport seam: what moves block bytes between a client and one server.

Two small ABCs, each a real seam with socket implementations here and an in-memory one
in the tests (tests/support/memory_net.py):

- :class:`Transport` is the byte mover of one kind of link: ``read`` / ``write`` of a
  batch, ``begin_layers`` of a write filled layer by layer (a :class:`LayerSink`), and
  the per-batch metadata questions ``exists`` / ``match_prefix``. Which
  server, which connection, retries and deadlines belong to the client; the index of
  what is stored belongs to the node.
- :class:`Links` lends a link (the connection a transport speaks over) with its
  transport to one caller at a time: the client's data calls are ``lend``, one
  transport call, ``give_back``. ConnPool (pool.py) is the socket implementation.

The socket transports speak over the same authenticated data connection (conn.py) and
differ in where the payload travels:

- ``shm``: the server is on this host; payloads are copied with numpy straight out of
  (or into) the node's shared-memory segment under a lease, and the socket carries only
  the lease requests.
- ``tcp``: payloads travel on the socket, received with ``recv_into`` straight into the
  destination buffer and checked against their xxh3.

Results are per key, in order. Reads: for ``get_into`` True (hit), False (miss) or the
key's KVStoreError; for ``get`` (``outs`` is None) the value, None or the error. Writes:
True (stored), False (already present) or the error. A checksum mismatch after a
transfer is a miss, counted in ``counters["corrupt_transfers"]`` and logged. A failure
of the link itself (reset, deadline, server gone) is raised as a KVStoreError, and a
link it leaves out of step reports ``usable`` False so ``give_back`` drops it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

from kvstore._proto import store_pb2 as pb
from kvstore.blocks import ValueInfo
from kvstore.observe.counters import NodeCounters

__all__ = ["LayerSink", "Link", "Links", "Transport"]

C = TypeVar("C")


class Transport(ABC, Generic[C]):
    """Moves payloads for reads and writes over one connection of type ``C``."""

    name: ClassVar[str]

    def __init__(self, counters: NodeCounters) -> None:
        self.counters = counters

    @abstractmethod
    def read(
        self,
        conn: C,
        keys: Sequence[bytes],
        outs: Sequence[Any] | None,
        scope: pb.Scope,
        deadline: float,
        layers: tuple[int, int] | None = None,
    ) -> list[Any]:
        """Fetch blocks into ``outs`` (get_into) or into fresh values (``outs`` None);
        ``layers``: only layers [a, b) of each block, into ``outs`` (a ranged read is
        verified as a whole: a range sent inline against the server's checksum of it)."""

    @abstractmethod
    def write(
        self,
        conn: C,
        keys: Sequence[bytes],
        values: Sequence[Any],
        scope: pb.Scope,
        deadline: float,
    ) -> list[Any]:
        """Store values (tensors, arrays, bytes) under keys."""

    @abstractmethod
    def begin_layers(
        self,
        conn: C,
        keys: Sequence[bytes],
        infos: Sequence[ValueInfo],
        layers: int,
        scope: pb.Scope,
        deadline: float,
    ) -> LayerSink:
        """Start a write whose payloads come one layer range at a time
        (kvstore/client/layered.py): the server reserves every item now and stores
        none before :meth:`LayerSink.finish`."""

    @abstractmethod
    def exists(self, conn: C, keys: Sequence[bytes], deadline: float) -> list[bool]:
        """Whether each key is stored (any tier)."""

    @abstractmethod
    def match_prefix(self, conn: C, keys: Sequence[bytes], deadline: float) -> int:
        """How many leading keys are stored."""


class Link(NamedTuple):
    """A lent connection and the transport that speaks over it."""

    conn: Any
    transport: Transport[Any]


class LayerSink(ABC):
    """One layer-by-layer write in flight on one link: the bytes of each layer range,
    then each item's checksum and keep flag, then the per-item results."""

    @abstractmethod
    def send(self, parts: Sequence[Any], deadline: float) -> None:
        """The next layer of every item, in item order (flat uint8 buffers)."""

    @abstractmethod
    def finish(self, sums: Sequence[int], keep: Sequence[bool], deadline: float) -> list[Any]:
        """Commit: per item True (stored), False (stored already), None (withdrawn:
        ``keep`` False) or its error."""

    @abstractmethod
    def abort(self, deadline: float) -> None:
        """Drop the write: nothing of it is stored and every reservation is freed,
        by a message or by closing the link (it then reports ``usable`` False)."""


class Links(ABC):
    """Lends links (a connection and its transport) to one caller at a time.

    ``lend`` waits (within ``deadline``) for a free slot and opens a connection when
    none is idle; ``give_back`` keeps a usable one for reuse and closes a broken one.
    ``last_transport`` names the transport of the latest connection opened ("" before).
    """

    last_transport: str = ""

    @abstractmethod
    def lend(self, deadline: float) -> Link:
        """A connection and its transport, for one caller until :meth:`give_back`."""

    @abstractmethod
    def give_back(self, link: Link) -> None:
        """Return a link from :meth:`lend`."""

    @abstractmethod
    def settle(self, deadline: float) -> None:
        """Make sure the server has heard everything this client owes it (deferred
        releases and read reports), so a stats call right after sees them."""

    def prefaulted(self, timeout: float | None) -> bool:
        """Wait until mapped shared segments are prefaulted (none here: at once)."""
        return True

    @abstractmethod
    def close(self) -> None:
        """Close idle connections (lent ones close on return); idempotent."""
