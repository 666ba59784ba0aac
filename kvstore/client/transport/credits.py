"""Write credits a same-host connection holds (PutRequest.credits).

A credit is an extent of the node's shared segment reserved for a block whose key is
not known yet, lent to one connection for ``lease_ttl_s``. A put of that size and scope
copies its payload straight into it and names the block in the one COMMIT that stores
it: one round trip instead of RESERVE, then COMMIT. Each COMMIT asks for as many
credits as it uses, so a writer that keeps putting blocks of one size keeps a stock.

A credit is never copied into close to its expiry: once its lease runs out the server
frees the extent, and it may be another block's by the time a late copy lands.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

from kvstore._proto import store_pb2 as pb

__all__ = ["Credit", "CreditPool"]

# A credit is used only if it has this long left: the copy and the COMMIT must land
# before the lease ends (a 16 MiB copy takes a few ms; leases last lease_ttl_s, 30 s).
MARGIN_NS = 2_000_000_000


class Credit(NamedTuple):
    """One lent extent: its lease, where it starts in the segment, when it expires."""

    lease_id: int
    offset: int
    expires_ns: int


class CreditPool:
    """A connection's credits by (scope, payload size). Used by one thread at a time,
    as its connection is."""

    def __init__(self) -> None:
        self._by: dict[tuple[bytes, int], list[Credit]] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._by.values())

    def take(self, scope: bytes, nbytes: int) -> Credit | None:
        """A credit for a block of ``nbytes`` in ``scope`` with time left, or None.
        Those too close to their expiry are dropped (the server reclaims them)."""
        stock = self._by.get((scope, nbytes))
        limit = time.monotonic_ns() + MARGIN_NS
        while stock:
            credit = stock.pop()
            if credit.expires_ns > limit:
                return credit
        return None

    def keep(self, scope: bytes, sizes: Sequence[int], resp: pb.PutResponse) -> None:
        """Add the credits ``resp`` grants (for ``sizes``, in order: a prefix of them)."""
        for n, c in zip(sizes, resp.credits, strict=False):
            if c.lease_id:
                credit = Credit(c.lease_id, c.offset, resp.credits_expire_ns)
                self._by.setdefault((scope, n), []).append(credit)
