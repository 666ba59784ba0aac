"""One data connection's session: the handshake, then its frames in order.

HELLO carries a bearer token (wrong or missing: an ERROR frame, then close) and says
which process the client runs in: while any client of this very process is connected,
no connection polls for its next request (kvstore/wire/polling.py), since the poller
would hold the GIL that client needs to send it. A HELLO carrying a UCX worker address
moves the connection's large payloads to a UCX worker of its own after INFO
(kvstore/wire/ucx.py); headers, metadata and small bodies stay on the socket, and the
session serves it exactly as a socket. Its payloads count as path ``ucx``.

Then each request frame goes to its handler: reads and metadata in read_frames.py,
writes in write_frames.py. A request that fails as a whole is answered with ERROR and
the stream goes on; a frame that breaks the framing, or a socket failure, ends the
connection. One latency observation per GET and PUT (tcp) and per LEASE and COMMIT
(shm), reply sent included (kvstore/observe/names.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from google.protobuf.message import Message

from kvstore._proto import store_pb2 as pb
from kvstore.config import ServerConfig
from kvstore.errors import KVStoreError
from kvstore.server.auth import TokenTable
from kvstore.server.frame_codec import parse, send_error
from kvstore.server.gateway import Gateway
from kvstore.server.read_frames import ReadFrames
from kvstore.server.tenant_connections import TenantConnections
from kvstore.server.write_frames import WriteFrames
from kvstore.tenants import Principal
from kvstore.wire.frames import PROTOCOL, REPLY, FrameSocket, Op, ProtocolError
from kvstore.wire.polling import IdlePoller, same_process
from kvstore.wire.ucx import WIRE as UCX_WIRE
from kvstore.wire.ucx import UcxFrames, UcxWorker, new_tag

__all__ = ["Server", "Session"]

log = logging.getLogger(__name__)


class Server(Protocol):
    """What a session needs of the server that accepted it (dataserver.py's DataServer)."""

    config: ServerConfig
    gateway: Gateway
    tokens: TokenTable
    info: Callable[[Principal], pb.InfoResponse]  # what INFO tells this caller
    poller: IdlePoller
    ucx: bool  # the server offers UCX
    tenants: TenantConnections  # each tenant's open connections, against its quota

    def count_in_process(self, step: int) -> None: ...

    def handshake_over(self) -> None: ...


_TIMED: dict[
    int, tuple[str, str]
] = {  # op -> (latency op, path); RESERVE, RELEASE and metadata ops are not timed;
    # "tcp" is the connection's own path (ucx once moved there)
    Op.GET: ("get", "tcp"),
    Op.LEASE: ("get", "shm"),
    Op.PUT: ("put", "tcp"),
    Op.COMMIT: ("put", "shm"),
}


# Frames with no reply: a client's deferred RELEASE or TOUCH waits on nothing, so it
# neither ends another connection's poll nor counts as clients taking turns (busypoll.py).
_UNANSWERED = frozenset((Op.RELEASE, Op.TOUCH))


class Session:
    """One authenticated connection: reads frames and dispatches them in order, each
    to its handler (kvstore/server/read_frames.py, kvstore/server/write_frames.py)."""

    def __init__(self, server: Server, fs: FrameSocket, conn_id: int) -> None:
        self.server = server
        self.gw = server.gateway
        self.counters = server.gateway.books.counters  # one latency observation a request
        self.fs: FrameSocket | UcxFrames = fs
        self.id = conn_id
        self.p: Principal | None = None
        self.in_process = False  # the client runs in this process (counted on the server)
        self.copying_s = 0.0  # how long the client needs before its next request (RESERVE)
        self.path = "tcp"  # where this connection's payloads travel: tcp, or ucx once moved
        reads, writes = ReadFrames(self), WriteFrames(self)
        self.handlers: dict[int, Callable[[bytes, int], Message | None]] = {
            Op.GET: reads.get,
            Op.LEASE: reads.lease,
            Op.RELEASE: reads.release,
            Op.PUT: writes.put,
            Op.RESERVE: writes.reserve,
            Op.COMMIT: writes.commit,
            Op.ABORT: writes.abort,
            Op.EXISTS: reads.exists,
            Op.MATCH: reads.match,
            Op.TOUCH: reads.touch,
        }

    @property
    def principal(self) -> Principal:
        assert self.p is not None
        return self.p

    def serve(self) -> None:
        """Handshake, then serve requests until the peer closes or breaks the framing."""
        self.fs.set_timeout(self.server.config.io_timeout_s)
        try:
            self._serve()
        finally:
            if self.in_process:
                self.server.count_in_process(-1)
            self.handlers.clear()  # its handlers hold this session in a cycle

    def _serve(self) -> None:
        try:
            try:
                self.hello()
            finally:
                self.server.handshake_over()
            later: bytes | None = None  # a RELEASE that came ahead of a request
            poller = self.server.poller
            while True:
                try:
                    op, meta_len, body_len = self.fs.recv_header(idle=True)
                except EOFError:
                    return
                meta = self.fs.recv_bytes(meta_len)
                if op == Op.RELEASE and not body_len and later is None and self.fs.buffered:
                    # piggybacked on a request that is already here: answer that first
                    # and hand the leases back while the client copies (RELEASE has no
                    # reply, so the client sees no difference but a shorter wait)
                    later = meta
                    continue
                if op not in _UNANSWERED:
                    poller.served(self.id)
                self.dispatch(op, meta, body_len)
                if later is not None:
                    meta, later = later, None
                    self.dispatch(Op.RELEASE, meta, 0)
                # returns at once when it may not poll
                poller.wait(self.fs, self.id, self.copying_s)
                self.copying_s = 0.0
        except ProtocolError as exc:
            log.warning("data connection %d: %s", self.id, exc)
            send_error(self.fs, exc)

    def hello(self) -> None:
        try:
            op, meta_len, body_len = self.fs.recv_header()
        except EOFError:
            raise ProtocolError("closed before HELLO") from None
        if op != Op.HELLO or body_len:
            raise ProtocolError(f"first frame must be HELLO, got op {op}")
        hello = parse(pb.Hello, self.fs.recv_bytes(meta_len))
        if hello.protocol != PROTOCOL:
            raise ProtocolError(f"protocol {hello.protocol} unsupported (server speaks {PROTOCOL})")
        try:
            self.p = self.server.tokens.authenticate(hello.token)
            self.server.tenants.admit(self.id, self.p.tenant)
        except KVStoreError as exc:
            send_error(self.fs, exc)
            raise
        self.fs.max_meta = self.server.config.max_message_bytes  # authenticated
        if same_process(hello.host_id, hello.pid):
            self.in_process = True  # no connection polls until this one ends
            self.server.count_in_process(1)
        info = self.server.info(self.p)
        link = self._ucx_link(hello) if hello.ucx_address else None
        if link is not None:
            info.ucx_address, info.ucx_tag, info.ucx_wire = link.address, new_tag(), UCX_WIRE
        try:
            self.fs.send(Op.INFO, info.SerializeToString())
        except BaseException:
            if link is not None:
                link.close()
            raise
        if link is not None:  # from here on large payloads travel over UCX
            assert isinstance(self.fs, FrameSocket)  # HELLO is always read off the socket
            self.fs = UcxFrames(link, info.ucx_tag, self.fs)
            self.fs.set_timeout(self.server.config.io_timeout_s)
            self.path = "ucx"

    def _ucx_link(self, hello: pb.Hello) -> UcxWorker | None:
        """A UCX worker and endpoint for this connection, when this server offers UCX
        and speaks the client's UCX framing (None: the client stays on its socket; INFO
        says so by leaving the address empty)."""
        if not self.server.ucx:
            return None
        if hello.ucx_wire != UCX_WIRE:
            log.warning(
                "data connection %d: the client speaks UCX framing %d, this server %d; it "
                "stays on its socket",
                self.id,
                hello.ucx_wire,
                UCX_WIRE,
            )
            return None
        try:
            link = UcxWorker()
            link.connect(hello.ucx_address)
        except KVStoreError as exc:
            log.warning("data connection %d: no UCX (%s); it stays on its socket", self.id, exc)
            return None
        return link

    def dispatch(self, op: int, meta: bytes, body_len: int) -> None:
        handler = self.handlers.get(op)
        if handler is None:
            raise ProtocolError(f"unknown op {op}")
        if body_len and op != Op.PUT:
            raise ProtocolError(f"op {Op(op).name} carries no payload, got {body_len} bytes")
        timed = _TIMED.get(op)
        if timed is None:
            self._handle(handler, op, meta, body_len)
            return
        # timed inline: a generator context manager per request costs ~10% of a lease
        t0 = time.perf_counter()
        try:
            self._handle(handler, op, meta, body_len)
        finally:
            path = self.path if timed[1] == "tcp" else timed[1]
            self.counters.observe(timed[0], path, time.perf_counter() - t0)

    def _handle(
        self, handler: Callable[[bytes, int], Message | None], op: int, meta: bytes, body_len: int
    ) -> None:
        try:
            reply = handler(meta, body_len)
        except ProtocolError:
            raise
        except KVStoreError as exc:
            if self.fs.broken:  # a socket failure: the stream is out of step
                raise
            send_error(self.fs, exc)  # the request failed as a whole; stream intact
            return
        if reply is not None:
            self.fs.send(op | REPLY, reply.SerializeToString())
