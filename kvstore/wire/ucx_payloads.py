"""The UCX side of a UCX connection: the large bodies, as tag messages, and the waiting.

:class:`~kvstore.wire.ucx.UcxFrames` decides, frame by frame, which carrier a body takes
(kvstore/wire/ucx.py tells the whole story); what goes over UCX is this module's:

- sending posts one payload message per part, from where it lies, and waits (now or at
  ``flush``) until the peer has every part the caller owns;
- receiving probes the next message and lands it straight in the destination when it
  fits, else in a small buffer first; a reply's payloads are received all at once
  (:class:`_Batch`), each hashed as soon as it is whole;
- waiting is UCX's blocking progress mode (progress, spin, then arm the worker and
  sleep in poll() on its event descriptor and the socket), which also watches the
  connection's socket, its lifeline: a peer that closes it is noticed at once.

It knows the worker only through :class:`PayloadLink` (UcxWorker, which owns ucxx), so
that nothing here imports ucxx or the module above.
"""

from __future__ import annotations

import contextlib
import math
import select
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol

from kvstore.errors import KVStoreError, TimeoutError_, TransportError
from kvstore.wire.frames import FrameSocket, ProtocolError

__all__ = ["PayloadLink", "UcxPayloads", "ucx_error"]

_SPINS = 64  # progress rounds (~1-2 us each) before arming the worker and sleeping
# A sleep in the middle of a call lasts this long at most. UCX's blocking mode can miss
# a wake-up: a sender whose rendezvous fragments were queued behind a full socket slept
# through the socket draining (seen with a receiver that paced its receives; both ends
# slept until the call's timeout). Such a miss now costs this, never the timeout.
_NAP_MS = 20
_FLUSH_S = 0.5  # at close, how long our last small sends may take to leave
_POLL_IN = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP


class PayloadLink(Protocol):
    """What the payload side needs of a connection's UCX worker (ucx.py, UcxWorker):
    its worker (None once closed), endpoint, event descriptor, and tag messages."""

    worker: Any
    ep: Any
    fd: int

    def tag_send(self, data: Any, tag: Any) -> Any:
        """Post a send of ``data`` (bytes or a flat byte view) to the peer."""

    def tag_probe(self, tag: Any) -> Any:
        """The next message under exactly ``tag``, taken off UCX's queue."""

    def tag_recv(self, view: memoryview, msg: Any) -> Any:
        """Post the receive of probed message ``msg`` into ``view``."""


class _PeerClosed(TransportError):
    """The lifeline socket closed: the peer is gone (or cut this connection)."""


def ucx_error(exc: BaseException, what: str) -> KVStoreError:
    """A ucxx failure as the KVStoreError it means (a KVStoreError as it is)."""
    if isinstance(exc, KVStoreError):
        return exc
    return TransportError(f"UCX {what}: {exc}")


