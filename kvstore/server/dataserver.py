"""The server side of the data socket: bulk bytes and same-host leases.

One thread per connection, blocking sockets: in CPython on a 2-core host a blocking
socket round trip costs ~25 us where an asyncio one costs 55-175 us, and a payload
arrives in a single ``recv_into`` straight into its reserved slab extent.

A connection's life: TLS handshake (when configured), HELLO with a bearer token, then
requests in order (kvstore/server/session.py). A PUT payload is received into a fresh
reservation and committed against the writer's xxh3; a frame cut short, a reset or a
stall past ``io_timeout_s`` closes the connection and aborts that reservation, so
nothing half-written is ever visible. Every lease granted on a connection (shared-memory
reads and writes, write credits) ends when it closes (Gateway.end_connection).

A reservation is held only while its payload keeps coming: each item's receive runs
under a FILL lease of ``put_grace_s + nbytes / put_floor_bytes``
(Gateway.fill_deadline_s). When it expires the lease reaper shuts the socket down, the
receive returns, and this connection's thread aborts the reservation and closes: a
peer sending a byte a second holds space for seconds, not for the frame's whole
``io_timeout_s``, and never across items.

A layer-by-layer PUT (``PutRequest.layers``, kvstore/server/layered.py) reserves every
item first, then receives layer 0 of each item, layer 1 of each, and so on, each run
straight into its place in the reservation under its own FILL lease, so a writer may
pause between layers for as long as one layer's lease (its forward computes the next
layer meanwhile). The items' checksums and keep flags close the body; one commit
follows. A stream that ends early aborts every reservation of the request.

A server with ``transport = "ucx"`` also offers UCX (kvstore/wire/ucx.py): a HELLO
carrying a UCX worker address moves its connection's large payloads there.

Counting (kvstore/observe/names.py): payload bytes on the socket are path ``tcp`` (over
TCP or the same-host Unix socket alike), leased extents are ``shm``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import ssl
import sys
import threading
from collections.abc import Callable

from kvstore._proto import store_pb2 as pb
from kvstore.config import ServerConfig
from kvstore.errors import ConfigError, KVStoreError, Unavailable
from kvstore.server.auth import TokenTable
from kvstore.server.frame_codec import send_error
from kvstore.server.gateway import Gateway
from kvstore.server.session import Session
from kvstore.server.tenant_connections import TenantConnections
from kvstore.tenants import Principal
from kvstore.wire.crowding import CROWDING
from kvstore.wire.frames import FrameSocket, socket_errors
from kvstore.wire.polling import IdlePoller
from kvstore.wire.ucx import UcxFrames
from kvstore.wire.ucx import available as ucx_available

__all__ = ["HELLO_MAX_META", "DataServer"]

log = logging.getLogger(__name__)


HELLO_MAX_META = 4096
"""Largest HELLO metadata accepted: a token, a protocol number, a pid and a host id fit
many times over, and an unauthenticated peer can make the server allocate no more."""


def _never() -> bool:
    return False


class DataServer:
    """Accepts data sockets and serves each on its own thread."""

    def __init__(
        self,
        gateway: Gateway,
        tokens: TokenTable,
        info: Callable[[Principal], pb.InfoResponse],
        config: ServerConfig,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.gateway = gateway
        self.tokens = tokens
        self.info = info
        self.config = config
        self.tls = tls
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._conns: dict[int, FrameSocket] = {}
        self._workers: set[threading.Thread] = set()
        self._listeners: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._in_process = 0  # open connections of clients in this process (under _lock)
        self._handshaking = 0  # connections before (or in) HELLO (under _lock)
        self.unix_name = ""
        self.ucx = config.transport == "ucx"
        if self.ucx and not ucx_available():
            raise ConfigError("transport ucx: ucxx is not installed (pip install 'kvstore[ucx]')")
        self.poller = IdlePoller(
            config.data_poll_us / 1e6,
            gateway.books.counters,
            may_poll=self._may_poll,
            crowded=_never if config.data_poll_crowded else CROWDING.crowded,
        )
        self.tenants = TenantConnections(gateway.books.quotas, gateway.books.counters)
        gateway.gauges["connections"] = lambda: len(self._conns)
        gateway.gauges["handshakes"] = lambda: self._handshaking

    def start(self, unix_name: str = "") -> int:
        """Bind the TCP listener (and, given a name, an abstract Unix socket for same-host
        clients) and start accepting; returns the TCP port."""
        c = self.config
        with socket_errors(f"data socket bind {c.host}:{c.data_port}"):
            family = socket.AF_INET6 if ":" in c.host else socket.AF_INET
            ls = socket.socket(family, socket.SOCK_STREAM)
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind((c.host, c.data_port))
            ls.listen(128)
        self._listen(ls)
        if unix_name and sys.platform.startswith("linux"):
            try:
                us = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                us.bind("\0" + unix_name)  # abstract: nothing on disk to clean up
                us.listen(128)
            except OSError as exc:
                log.warning("no Unix data socket (%s); same-host clients use TCP", exc)
            else:
                self._listen(us)
                self.unix_name = unix_name
        return int(ls.getsockname()[1])

    def _listen(self, ls: socket.socket) -> None:
        self._listeners.append(ls)
        t = threading.Thread(target=self._accept_loop, args=(ls,), name="kvstore-data-accept")
        t.daemon = True
        t.start()
        self._threads.append(t)

    def close(self) -> None:
        """Stop accepting and close every connection (their leases end)."""
        self._closing = True
        for ls in self._listeners:
            with contextlib.suppress(OSError):
                ls.shutdown(socket.SHUT_RDWR)
            ls.close()
        for t in self._threads:
            t.join(timeout=5)
        with self._lock:
            conns = list(self._conns.values())
            workers = list(self._workers)
        for fs in conns:
            fs.close()  # wakes each connection thread, which ends its leases and exits
        for t in workers:
            t.join(timeout=5)

    @property
    def in_process_clients(self) -> int:
        """Open connections whose client runs in this process (none polls meanwhile)."""
        return self._in_process

    def _may_poll(self) -> bool:
        # a plain read under the GIL: a connection that just came or went costs one
        # poll window at most
        return not self._in_process

    def handshake_over(self) -> None:
        with self._lock:
            self._handshaking -= 1

    def count_in_process(self, step: int) -> None:
        with self._lock:
            self._in_process += step

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._closing:
            try:
                sock, _addr = listener.accept()
            except OSError:
                if self._closing:
                    return
                continue
            t = threading.Thread(target=self._run, args=(sock,), name="kvstore-data-conn")
            t.daemon = True
            with self._lock:
                self._workers = {w for w in self._workers if w.is_alive()}
                self._workers.add(t)
            t.start()

    def _run(self, sock: socket.socket) -> None:
        conn_id = next(self._ids)
        fs: FrameSocket | UcxFrames | None = None
        try:
            if self.tls is not None and sock.family != socket.AF_UNIX:  # local: no wire
                sock.settimeout(self.config.io_timeout_s)
                with socket_errors("TLS handshake"):
                    sock = self.tls.wrap_socket(sock, server_side=True)
            # Until HELLO authenticates it, a connection may send only a small frame:
            # nothing it claims is allocated beyond HELLO_MAX_META.
            fs = FrameSocket(sock, max_meta=HELLO_MAX_META)
            fs.frame_timeout = self.config.io_timeout_s
            with self._lock:
                full = len(self._conns) >= self.config.max_connections
                crowded = self._handshaking >= self.config.max_handshakes
                if not (full or crowded):
                    self._conns[conn_id] = fs
                    self._handshaking += 1
            if full or crowded:
                what = "data connections" if full else "connections not yet authenticated"
                send_error(fs, Unavailable(f"too many {what}; try again later"))
                return
            session = Session(self, fs, conn_id)
            try:
                session.serve()
            finally:
                fs = session.fs  # the UCX frames, when the connection moved there
        except (KVStoreError, OSError) as exc:
            log.info("data connection %d closed: %s", conn_id, exc)
        except Exception:
            log.exception("data connection %d failed", conn_id)
        finally:
            with self._lock:
                self._conns.pop(conn_id, None)
            self.tenants.release(conn_id)
            self.gateway.end_connection(conn_id)
            if fs is not None:
                fs.close()
            else:
                sock.close()
