"""Data-socket framing, shared by the client transports and the server.

A frame is a 20-byte header, ``meta_len`` bytes of protobuf metadata (a message of
proto/kvstore/v1/store.proto) and ``body_len`` raw payload bytes::

    magic b"KVD1" | op u8 | flags u8 | 2 pad | meta_len u32 | body_len u64   (little-endian)

A connection starts with HELLO (meta ``Hello``: bearer token, protocol version); the
server answers INFO (``InfoResponse``) or ERROR (``Status``) and closes. Then requests
and replies alternate, a reply carrying ``op | REPLY`` or ERROR; RELEASE alone has no
reply (a client hands back read leases without waiting), nor has TOUCH (a same-host
client reporting reads it served itself from the published DRAM index). Payload bytes are never
parsed: they are received with ``recv_into`` straight into their destination (a
reserved slab extent on the server, the caller's tensor on the client) and checked
against their xxh3 afterwards.

This module is also the one place socket errors become store errors: an orderly close
mid-frame, a reset or an unknown magic is a TransportError (the connection is dropped;
whatever half-received write it carried is aborted by the server), a refused connect is
Unavailable and a stall past the deadline is TimeoutError_.

Plain sockets stay in blocking mode with a kernel receive/send timeout, so a payload
arrives in one ``recv_into(MSG_WAITALL)`` call rather than one Python loop turn per
segment, or, for a client reading a reply, in a few polls that never sleep while the
bytes keep coming (``recv_into(spin=True)``); TLS sockets use Python's timeout mode (SSL
reads take no flags).
"""

from __future__ import annotations

import errno
import math
import socket
import ssl
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from enum import IntEnum
from typing import Any

from kvstore.errors import KVStoreError, TimeoutError_, TransportError, Unavailable

__all__ = [
    "HEADER",
    "MAGIC",
    "PROTOCOL",
    "REPLY",
    "FrameSocket",
    "Op",
    "ProtocolError",
    "frame",
    "socket_errors",
]

MAGIC = b"KVD1"
PROTOCOL = 1
HEADER = struct.Struct("<4sBBxxIQ")
REPLY = 0x80
_SOCK_BUF = 4 << 20  # loopback at 1-4 MiB blocks wants the whole block in flight
_READ_BUF = 64 << 10  # header + metadata of nearly every reply in one recv
_IOV_MAX = 512
_SPIN_MISSES = 64  # empty polls in a row (~1.5 us each) that end a polled receive


class Op(IntEnum):
    """Frame operations (requests; a reply is ``op | REPLY``)."""

    HELLO = 1  # Hello -> INFO
    INFO = 2  # InfoResponse (the reply to HELLO)
    ERROR = 3  # Status: the request failed as a whole
    GET = 10  # GetRequest -> GetResponse + payloads of the hits
    LEASE = 11  # GetRequest -> GetResponse with read leases + payloads sent inline
    RELEASE = 12  # LeaseRequest, no reply
    PUT = 13  # PutRequest + payloads -> PutResponse
    RESERVE = 14  # PutRequest -> PutResponse with write leases
    COMMIT = 15  # CommitRequest -> PutResponse
    ABORT = 16  # LeaseRequest -> LeaseResponse
    EXISTS = 17  # KeysRequest -> ExistsResponse
    MATCH = 18  # KeysRequest -> MatchPrefixResponse
    TOUCH = 19  # TouchRequest, no reply: reads served from the published index


class ProtocolError(TransportError):
    """The peer broke the framing contract (bad magic, oversized or undecodable
    metadata, an unexpected op); the connection cannot continue. Not retryable."""

    retryable = False


def _retry_off(exc: KVStoreError) -> KVStoreError:
    exc.retryable = False
    return exc


def socket_error(exc: BaseException, what: str) -> KVStoreError:
    """The store error for an OS, TLS or timeout error (the one place they are mapped)."""
    if isinstance(exc, KVStoreError):
        return exc
    if isinstance(exc, ssl.SSLCertVerificationError):
        return _retry_off(TransportError(f"{what}: TLS certificate rejected: {exc}"))
    if isinstance(exc, (socket.timeout, BlockingIOError)):  # BlockingIOError: SO_RCVTIMEO
        return TimeoutError_(f"{what}: timed out")
    if isinstance(exc, ConnectionRefusedError):
        return Unavailable(f"{what}: connection refused")
    if isinstance(exc, ssl.SSLError):
        return TransportError(f"{what}: TLS error: {exc}")
    if isinstance(exc, OSError):
        if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ECONNABORTED):
            return Unavailable(f"{what}: {exc.strerror}")
        if exc.errno == errno.ENOENT:  # an abstract Unix socket nobody listens on
            return Unavailable(f"{what}: no such socket")
        return TransportError(f"{what}: {exc.strerror or exc}")
    raise TypeError(f"not a socket error: {exc!r}")


