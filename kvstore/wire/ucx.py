"""UCX links: payloads carried by ucxx tag messages, one worker per connection, beside
the connection's socket, which carries everything else.

A UCX connection starts as an ordinary data socket (TCP or the same-host Unix socket).
HELLO carries the client's UCX worker address; a server that offers UCX makes a worker
for this connection, an endpoint to the client's worker and a random 64-bit tag, and
answers INFO with its own worker address and that tag. From then on both ends speak the
same frames as before (kvstore/wire/frames.py), split between two carriers (framing 3):

- every frame's header and metadata, and the whole body of a frame whose body is
  64 KiB or less, travel on the socket, exactly as on a TCP connection. A request or
  reply without a large payload costs what it costs over TCP: one system call each
  way, no ucxx request, no receive to post, no UCX worker to wake;
- a larger body goes over UCX, one payload message per part the sender hands over,
  sent from where it lies (UCX registers it; over rendezvous the receiver pulls it
  straight into its destination). Both ends know which carrier a body takes from the
  header's body length alone.

A payload is probed (its size is not known ahead) and, when it fits what is being
read, received straight into the destination (the caller's tensor, a reserved slab
extent); anything else lands in a small buffer first. A reply's payloads are received
all at once (:meth:`UcxFrames.recv_many`). Payloads are still checked against their
xxh3 as on TCP. Payloads travel under a tag derived from the connection's, so a
stranger that reaches the worker cannot have a message of its own taken for one.

Framing 2 (every frame a UCX message, control messages received into a posted
buffer) cost a small call about twice what it costs over TCP: a ucxx request per
message and its re-posted receive, at both ends (benchmarks/RESULTS.md, "UCX").

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

What else the socket does. It authenticated the connection (and the tag travels on
it, so a third party that reaches the worker's port cannot speak on it), and it is the
connection's lifeline: while an end waits for UCX it also watches the socket, so a
peer that dies or closes is noticed at once, however long UCX's own failure detection
would take. The lease reaper ends a stalled put by shutting that socket down, as on
TCP. Payloads over UCX travel in the clear, so a server with TLS never offers UCX.

Waiting for a payload is UCX's blocking progress mode: progress, probe, spin a few
rounds, then arm the worker and sleep in poll() on its event descriptor and the socket.

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
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from kvstore.errors import KVStoreError, TimeoutError_, TransportError
from kvstore.wire.frames import FrameSocket, ProtocolError

__all__ = ["WIRE", "UcxFrames", "UcxWorker", "available", "new_tag"]

# The version of the framing below (Hello.ucx_wire, InfoResponse.ucx_wire). 3: headers,
# metadata and small bodies on the socket, larger bodies over UCX. 2: every frame over
# UCX, control messages, payloads and control overflow under three tags. Version 1 (one
# tag, every message probed) sent no version.
WIRE = 3

_SPINS = 64  # progress rounds (~1-2 us each) before arming the worker and sleeping
# A sleep in the middle of a call lasts this long at most. UCX's blocking mode can miss
# a wake-up: a sender whose rendezvous fragments were queued behind a full socket slept
# through the socket draining (seen with a receiver that paced its receives; both ends
# slept until the call's timeout). Such a miss now costs this, never the timeout.
_NAP_MS = 20
_FLUSH_S = 0.5  # at close, how long our last small sends may take to leave
_SMALL = 64 << 10  # a frame body this small travels on the socket, after its header
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

    ``fs`` is the connection's socket, already authenticated: it carries headers,
    metadata and small bodies, and is the connection's lifeline (see the module).
    """

    tls = False

    def __init__(self, link: UcxWorker, tag: int, fs: FrameSocket) -> None:
        self.link = link
        self.tag = tag
        self.fs = fs
        self.sock = fs.sock
        self._timeout: float | None = None
        self._frame_until = 0.0  # time.monotonic() bound of the frame being read
        self.closed = False
        self._broken = False
        self._meta_left = 0  # metadata bytes of the frame being read still on the socket
        self._body_ucx = False  # the body of the frame being read travels over UCX
        self._send_ucx = False  # the body of the frame being sent travels over UCX
        self._buf: bytes | bytearray = b""  # payload bytes received, not consumed: _buf[_r:]
        self._r = 0
        self._owned: list[tuple[Any, bytes]] = []  # sends of our own bytes in flight
        self._lent: list[tuple[Any, memoryview]] = []  # sends from callers' buffers
        self._next: Any = None  # a probed message not yet received
        self._poll = select.poll()
        self._poll.register(link.fd, select.POLLIN)
        self._poll.register(self.sock.fileno(), _POLL_IN)
        self._data = _lib.UCXXTag((tag & ~3) | 1)  # payloads (see the module)
        self._mask = _lib.UCXXTagMaskFull

    @property
    def broken(self) -> bool:
        """A send or receive failed, on either carrier: the stream is out of step."""
        return self._broken or self.fs.broken

    @broken.setter
    def broken(self, value: bool) -> None:
        self._broken = value

    @property
    def max_meta(self) -> int:
        return self.fs.max_meta

    @max_meta.setter
    def max_meta(self, value: int) -> None:
        self.fs.max_meta = value

    @property
    def frame_timeout(self) -> float | None:
        """A server's bound on one whole frame (FrameSocket.frame_timeout)."""
        return self.fs.frame_timeout

    @frame_timeout.setter
    def frame_timeout(self, value: float | None) -> None:
        self.fs.frame_timeout = value

    @property
    def _w(self) -> Any:
        """The connection's worker (TransportError once closed)."""
        w = self.link.worker
        if w is None:
            self._broken = True
            raise TransportError("UCX: the connection is closed")
        return w

    # -- timeouts ------------------------------------------------------------------------

    def set_timeout(self, seconds: float | None) -> None:
        """Bound every following send and receive, on both carriers (None: forever)."""
        self.fs.set_timeout(seconds)
        self._timeout = None if seconds is None else max(seconds, 0.001)

    def set_deadline(self, deadline: float | None) -> None:
        """:meth:`set_timeout` to what remains until ``deadline`` (time.monotonic)."""
        if deadline is None:
            self.set_timeout(None)
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError_("deadline passed before the UCX request")
        self.set_timeout(left)

    def _until(self) -> float:
        return math.inf if self._timeout is None else time.monotonic() + self._timeout

    # -- waiting -------------------------------------------------------------------------

    def _sleep(self, until: float, nap: bool = True) -> None:
        """Sleep until a UCX event, the socket stirs, or ``until`` (``nap`` False: only
        look); raise when the lifeline socket closed or failed, or time ran out."""
        now = time.monotonic()
        if now >= until:
            raise TimeoutError_("UCX: the peer stalled")
        wait_ms = _NAP_MS if until == math.inf else min(int((until - now) * 1000) + 1, _NAP_MS)
        sock_fd = self.sock.fileno()
        if self.closed or sock_fd < 0:  # closed under this wait: nothing more will come
            raise _PeerClosed("UCX: the connection is closed")
        if self.fs.buffered:  # read ahead with the header: the next frame came too soon
            raise ProtocolError("UCX: a frame on the socket while a payload was due")
        for fd, ev in self._poll.poll(wait_ms if nap else 0):
            if ev & select.POLLNVAL:  # a descriptor closed under us: never poll it again
                raise _PeerClosed("UCX: the connection is closed")
            if fd == sock_fd:
                self._check_socket()
        if self.frame_timeout is not None and self._frame_until:
            self._check_frame_time()

    def _check_socket(self) -> None:
        """The socket stirred while a payload was due over UCX: the peer closed, or it
        broke the framing (nothing may come on the socket until this frame is done)."""
        try:
            data = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            raise TransportError(f"UCX: the connection's socket failed: {exc}") from None
        if not data:
            raise _PeerClosed("UCX: the peer closed the connection")
        raise ProtocolError("UCX: bytes on the connection's socket while a payload was due")

    def _progress_until(self, done: Callable[[], bool], until: float) -> None:
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
                    self._sleep(until)
                except _PeerClosed:
                    # what the peer sent before it closed may still be on its way
                    for _ in range(_SPINS):
                        w.progress()
                        if done():
                            return
                    raise
            elif not spins % _SPINS:  # busy (events keep coming): still watch the socket
                self._sleep(until, nap=False)

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
        self._broken = True
        with contextlib.suppress(Exception):
            self._w.cancel_inflight_requests()
            self._w.progress()
        self._lent = []
        if isinstance(exc, KVStoreError):
            raise exc
        if isinstance(exc, Exception):
            raise _ucx_error(exc, what) from exc
        raise exc

    # -- sending -------------------------------------------------------------------------

    def _post(self, parts: Sequence[Any]) -> list[tuple[Any, memoryview]]:
        """Post one payload message per part; returns the requests to wait for, each
        with the view it reads (which keeps the caller's buffer alive). A ``bytes`` part
        is this connection's to keep alive (nobody can change it), so it is not waited
        for: it completes while later calls progress the worker."""
        ep = self.link.ep
        if ep is None or self.closed:
            self._broken = True
            raise TransportError("UCX: the connection is closed")
        self._reap()
        reqs = []
        tag = self._data
        for part in parts:
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
                    self._broken = True
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
        """Send one frame: on the socket with its body when the body is small, else
        its header and metadata on the socket and each body part as one payload
        message, from where it lies. The payloads are posted first, so they are on
        their way when the peer reads the header. Returns once the peer has every part
        the caller owns, so the caller may reuse its buffers; with ``wait`` False it
        returns once they are posted, and :meth:`flush` waits for them."""
        self._send_ucx = body_len > _SMALL
        if not self._send_ucx:
            self.fs.send(op, meta, body, body_len, before=before)
            return
        self._send(body, wait=False)
        try:
            self.fs.send(op, meta, (), body_len, before=before)
        except BaseException as exc:
            self._abandon(exc, "send")
        if wait:
            self.flush()

    def send_more(self, parts: Sequence[Any], *, wait: bool = True) -> None:
        """More body bytes of the frame :meth:`send` started (``wait`` as there)."""
        if self._send_ucx:
            self._send(parts, wait)
        else:
            self.fs.send_more(parts)

    def send_raw(self, data: bytes) -> None:
        """Send whole frames prepared with frames.frame (no body: on the socket)."""
        self.fs.send_raw(data)

    def flush(self) -> None:
        """Wait until the peer has every part sent with ``wait`` False: a writer that
        posts a batch's payloads and hashes each while the next ones travel."""
        lent, self._lent = self._lent, []
        if lent:
            self._wait_all([r for r, _ in lent], "send")

    def _send(self, parts: Sequence[Any], wait: bool) -> None:
        try:
            reqs = self._post(parts)
        except KVStoreError:
            self._broken = True
            raise
        except Exception as exc:
            self._broken = True
            raise _ucx_error(exc, "send") from exc
        self._lent.extend(reqs)
        if wait:
            self.flush()

    # -- receiving -----------------------------------------------------------------------

    @property
    def buffered(self) -> int:
        """Bytes received (or announced) and not yet consumed."""
        nxt = self._next.length if self._next is not None else 0
        return self.fs.buffered + len(self._buf) - self._r + nxt

    def poll_next(self, keep_going: Callable[[], bool]) -> bool:
        """Poll, without sleeping, for the next frame's first bytes while
        ``keep_going()`` holds (FrameSocket.poll_next: they come on the socket)."""
        return self.fs.poll_next(keep_going)

    def recv_header(self, *, idle: bool = False) -> tuple[int, int, int]:
        """Read a frame header off the socket: (op, meta_len, body_len)
        (FrameSocket.recv_header); the body length says which carrier brings the
        body."""
        if self._r < len(self._buf) or self._next is not None:
            self._broken = True
            raise ProtocolError("UCX: payload bytes past the end of a frame's body")
        op, meta_len, body_len = self.fs.recv_header(idle=idle)
        self._meta_left = meta_len
        self._body_ucx = body_len > _SMALL
        if self.frame_timeout is not None:
            self._frame_until = time.monotonic() + self.frame_timeout
        return op, meta_len, body_len

    def _check_frame_time(self) -> None:
        if self._frame_until and time.monotonic() > self._frame_until:
            self._broken = True
            raise TimeoutError_(
                f"UCX: the peer took more than {self.frame_timeout:g} s to send one frame"
            )

    def recv_bytes(self, n: int) -> bytes:
        """Read exactly ``n`` bytes (frame metadata, or a few body bytes)."""
        if n <= self._meta_left:
            self._meta_left -= n
            return self.fs.recv_bytes(n)
        out = bytearray(n)
        self.recv_into(memoryview(out))
        return bytes(out)

    def _meta_into(self, view: memoryview) -> int:
        """Fill the start of ``view`` with what is left of the frame's metadata (a
        reader that takes metadata and body in one read); returns how many bytes."""
        k = min(self._meta_left, view.nbytes)
        if k:
            self.fs.recv_into(view[:k])
            self._meta_left -= k
        return k

    def recv_into(self, view: memoryview, *, spin: bool = False, digest: Any = None) -> None:
        """Fill ``view`` exactly (a payload straight into its destination); ``digest``
        is fed every byte of it (as it arrives on the socket, once it is here over
        UCX)."""
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        k = self._meta_into(view) if self._meta_left else 0
        if not self._body_ucx and not k:
            self.fs.recv_into(view, spin=spin, digest=digest)
            return
        if self._body_ucx:
            self._read(view[k:])
        else:
            self.fs.recv_into(view[k:], spin=spin)
        if digest is not None:
            digest.update(view)

    def _take(self, view: memoryview, until: float) -> int:
        """Fill ``view`` from buffered payload bytes, else with the next payload
        message; returns how many bytes landed. A message that fits lands straight in
        ``view``."""
        if self._r < len(self._buf):
            k = min(len(self._buf) - self._r, view.nbytes)
            view[:k] = self._buf[self._r : self._r + k]
            self._r += k
            if self._r == len(self._buf):
                self._buf, self._r = b"", 0
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

    def _recv_msg(self, view: memoryview, msg: Any) -> None:
        if not view.nbytes:
            return
        try:
            req = self._w.tag_recv_with_handle(_arr.Array(view), msg)
        except Exception as exc:
            self._broken = True
            raise _ucx_error(exc, "receive") from exc
        self._wait_all([req], "receive")

    def _read(self, view: memoryview) -> None:
        """Fill ``view`` with payload bytes over UCX."""
        until = self._until()
        got, n = 0, view.nbytes
        try:
            while got < n:
                got += self._take(view[got:], until)
                if self.frame_timeout is not None and got < n:
                    self._check_frame_time()
        except KVStoreError:
            self._broken = True
            raise

    def recv_many(
        self, views: Sequence[memoryview], digests: Sequence[Any], *, spin: bool = False
    ) -> None:
        """Fill each of ``views`` in turn, as ``recv_into`` would, feeding ``digests[i]``
        (or nothing, where it is None) every byte of ``views[i]`` (``spin``: as
        FrameSocket.recv_many, for a small body on the socket).

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
        if not self._body_ucx or self._meta_left:
            for view, digest in zip(views, digests, strict=True):
                self.recv_into(view, spin=spin, digest=digest)
            return
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
        if self._r == len(self._buf):
            self._buf, self._r = b"", 0
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
        """Read and drop ``n`` body bytes (a refused item of a batch)."""
        if not self._body_ucx:
            self.fs.discard(n)
            return
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n > 0:
            k = min(n, scratch.nbytes)
            self._read(scratch[:k])
            n -= k

    def close(self) -> None:
        """Close the UCX endpoint and the socket (idempotent); the peer sees the
        socket close."""
        if self.closed:
            return
        self._flush_owned()
        self.closed = True
        self.link.close()
        self.fs.close()

    def _flush_owned(self) -> None:
        """Let sends of our own bytes still in flight leave before the endpoint is
        forced shut, for a moment at most."""
        w = self.link.worker
        end = time.monotonic() + _FLUSH_S
        with contextlib.suppress(Exception):
            while w is not None and self._owned and time.monotonic() < end:
                w.progress()
                self._owned = [(r, b) for r, b in self._owned if not r.completed]