class UcxPayloads:
    """One connection's payload messages under ``tag`` (derived from the connection's,
    see ucx.py), with ``fs`` its socket: the lifeline watched while waiting, and the
    bound on one frame (``frame_timeout``). Not thread-safe, as its connection.

    ``timeout`` bounds each wait (None: forever), ``frame_until`` the frame being read
    (0: none); ``broken`` is set once a send or receive failed, ``closed`` at close.
    """

    def __init__(self, link: PayloadLink, tag: Any, fs: FrameSocket) -> None:
        self.link = link
        self.tag = tag
        self.fs = fs
        self.sock = fs.sock
        self.timeout: float | None = None
        self.frame_until = 0.0  # time.monotonic() bound of the frame being read
        self.closed = False
        self.broken = False
        self._buf: bytes | bytearray = b""  # payload bytes received, not consumed: _buf[_r:]
        self._r = 0
        self._owned: list[tuple[Any, bytes]] = []  # sends of our own bytes in flight
        self._lent: list[tuple[Any, memoryview]] = []  # sends from callers' buffers
        self._next: Any = None  # a probed message not yet received
        self._poll = select.poll()
        self._poll.register(link.fd, select.POLLIN)
        self._poll.register(self.sock.fileno(), _POLL_IN)

    @property
    def pending(self) -> bool:
        """Whether a payload byte (or a probed message) is here and not consumed."""
        return self._r < len(self._buf) or self._next is not None

    @property
    def buffered(self) -> int:
        """Payload bytes received (or announced by a probe) and not yet consumed."""
        nxt = self._next.length if self._next is not None else 0
        return len(self._buf) - self._r + nxt

    def _worker(self) -> Any:
        """The connection's worker (TransportError once closed)."""
        w = self.link.worker
        if w is None:
            self.broken = True
            raise TransportError("UCX: the connection is closed")
        return w

    def _until(self) -> float:
        return math.inf if self.timeout is None else time.monotonic() + self.timeout

    # -- waiting -------------------------------------------------------------------------

    def _sleep(self, until: float, nap: bool = True, *, strict: bool = True) -> None:
        """Sleep until a UCX event, the socket stirs, or ``until`` (``nap`` False: only
        look); raise when the lifeline socket closed or failed, or time ran out, and
        (``strict``) when a frame came on the socket while a payload is still due. Not
        ``strict`` once the payload's message has arrived and is being received: the
        peer sent it before what follows on the socket, which may then come first."""
        now = time.monotonic()
        if now >= until:
            raise TimeoutError_("UCX: the peer stalled")
        wait_ms = _NAP_MS if until == math.inf else min(int((until - now) * 1000) + 1, _NAP_MS)
        sock_fd = self.sock.fileno()
        if self.closed or sock_fd < 0:  # closed under this wait: nothing more will come
            raise _PeerClosed("UCX: the connection is closed")
        if strict and self.fs.buffered:  # read ahead with the header: the next frame came too soon
            raise ProtocolError("UCX: a frame on the socket while a payload was due")
        for fd, ev in self._poll.poll(wait_ms if nap else 0):
            if ev & select.POLLNVAL:  # a descriptor closed under us: never poll it again
                raise _PeerClosed("UCX: the connection is closed")
            if fd == sock_fd:
                self._check_socket(strict)
        if self.fs.frame_timeout is not None and self.frame_until:
            self.check_frame_time()

    def _check_socket(self, strict: bool = True) -> None:
        """The socket stirred while a payload was due over UCX: the peer closed, or
        (``strict``) it broke the framing (nothing may come on the socket until this
        frame's payloads were sent)."""
        try:
            data = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            raise TransportError(f"UCX: the connection's socket failed: {exc}") from None
        if not data:
            raise _PeerClosed("UCX: the peer closed the connection")
        if strict:
            raise ProtocolError("UCX: bytes on the connection's socket while a payload was due")

    def check_frame_time(self) -> None:
        """TimeoutError_ (the connection broken) once the frame being read has taken
        longer than the socket's ``frame_timeout``."""
        if self.frame_until and time.monotonic() > self.frame_until:
            self.broken = True
            raise TimeoutError_(
                f"UCX: the peer took more than {self.fs.frame_timeout:g} s to send one frame"
            )

    def _progress_until(
        self, done: Callable[[], bool], until: float, *, strict: bool = True
    ) -> None:
        w = self._worker()
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
                    self._sleep(until, strict=strict)
                except _PeerClosed:
                    # what the peer sent before it closed may still be on its way
                    for _ in range(_SPINS):
                        w.progress()
                        if done():
                            return
                    raise
            elif not spins % _SPINS:  # busy (events keep coming): still watch the socket
                self._sleep(until, nap=False, strict=strict)

    def _wait_all(self, reqs: list[Any], what: str, *, strict: bool = True) -> None:
        until = self._until()
        try:
            done = lambda: all(r.completed for r in reqs)  # noqa: E731
            self._progress_until(done, until, strict=strict)
            for r in reqs:
                r.check_error()
        except BaseException as exc:
            self.abandon(exc, what)

    def abandon(self, exc: BaseException, what: str) -> NoReturn:
        """End a failed call: nothing may go on writing into (or reading from) the
        caller's buffers once it has failed, so what is in flight is cancelled before
        the error (a KVStoreError) is raised; the connection is done."""
        self.broken = True
        with contextlib.suppress(Exception):
            self._worker().cancel_inflight_requests()
            self._worker().progress()
        self._lent = []
        if isinstance(exc, KVStoreError):
            raise exc
        if isinstance(exc, Exception):
            raise ucx_error(exc, what) from exc
        raise exc

    # -- sending -------------------------------------------------------------------------

    def send(self, parts: Sequence[Any], wait: bool) -> None:
        """Post one payload message per part; with ``wait``, return once the peer has
        every part the caller owns (else :meth:`flush` waits for them)."""
        try:
            reqs = self._post(parts)
        except KVStoreError:
            self.broken = True
            raise
        except Exception as exc:
            self.broken = True
            raise ucx_error(exc, "send") from exc
        self._lent.extend(reqs)
        if wait:
            self.flush()

    def flush(self) -> None:
        """Wait until the peer has every part sent with ``wait`` False: a writer that
        posts a batch's payloads and hashes each while the next ones travel."""
        lent, self._lent = self._lent, []
        if lent:
            self._wait_all([r for r, _ in lent], "send")

    def _post(self, parts: Sequence[Any]) -> list[tuple[Any, memoryview]]:
        """Post one payload message per part; returns the requests to wait for, each
        with the view it reads (which keeps the caller's buffer alive). A ``bytes`` part
        is this connection's to keep alive (nobody can change it), so it is not waited
        for: it completes while later calls progress the worker."""
        link = self.link
        if link.ep is None or self.closed:
            self.broken = True
            raise TransportError("UCX: the connection is closed")
        self._reap()
        reqs = []
        tag = self.tag
        for part in parts:
            if type(part) is bytes:
                if part:
                    self._owned.append((link.tag_send(part, tag), part))
                continue
            mv = memoryview(part).cast("B")
            if mv.nbytes:
                reqs.append((link.tag_send(mv, tag), mv))
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
                    raise ucx_error(exc, "send") from exc
            else:
                left.append((req, part))
        self._owned = left

    def flush_owned(self) -> None:
        """Let sends of our own bytes still in flight leave before the endpoint is
        forced shut, for a moment at most."""
        w = self.link.worker
        end = time.monotonic() + _FLUSH_S
        with contextlib.suppress(Exception):
            while w is not None and self._owned and time.monotonic() < end:
                w.progress()
                self._owned = [(r, b) for r, b in self._owned if not r.completed]

    # -- receiving -----------------------------------------------------------------------

    def read(self, view: memoryview) -> None:
        """Fill ``view`` (flat bytes) with payload bytes."""
        until = self._until()
        got, n = 0, view.nbytes
        try:
            while got < n:
                got += self._take(view[got:], until)
                if self.fs.frame_timeout is not None and got < n:
                    self.check_frame_time()
        except KVStoreError:
            self.broken = True
            raise

    def read_many(self, flat: Sequence[memoryview], digests: Sequence[Any]) -> None:
        """Fill each of ``flat`` in turn, feeding ``digests[i]`` (where not None) every
        byte of ``flat[i]``, every announced message received at once (:class:`_Batch`)."""
        _Batch(self, flat, digests).run()

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
        self._worker()  # closed: TransportError before probing
        link, tag = self.link, self.tag
        box: list[Any] = []

        def arrived() -> bool:
            r = link.tag_probe(tag)
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
            self._worker()  # closed: TransportError before posting
            req = self.link.tag_recv(view, msg)
        except Exception as exc:
            self.broken = True
            raise ucx_error(exc, "receive") from exc
        self._wait_all([req], "receive", strict=False)  # its message is here: see _sleep


