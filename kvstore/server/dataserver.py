"""The server side of the data socket: bulk bytes and same-host leases.

One thread per connection, blocking sockets: in CPython on a 2-core host a blocking
socket round trip costs ~25 us where an asyncio one costs 55-175 us, and a payload
arrives in a single ``recv_into`` straight into its reserved slab extent.

A connection's life: TLS handshake (when configured), HELLO with a bearer token (wrong
or missing: an ERROR frame, then close), then requests in order. A PUT payload is
received into a fresh reservation and committed against the writer's xxh3; a frame cut
short, a reset or a stall past ``io_timeout_s`` closes the connection and aborts that
reservation, so nothing half-written is ever visible. Every lease granted on a
connection (shared-memory reads and writes) ends when it closes.

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

A server with ``transport = "ucx"`` also offers UCX: a HELLO carrying a UCX worker
address moves its connection's large payloads to a UCX worker of its own after INFO
(kvstore/wire/ucx.py); headers, metadata and small bodies stay on the socket, and the
session serves it exactly as a socket. Its payloads count as path ``ucx``.

HELLO also says which process the client runs in: while any client of this very process
is connected, no connection polls for its next request (kvstore/wire/polling.py), since
the poller would hold the GIL that client needs to send it.

Counting (kvstore/observe/names.py): payload bytes on the socket are path ``tcp`` (over
TCP or the same-host Unix socket alike), leased extents are ``shm``; one latency
observation per GET and PUT (tcp) and per LEASE and COMMIT (shm), reply sent included.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import ssl
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from google.protobuf.message import DecodeError, Message

from kvstore._proto import store_pb2 as pb
from kvstore.blocks import ValueInfo, checksum, checksum_stream, layer_span
from kvstore.config import ServerConfig
from kvstore.errors import ConfigError, InvalidValue, KVStoreError, TimeoutError_, Unavailable
from kvstore.node.store import BlockRead
from kvstore.server.auth import TokenTable
from kvstore.server.gateway import CreditBind, Filled, Gateway, ReadItem, WriteItem
from kvstore.server.leases import LeaseKind
from kvstore.tenants import Principal
from kvstore.wire.codec import info_from_meta, status_of
from kvstore.wire.crowding import CROWDING
from kvstore.wire.frames import (
    PROTOCOL,
    REPLY,
    FrameSocket,
    Op,
    ProtocolError,
    socket_errors,
)
from kvstore.wire.polling import IdlePoller, same_process
from kvstore.wire.ucx import WIRE as UCX_WIRE
from kvstore.wire.ucx import UcxFrames, UcxWorker, new_tag
from kvstore.wire.ucx import available as ucx_available

__all__ = ["DataServer"]

log = logging.getLogger(__name__)

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


HELLO_MAX_META = 4096
"""Largest HELLO metadata accepted: a token, a protocol number, a pid and a host id fit
many times over, and an unauthenticated peer can make the server allocate no more."""


_SUM = struct.Struct("<Q")  # a payload's xxh3 after it (PutRequest.sums_follow)
_KEEP = struct.Struct("<QB")  # a layer-by-layer PUT's trailer: xxh3 and keep, per item
_CLIENT_COPY_RATE = 8e9  # bytes/s a same-host client copies into the segment, at least
# Write credits one connection may hold at a time (PutRequest.credits): at most this
# many bytes, and at most this share of the DRAM tier.
_CREDIT_BYTES = 64 << 20
_CREDIT_SHARE = 8


def _never() -> bool:
    return False


def _parse(cls: type[Message], meta: bytes) -> Any:
    msg = cls()
    try:
        msg.ParseFromString(meta)
    except DecodeError as exc:
        raise ProtocolError(f"undecodable {cls.__name__} metadata: {exc}") from None
    return msg


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
            gateway.counters,
            may_poll=self._may_poll,
            crowded=_never if config.data_poll_crowded else CROWDING.crowded,
        )
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

    def _handshake_over(self) -> None:
        with self._lock:
            self._handshaking -= 1

    def _count_in_process(self, step: int) -> None:
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
                _send_error(fs, Unavailable(f"too many {what}; try again later"))
                return
            session = _Session(self, fs, conn_id)
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
            self.gateway.leases.end_owner(conn_id)
            if fs is not None:
                fs.close()
            else:
                sock.close()


def _send_error(fs: FrameSocket | UcxFrames, exc: KVStoreError) -> None:
    with contextlib.suppress(KVStoreError):
        fs.send(Op.ERROR, status_of(exc).SerializeToString())


class _Session:
    """One authenticated connection: reads frames and dispatches them in order."""

    def __init__(self, server: DataServer, fs: FrameSocket, conn_id: int) -> None:
        self.server = server
        self.gw = server.gateway
        self.fs: FrameSocket | UcxFrames = fs
        self.id = conn_id
        self.p: Principal | None = None
        self.in_process = False  # the client runs in this process (counted on the server)
        self.copying_s = 0.0  # how long the client needs before its next request (RESERVE)
        self._credits: dict[int, int] = {}  # this connection's write credits: lease id -> bytes
        self._credit_cap = -1  # how many bytes of them it may hold (set at the first ask)
        self.path = "tcp"  # where this connection's payloads travel: tcp, or ucx once moved
        self.handlers: dict[int, Callable[[bytes, int], Message | None]] = {
            Op.GET: self.get,
            Op.LEASE: self.lease,
            Op.RELEASE: self.release,
            Op.PUT: self.put,
            Op.RESERVE: self.reserve,
            Op.COMMIT: self.commit,
            Op.ABORT: self.abort,
            Op.EXISTS: self.exists,
            Op.MATCH: self.match,
            Op.TOUCH: self.touch,
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
                self.server._count_in_process(-1)
            self.handlers.clear()  # its bound methods hold this session in a cycle

    def _serve(self) -> None:
        try:
            try:
                self.hello()
            finally:
                self.server._handshake_over()
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
            _send_error(self.fs, exc)

    def hello(self) -> None:
        try:
            op, meta_len, body_len = self.fs.recv_header()
        except EOFError:
            raise ProtocolError("closed before HELLO") from None
        if op != Op.HELLO or body_len:
            raise ProtocolError(f"first frame must be HELLO, got op {op}")
        hello = _parse(pb.Hello, self.fs.recv_bytes(meta_len))
        if hello.protocol != PROTOCOL:
            raise ProtocolError(f"protocol {hello.protocol} unsupported (server speaks {PROTOCOL})")
        try:
            self.p = self.server.tokens.authenticate(hello.token)
        except KVStoreError as exc:
            _send_error(self.fs, exc)
            raise
        self.fs.max_meta = self.server.config.max_message_bytes  # authenticated
        if same_process(hello.host_id, hello.pid):
            self.in_process = True  # no connection polls until this one ends
            self.server._count_in_process(1)
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
            self.gw.counters.observe(timed[0], path, time.perf_counter() - t0)

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
            _send_error(self.fs, exc)  # the request failed as a whole; stream intact
            return
        if reply is not None:
            self.fs.send(op | REPLY, reply.SerializeToString())

    # -- reads -------------------------------------------------------------------------

    def get(self, meta: bytes, body_len: int) -> None:
        req = _parse(pb.GetRequest, meta)
        layers = _layers(req)
        scope = req.scope
        with self.gw.read(
            self.principal, scope.model, scope.layout, req.keys, path=self.path
        ) as batch:
            resp = pb.GetResponse()
            parts = [self._describe(r, resp.blocks.add(), layers) for r in batch.items]
            body = [mv for mv in parts if mv is not None]
            self.fs.send(Op.GET | REPLY, resp.SerializeToString(), body, _total(body))

    def lease(self, meta: bytes, body_len: int) -> None:
        req = _parse(pb.GetRequest, meta)
        scope, layers = req.scope, _layers(req)
        with self.gw.lease(self.principal, scope.model, scope.layout, req.keys, self.id) as batch:
            resp = pb.GetResponse(shm_name=self.gw.node.shm_name or "")
            resp.server_now_ns = time.monotonic_ns()
            resp.namespace_fp = batch.namespace_fp
            body = []
            for i, r in enumerate(batch.items):
                ref = resp.blocks.add()
                lease = batch.leases.get(i)
                if lease is not None and isinstance(r, BlockRead) and layers is not None:
                    try:
                        layer_span(r.header, layers)  # the client copies it: check it here
                    except KVStoreError as exc:
                        self.gw.release_reads(self.principal, [lease.id])
                        ref.error.CopyFrom(status_of(exc))
                        continue
                if lease is not None and isinstance(r, BlockRead):
                    ref.found, ref.header = True, r.header.pack()
                    ref.lease_id, ref.offset = lease.id, r.shm_offset
                    resp.lease_expires_ns = resp.lease_expires_ns or lease.expires_ns
                    continue
                mv = self._describe(r, ref, layers)
                if mv is not None:
                    body.append(mv)
            self.fs.send(Op.LEASE | REPLY, resp.SerializeToString(), body, _total(body))

    @staticmethod
    def _describe(
        r: ReadItem, ref: pb.BlockRef, layers: tuple[int, int] | None = None
    ) -> memoryview | None:
        """Fill a BlockRef for a payload sent inline; returns the payload to send (for
        ``layers``, their bytes alone, with their checksum in the ref)."""
        ref.offset = -1
        if isinstance(r, KVStoreError):
            ref.error.CopyFrom(status_of(r))
            return None
        if r is None:
            return None
        if layers is None:
            ref.found, ref.header = True, r.header.pack()
            return memoryview(r.host())
        try:
            lo, hi = layer_span(r.header, layers)
        except KVStoreError as exc:
            ref.error.CopyFrom(status_of(exc))
            return None
        part = memoryview(r.host())[lo:hi]
        ref.found, ref.header, ref.range_checksum = True, r.header.pack(), checksum(part)
        return part

    def release(self, meta: bytes, body_len: int) -> None:
        req = _parse(pb.LeaseRequest, meta)
        try:  # no reply, not even an error (see touch)
            self.gw.release_reads(self.principal, req.lease_ids)
        except KVStoreError as exc:
            log.warning("data connection %d: RELEASE failed: %s", self.id, exc)

    def touch(self, meta: bytes, body_len: int) -> None:
        # No reply, not even an error: an ERROR frame here would answer the client's
        # next request. What cannot be counted is logged and dropped.
        req = _parse(pb.TouchRequest, meta)
        try:
            self.gw.touch(self.principal, req.keys, req.payload_bytes, req.call_seconds)
        except KVStoreError as exc:
            log.warning(
                "data connection %d: TOUCH of %d keys dropped: %s", self.id, len(req.keys), exc
            )

    # -- writes ------------------------------------------------------------------------

    def put(self, meta: bytes, body_len: int) -> pb.PutResponse:
        if body_len > self._body_cap():  # refused at once: skipping it would take forever
            raise ProtocolError(
                f"PUT body of {body_len} bytes exceeds max_batch x max_value_bytes "
                f"({self._body_cap()})"
            )
        req = _parse(pb.PutRequest, meta)
        items = _write_items(req)
        if req.layers:
            return self._put_layers(req, items, body_len)
        trailer = _SUM.size if req.sums_follow else 0  # each payload's xxh3 after it
        expected = sum(it.nbytes + trailer for it in items)
        if expected != body_len:
            raise ProtocolError(f"PUT items add up to {expected} bytes, frame has {body_len}")
        received = 0

        def fill(target: Any, n: int) -> Filled:
            nonlocal received
            received += n + trailer
            if target is None:
                self.fs.discard(n + trailer)
                return None, None
            landed = self._fill(target.data, n)
            sent = _SUM.unpack(self.fs.recv_bytes(trailer))[0] if trailer else None
            return sent, landed

        def fill_all(targets: list[Any]) -> list[Filled]:
            nonlocal received
            received = body_len
            return self._fill_all(targets, [it.nbytes for it in items], trailer)

        try:
            scope = req.scope
            if len(items) > 1 and isinstance(self.fs, UcxFrames):
                results = self.gw.write_at_once(
                    self.principal, scope.model, scope.layout, items, fill_all, path=self.path
                )
            else:
                results = self.gw.write(
                    self.principal, scope.model, scope.layout, items, fill, path=self.path
                )
        except KVStoreError:
            if not received and not self.fs.broken:
                self._skip_body(body_len)  # refused whole: the stream stays in step
            raise
        resp = pb.PutResponse()
        for r in results:
            _put_result(r, resp.results.add())
        return resp

    def _put_layers(
        self, req: pb.PutRequest, items: list[WriteItem], body_len: int
    ) -> pb.PutResponse:
        """A layer-by-layer PUT (PutRequest.layers): every item reserved first, then
        each layer of every item received straight into its run of the reservation as
        the writer produces it, then the items' checksums and keep flags, then one
        commit. A stream that ends early aborts every reservation."""
        layers = req.layers
        sizes = [it.nbytes for it in items]
        if any(n % layers for n in sizes):
            raise ProtocolError(f"PUT of {layers} layers: an item does not split into them")
        if sum(sizes) + _KEEP.size * len(items) != body_len:
            raise ProtocolError(
                f"PUT items add up to {sum(sizes)} bytes and trailers, frame has {body_len}"
            )
        try:
            write = self.gw.begin_layers(
                self.principal, req.scope.model, req.scope.layout, items, layers, path=self.path
            )
        except KVStoreError:
            if not self.fs.broken:
                self._skip_body(body_len)  # refused whole: the stream stays in step
            raise
        try:
            for layer in range(layers):
                for i, n in enumerate(sizes):
                    view = write.target(i, layer)
                    if view is None:
                        self.fs.discard(n // layers)
                    else:
                        self._fill(view.data, n // layers)
            tail = self.fs.recv_bytes(_KEEP.size * len(items))
        except BaseException:
            write.abort()  # a cut-short stream never becomes visible
            raise
        sums = [(c, bool(k)) for c, k in _KEEP.iter_unpack(tail)]
        resp = pb.PutResponse()
        for r in write.finish(sums):
            out = resp.results.add()
            if r is not None:
                _put_result(r, out)
        return resp

    def _fill(self, view: Any, n: int) -> int:
        """Receive one item's payload straight into its reservation's extent, under a
        FILL lease: past its deadline the reaper cuts the connection (``_cut``), and the
        caller (Gateway.write) aborts the reservation when this raises. Returns the
        xxh3 of the bytes as they landed: on a socket each piece is hashed while the
        next arrives, which spares the commit a second pass over the bytes."""
        digest = checksum_stream()
        self._under_fill_lease(n, lambda: self.fs.recv_into(view, spin=True, digest=digest))
        return int(digest.intdigest())

    def _fill_all(self, targets: list[Any], sizes: list[int], trailer: int) -> list[Filled]:
        """Receive a whole batch's payloads at once (Gateway.write_at_once), each
        straight into its reservation's extent (a refused item's into scratch), with
        its xxh3 after it when ``trailer``; returns, per item, that checksum (None
        without) and the xxh3 of what landed. Under one FILL lease for the whole body."""
        views: list[memoryview] = []
        digests: list[Any] = []  # one per view: a payload's, or None (a trailer, scratch)
        items: list[tuple[Any, bytearray | None]] = []  # per item: its digest, its trailer
        for target, n in zip(targets, sizes, strict=True):
            digest = None if target is None else checksum_stream()
            views.append(memoryview(bytearray(n) if target is None else target.data))
            digests.append(digest)
            tail = bytearray(trailer) if trailer else None
            if tail is not None:
                views.append(memoryview(tail))
                digests.append(None)
            items.append((digest, tail))
        total = sum(sizes) + trailer * len(sizes)
        self._under_fill_lease(total, lambda: self.fs.recv_many(views, digests))
        return [
            (
                None if tail is None else _SUM.unpack(tail)[0],
                None if digest is None else int(digest.intdigest()),
            )
            for digest, tail in items
        ]

    def _under_fill_lease(self, n: int, receive: Callable[[], None]) -> None:
        """Run ``receive`` (of ``n`` payload bytes) under a FILL lease: past its
        deadline the reaper cuts the connection, and this raises."""
        p, leases = self.principal, self.gw.leases
        ttl = self.gw.fill_deadline_s(n)
        lease = leases.grant(LeaseKind.FILL, self._cut, p.tenant, self.id, ttl_s=ttl)
        try:
            receive()
        except BaseException:  # the lease is always taken back here, never left behind
            if leases.take(lease.id, p.tenant, LeaseKind.FILL) is None:
                raise self._stalled(n, ttl) from None
            raise
        if leases.take(lease.id, p.tenant, LeaseKind.FILL) is None:  # cut as it ended
            raise self._stalled(n, ttl)

    def _stalled(self, n: int, ttl: float) -> KVStoreError:
        self.fs.broken = True  # the socket is shut: nothing more goes either way
        log.info("data connection %d: a put of %d bytes stalled past %.1f s", self.id, n, ttl)
        return TimeoutError_(
            f"put payload of {n} bytes did not arrive within {ttl:.1f} s (put_grace_s + "
            "nbytes / put_floor_bytes); its reservation was released"
        )

    def _cut(self) -> None:
        """End a stalled put (called by the lease reaper): shut the socket down, which
        wakes this connection's thread from its receive. The plain socket's shutdown,
        also under TLS: the TLS object stays the connection thread's."""
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.fs.sock, socket.SHUT_RDWR)

    def _body_cap(self) -> int:
        """The largest PUT body a well-formed request can carry; the refused items of
        one within it are read and dropped to keep the stream in step."""
        return self.server.config.max_batch * self.gw.max_value_bytes

    def _skip_body(self, body_len: int) -> None:
        self.fs.discard(body_len)  # within _body_cap: put() refused larger ones first

    def reserve(self, meta: bytes, body_len: int) -> pb.PutResponse:
        req = _parse(pb.PutRequest, meta)
        scope = req.scope
        items = _write_items(req)
        leases = self.gw.reserve_leased(self.principal, scope.model, scope.layout, items, self.id)
        # the client copies the granted bytes before its first COMMIT: poll that much
        # longer for it (a sleeping thread costs a wake-up per put)
        granted = sum(it.nbytes for it, lease in zip(items, leases, strict=True) if lease)
        self.copying_s = granted / _CLIENT_COPY_RATE
        resp = pb.PutResponse(shm_name=self.gw.node.shm_name or "")
        for lease in leases:
            out = resp.results.add()
            if isinstance(lease, KVStoreError):
                out.error.CopyFrom(status_of(lease))
            elif lease is not None:
                out.lease_id, out.offset = lease.id, lease.obj.shm_offset
                resp.lease_expires_ns = resp.lease_expires_ns or lease.expires_ns
        self._lend_credits(scope, req.credits, resp)
        return resp

    def commit(self, meta: bytes, body_len: int) -> pb.PutResponse:
        req = _parse(pb.CommitRequest, meta)
        items: list[tuple[int, int] | CreditBind] = []
        for it in req.items:
            if it.key:
                self._credits.pop(it.lease_id, None)
                info: ValueInfo | KVStoreError
                try:
                    info = info_from_meta(it.meta)
                except KVStoreError as exc:
                    info = exc
                items.append((it.lease_id, it.checksum, it.key, info))
            else:
                items.append((it.lease_id, it.checksum))
        scope = req.scope
        resp = pb.PutResponse()
        for r in self.gw.commit_leased(self.principal, items, scope.model, scope.layout):
            _put_result(r, resp.results.add())
        self._lend_credits(scope, req.credits, resp)
        return resp

    def _lend_credits(self, scope: pb.Scope, sizes: Sequence[int], resp: pb.PutResponse) -> None:
        """Grant the write credits asked for (PutRequest.credits) into ``resp``, as many
        as this connection may hold: at most _CREDIT_BYTES of them, live, at a time, and
        at most max_batch per request. Never an error: the request's own results stand,
        and a writer without credits reserves as before."""
        sizes = sizes[: self.server.config.max_batch]
        if not sizes:
            return
        if self._credit_cap < 0:
            dram = self.gw.node.stats()["tiers"].get("dram", {}).get("capacity", 0)
            self._credit_cap = min(_CREDIT_BYTES, int(dram) // _CREDIT_SHARE)
        leases = self.gw.leases
        self._credits = {lid: n for lid, n in self._credits.items() if leases.holds(lid)}
        room = self._credit_cap - sum(self._credits.values())
        take: list[int] = []
        for n in sizes:
            if n > room:
                break
            take.append(n)
            room -= n
        try:
            granted = self.gw.grant_credits(
                self.principal, scope.model, scope.layout, take, self.id
            )
        except KVStoreError as exc:  # a scope this tenant cannot write, a closed node
            log.debug("data connection %d: no write credits: %s", self.id, exc)
            return
        # the client copies into them before its next request: poll that much longer
        lent = sum(lease.obj.info.nbytes for lease in granted)
        self.copying_s = max(self.copying_s, lent / _CLIENT_COPY_RATE)
        for lease in granted:
            self._credits[lease.id] = lease.obj.info.nbytes
            resp.credits.add(lease_id=lease.id, offset=lease.obj.shm_offset)
            resp.credits_expire_ns = resp.credits_expire_ns or lease.expires_ns

    def abort(self, meta: bytes, body_len: int) -> pb.LeaseResponse:
        req = _parse(pb.LeaseRequest, meta)
        done, expired = self.gw.abort_leased(self.principal, req.lease_ids)
        return pb.LeaseResponse(released=done, expired=expired)

    # -- metadata ----------------------------------------------------------------------

    def exists(self, meta: bytes, body_len: int) -> pb.ExistsResponse:
        req = _parse(pb.KeysRequest, meta)
        return pb.ExistsResponse(present=self.gw.exists(self.principal, req.keys))

    def match(self, meta: bytes, body_len: int) -> pb.MatchPrefixResponse:
        req = _parse(pb.KeysRequest, meta)
        return pb.MatchPrefixResponse(matched=self.gw.match_prefix(self.principal, req.keys))


def _layers(req: pb.GetRequest) -> tuple[int, int] | None:
    """The layer range a GET or LEASE asks for (None: whole blocks)."""
    if not req.layer_to:
        return None
    if req.layer_from >= req.layer_to:
        raise InvalidValue(f"layers [{req.layer_from}, {req.layer_to}): an empty range")
    return req.layer_from, req.layer_to


def _total(body: list[memoryview]) -> int:
    return sum(mv.nbytes for mv in body)


def _write_items(req: pb.PutRequest) -> list[WriteItem]:
    """A PUT or RESERVE request's items; one whose metadata does not decode carries
    its error (that item fails, the others go on)."""
    items = []
    for it in req.items:
        info: ValueInfo | KVStoreError
        try:
            info = info_from_meta(it.meta)
        except KVStoreError as exc:
            info = exc
        items.append(WriteItem(it.key, info, it.checksum, int(it.meta.nbytes)))
    return items


def _put_result(r: bool | KVStoreError, out: pb.PutResult) -> None:
    if isinstance(r, KVStoreError):
        out.error.CopyFrom(status_of(r))
    else:
        out.stored = r
