"""UCX links: data-socket frames carried by ucxx tag messages, one worker per connection.

A UCX connection starts as an ordinary data socket (TCP or the same-host Unix socket).
HELLO carries the client's UCX worker address; a server that offers UCX makes a worker
for this connection, an endpoint to the client's worker and a random 64-bit tag, and
answers INFO with its own worker address and that tag. From then on both ends speak the
same frames as before (kvstore/wire/frames.py), over UCX:

- a frame's header and metadata (with any frames queued ahead of it) go as one control
  message, with the body when it is 64 KiB or less (copied: one message instead of
  several); a larger body goes as one payload message per part, sent from where it
  lies (UCX registers it; over rendezvous the receiver pulls it straight into its
  destination). Control messages, payloads and the tail of a control message too big
  for the receiver's control buffer travel under three tags derived from the
  connection's, so a receive posted for one kind never takes a message of another;
- a control message starts with its length. Each end keeps a receive posted into its
  control buffer, so a request or reply header is in place when it arrives, with no
  probe and no receive to post then;
- a payload is probed (its size is not known ahead) and, when it fits what is being
  read, received straight into the destination (the caller's tensor, a reserved slab
  extent); anything else lands in a small buffer first. A reply's payloads are
  received all at once (:meth:`UcxFrames.recv_many`). Payloads are still checked
  against their xxh3 as on TCP.

Why worker-address endpoints rather than a UCX listener: an endpoint a listener accepts
belongs to the listener's worker (one for all connections, not thread-safe).

Peer failures. Endpoints always use UCX's peer-failure handling. Without it a transport
error is fatal to the process (cma's ``process_vm_readv`` on a client that died
mid-transfer aborted the server in a test), and an endpoint cannot be closed without the
peer's help: UCX flushes it first, so closing one whose peer is gone or idle never
finishes, and the worker leaks or the closing thread spins. With it, a close is forced
and immediate. The price: no shared-memory transport (posix, sysv, cma) offers it, so
UCX between two processes of one host runs over tcp. Same-host clients use the shm
transport (kvstore/client/transport/shm.py) anyway, which copies once; UCX is for
other hosts, where the RDMA and tcp transports support peer-failure handling. A server
whose UCX_TLS leaves no such transport declines UCX and the connection stays on its
socket.

What the socket still does. It authenticated the connection (and the tag travels on
it, so a third party that reaches the worker's port cannot speak on it), and it stays
open as the connection's lifeline: both ends wait for UCX events and for the socket at
once, so a peer that dies or closes is noticed at once, however long UCX's own failure
detection would take. The lease reaper ends a stalled put by shutting that socket down, as on
TCP. Payloads over UCX travel in the clear, so a server with TLS never offers UCX.

Waiting is UCX's blocking progress mode: progress, probe, spin a few rounds, then arm
the worker and sleep in poll() on its event descriptor and the socket.

Settings (unless the environment says otherwise): ``UCX_RNDV_FRAG_MEM_TYPE=host`` (no
GPU: rendezvous fragments in host memory) and 256 KiB tcp segments. Tests set
``UCX_NET_DEVICES=lo``.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from kvstore.errors import KVStoreError, TimeoutError_, TransportError
from kvstore.wire.frames import HEADER, MAGIC, ProtocolError

__all__ = ["WIRE", "UcxFrames", "UcxWorker", "available", "new_tag"]

# The version of the framing below (Hello.ucx_wire, InfoResponse.ucx_wire). 2: control
# messages, payloads and control overflow under three tags, control messages length-
# prefixed and received into a posted buffer. Version 1 (one tag, every message probed)
# sent no version.
WIRE = 2

_SPINS = 64  # progress rounds (~1-2 us each) before arming the worker and sleeping
# A sleep in the middle of a call lasts this long at most. UCX's blocking mode can miss
# a wake-up: a sender whose rendezvous fragments were queued behind a full socket slept
# through the socket draining (seen with a receiver that paced its receives; both ends
# slept until the call's timeout). Such a miss now costs this, never the timeout.
_NAP_MS = 20
_FLUSH_S = 0.5  # at close, how long our last small sends may take to leave
_LEN = struct.Struct("<I")  # a control message's length, ahead of it
_COALESCE = 64 << 10  # a frame body this small travels in its header's message (copied)
_CTL_CAP = _COALESCE + (16 << 10)  # the control buffer: a header, metadata, a small body
_POLL_IN = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP
# Defaults unless the environment sets them: rendezvous fragments in host memory (no
# GPU), and 256 KiB tcp segments (UCX's 8 KiB default moved 1 MiB at 0.8 GB/s on
# loopback, 256 KiB at 1.7: benchmarks/bench_ucx.py).
_DEFAULTS = {
    "RNDV_FRAG_MEM_TYPE": "host",
    "TCP_TX_SEG_SIZE": "256k",
    "TCP_RX_SEG_SIZE": "256k",
}

_lib: Any = None
_arr: Any = None
_context: Any = None
_context_lock = threading.Lock()


def available() -> bool:
    """Whether ucxx imports here (the ``ucx`` extra)."""
    global _lib, _arr
    if _lib is not None:
        return True
    try:
        import ucxx._lib.arr as arr
        import ucxx._lib.libucxx as lib
    except Exception:
        return False
    _lib, _arr = lib, arr
    return True


def _ctx() -> Any:
    """The process's UCX context (made once; UCX reads its UCX_* settings here)."""
    global _context
    with _context_lock:
        if _context is None:
            if not available():
                raise TransportError("UCX: ucxx is not installed (pip install 'kvstore[ucx]')")
            # ucxx sets UCX_MEMTYPE_CACHE itself, which UCX then warns about at every start
            os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
            config = {k: v for k, v in _DEFAULTS.items() if f"UCX_{k}" not in os.environ}
            flags = (_lib.Feature.TAG, _lib.Feature.WAKEUP)
            _context = _lib.UCXContext(config_dict=config, feature_flags=flags)
        return _context