class _Batch:
    """One reply's payloads received into their views at once (UcxFrames.recv_many).

    Why not a loop of ``read``: each payload above UCX's eager limit is a rendezvous,
    and a receive posted only once the previous payload is in and hashed costs a round
    trip per payload to a sender that has gone to sleep meanwhile. Here every message
    already announced is received straight into the place it fills, so the sender
    streams the whole batch after one wake-up, and each view is hashed as soon as it is
    whole while later ones are still arriving. A message that does not end inside the
    view it starts in (not how our peers send) ends the pipelining (``odd``): what is
    posted is waited for, and the rest is read one view at a time.

    The next byte lands at ``flat[i][off]``; views [0, fed) are whole and hashed;
    ``posted`` holds each receive in flight with the view it completes (or -1).
    """

    def __init__(self, rx: UcxPayloads, flat: Sequence[memoryview], digests: Sequence[Any]) -> None:
        self.rx, self.flat, self.digests = rx, flat, digests
        self.count = len(flat)
        self.i = self.off = self.fed = 0
        self.posted: deque[tuple[Any, int]] = deque()
        self.odd = False

    def run(self) -> None:
        rx, flat, count = self.rx, self.flat, self.count
        if count and not flat[0].nbytes:
            self._advance(0)
        self._buffered_first()
        rx._worker()  # a closed connection fails here (TransportError)
        if self.fed < count:
            try:
                rx._progress_until(self._step, rx._until())
            except BaseException as exc:
                rx.abandon(exc, "receive")
        if self.fed < count:  # pipelining ended: the rest one view at a time
            rx.read(flat[self.i][self.off :])
            self._feed(self.i)
            for j in range(self.i + 1, count):
                rx.read(flat[j])
                self._feed(j)

    def _advance(self, n: int) -> bool:
        """``n`` more bytes of flat[i] are placed; True when that ends the view."""
        self.off += n
        if self.off < self.flat[self.i].nbytes:
            return False
        self.i, self.off = self.i + 1, 0
        while self.i < self.count and not self.flat[self.i].nbytes:
            self.i += 1
        return True

    def _buffered_first(self) -> None:
        """Place the payload bytes already received, and hash the views they fill."""
        rx, flat = self.rx, self.flat
        while self.i < self.count and rx._r < len(rx._buf):
            i, off = self.i, self.off
            k = min(len(rx._buf) - rx._r, flat[i].nbytes - off)
            flat[i][off : off + k] = rx._buf[rx._r : rx._r + k]
            rx._r += k
            self._advance(k)
        if rx._r == len(rx._buf):
            rx._buf, rx._r = b"", 0
        for j in range(self.i):
            self._feed(j)
        self.fed = self.i

    def _step(self) -> bool:
        """Post a receive for every message announced, hash the views completed; True
        when every view is whole, or the pipelining ended and nothing is in flight."""
        rx, flat, posted = self.rx, self.flat, self.posted
        link, tag = rx.link, rx.tag
        while self.i < self.count and not self.odd:
            if rx._next is not None:
                msg, rx._next = rx._next, None
            else:
                msg = link.tag_probe(tag)
                if not msg.matched:
                    break
            n = int(msg.length)
            i, off = self.i, self.off
            if n > flat[i].nbytes - off:
                rx._next, self.odd = msg, True
                break
            req = link.tag_recv(flat[i][off : off + n], msg)
            posted.append((req, i if self._advance(n) else -1))
        while posted and posted[0][0].completed:
            req, ends = posted.popleft()
            req.check_error()
            while self.fed <= ends:
                self._feed(self.fed)
                self.fed += 1
        if self.fed < self.i and not posted:  # empty views skipped at the end
            for j in range(self.fed, self.i):
                self._feed(j)
            self.fed = self.i
        return self.fed >= self.count or (self.odd and not posted)

    def _feed(self, j: int) -> None:
        if self.digests[j] is not None:
            self.digests[j].update(self.flat[j])
