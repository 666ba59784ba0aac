"""The transport seam: what moves block bytes between a client and one server.

A transport is the byte mover only. Which server, which connection, retries and
deadlines belong to the client; the index of what is stored belongs to the node. Both
implementations speak over the same authenticated data connection (conn.py) and differ
in where the payload travels:

- ``shm``: the server is on this host; payloads are copied with numpy straight out of
  (or into) the node's shared-memory segment under a lease, and the socket carries only
  the lease requests.
- ``tcp``: payloads travel on the socket, received with ``recv_into`` straight into the
  destination buffer and checked against their xxh3.

Results are per key, in order. Reads: for ``get_into`` True (hit), False (miss) or the
key's KVStoreError; for ``get`` (``outs`` is None) the value, None or the error. Writes:
True (stored), False (already present) or the error. A checksum mismatch after a
transfer is a miss, counted in ``counters["corrupt_transfers"]`` and logged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from kvstore._proto import store_pb2 as pb
from kvstore.client.transport.conn import DataConn
from kvstore.observe.counters import NodeCounters

__all__ = ["Transport"]


class Transport(ABC):
    """Moves payloads for reads and writes over one data connection."""

    name: ClassVar[str]

    def __init__(self, counters: NodeCounters) -> None:
        self.counters = counters

    @abstractmethod
    def read(
        self,
        conn: DataConn,
        keys: Sequence[bytes],
        outs: Sequence[Any] | None,
        scope: pb.Scope,
        deadline: float,
    ) -> list[Any]:
        """Fetch blocks into ``outs`` (get_into) or into fresh values (``outs`` None)."""

    @abstractmethod
    def write(
        self,
        conn: DataConn,
        keys: Sequence[bytes],
        values: Sequence[Any],
        scope: pb.Scope,
        deadline: float,
    ) -> list[Any]:
        """Store values (tensors, arrays, bytes) under keys."""