def new_tag() -> int:
    """A connection's tag: random, so only the authenticated peer that was told it can
    send frames this connection accepts."""
    return secrets.randbits(64)


class _PeerClosed(TransportError):
    """The lifeline socket closed: the peer is gone (or cut this connection)."""


def _ucx_error(exc: BaseException, what: str) -> KVStoreError:
    if isinstance(exc, KVStoreError):
        return exc
    return TransportError(f"UCX {what}: {exc}")


class UcxWorker:
    """One connection's UCX worker, in blocking progress mode, and its endpoint to the
    peer. Not thread-safe: the connection it serves is used by one thread at a time."""

    def __init__(self) -> None:
        ctx = _ctx()
        try:
            self.worker = _lib.UCXWorker(ctx)
            self.worker.init_blocking_progress_mode()
        except Exception as exc:
            raise _ucx_error(exc, "worker") from exc
        self.fd = int(self.worker.epoll_file_descriptor)
        self.ep: Any = None

    @property
    def address(self) -> bytes:
        """This worker's address, for the peer's endpoint."""
        return bytes(self.worker.address.tobytes())

    def connect(self, peer: bytes) -> None:
        """An endpoint to the peer's worker, with peer-failure handling (see the
        module)."""
        try:
            addr = _lib.UCXAddress.create_from_buffer(peer)
            self.ep = _lib.UCXEndpoint.create_from_worker_address(self.worker, addr, True)
        except Exception as exc:
            raise _ucx_error(exc, "endpoint") from exc

    def close(self) -> None:
        """Cancel what is in flight, close the endpoint and let the worker go
        (idempotent): its descriptors and shared-memory fifo are freed now, not when
        whatever still refers to this object is collected."""
        worker, self.worker = self.worker, None
        if worker is None:
            return
        with contextlib.suppress(Exception):
            worker.cancel_inflight_requests()
        ep, self.ep = self.ep, None
        if ep is not None:
            with contextlib.suppress(Exception):
                ep.close_blocking()  # forced (peer-failure handling): returns at once
        del ep, worker


