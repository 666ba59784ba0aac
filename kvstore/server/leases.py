"""Leases: node pins and reservations handed to other processes, with an expiry.

A same-host client copies a block out of (or into) the node's shared-memory segment
between two requests on its data connection (LEASE then RELEASE, RESERVE then COMMIT).
A put over the socket holds its reservation while the payload arrives, which a peer
can make last for ever by sending slowly; that hold is a lease too (FILL), whose end
cuts the connection, so the connection's own thread aborts the reservation (never the
reaper: the thread may still be writing into it).
Between them the node must keep the extent pinned (a read) or reserved (a write), yet
a client may crash, hang or simply forget. Every such grant is therefore a lease: it
ends when its holder releases it, when the holder's data connection closes, or when it
expires and the reaper ends it.

Expiry rule (what makes an expired reader safe): a lease granted at server time T
expires at ``T + ttl`` on CLOCK_MONOTONIC, which is one clock for every process of a
host. The reaper only ends leases whose deadline has passed, so a client that finishes
its copy and then sees ``monotonic_ns() < expires_ns`` knows the bytes it copied were
pinned the whole time. A client that sees the deadline passed treats the block as a
miss (and also verifies the xxh3 checksum, which catches anything else).

Concurrency contract: ``_lock`` guards ``_leases``; taking a lease (release, commit,
abort, expiry, connection close) removes it under the lock, so exactly one party ends
each lease; ending it (node.close_read / node.abort) happens outside the lock.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = ["Lease", "LeaseKind", "LeaseTable"]

log = logging.getLogger(__name__)


class LeaseKind(StrEnum):
    """A pinned read (node.open_read), a reserved write (node.reserve) filled through
    shared memory, a write credit (node.reserve_credit: a reservation whose key the
    COMMIT that fills it names), or a reservation being filled from a data socket
    (FILL: ``obj`` is what cuts that connection)."""

    READ = "read"
    WRITE = "write"
    CREDIT = "credit"
    FILL = "fill"


@dataclass(slots=True)
class Lease:
    """One grant: ``obj`` is the node's BlockRead or Reservation."""

    id: int
    kind: LeaseKind
    obj: Any
    tenant: str
    owner: int  # the data connection it was granted on
    expires_ns: int


class LeaseTable:
    """Live leases by id, and the reaper that ends expired ones.

    ``end`` is called (outside the lock) for every lease that expires or whose owner
    goes away, never for a lease taken with :meth:`take`: its taker ends it.
    """

    def __init__(
        self, ttl_s: float, end: Callable[[Lease], None], *, shortest_s: float | None = None
    ) -> None:
        self.ttl_ns = int(ttl_s * 1e9)
        # the shortest lease granted (grant's ttl_s): how often the reaper must look
        self.shortest_ns = int((ttl_s if shortest_s is None else min(ttl_s, shortest_s)) * 1e9)
        self._end = end
        self._lock = threading.Lock()
        self._leases: dict[int, Lease] = {}
        # ids from a random start: a restarted server never honours an old id by chance
        self._ids = itertools.count(secrets.randbits(62) + 1)
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.expired = 0  # leases ended by the reaper (a counter for stats)

    def __len__(self) -> int:
        return len(self._leases)

    def grant(
        self, kind: LeaseKind, obj: Any, tenant: str, owner: int, ttl_s: float | None = None
    ) -> Lease:
        """Register a new lease expiring ``ttl_s`` (default: the table's ttl) from now."""
        ttl_ns = self.ttl_ns if ttl_s is None else int(ttl_s * 1e9)
        lease = Lease(0, kind, obj, tenant, owner, time.monotonic_ns() + ttl_ns)
        with self._lock:
            lease.id = next(self._ids)
            self._leases[lease.id] = lease
        return lease

    def take(self, lease_id: int, tenant: str, kind: LeaseKind) -> Lease | None:
        """Remove and return a live lease of this tenant and kind; None if there is
        none (unknown, expired and reaped, another tenant's, or already taken)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.tenant != tenant or lease.kind is not kind:
                return None
            del self._leases[lease_id]
        return lease

    def count(self, kind: LeaseKind) -> int:
        """How many live leases are of ``kind``."""
        with self._lock:
            return sum(1 for lease in self._leases.values() if lease.kind is kind)

    def holds(self, lease_id: int) -> bool:
        """Whether the lease is live (granted, not yet taken, ended or reaped)."""
        with self._lock:
            return lease_id in self._leases

    def end_owner(self, owner: int) -> int:
        """End every lease of a closed data connection; returns how many."""
        with self._lock:
            gone = [lease for lease in self._leases.values() if lease.owner == owner]
            for lease in gone:
                del self._leases[lease.id]
        self._end_all(gone)
        return len(gone)

    def end_expired(self, now_ns: int | None = None) -> int:
        """End every lease past its deadline; returns how many."""
        now = time.monotonic_ns() if now_ns is None else now_ns
        with self._lock:
            gone = [lease for lease in self._leases.values() if lease.expires_ns < now]
            for lease in gone:
                del self._leases[lease.id]
        self.expired += len(gone)
        self._end_all(gone)
        return len(gone)

    def end_everything(self) -> None:
        """End all leases (server shutdown)."""
        with self._lock:
            gone = list(self._leases.values())
            self._leases.clear()
        self._end_all(gone)

    def _end_all(self, leases: list[Lease]) -> None:
        for lease in leases:
            try:
                self._end(lease)
            except Exception:  # one bad lease must not keep the others pinned
                log.exception("ending lease %d failed", lease.id)

    # -- reaper ------------------------------------------------------------------------

    def start_reaper(self) -> None:
        """Run :meth:`end_expired` in a daemon thread, several times per shortest ttl."""
        interval = min(max(self.shortest_ns / 4e9, 0.01), 1.0)

        def loop() -> None:
            while not self._stop.wait(interval):
                self.end_expired()

        self._reaper = threading.Thread(target=loop, name="kvstore-lease-reaper", daemon=True)
        self._reaper.start()

    def close(self) -> None:
        """Stop the reaper and end every lease."""
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
        self.end_everything()
