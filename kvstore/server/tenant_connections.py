"""Each tenant's open data connections, held to its ``connections`` quota.

Why: a server serves at most ``max_connections`` data sockets. Without a per-tenant
bound, one tenant opening that many (idle, or each dribbling a put) leaves every other
tenant's new connections refused. With ``connections = N`` in a tenant's quota table
(kvstore/server/quotas.py) its N+1-th connection is refused right after its HELLO
authenticated it, before it is served, with ``QuotaExceeded`` (code ``quota_exceeded``)
and a ``connections_refused@<tenant>`` count; the connections it holds are untouched.
A tenant without the limit is unbounded, as before.
"""

from __future__ import annotations

import threading

from kvstore.errors import QuotaExceeded
from kvstore.observe.counters import NodeCounters
from kvstore.server.quotas import Quotas

__all__ = ["TenantConnections"]


class TenantConnections:
    """Open data connections by tenant (thread-safe: connection threads call it)."""

    def __init__(self, quotas: Quotas, counters: NodeCounters) -> None:
        self.quotas = quotas
        self.counters = counters
        self._lock = threading.Lock()
        self._tenant_of: dict[int, str] = {}  # connection id -> its tenant
        self._open: dict[str, int] = {}

    def admit(self, conn_id: int, tenant: str) -> None:
        """Count connection ``conn_id`` as ``tenant``'s, or raise QuotaExceeded when the
        tenant holds its quota of connections already."""
        quota = self.quotas.get(tenant)
        limit = quota.connections if quota is not None else 0
        with self._lock:
            held = self._open.get(tenant, 0)
            if not limit or held < limit:
                self._open[tenant] = held + 1
                self._tenant_of[conn_id] = tenant
                return
        self.counters.inc("connections_refused", tenant=tenant)
        raise QuotaExceeded(
            f"tenant {tenant!r} has {held} data connections open, its quota "
            f"(connections = {limit}); close one or raise the quota"
        )

    def release(self, conn_id: int) -> None:
        """Connection ``conn_id`` closed (any connection: one never admitted is a no-op)."""
        with self._lock:
            tenant = self._tenant_of.pop(conn_id, None)
            if tenant is not None:
                left = self._open[tenant] - 1
                if left:
                    self._open[tenant] = left
                else:
                    del self._open[tenant]

    def open(self, tenant: str) -> int:
        """How many data connections ``tenant`` holds now."""
        with self._lock:
            return self._open.get(tenant, 0)
