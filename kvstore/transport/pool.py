"""Data connections of one client, and the transport each one uses.

Connections are opened lazily, lent to one caller at a time and kept for reuse (up to
``size`` at once; a caller beyond that waits for one to come back). A connection whose
stream broke is closed, never returned. The transport is chosen per connection from the
server's HELLO reply, so a server restart (new instance id, new segment) is picked up
by the next connection without any client-wide state to reset:

- ``shm`` when the server's host id is this kernel's boot id and its segment maps here;
- ``tcp`` otherwise (or when configured), the fallback for ``auto`` when mapping fails.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvstore._proto import store_pb2 as pb
from kvstore.config import ClientConfig
from kvstore.errors import (
    KVStoreError,
    StorageError,
    TimeoutError_,
    TransportError,
    Unavailable,
)
from kvstore.stats import NodeCounters
from kvstore.transport.base import Transport
from kvstore.transport.conn import DataConn
from kvstore.transport.locality import host_id
from kvstore.transport.shm import Segment, ShmTransport
from kvstore.transport.tcp import TcpTransport

__all__ = ["ConnPool"]

log = logging.getLogger(__name__)


class ConnPool:
    """Lends authenticated data connections with their transport.

    Concurrency: ``_lock`` (and ``_cond`` on it) guards ``_idle``, ``_segments``,
    ``_server`` and ``_deferred``; ``_slots`` bounds connections in use. Connecting and
    all I/O happen outside the lock. Read leases a connection still owes the server
    (DataConn.defer_release) go out with its next request; a flusher thread, started on
    first need, sends them for connections left idle longer than RELEASE_DELAY_S, so an
    idle client pins nothing for long.
    """

    RELEASE_DELAY_S = 0.005

    def __init__(
        self,
        host: str,
        config: ClientConfig,
        counters: NodeCounters,
        locate: Callable[[float], pb.InfoResponse],
        tls: ssl.SSLContext | None = None,
        server: pb.InfoResponse | None = None,
    ) -> None:
        self.host = host
        self.config = config
        self.counters = counters
        self._locate = locate  # deadline -> the server's Info (a gRPC call)
        self._tls = tls
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._deferred = False  # an idle connection owes read releases
        self._flusher: threading.Thread | None = None
        self._idle: list[tuple[DataConn, Transport]] = []
        self._segments: dict[tuple[str, str], Segment] = {}
        self._slots = threading.BoundedSemaphore(config.pool_size)
        self._server = server  # where the data sockets are (None: ask with locate)
        self._tcp = TcpTransport(counters)
        self._closed = False
        self.last_transport = ""

    @contextmanager
    def connection(self, deadline: float) -> Iterator[tuple[DataConn, Transport]]:
        """Lend a connection and its transport until the block ends."""
        if not self._slots.acquire(timeout=max(deadline - time.monotonic(), 0)):
            raise TimeoutError_(f"all {self.config.pool_size} data connections stayed busy")
        link = None
        try:
            with self._lock:
                link = self._idle.pop() if self._idle else None
            if link is None:
                link = self._open(deadline)
            yield link
        finally:
            if link is not None:
                self._give_back(link)
            self._slots.release()

    def _give_back(self, link: tuple[DataConn, Transport]) -> None:
        conn = link[0]
        with self._lock:
            keep = conn.usable and not self._closed
            if keep:
                self._idle.append(link)
                if conn.pending:
                    self._deferred = True
                    self._cond.notify()
                    if self._flusher is None:
                        self._flusher = threading.Thread(
                            target=self._flush_loop, name="kvstore-release", daemon=True
                        )
                        self._flusher.start()
        if not keep:
            conn.close()

    def _flush_loop(self) -> None:
        """Send the releases of connections that stay idle (see RELEASE_DELAY_S)."""
        while True:
            with self._cond:
                while not self._closed and not self._deferred:
                    self._cond.wait()
                if self._closed:
                    return
            time.sleep(self.RELEASE_DELAY_S)  # the next request usually carries them
            with self._lock:
                due = [link for link in self._idle if link[0].pending]
                self._idle = [link for link in self._idle if not link[0].pending]
                self._deferred = False
            for link in due:
                # a broken connection is closed by _give_back, which ends its leases
                with contextlib.suppress(KVStoreError):
                    link[0].flush_releases()
                self._give_back(link)

    def _open(self, deadline: float) -> tuple[DataConn, Transport]:
        with self._lock:
            server = self._server
        if server is None:
            server = self._locate(deadline)
        try:
            conn = self._connect(server, deadline)
        except Unavailable:
            with self._lock:
                self._server = None  # the server may have restarted elsewhere: ask again
            raise
        with self._lock:
            self._server = conn.info  # the freshest word on where the sockets are
        try:
            transport = self._pick(conn)
        except BaseException:
            conn.close()
            raise
        self.last_transport = transport.name
        return conn, transport

    def _connect(self, server: pb.InfoResponse, deadline: float) -> DataConn:
        """Same host: the Unix data socket when offered (no TCP cost); else TCP."""
        c = self.config
        kw: dict = {"deadline": deadline, "max_meta": c.max_message_bytes}
        if c.transport != "tcp" and server.unix_socket and self._same_host(server):
            try:
                return DataConn.open(server.unix_socket, c.token, **kw)
            except (Unavailable, TransportError) as exc:
                fresh = self._locate(deadline)  # a restarted server has a new socket name
                if fresh.unix_socket and fresh.unix_socket != server.unix_socket:
                    return self._connect(fresh, deadline)
                log.info("Unix data socket unreachable (%s); using TCP", exc)
                server = fresh
        return DataConn.open(
            (self.host, server.data_port),
            c.token,
            tls=self._tls,
            server_name=c.tls_server_name or None,
            **kw,
        )

    @staticmethod
    def _same_host(info: pb.InfoResponse) -> bool:
        return bool(info.host_id) and info.host_id == host_id()

    def _pick(self, conn: DataConn) -> Transport:
        info, want = conn.info, self.config.transport
        if want == "tcp":
            return self._tcp
        if self._same_host(info) and info.shm_name:
            try:
                seg = self._segment(info)
                return ShmTransport(self.counters, seg, verify=self.config.verify_shm)
            except StorageError as exc:
                if want == "shm":
                    raise
                log.info("server segment does not map here (%s); using TCP", exc)
        elif want == "shm":
            raise Unavailable("transport=shm but the server is not on this host")
        return self._tcp

    def _segment(self, info: pb.InfoResponse) -> Segment:
        instance, name = info.instance_id, info.shm_name
        with self._lock:
            seg = self._segments.get((instance, name))
            if seg is not None:
                return seg
            stale = [k for k in self._segments if k[0] != instance]
            for k in stale:  # a restarted server has a new segment; drop old mappings
                self._segments.pop(k).close()
        seg = Segment(name, info.shm_size)
        with self._lock:
            kept = self._segments.setdefault((instance, name), seg)
        if kept is not seg:  # another thread mapped it first
            seg.close()
        return kept

    def close(self) -> None:
        """Close idle connections and unmap segments (lent ones close on return)."""
        with self._lock:
            self._closed = True
            self._cond.notify_all()
            idle, self._idle = self._idle, []
            segs, self._segments = list(self._segments.values()), {}
        for conn, _ in idle:
            conn.close()
        for seg in segs:
            seg.close()