@contextmanager
def socket_errors(what: str) -> Iterator[None]:
    """Translate OS, TLS and timeout errors raised in the block into the store's tree."""
    try:
        yield
    except KVStoreError:
        raise
    except OSError as exc:
        raise socket_error(exc, what) from exc


class FrameSocket:
    """A connected socket that sends and receives frames.

    Reads go through a small buffer, so a reply's header and metadata usually arrive in
    one system call; payloads bigger than what is buffered are received straight into
    their destination. Not thread-safe: one request at a time (the client pools
    connections; the server runs one thread per connection).
    """

    def __init__(self, sock: socket.socket, *, max_meta: int) -> None:
        self.sock = sock
        self.max_meta = max_meta
        self.tls = isinstance(sock, ssl.SSLSocket)
        self._buf = bytearray(_READ_BUF)
        self._view = memoryview(self._buf)
        self._r0 = self._r1 = 0  # buffered, unread bytes are _buf[_r0:_r1]
        self._timeout: float | None = -1.0
        # A server bounds each frame as a whole (a peer dribbling a byte at a time never
        # trips a per-receive timeout): the clock starts at a frame's first byte and is
        # checked after every receive inside the frame. None (clients): no bound.
        self.frame_timeout: float | None = None
        self._frame_until = 0.0  # time.monotonic() deadline of the frame being read
        self.closed = False
        self.broken = False  # a send or receive failed: the stream is out of step
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)
            if not self.tls:
                sock.settimeout(None)
        except KVStoreError:
            self.broken = True
            raise
        except OSError as exc:
            raise self._failed(exc, "data socket setup") from exc

    def _failed(self, exc: OSError, what: str) -> KVStoreError:
        """Mark the stream out of step and map the error (plain ``try`` on hot paths:
        a generator context manager per system call costs more than the call)."""
        self.broken = True
        return socket_error(exc, what)

    # -- timeouts ------------------------------------------------------------------------

    def set_timeout(self, seconds: float | None) -> None:
        """Bound every following send and receive (None: wait forever).

        Rounded up to a quarter second, so back-to-back requests with nearly the same
        deadline do not pay two system calls each to move the kernel timeout.
        """
        if seconds is not None:
            seconds = math.ceil(max(seconds, 0.001) * 4) / 4
        if seconds == self._timeout:
            return
        self._timeout = seconds
        try:
            if self.tls:
                self.sock.settimeout(seconds)
                return
            tv = _timeval(seconds)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        except KVStoreError:
            self.broken = True
            raise
        except OSError as exc:
            raise self._failed(exc, "data socket") from exc

    def set_deadline(self, deadline: float | None) -> None:
        """:meth:`set_timeout` to what remains until ``deadline`` (time.monotonic)."""
        if deadline is None:
            self.set_timeout(None)
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError_("deadline passed before the data-socket request")
        self.set_timeout(left)

    # -- sending -------------------------------------------------------------------------

    def send(
        self,
        op: int,
        meta: bytes = b"",
        body: Sequence[Any] = (),
        body_len: int = 0,
        *,
        before: bytes = b"",
        wait: bool = True,
    ) -> None:
        """Send one frame; ``body`` buffers are sent from where they are (no copy) and
        must add up to ``body_len``. ``before`` (whole frames, see :func:`frame`) goes
        out in the same system call, ahead of it. A socket's send has copied the bytes
        when it returns, so ``wait`` (UcxFrames.send) changes nothing here."""
        head = before + HEADER.pack(MAGIC, op, 0, len(meta), body_len) + meta
        try:
            if not body:
                self.sock.sendall(head)
            elif self.tls:
                self.sock.sendall(head)
                for part in body:
                    self.sock.sendall(part)
            else:
                self._sendv([memoryview(head), *(memoryview(b).cast("B") for b in body)])
        except KVStoreError:
            self.broken = True
            raise
        except OSError as exc:
            raise self._failed(exc, "data socket send") from exc

    def send_more(self, parts: Sequence[Any], *, wait: bool = True) -> None:
        """Send more of the body of the frame :meth:`send` started (it was given the
        whole ``body_len`` but only the first parts): a writer that prepares each part
        while the previous one is on its way (``wait``: as in :meth:`send`)."""
        try:
            if self.tls:
                for part in parts:
                    self.sock.sendall(part)
            else:
                self._sendv([memoryview(b).cast("B") for b in parts])
        except KVStoreError:
            self.broken = True
            raise
        except OSError as exc:
            raise self._failed(exc, "data socket send") from exc

    def flush(self) -> None:
        """Nothing to wait for: every send has copied its bytes (UcxFrames.flush)."""

    def send_raw(self, data: bytes) -> None:
        """Send whole frames prepared with :func:`frame`."""
        try:
            self.sock.sendall(data)
        except KVStoreError:
            self.broken = True
            raise
        except OSError as exc:
            raise self._failed(exc, "data socket send") from exc

    def _sendv(self, bufs: list[memoryview]) -> None:
        """Gathered send: header, metadata and payloads in as few system calls as fit."""
        i = 0
        while i < len(bufs):
            n = self.sock.sendmsg(bufs[i : i + _IOV_MAX])
            while n and i < len(bufs):
                if n >= bufs[i].nbytes:
                    n -= bufs[i].nbytes
                    i += 1
                else:
                    bufs[i] = bufs[i][n:]
                    n = 0
            while i < len(bufs) and bufs[i].nbytes == 0:
                i += 1

    # -- receiving -----------------------------------------------------------------------

    def _buffered(self) -> int:
        return self._r1 - self._r0

    @property
    def buffered(self) -> int:
        """Received bytes not yet consumed (the start of a frame the peer already sent)."""
        return self._r1 - self._r0

    def _fill(self, need: int, *, idle: bool = False, header: bool = False) -> None:
        """Buffer at least ``need`` bytes (``need`` <= the buffer size). An orderly close
        before the first byte of a header raises EOFError."""
        if self._buffered() >= need:
            return
        if self._r0 == self._r1:
            self._r0 = self._r1 = 0
        elif len(self._buf) - self._r0 < need:  # move the tail to the front
            n = self._buffered()
            self._buf[:n] = self._buf[self._r0 : self._r1]
            self._r0, self._r1 = 0, n
        while self._buffered() < need:
            try:
                k = self.sock.recv_into(self._view[self._r1 :])
            except (TimeoutError, BlockingIOError):
                if idle and self._buffered() == 0:
                    continue
                raise TimeoutError_("data socket: the peer stalled inside a frame") from None
            if k == 0:
                if self._buffered() == 0 and header:
                    raise EOFError("peer closed the connection")
                raise TransportError(
                    f"data socket: connection closed inside a frame ({self._buffered()} of "
                    f"{need} bytes)"
                )
            self._r1 += k
            if self.frame_timeout is not None:
                self._check_frame_time()

    def poll_next(self, keep_going: Callable[[], bool]) -> bool:
        """Poll, without sleeping, for the first bytes of the next frame while
        ``keep_going()`` holds (kvstore/wire/polling.py says when a server does).

        True once bytes are buffered, or the peer closed or failed; the following
        :meth:`recv_header` then reads the frame or reports the close as usual. False
        when ``keep_going`` ended it first. Plain sockets only: a TLS record cannot be
        polled for without decrypting it.
        """
        if self.tls:
            return False
        if self._r0 == self._r1:
            self._r0 = self._r1 = 0
        view = self._view[self._r1 :]
        if not view.nbytes:
            return True
        recv_into = self.sock.recv_into
        while keep_going():
            try:
                k = recv_into(view, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            except OSError:
                return True  # the blocking read that follows reports the failure
            self._r1 += k
            return True  # k == 0: closed, and the next read sees it too
        return False

    def recv_header(self, *, idle: bool = False) -> tuple[int, int, int]:
        """Read a frame header: (op, meta_len, body_len).

        With ``idle`` a timeout before the first byte is not an error: the loop waits
        again (a server waiting for a client's next request), and an orderly close
        there raises EOFError. Anything malformed is a TransportError.
        """
        if self.frame_timeout is not None:  # the clock starts at the frame's first byte
            self._frame_until = time.monotonic() + self.frame_timeout if self._buffered() else 0.0
        try:
            self._fill(HEADER.size, idle=idle, header=True)
        except KVStoreError:
            self.broken = True
            raise
        except OSError as exc:
            raise self._failed(exc, "data socket receive") from exc
        magic, op, _flags, meta_len, body_len = HEADER.unpack_from(self._buf, self._r0)
        self._r0 += HEADER.size
        if magic != MAGIC:
            self.broken = True
            raise ProtocolError(f"data socket: bad frame magic {bytes(magic)!r}")
        if meta_len > self.max_meta:
            self.broken = True
            raise ProtocolError(
                f"data socket: frame metadata of {meta_len} bytes exceeds the limit of "
                f"{self.max_meta}"
            )
        return op, meta_len, body_len

    def _check_frame_time(self) -> None:
        now = time.monotonic()
        if not self._frame_until:
            self._frame_until = now + (self.frame_timeout or 0.0)
        elif now > self._frame_until:
            raise TimeoutError_(
                f"data socket: the peer took more than {self.frame_timeout:g} s to send one frame"
            )

    def recv_bytes(self, n: int) -> bytes:
        """Read exactly ``n`` bytes (frame metadata)."""
        if n <= len(self._buf):
            try:
                self._fill(n)
            except KVStoreError:
                self.broken = True
                raise
            except OSError as exc:
                raise self._failed(exc, "data socket receive") from exc
            out = bytes(self._view[self._r0 : self._r0 + n])
            self._r0 += n
            return out
        buf = bytearray(n)
        self.recv_into(memoryview(buf))
        return bytes(buf)

    def recv_into(self, view: memoryview, *, spin: bool = False, digest: Any = None) -> None:
        """Fill ``view`` exactly (a payload straight into its destination).

        With ``spin`` (a client receiving a reply the server is already sending) a plain
        socket is polled rather than slept on while the payload streams in, see
        :meth:`_recv_spinning`; ``digest`` (an object with ``update(buf)``, such as
        blocks.checksum_stream()) is fed every byte of ``view`` in order, while waiting
        for more where it can.
        """
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        n = view.nbytes
        got = min(self._buffered(), n)
        if got:
            view[:got] = self._view[self._r0 : self._r0 + got]
            self._r0 += got
        fed = 0
        try:
            if spin and got < n and not self.tls:
                got, fed = self._recv_spinning(view, got, n, digest)
            while got < n:
                k = self._recv_direct(view[got:])
                if k == 0:
                    raise TransportError(
                        f"data socket: connection closed after {got} of {n} payload bytes"
                    )
                got += k
                if self.frame_timeout is not None and got < n:
                    self._check_frame_time()
        except KVStoreError:
            self.broken = True
            raise
        except OSError as exc:
            raise self._failed(exc, "data socket receive") from exc
        if digest is not None and fed < n:
            digest.update(view[fed:])

    def recv_many(
        self, views: Sequence[memoryview], digests: Sequence[Any], *, spin: bool = False
    ) -> None:
        """Fill each of ``views`` in turn, feeding ``digests[i]`` (None: no digest) every
        byte of ``views[i]``: one stream, so simply one :meth:`recv_into` after another
        (UcxFrames.recv_many is where receiving a batch at once pays)."""
        for view, digest in zip(views, digests, strict=True):
            self.recv_into(view, spin=spin, digest=digest)

    def discard(self, n: int) -> None:
        """Read and drop ``n`` payload bytes (a refused item of a batch)."""
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n > 0:
            k = min(n, scratch.nbytes)
            self.recv_into(scratch[:k])
            n -= k

    def _recv_spinning(self, view: memoryview, got: int, n: int, digest: Any) -> tuple[int, int]:
        """Receive into ``view[got:n]`` polling the socket while the bytes keep coming;
        returns (received, fed to ``digest``). Waiting for the next bytes, it feeds
        ``digest`` what came so far; after _SPIN_MISSES empty polls in a row it stops
        and leaves the rest to a sleeping receive.

        A blocked receiver is woken once per arriving segment (64 KiB on loopback); on a
        virtual machine each wake-up is an interprocessor interrupt the sender pays for
        and a context switch for the receiver, which together cost more than copying
        the segment. Polling spares both while the sender keeps up (on loopback the
        longest gap between segments is a few dozen polls); a slow link or a stalled
        sender ends it after one bounded wait.
        """
        sock = self.sock
        misses = fed = 0
        while got < n:
            try:
                k = sock.recv_into(view[got:], n - got, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if digest is not None and fed < got:
                    digest.update(view[fed:got])
                    fed = got
                    continue
                misses += 1
                if misses >= _SPIN_MISSES:
                    break
                continue
            if k == 0:
                raise TransportError(
                    f"data socket: connection closed after {got} of {n} payload bytes"
                )
            got += k
            misses = 0
        return got, fed

    def _recv_direct(self, view: memoryview) -> int:
        if self.tls:
            return self.sock.recv_into(view)
        return self.sock.recv_into(view, view.nbytes, socket.MSG_WAITALL)

    def close(self) -> None:
        """Close the socket (idempotent); a blocked peer sees EOF."""
        if self.closed:
            return
        self.closed = True
        with suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def frame(op: int, meta: bytes) -> bytes:
    """A whole frame without payload, to send later (e.g. ahead of a request)."""
    return HEADER.pack(MAGIC, op, 0, len(meta), 0) + meta


def _timeval(seconds: float | None) -> bytes:
    if seconds is None:
        return struct.pack("ll", 0, 0)
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))
