"""Data connections of one client, and the transport each one uses.

Connections are opened lazily, lent to one caller at a time and kept for reuse (up to
``size`` at once; a caller beyond that waits for one to come back). A connection whose
stream broke is closed, never returned. The transport is chosen per connection from the
server's HELLO reply, so a server restart (new instance id, new segment) is picked up
by the next connection without any client-wide state to reset:

- ``shm`` when the server's host id is this kernel's boot id and its segment maps here;
- ``ucx`` when configured, or for ``auto`` when the server is on another host, offers
  UCX and ucxx imports here: the connection moves to UCX at its handshake;
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
from kvstore.client.device.side import DeviceSide
from kvstore.client.transport.base import Link, Links
from kvstore.client.transport.conn import DataConn
from kvstore.client.transport.shm import Segment, ShmTransport
from kvstore.client.transport.shm_direct import DirectReader
from kvstore.client.transport.tcp import SocketTransport, TcpTransport
from kvstore.client.transport.ucx import UcxTransport
from kvstore.config import ClientConfig
from kvstore.copies.engine import CopyEngine
from kvstore.copies.registry import HostRegistry
from kvstore.errors import (
    KVStoreError,
    StorageError,
    TimeoutError_,
    TransportError,
    Unavailable,
)
from kvstore.observe.counters import NodeCounters
from kvstore.shm.index import IndexReader, reader_supported
from kvstore.wire.crowding import CROWDING
from kvstore.wire.frames import Op
from kvstore.wire.locality import host_id
from kvstore.wire.ucx import available as ucx_available

__all__ = ["ConnPool"]

log = logging.getLogger(__name__)


class ConnPool(Links):
    """Lends authenticated data connections with their transport.

    Concurrency: ``_lock`` (and ``_cond`` on it) guards ``_idle``, ``_shm_of``,
    ``_server``, ``_deferred``, ``_lent`` and ``_waiters``; ``_lent`` stays within
    ``pool_size`` (callers beyond it wait on ``_cond``). Connecting and all I/O happen
    outside the lock. Read leases a connection still owes the server
    (DataConn.defer_release) go out with its next request; a flusher thread, started on
    first need, sends them for connections left idle longer than RELEASE_DELAY_S, so an
    idle client pins nothing for long. ``_reply_slot`` is held by the one thread of this
    pool polling for a reply (DataConn.poll_replies).
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
        device: CopyEngine | None = None,
        registry: HostRegistry | None = None,
    ) -> None:
        self.host = host
        self.config = config
        self.counters = counters
        self._locate = locate  # deadline -> the server's Info (a gRPC call)
        self._tls = tls
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._deferred = False  # a connection owes read releases (the flusher watches)
        self._lent = 0  # callers holding (or opening) a connection, at most _size
        self._flusher: threading.Thread | None = None
        self._idle: list[Link] = []
        # (instance id, segment name) -> that server's shared-memory transport
        self._shm_of: dict[tuple[str, str], ShmTransport] = {}
        self._size = config.pool_size
        self._waiters = 0  # callers waiting for a connection slot
        self._server = server  # where the data sockets are (None: ask with locate)
        # the device paths' engine (None: CUDA, on the first CUDA tensor) and registry
        # (None: the process's); each transport has its own side (and registration)
        self._device = device
        self._registry = registry
        self._tcp = TcpTransport(counters, DeviceSide(device, registry))
        self._ucx = UcxTransport(counters, DeviceSide(device, registry))
        self._reply_slot = threading.Lock()  # one thread of this pool polls for a reply
        self._closed = False
        self.last_transport = ""

    @contextmanager
    def connection(self, deadline: float) -> Iterator[Link]:
        """Lend a connection and its transport until the block ends."""
        link = self.lend(deadline)
        try:
            yield link
        finally:
            self.give_back(link)

    def lend(self, deadline: float) -> Link:
        """A connection and its transport, for one caller until :meth:`give_back`
        (what :meth:`connection` does, without a generator per call on the hot path)."""
        with self._cond:
            if self._lent >= self._size:
                self._waiters += 1
                try:
                    while self._lent >= self._size:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise TimeoutError_(f"all {self._size} data connections stayed busy")
                        self._cond.wait(left)
                finally:
                    self._waiters -= 1
            self._lent += 1
            link = self._idle.pop() if self._idle else None
        if link is None:
            try:
                link = self._open(deadline)
            except BaseException:
                with self._cond:
                    self._unlend_locked()
                raise
        return link

    def give_back(self, link: Link) -> None:
        """Return a connection from :meth:`lend` (a broken one is closed instead)."""
        self._give_back(link, lent=True)

    def _unlend_locked(self) -> None:
        self._lent -= 1
        if self._waiters:
            self._cond.notify_all()  # the flusher waits on it too: wake every waiter

    def _give_back(self, link: Link, *, lent: bool = False) -> None:
        conn = link.conn
        with self._lock:
            if lent:
                self._unlend_locked()
            keep = conn.usable and not self._closed
            if keep:
                conn.idle_since = time.monotonic()
                self._idle.append(link)
                if conn.owes and not self._deferred:
                    # one wake-up when releases start to be owed, not one per call: a
                    # busy caller's next request carries them (see _flush_loop)
                    self._deferred = True
                    self._cond.notify_all()
                    if self._flusher is None:
                        self._flusher = threading.Thread(
                            target=self._flush_loop, name="kvstore-release", daemon=True
                        )
                        self._flusher.start()
        if not keep:
            conn.close()

    def _flush_loop(self) -> None:
        """Send the releases of connections idle for RELEASE_DELAY_S or longer.

        Only a connection that has sat idle that long is taken out of ``_idle``: one in
        steady use is never borrowed from under its caller (which would make the
        caller open another connection), and its releases go with its next request.
        """
        delay = self.RELEASE_DELAY_S
        while True:
            with self._cond:
                if self._closed:
                    return
                if not self._deferred:
                    self._cond.wait()
                    continue
                owing = [link for link in self._idle if link.conn.owes]
                if not owing:
                    if self._lent:  # may come back owing: look again, without a wake-up
                        self._cond.wait(delay)
                    else:
                        self._deferred = False  # set again by the next return owing
                    continue
                now = time.monotonic()
                due = [link for link in owing if now - link.conn.idle_since >= delay]
                if not due:
                    oldest = min(link.conn.idle_since for link in owing)
                    self._cond.wait(max(oldest + delay - now, 0.0005))
                    continue
                taken = {id(link) for link in due}
                self._idle = [link for link in self._idle if id(link) not in taken]
            for link in due:
                # a broken connection is closed by _give_back, which ends its leases
                with contextlib.suppress(KVStoreError):
                    link.conn.flush_releases()
                self._give_back(link)

    def _open(self, deadline: float) -> Link:
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
        return Link(conn, transport)

    def _connect(self, server: pb.InfoResponse, deadline: float) -> DataConn:
        """A new data connection, polling for replies as the config says (never for a
        server in this process, which learns from HELLO not to poll either)."""
        conn = self._dial(server, deadline)
        crowded = _never if self.config.reply_poll_crowded else CROWDING.crowded
        conn.poll_replies(self.config.reply_poll_us / 1e6, self._reply_slot, crowded)
        return conn

    def _dial(self, server: pb.InfoResponse, deadline: float) -> DataConn:
        """Same host: the Unix data socket when offered (no TCP cost); else TCP."""
        c = self.config
        kw: dict = {
            "deadline": deadline,
            "max_meta": c.max_reply_bytes,
            "ucx": self._ucx_for(server),
        }
        if c.transport != "tcp" and server.unix_socket and self._same_host(server):
            try:
                return DataConn.open(server.unix_socket, c.token, **kw)
            except (Unavailable, TransportError) as exc:
                fresh = self._locate(deadline)  # a restarted server has a new socket name
                if fresh.unix_socket and fresh.unix_socket != server.unix_socket:
                    return self._dial(fresh, deadline)
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

    def _ucx_for(self, server: pb.InfoResponse) -> bool:
        """Whether a new connection asks to move to UCX."""
        want = self.config.transport
        if want == "ucx":
            return True
        return want == "auto" and server.ucx and not self._same_host(server) and ucx_available()

    def _pick(self, conn: DataConn) -> SocketTransport:
        info, want = conn.info, self.config.transport
        if conn.on_ucx:
            return self._ucx
        if want == "ucx":
            why = (
                "declined UCX for this connection (no UCX transport with peer-failure "
                "handling reaches it: see its log)"
                if info.ucx
                else "offers no UCX (kvstore serve --transport ucx)"
            )
            raise Unavailable(f"transport=ucx but the server {why}")
        if want == "tcp":
            return self._tcp
        if self._same_host(info) and info.shm_name:
            try:
                return self._shm(info)
            except StorageError as exc:
                if want == "shm":
                    raise
                log.info("server segment does not map here (%s); using TCP", exc)
        elif want == "shm":
            where = "offers no shared memory" if self._same_host(info) else "is not on this host"
            raise Unavailable(f"transport=shm but the server {where}")
        return self._tcp

    def _shm(self, info: pb.InfoResponse) -> ShmTransport:
        """The shared-memory transport of one server instance (its segment mapped once,
        with the reader of its published index when it offers one and this client uses
        it); a restarted server has new segments, so older instances' mappings go."""
        key = (info.instance_id, info.shm_name)
        with self._lock:
            shm = self._shm_of.get(key)
            if shm is not None:
                return shm
            for k in [k for k in self._shm_of if k[0] != info.instance_id]:
                self._shm_of.pop(k).close()
        seg = Segment(info.shm_name, info.shm_size, prefault=self.config.shm_prefault_bytes)
        shm = ShmTransport(
            self.counters,
            seg,
            verify=self.config.verify_shm,
            direct=self._direct(info, seg),
            credits=self.config.shm_write_credits,
            device=DeviceSide(self._device, self._registry),
        )
        with self._lock:
            kept = self._shm_of.setdefault(key, shm)
        if kept is not shm:  # another thread mapped it first
            shm.close()
        return kept

    def _direct(self, info: pb.InfoResponse, seg: Segment) -> DirectReader | None:
        if not (self.config.shm_direct and info.shm_index and reader_supported()):
            return None
        try:
            return DirectReader(IndexReader(info.shm_index), seg.view, info.tenant, info.scope_key)
        except StorageError as exc:
            log.info("published index does not map here (%s); leased reads only", exc)
            return None

    def settle(self, deadline: float) -> None:
        """Make sure the server has processed every touch and release this client owes
        on its idle connections (one round trip each that owes), so a stats call
        right after reads sees them."""
        with self._lock:
            owing = [link for link in self._idle if link.conn.owes]
            taken = {id(link) for link in owing}
            self._idle = [link for link in self._idle if id(link) not in taken]
        for link in owing:
            with contextlib.suppress(KVStoreError):
                link.conn.call(Op.EXISTS, pb.KeysRequest(), pb.ExistsResponse, deadline)
            self._give_back(link)

    def prefaulted(self, timeout: float | None) -> bool:
        """Wait until the segments mapped so far are prefaulted; True when they are."""
        with self._lock:
            shms = list(self._shm_of.values())
        end = None if timeout is None else time.monotonic() + timeout
        for shm in shms:
            left = None if end is None else max(end - time.monotonic(), 0.0)
            if not shm.segment.prefaulter.wait(left):
                return False
        return True

    def close(self) -> None:
        """Close idle connections and unmap segments (lent ones close on return)."""
        with self._lock:
            self._closed = True
            self._cond.notify_all()
            idle, self._idle = self._idle, []
            shms, self._shm_of = list(self._shm_of.values()), {}
        for conn, _ in idle:
            conn.close()
        for shm in shms:
            shm.close()


def _never() -> bool:
    return False
