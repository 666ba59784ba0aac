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

Where the code is: this module sets up UCX (the process's context, one worker and
endpoint per connection: :class:`UcxWorker`) and splits each frame between the two
carriers (:class:`UcxFrames`); kvstore/wire/ucx_payloads.py sends and receives the
payload messages and does the waiting.

Settings (unless the environment says otherwise): ``UCX_RNDV_FRAG_MEM_TYPE=host`` (no
GPU: rendezvous fragments in host memory) and 256 KiB tcp segments. Tests set
``UCX_NET_DEVICES=lo``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.errors import TimeoutError_, TransportError
from kvstore.wire.frames import FrameSocket, ProtocolError
from kvstore.wire.ucx_payloads import UcxPayloads, ucx_error

__all__ = ["WIRE", "UcxFrames", "UcxWorker", "available", "new_tag"]

# The version of the framing below (Hello.ucx_wire, InfoResponse.ucx_wire). 3: headers,
# metadata and small bodies on the socket, larger bodies over UCX. 2: every frame over
# UCX, control messages, payloads and control overflow under three tags. Version 1 (one
# tag, every message probed) sent no version.
WIRE = 3

_SMALL = 64 << 10  # a frame body this small travels on the socket, after its header
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


class UcxWorker:
    """One connection's UCX worker, in blocking progress mode, and its endpoint to the
    peer. Not thread-safe: the connection it serves is used by one thread at a time."""

    def __init__(self) -> None:
        ctx = _ctx()
        try:
            self.worker = _lib.UCXWorker(ctx)
            self.worker.init_blocking_progress_mode()
        except Exception as exc:
            raise ucx_error(exc, "worker") from exc
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
            raise ucx_error(exc, "endpoint") from exc

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

    # -- tag messages (what kvstore/wire/ucx_payloads.py needs of ucxx) ---------------

    def tag_send(self, data: Any, tag: Any) -> Any:
        """Post a send of ``data`` (bytes or a flat byte view, kept alive by the
        caller until it completes) to the peer under ``tag``."""
        return self.ep.tag_send(_arr.Array(data), tag)

    def tag_probe(self, tag: Any) -> Any:
        """The next message under exactly ``tag``, taken off UCX's queue (``matched``
        False: none yet)."""
        return self.worker.tag_probe(tag, _lib.UCXXTagMaskFull, True)

    def tag_recv(self, view: memoryview, msg: Any) -> Any:
        """Post the receive of probed message ``msg`` into ``view``."""
        return self.worker.tag_recv_with_handle(_arr.Array(view), msg)


