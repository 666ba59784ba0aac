"""UCX transport: the TCP transport's frames on a connection that moved to UCX at its
handshake, their large payloads carried by ucxx (kvstore/wire/ucx.py).

Reads and writes are the TCP transport's (tcp.py): a GET's payloads are received straight
into the caller's tensor and checked against their xxh3, a PUT's are sent from the
values' own memory. Only the carrier of payloads above 64 KiB differs: UCX tag
messages over whichever UCX transport reaches the server (an RDMA NIC where there is
one; tcp otherwise). Headers, metadata and small bodies stay on the connection's
socket, which is also its lifeline.
"""

from __future__ import annotations

from kvstore.client.transport.tcp import TcpTransport

__all__ = ["UcxTransport"]


class UcxTransport(TcpTransport):
    """Payloads on a UCX connection (DataConn.on_ucx)."""

    name = "ucx"