class UcxFrames:
    """Frames over one UCX connection, with the surface of FrameSocket (frames.py), so
    the client's DataConn and the server's session use either unchanged.

    ``sock`` is the connection's socket, kept as its lifeline (see the module).
    """

    tls = False

    def __init__(self, link: UcxWorker, tag: int, sock: socket.socket, *, max_meta: int) -> None:
        self.link = link
        self.tag = tag
        self.sock = sock
        self.max_meta = max_meta
        self.frame_timeout: float | None = None
        self._frame_until = 0.0
        self._timeout: float | None = None
        self.closed = False
        self.broken = False
        self._buf: bytes | bytearray = b""  # received bytes not yet consumed: _buf[_r:]
        self._owned: list[tuple[Any, bytes]] = []  # sends of our own bytes in flight
        self._lent: list[tuple[Any, memoryview]] = []  # sends from callers' buffers
        self._r = 0
        self._next: Any = None  # a probed message not yet received
        self._poll = select.poll()
        self._poll.register(link.fd, select.POLLIN)
        self._poll.register(sock.fileno(), _POLL_IN)
        base = tag & ~3
        self._ctl = _lib.UCXXTag(base)  # control messages (see the module)
        self._data = _lib.UCXXTag(base | 1)  # payloads
        self._over = _lib.UCXXTag(base | 2)  # the rest of an oversize control message
        self._mask = _lib.UCXXTagMaskFull
        self._ctl_left = 0  # bytes of the current frame's header or metadata to come
        self._ctl_buf = bytearray(_CTL_CAP)
        self._ctl_req: Any = None
        self._post_ctl()

    @property
    def _w(self) -> Any:
        """The connection's worker (TransportError once closed)."""
        w = self.link.worker
        if w is None:
            self.broken = True
            raise TransportError("UCX: the connection is closed")
        return w

    # -- timeouts ------------------------------------------------------------------------

    def set_timeout(self, seconds: float | None) -> None:
        """Bound every following send and receive (None: wait forever)."""
        self._timeout = None if seconds is None else max(seconds, 0.001)

    def set_deadline(self, deadline: float | None) -> None:
        """:meth:`set_timeout` to what remains until ``deadline`` (time.monotonic)."""
        if deadline is None:
            self._timeout = None
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError_("deadline passed before the UCX request")
        self._timeout = left

    def _until(self) -> float:
        return math.inf if self._timeout is None else time.monotonic() + self._timeout

    # -- waiting -------------------------------------------------------------------------

    def _sleep(self, until: float, idle: bool, nap: bool = True) -> None:
        """Sleep until a UCX event, the socket stirs, or ``until`` (``nap`` False: only
        look); raise when the lifeline socket closed or failed, or time ran out (not
        while ``idle``)."""
        now = time.monotonic()
        if now >= until and not idle:
            raise TimeoutError_("UCX: the peer stalled")
        wait_ms = -1 if until == math.inf else max(int((until - now) * 1000) + 1, 1)
        cap = 1000 if idle else _NAP_MS
        wait_ms = cap if wait_ms < 0 else min(wait_ms, cap)
        sock_fd = self.sock.fileno()
        if self.closed or sock_fd < 0:  # closed under this wait: nothing more will come
            raise _PeerClosed("UCX: the connection is closed")
        for fd, ev in self._poll.poll(wait_ms if nap else 0):
            if ev & select.POLLNVAL:  # a descriptor closed under us: never poll it again
                raise _PeerClosed("UCX: the connection is closed")
            if fd == sock_fd:
                self._check_socket()
        if self.frame_timeout is not None and self._frame_until and not idle:
            self._check_frame_time()

    def _check_socket(self) -> None:
        try:
            data = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            raise TransportError(f"UCX: the connection's socket failed: {exc}") from None
        if not data:
            raise _PeerClosed("UCX: the peer closed the connection")
        raise ProtocolError("UCX: unexpected bytes on the connection's socket")

    def _progress_until(self, done: Callable[[], bool], until: float, idle: bool = False) -> None:
        w = self._w
        spins = 0
        while True:
            w.progress()
            if done():
                return
            spins += 1
            if spins < _SPINS:
                continue
            if w.arm():
                try:
                    self._sleep(until, idle)
                except _PeerClosed:
                    # what the peer sent before it closed may still be on its way
                    for _ in range(_SPINS):
                        w.progress()
                        if done():
                            return
                    raise
            elif not spins % _SPINS:  # busy (events keep coming): still watch the socket
                self._sleep(until, idle, nap=False)

    def _wait_all(self, reqs: list[Any], what: str) -> None:
        until = self._until()
        try:
            self._progress_until(lambda: all(r.completed for r in reqs), until)
            for r in reqs:
                r.check_error()
        except BaseException as exc:
            self._abandon(exc, what)

    def _abandon(self, exc: BaseException, what: str) -> NoReturn:
        """End a failed call: nothing may go on writing into (or reading from) the
        caller's buffers once it has failed, so what is in flight is cancelled before
        the error (a KVStoreError) is raised; the connection is done."""
        self.broken = True
        with contextlib.suppress(Exception):
            self._w.cancel_inflight_requests()
            self._w.progress()
        if isinstance(exc, KVStoreError):
            raise exc
        if isinstance(exc, Exception):
            raise _ucx_error(exc, what) from exc
        raise exc

    # -- sending -------------------------------------------------------------------------

    def _post(self, parts: Sequence[tuple[Any, Any]]) -> list[tuple[Any, memoryview]]:
        """Post one tag message per (tag, part); returns the requests to wait for, each
        with the view it reads (which keeps the caller's buffer alive). A ``bytes`` part
        is this connection's to keep alive (nobody can change it), so it is not waited
        for: it completes while later calls progress the worker."""
        ep = self.link.ep
        if ep is None or self.closed:
            self.broken = True
            raise TransportError("UCX: the connection is closed")
        self._reap()
        reqs = []
        for tag, part in parts:
            if type(part) is bytes:
                if part:
                    self._owned.append((ep.tag_send(_arr.Array(part), tag), part))
                continue
            mv = memoryview(part).cast("B")
            if mv.nbytes:
                reqs.append((ep.tag_send(_arr.Array(mv), tag), mv))
        return reqs

    def _reap(self) -> None:
        """Forget completed sends of our own bytes (raising if one failed)."""
        if not self._owned:
            return
        left = []
        for req, part in self._owned:
            if req.completed:
                try:
                    req.check_error()
                except Exception as exc:
                    self.broken = True
                    raise _ucx_error(exc, "send") from exc
            else:
                left.append((req, part))
        self._owned = left

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
        """Send one frame: header and metadata in one control message, with the body
        when it is small (copied: one message instead of several), else each body part
        in one payload message, from where it lies. Returns once the peer has every
        part the caller owns, so the caller may reuse its buffers; with ``wait`` False
        it returns once they are posted, and :meth:`flush` waits for them."""
        head = before + HEADER.pack(MAGIC, op, 0, len(meta), body_len) + meta
        views = [memoryview(b).cast("B") for b in body]
        if sum(v.nbytes for v in views) <= _COALESCE:
            self._send(self._control(head + b"".join(views)), wait)
        else:
            self._send(self._control(head) + [(self._data, v) for v in views], wait)

    def send_more(self, parts: Sequence[Any], *, wait: bool = True) -> None:
        """More body bytes of the frame :meth:`send` started (``wait`` as there)."""
        self._send([(self._data, p) for p in parts], wait)

    def send_raw(self, data: bytes) -> None:
        """Send whole frames prepared with frames.frame."""
        self._send(self._control(bytes(data)), True)

    def _control(self, content: bytes) -> list[tuple[Any, bytes]]:
        """``content`` as a control message: its length, then itself; what does not
        fit the receiver's control buffer follows under the overflow tag."""
        msg = _LEN.pack(len(content)) + content
        if len(msg) <= _CTL_CAP:
            return [(self._ctl, msg)]
        return [(self._ctl, msg[:_CTL_CAP]), (self._over, msg[_CTL_CAP:])]

    def flush(self) -> None:
        """Wait until the peer has every part sent with ``wait`` False: a writer that
        posts a batch's payloads and hashes each while the next ones travel."""
        lent, self._lent = self._lent, []
        if lent:
            self._wait_all([r for r, _ in lent], "send")

    def _send(self, parts: Sequence[tuple[Any, Any]], wait: bool) -> None:
        try:
            reqs = self._post(parts)
        except KVStoreError:
            self.broken = True
            raise
        except Exception as exc:
            self.broken = True
            raise _ucx_error(exc, "send") from exc
        self._lent.extend(reqs)
        if wait:
            self.flush()

    # -- receiving -----------------------------------------------------------------------

    @property
    def buffered(self) -> int:
        """Bytes received (or announced) and not yet consumed."""
        ready = self._ctl_req is not None and self._ctl_req.completed
        nxt = self._next.length if self._next is not None else 0
        return len(self._buf) - self._r + nxt + (1 if ready else 0)

    def _post_ctl(self) -> None:
        """Post the receive of the next control message into the control buffer: a
        request or reply header lands as it arrives, with no probe and no receive to
        post then."""
        try:
            self._ctl_req = self._w.tag_recv(_arr.Array(self._ctl_buf), self._ctl, self._mask)
        except KVStoreError:
            raise
        except Exception as exc:
            self.broken = True
            raise _ucx_error(exc, "receive") from exc

    def _next_control(self, until: float, idle: bool) -> None:
        """Wait for the next control message and make its content the buffered bytes
        (called once the previous message's bytes are all consumed); the control
        receive is posted again at once."""
        req = self._ctl_req
        self._progress_until(lambda: req.completed, until, idle)
        try:
            req.check_error()  # a message larger than the control buffer: truncated
        except Exception as exc:
            self.broken = True
            raise _ucx_error(exc, "control receive") from exc
        (total,) = _LEN.unpack_from(self._ctl_buf)
        if not 0 < total <= self._ctl_limit():
            self.broken = True
            raise ProtocolError(f"UCX: a control message of {total} bytes")
        first = min(total, _CTL_CAP - _LEN.size)
        content = bytearray(total)
        content[:first] = self._ctl_buf[_LEN.size : _LEN.size + first]
        self._post_ctl()
        if total > first:
            rest = memoryview(content)[first:]
            self._wait_all([self._w.tag_recv(_arr.Array(rest), self._over, self._mask)], "receive")
        self._buf, self._r = content, 0

    def _ctl_limit(self) -> int:
        """The largest control message a peer may send: owed frames ahead, a header,
        metadata within max_meta and a small body."""
        return 2 * (self.max_meta + HEADER.size) + _COALESCE

    def _probe(self, until: float) -> Any:
        """The next payload message (probed and taken off UCX's queue)."""
        if self._next is not None:
            found, self._next = self._next, None
            return found
        w, tag, mask = self._w, self._data, self._mask
        box: list[Any] = []

        def arrived() -> bool:
            r = w.tag_probe(tag, mask, True)
            if r.matched:
                box.append(r)
                return True
            return False

        self._progress_until(arrived, until)
        return box[0]

    def _take(self, view: memoryview, until: float, idle: bool = False) -> int:
        """Fill ``view`` from buffered bytes, else with the next control message (while
        the frame's header or metadata is being read) or the next payload message;
        returns how many bytes landed. A payload that fits lands straight in ``view``."""
        if self._r >= len(self._buf) and self._ctl_left:
            self._next_control(until, idle)
        if self._r < len(self._buf):
            k = min(len(self._buf) - self._r, view.nbytes)
            if self._ctl_left:
                k = min(k, self._ctl_left)
                self._ctl_left -= k
            view[:k] = self._buf[self._r : self._r + k]
            self._r += k
            return k
        msg = self._probe(until)
        n = int(msg.length)
        if n <= view.nbytes:
            self._recv_msg(view[:n], msg)
            return n
        spill = bytearray(n)
        self._recv_msg(memoryview(spill), msg)
        self._buf, self._r = spill, view.nbytes
        view[:] = self._buf[: view.nbytes]
        return view.nbytes

    def _recv_msg(self, view: memoryview, msg: Any) -> None:
        if not view.nbytes:
            return
        try:
            req = self._w.tag_recv_with_handle(_arr.Array(view), msg)
        except Exception as exc:
            self.broken = True
            raise _ucx_error(exc, "receive") from exc
        self._wait_all([req], "receive")

    def poll_next(self, keep_going: Callable[[], bool]) -> bool:
        """Poll, without sleeping, for the next control message while ``keep_going()``
        holds; True once one is here (FrameSocket.poll_next)."""
        if self.buffered:
            return True
        w, req = self._w, self._ctl_req
        try:
            while keep_going():
                w.progress()
                if req.completed:
                    return True
        except Exception:
            return True
        return False

    def _read(self, view: memoryview, idle: bool = False, header: bool = False) -> None:
        until = self._until()
        got, n = 0, view.nbytes
        try:
            while got < n:
                try:
                    got += self._take(view[got:], until, idle and not got)
                except _PeerClosed:
                    if header and not got:  # nothing of a next frame had come
                        raise EOFError("peer closed the connection") from None
                    raise
                if self.frame_timeout is not None and got < n:
                    self._check_frame_time()
        except KVStoreError:
            self.broken = True
            raise

    def recv_header(self, *, idle: bool = False) -> tuple[int, int, int]:
        """Read a frame header: (op, meta_len, body_len) (FrameSocket.recv_header)."""
        if self.frame_timeout is not None:
            self._frame_until = time.monotonic() + self.frame_timeout if self.buffered else 0.0
        head = bytearray(HEADER.size)
        self._ctl_left = HEADER.size
        self._read(memoryview(head), idle=idle, header=True)
        magic, op, _flags, meta_len, body_len = HEADER.unpack(head)
        if magic != MAGIC:
            self.broken = True
            raise ProtocolError(f"UCX: bad frame magic {bytes(magic)!r}")
        if meta_len > self.max_meta:
            self.broken = True
            raise ProtocolError(
                f"UCX: frame metadata of {meta_len} bytes exceeds the limit of {self.max_meta}"
            )
        self._ctl_left = meta_len
        if self.frame_timeout is not None and not self._frame_until:
            self._frame_until = time.monotonic() + self.frame_timeout
        return op, meta_len, body_len

    def _check_frame_time(self) -> None:
        if self._frame_until and time.monotonic() > self._frame_until:
            self.broken = True
            raise TimeoutError_(
                f"UCX: the peer took more than {self.frame_timeout:g} s to send one frame"
            )

    def recv_bytes(self, n: int) -> bytes:
        """Read exactly ``n`` bytes (frame metadata)."""
        out = bytearray(n)
        self._read(memoryview(out))
        return bytes(out)

    def recv_into(self, view: memoryview, *, spin: bool = False, digest: Any = None) -> None:
        """Fill ``view`` exactly (a payload straight into its destination); ``digest``
        is fed every byte of it once it is here."""
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        self._read(view)
        if digest is not None:
            digest.update(view)

    def recv_many(
        self, views: Sequence[memoryview], digests: Sequence[Any], *, spin: bool = False
    ) -> None:
        """Fill each of ``views`` in turn, as ``recv_into`` would, feeding ``digests[i]``
        (or nothing, where it is None) every byte of ``views[i]`` (``spin``: as
        FrameSocket.recv_many; waiting here always spins first).

        Why not a loop of ``recv_into``: each payload above UCX's eager limit is a
        rendezvous, and a receive posted only once the previous payload is in and hashed
        costs a round trip per payload to a sender that has gone to sleep meanwhile.
        Here every message already announced is received straight into the place it
        fills, so the sender streams the whole batch after one wake-up, and each view
        is hashed as soon as it is whole while later ones are still arriving. A message
        that does not end inside the view it starts in (not how our peers send) ends
        the pipelining: what is posted is waited for, and the rest is read as
        ``recv_into`` reads it.
        """
        flat = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views]
        count = len(flat)
        i = off = 0  # where the next byte lands: flat[i][off]

        def advance(n: int) -> bool:
            """``n`` more bytes of flat[i] are placed; True when that ends the view."""
            nonlocal i, off
            off += n
            if off < flat[i].nbytes:
                return False
            i, off = i + 1, 0
            while i < count and not flat[i].nbytes:
                i += 1
            return True

        if count and not flat[0].nbytes:
            advance(0)
        while i < count and self._r < len(self._buf):  # bytes already here come first
            k = min(len(self._buf) - self._r, flat[i].nbytes - off)
            flat[i][off : off + k] = self._buf[self._r : self._r + k]
            self._r += k
            advance(k)
        for j in range(i):
            self._feed(flat, digests, j)
        fed = i  # views [0, fed) are whole and hashed
        posted: deque[tuple[Any, int]] = deque()  # (request, the view it completes or -1)
        w, tag, mask = self._w, self._data, self._mask
        odd = False  # a message runs past the end of its view: stop posting

        def step() -> bool:
            nonlocal fed, odd
            while i < count and not odd:
                if self._next is not None:
                    msg, self._next = self._next, None
                else:
                    msg = w.tag_probe(tag, mask, True)
                    if not msg.matched:
                        break
                n = int(msg.length)
                if n > flat[i].nbytes - off:
                    self._next, odd = msg, True
                    break
                at = i
                req = w.tag_recv_with_handle(_arr.Array(flat[i][off : off + n]), msg)
                posted.append((req, at if advance(n) else -1))
            while posted and posted[0][0].completed:
                req, ends = posted.popleft()
                req.check_error()
                while fed <= ends:
                    self._feed(flat, digests, fed)
                    fed += 1
            if fed < i and not posted:  # empty views skipped at the end
                for j in range(fed, i):
                    self._feed(flat, digests, j)
                fed = i
            return fed >= count or (odd and not posted)

        if fed < count:
            try:
                self._progress_until(step, self._until())
            except BaseException as exc:
                self._abandon(exc, "receive")
        if fed < count:  # pipelining ended: the rest one view at a time
            self.recv_into(flat[i][off:])
            self._feed(flat, digests, i)
            for j in range(i + 1, count):
                self.recv_into(flat[j], digest=digests[j])

    @staticmethod
    def _feed(flat: Sequence[memoryview], digests: Sequence[Any], j: int) -> None:
        if digests[j] is not None:
            digests[j].update(flat[j])

    def discard(self, n: int) -> None:
        """Read and drop ``n`` payload bytes."""
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n > 0:
            k = min(n, scratch.nbytes)
            self.recv_into(scratch[:k])
            n -= k

    def close(self) -> None:
        """Close the UCX endpoint and the socket (idempotent); the peer sees the
        socket close."""
        if self.closed:
            return
        self._flush_owned()
        self.closed = True
        self.link.close()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def _flush_owned(self) -> None:
        """Let sends of our own bytes still in flight (an ERROR frame before a close)
        leave before the endpoint is forced shut, for a moment at most."""
        w = self.link.worker
        end = time.monotonic() + _FLUSH_S
        with contextlib.suppress(Exception):
            while w is not None and self._owned and time.monotonic() < end:
                w.progress()
                self._owned = [(r, b) for r, b in self._owned if not r.completed]