class UcxFrames:
    """Frames over one UCX connection, with the surface of FrameSocket (frames.py), so
    the client's DataConn and the server's session use either unchanged.

    ``fs`` is the connection's socket, already authenticated: it carries headers,
    metadata and small bodies, and is the connection's lifeline (see the module).
    This class decides, from a frame's body length, which carrier its body takes;
    ``payloads`` (kvstore/wire/ucx_payloads.py) moves the bodies that go over UCX.
    """

    tls = False

    def __init__(self, link: UcxWorker, tag: int, fs: FrameSocket) -> None:
        self.link = link
        self.tag = tag
        self.fs = fs
        self.sock = fs.sock  # the lifeline (a server's reaper shuts it down)
        # payloads travel under a tag of their own, derived from the connection's
        self.payloads = UcxPayloads(link, _lib.UCXXTag((tag & ~3) | 1), fs)
        self._meta_left = 0  # metadata bytes of the frame being read still on the socket
        self._body_ucx = False  # the body of the frame being read travels over UCX
        self._send_ucx = False  # the body of the frame being sent travels over UCX

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self.payloads.closed

    @property
    def broken(self) -> bool:
        """A send or receive failed, on either carrier: the stream is out of step."""
        return self.payloads.broken or self.fs.broken

    @broken.setter
    def broken(self, value: bool) -> None:
        self.payloads.broken = value

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

    # -- timeouts ------------------------------------------------------------------------

    def set_timeout(self, seconds: float | None) -> None:
        """Bound every following send and receive, on both carriers (None: forever)."""
        self.fs.set_timeout(seconds)
        self.payloads.timeout = None if seconds is None else max(seconds, 0.001)

    def set_deadline(self, deadline: float | None) -> None:
        """:meth:`set_timeout` to what remains until ``deadline`` (time.monotonic)."""
        if deadline is None:
            self.set_timeout(None)
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError_("deadline passed before the UCX request")
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
        self.payloads.send(body, wait=False)
        try:
            self.fs.send(op, meta, (), body_len, before=before)
        except BaseException as exc:
            self.payloads.abandon(exc, "send")
        if wait:
            self.flush()

    def send_more(self, parts: Sequence[Any], *, wait: bool = True) -> None:
        """More body bytes of the frame :meth:`send` started (``wait`` as there)."""
        if self._send_ucx:
            self.payloads.send(parts, wait)
        else:
            self.fs.send_more(parts)

    def send_raw(self, data: bytes) -> None:
        """Send whole frames prepared with frames.frame (no body: on the socket)."""
        self.fs.send_raw(data)

    def flush(self) -> None:
        """Wait until the peer has every part sent with ``wait`` False."""
        self.payloads.flush()

    # -- receiving -----------------------------------------------------------------------

    @property
    def buffered(self) -> int:
        """Bytes received (or announced) and not yet consumed."""
        return self.fs.buffered + self.payloads.buffered

    def poll_next(self, keep_going: Callable[[], bool]) -> bool:
        """Poll, without sleeping, for the next frame's first bytes while
        ``keep_going()`` holds (FrameSocket.poll_next: they come on the socket)."""
        return self.fs.poll_next(keep_going)

    def recv_header(self, *, idle: bool = False) -> tuple[int, int, int]:
        """Read a frame header off the socket: (op, meta_len, body_len)
        (FrameSocket.recv_header); the body length says which carrier brings the
        body."""
        if self.payloads.pending:
            self.payloads.broken = True
            raise ProtocolError("UCX: payload bytes past the end of a frame's body")
        op, meta_len, body_len = self.fs.recv_header(idle=idle)
        self._meta_left = meta_len
        self._body_ucx = body_len > _SMALL
        if self.frame_timeout is not None:
            self.payloads.frame_until = time.monotonic() + self.frame_timeout
        return op, meta_len, body_len

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
            self.payloads.read(view[k:])
        else:
            self.fs.recv_into(view[k:], spin=spin)
        if digest is not None:
            digest.update(view)

    def recv_many(
        self, views: Sequence[memoryview], digests: Sequence[Any], *, spin: bool = False
    ) -> None:
        """Fill each of ``views`` in turn, as ``recv_into`` would, feeding ``digests[i]``
        (or nothing, where it is None) every byte of ``views[i]`` (``spin``: as
        FrameSocket.recv_many, for a small body on the socket). A body over UCX is
        received all at once (UcxPayloads.read_many says why)."""
        if not self._body_ucx or self._meta_left:
            for view, digest in zip(views, digests, strict=True):
                self.recv_into(view, spin=spin, digest=digest)
            return
        flat = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views]
        self.payloads.read_many(flat, digests)

    def discard(self, n: int) -> None:
        """Read and drop ``n`` body bytes (a refused item of a batch)."""
        if not self._body_ucx:
            self.fs.discard(n)
            return
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n > 0:
            k = min(n, scratch.nbytes)
            self.payloads.read(scratch[:k])
            n -= k

    def close(self) -> None:
        """Close the UCX endpoint and the socket (idempotent); the peer sees the
        socket close."""
        if self.closed:
            return
        self.payloads.flush_owned()
        self.payloads.closed = True
        self.link.close()
        self.fs.close()
