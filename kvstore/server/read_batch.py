"""The gateway's read batches: pinned blocks handed to a reader, and their counting.

A read request pins each of the caller's keys (in the caller's namespace) for as long
as its reply takes (:class:`ReadBatch`); a same-host request instead hands the hits it
may copy from the shared segment over under read leases (kvstore/server/leases.py),
which stay pinned until released, until their data connection closes, or until they
expire. Hits, misses and bytes out are counted in the books once the reply is on its
way (kvstore/server/books.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.errors import KVStoreError
from kvstore.keys import Namespace
from kvstore.node.store import BlockRead, StoreNode
from kvstore.server.books import Books
from kvstore.server.leases import Lease, LeaseKind, LeaseTable
from kvstore.tenants import Principal

__all__ = ["ReadBatch", "ReadItem", "Reads"]

ReadItem = BlockRead | None | KVStoreError  # a pinned hit, a miss, or that key's failure


class ReadBatch:
    """One read request's pinned blocks (``items``, in key order), and for a same-host
    request the leases granted on some of them (``leases``, by item index). A context
    manager: leaving it unpins what no lease holds and, when its body succeeded, counts
    the request (kvstore/observe/names.py)."""

    __slots__ = ("_books", "_node", "_p", "counted", "items", "leases", "namespace_fp", "path")

    def __init__(
        self,
        reads: Reads,
        p: Principal,
        items: list[ReadItem],
        path: str,
        ns: Namespace | None,
    ) -> None:
        self._node, self._books = reads.node, reads.books
        self._p = p
        self.items = items
        self.leases: dict[int, Lease] = {}
        self.path = path
        self.counted = False
        self.namespace_fp = b"" if ns is None else ns.fingerprint()

    def __enter__(self) -> ReadBatch:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        node, leases = self._node, self.leases
        inline = shm = 0
        for i, r in enumerate(self.items):
            if isinstance(r, BlockRead):
                if i in leases:
                    shm += r.header.payload_len
                else:
                    inline += r.header.payload_len
                    node.close_read(r)
        if exc_type is None:
            books = self._books
            if not self.counted:
                books.count_reads(self._p, self.items)
            books.count_out(self._p, "shm", shm)
            books.count_out(self._p, self.path, inline)


class Reads:
    """Read requests against the node: pins, read leases, and reads a same-host client
    served itself."""

    def __init__(self, node: StoreNode, books: Books, leases: LeaseTable) -> None:
        self.node, self.books, self.leases = node, books, leases
        self.max_value_bytes = node.config.max_value_bytes

    def read(
        self, p: Principal, model: str, layout: str, keys: Sequence[bytes], path: str
    ) -> ReadBatch:
        """Pin each of the caller's keys (Gateway.read)."""
        self.books.check_batch(len(keys))
        ns = self.books.namespace(p, model, layout)
        return ReadBatch(self, p, self._open(p, keys, ns), path, ns)

    def lease(
        self, p: Principal, model: str, layout: str, keys: Sequence[bytes], owner: int
    ) -> ReadBatch:
        """Pin each of the caller's keys and lease the hits in the shared segment
        (Gateway.lease)."""
        self.books.check_batch(len(keys))
        ns = self.books.namespace(p, model, layout)
        batch = ReadBatch(self, p, self._open(p, keys, ns), "tcp", ns)
        try:
            for i, r in enumerate(batch.items):
                if isinstance(r, BlockRead) and r.shm_offset >= 0:
                    batch.leases[i] = self.leases.grant(LeaseKind.READ, r, p.tenant, owner)
        except BaseException:
            batch.__exit__(None, None, None)
            raise
        self.books.count_reads(p, batch.items)  # leased hits are counted when granted
        batch.counted = True
        return batch

    def _open(self, p: Principal, keys: Sequence[bytes], ns: Namespace | None) -> list[ReadItem]:
        node = self.node
        out: list[ReadItem] = []
        try:
            for k in p.scope_all(keys):
                try:
                    out.append(node.open_read(k, namespace=ns))
                except KVStoreError as exc:
                    out.append(exc)
        except BaseException:
            for r in out:
                if isinstance(r, BlockRead):
                    node.close_read(r)
            raise
        return out

    def release(self, p: Principal, lease_ids: Sequence[int]) -> tuple[int, int]:
        """End the caller's read leases; (released, expired or unknown)."""
        n = 0
        for lid in lease_ids:
            lease = self.leases.take(lid, p.tenant, LeaseKind.READ)
            if lease is not None:
                self.node.close_read(lease.obj)
                n += 1
        return n, len(lease_ids) - n

    def touch(
        self, p: Principal, keys: Sequence[bytes], nbytes: int, seconds: Sequence[float] = ()
    ) -> None:
        """Account reads a same-host client served itself (Gateway.touch)."""
        books = self.books
        books.check_batch(len(keys))
        self.node.touch(p.scope_all(keys))
        books.counters.inc("hits_dram", len(keys), tenant=p.tenant)
        books.count_out(p, "shm", min(max(nbytes, 0), len(keys) * self.max_value_bytes))
        for s in seconds[: len(keys)]:
            if 0.0 <= s <= 3600.0:  # NaN fails both
                books.counters.observe("get", "shm", s)
