"""The client end of one data socket: connected, authenticated, and aware of the server.

Opening a connection does the TLS handshake (when configured), sends HELLO with the
bearer token (and this process's host id and pid, so that a server in this very process
knows not to poll: kvstore/wire/polling.py) and keeps the server's INFO reply: its host
id, shared-memory segment and instance id decide which transport this connection uses
(see pool.py), its host id and pid whether it polls for replies. Requests and
replies alternate; a request-level failure comes back as an ERROR frame holding the
stable error code and is raised as that exact class, with the connection still usable.

Asked for UCX (``ucx=True``), HELLO also carries this connection's UCX worker address;
when INFO answers with the server's, large payloads move to UCX (kvstore/wire/ucx.py)
and everything above them stays the same.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from google.protobuf.message import DecodeError, Message

from kvstore._proto import store_pb2 as pb
from kvstore.client.transport.credits import CreditPool
from kvstore.errors import KVStoreError, TransportError, error_for_code
from kvstore.wire.crowding import CROWDING
from kvstore.wire.frames import (
    PROTOCOL,
    REPLY,
    FrameSocket,
    Op,
    ProtocolError,
    frame,
    socket_errors,
)
from kvstore.wire.locality import host_id
from kvstore.wire.polling import same_process
from kvstore.wire.ucx import WIRE as UCX_WIRE
from kvstore.wire.ucx import UcxFrames, UcxWorker

__all__ = ["DataConn"]

M = TypeVar("M", bound=Message)


class DataConn:
    """One authenticated data socket. Not thread-safe: the pool lends it to one caller."""

    def __init__(self, fs: FrameSocket | UcxFrames, info: pb.InfoResponse) -> None:
        self.fs = fs
        self.info = info
        self.pending: list[int] = []  # read leases to hand back (see defer_release)
        self.touched: list[bytes] = []  # reads served from the published index
        self.touched_bytes = 0
        self.touched_calls: list[float] = []  # seconds of each call served wholly so
        self.touched_since = 0.0  # time.monotonic() of the oldest unreported read
        self.idle_since = 0.0  # time.monotonic() when last returned to the pool
        self.reply_poll_s = 0.0  # poll this long for a reply before sleeping (see call)
        self.reply_slot: threading.Lock | None = None  # held by the one thread polling
        self.crowded: Callable[[], bool] = CROWDING.crowded
        self.credits = CreditPool()  # same-host write credits (credits.py)

    @property
    def server_in_process(self) -> bool:
        """Whether INFO shows the server running in this very process."""
        return same_process(self.info.host_id, self.info.pid)

    def poll_replies(
        self, window_s: float, slot: threading.Lock, crowded: Callable[[], bool] | None = None
    ) -> None:
        """Poll up to ``window_s`` for each reply before sleeping, while holding ``slot``
        (one lock per client pool: one of its threads polls at a time) and while
        ``crowded()`` says no (kvstore/wire/crowding.py). Never for a server in this
        process: the poller would hold the GIL it needs to answer."""
        self.reply_poll_s = 0.0 if self.server_in_process else window_s
        self.reply_slot = slot
        self.crowded = crowded or CROWDING.crowded

    @classmethod
    def open(
        cls,
        target: tuple[str, int] | str,
        token: str,
        *,
        deadline: float,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
        max_meta: int = 64 << 20,
        ucx: bool = False,
    ) -> DataConn:
        """Connect to ``(host, port)`` or an abstract Unix socket name, handshake and
        authenticate; raises AuthError for a refused token. TLS applies to TCP only.
        With ``ucx`` the connection asks to move to UCX; :attr:`on_ucx` says whether it
        did (a server that declines leaves it on the socket)."""
        sock = _socket_to(target, deadline, tls, server_name)
        fs = FrameSocket(sock, max_meta=max_meta)
        link: UcxWorker | None = None
        try:
            fs.set_deadline(deadline)
            hello = pb.Hello(token=token, protocol=PROTOCOL, pid=os.getpid(), host_id=host_id())
            if ucx:
                link = UcxWorker()
                hello.ucx_address, hello.ucx_wire = link.address, UCX_WIRE
            fs.send(Op.HELLO, hello.SerializeToString())
            info = cls._reply(fs, Op.INFO, pb.InfoResponse)[0]
            if link is not None and info.ucx_address:
                if info.ucx_wire != UCX_WIRE:  # it has moved: nothing else is understood
                    raise TransportError(
                        f"the server speaks UCX framing {info.ucx_wire}, this client "
                        f"{UCX_WIRE}: upgrade the older of the two"
                    )
                link.connect(info.ucx_address)
                moved = UcxFrames(link, info.ucx_tag, fs)
                return cls(moved, info)
        except BaseException:
            if link is not None:
                link.close()
            fs.close()
            raise
        if link is not None:
            link.close()
        return cls(fs, info)

    @property
    def on_ucx(self) -> bool:
        """Whether this connection's frames travel over UCX."""
        return isinstance(self.fs, UcxFrames)

    @property
    def usable(self) -> bool:
        """False once a send or receive failed (the stream is out of step) or it closed."""
        return not (self.fs.broken or self.fs.closed)

    def call(
        self,
        op: Op,
        msg: Message,
        reply: type[M],
        deadline: float,
        body: Sequence[Any] = (),
        body_len: int = 0,
    ) -> tuple[M, int]:
        """Send one request and read its reply's metadata; returns (reply, body_len).

        The caller then consumes exactly ``body_len`` payload bytes.
        """
        fs = self.fs
        fs.set_deadline(deadline)
        before = self._owed_frames()
        fs.send(op, msg.SerializeToString(), body, body_len, before=before)
        self._poll_reply()
        return self._reply(fs, op | REPLY, reply)

    def _poll_reply(self) -> None:
        """A sleeping receiver is woken per reply at the price of an interprocessor
        interrupt and a halted CPU's exit; a short poll catches a DRAM hit's reply with
        neither (ClientConfig.reply_poll_us). One thread of the pool polls at a time
        (poll_replies), and none while the host is crowded."""
        slot = self.reply_slot
        if (
            self.reply_poll_s
            and slot is not None
            and not self.fs.buffered
            and not self.crowded()
            and slot.acquire(blocking=False)
        ):
            try:
                end = time.perf_counter() + self.reply_poll_s
                self.fs.poll_next(lambda: time.perf_counter() < end)
            finally:
                slot.release()

    def send_only(
        self,
        op: Op,
        msg: Message,
        deadline: float,
        body: Sequence[Any] = (),
        body_len: int = 0,
        *,
        wait: bool = True,
    ) -> None:
        """Send a request whose reply is read later with :meth:`read_reply`: a pipelined
        writer sends the next request while the server works on this one. Replies
        come back in request order. ``body`` may be the first parts of ``body_len``
        bytes, the rest following with :meth:`send_more`. With ``wait`` False the
        parts may still be read after this returns (over UCX): :meth:`read_reply`
        waits for them first."""
        fs = self.fs
        fs.set_deadline(deadline)
        before = self._owed_frames()
        fs.send(op, msg.SerializeToString(), body, body_len, before=before, wait=wait)

    def send_more(self, parts: Sequence[Any], *, wait: bool = True) -> None:
        """More body bytes of the request :meth:`send_only` started (``wait``: as
        there)."""
        self.fs.send_more(parts, wait=wait)

    def read_reply(self, op: Op, reply: type[M], deadline: float) -> M:
        """The reply to the oldest request sent with :meth:`send_only` and not yet read
        (an ERROR reply raises its error; the stream stays in step)."""
        self.fs.set_deadline(deadline)
        self.fs.flush()
        self._poll_reply()
        return self._reply(self.fs, op | REPLY, reply)[0]

    def defer_release(self, lease_ids: Sequence[int]) -> None:
        """Hand read leases back with this connection's next request.

        A separate RELEASE costs a system call and a server wake-up per read (~15% of a
        1 MiB same-host get); riding along with the next request costs neither. The
        pool flushes leases of a connection left idle (ConnPool.RELEASE_DELAY_S).
        """
        self.pending.extend(lease_ids)

    TOUCH_BATCH = 64  # reads reported in one TOUCH frame at most
    TOUCH_DELAY_S = 0.005  # and none waits longer than this while the connection is used

    def defer_touch(self, keys: Sequence[bytes], nbytes: int, seconds: float | None) -> None:
        """Report reads served from the published index (kvstore/client/transport/shm_direct.py)
        with the next request, or on their own once a batch is full or old enough:
        the server's counters and eviction order lag by at most a few milliseconds."""
        if not self.touched:
            self.touched_since = time.monotonic()
        self.touched.extend(keys)
        self.touched_bytes += nbytes
        if seconds is not None:
            self.touched_calls.append(seconds)
        if (
            len(self.touched) >= self.TOUCH_BATCH
            or time.monotonic() - self.touched_since >= self.TOUCH_DELAY_S
        ):
            # The reads themselves are done and correct: a socket that fails here only
            # loses their report (the stream is marked broken and the pool drops it).
            with contextlib.suppress(KVStoreError):
                self.flush_releases()

    @property
    def owes(self) -> bool:
        """Whether releases or touches still have to reach the server."""
        return bool(self.pending or self.touched)

    def flush_releases(self) -> None:
        """Send deferred releases and touches now, on their own (neither has a reply)."""
        before = self._owed_frames()
        if before:
            self.fs.set_timeout(5.0)
            self.fs.send_raw(before)

    def _owed_frames(self) -> bytes:
        out = b""
        if self.touched:
            keys, self.touched = self.touched, []
            step = self.TOUCH_BATCH  # never more keys in a frame than any server allows
            for i in range(0, len(keys), step):
                req = pb.TouchRequest(keys=keys[i : i + step])
                if not i:  # totals ride on the first frame
                    req.payload_bytes = self.touched_bytes
                    req.call_seconds.extend(self.touched_calls)
                out += frame(Op.TOUCH, req.SerializeToString())
            self.touched_bytes, self.touched_calls = 0, []
        if self.pending:
            ids, self.pending = self.pending, []
            out += frame(Op.RELEASE, pb.LeaseRequest(lease_ids=ids).SerializeToString())
        return out

    @staticmethod
    def _reply(fs: FrameSocket | UcxFrames, want: int, reply: type[M]) -> tuple[M, int]:
        try:
            op, meta_len, body_len = fs.recv_header()
        except EOFError:
            fs.broken = True
            raise TransportError("data socket: server closed the connection") from None
        meta = fs.recv_bytes(meta_len)
        if op == Op.ERROR:
            status = _decode(fs, pb.Status, meta)
            if body_len:
                fs.discard(body_len)
            raise error_for_code(status.code, status.message)
        if op != want:
            fs.broken = True
            raise ProtocolError(f"data socket: expected reply op {want}, got {op}")
        return _decode(fs, reply, meta), body_len

    def recv_into(self, view: Any, *, spin: bool = False, digest: Any = None) -> None:
        """Receive payload bytes straight into ``view`` (FrameSocket.recv_into: ``spin``
        polls while a reply streams in, ``digest`` hashes the bytes as they arrive)."""
        self.fs.recv_into(memoryview(view), spin=spin, digest=digest)

    def recv_many(self, views: Sequence[Any], digests: Sequence[Any]) -> None:
        """Receive a reply's payloads straight into ``views``, each hashed into its
        digest as it arrives; over UCX every payload's receive is posted as soon as it
        is announced (UcxFrames.recv_many)."""
        self.fs.recv_many([memoryview(v) for v in views], digests, spin=True)

    def discard(self, n: int) -> None:
        """Skip payload bytes the caller cannot use."""
        self.fs.discard(n)

    def close(self) -> None:
        """Close the socket; the server ends this connection's leases."""
        self.fs.close()


def _socket_to(
    target: tuple[str, int] | str,
    deadline: float,
    tls: ssl.SSLContext | None,
    server_name: str | None,
) -> socket.socket:
    """A connected socket to ``(host, port)`` (through TLS when given) or to an abstract
    Unix socket name; the socket is closed again if any step fails."""
    left = max(deadline - time.monotonic(), 0.001)
    where = target if isinstance(target, str) else f"{target[0]}:{target[1]}"
    with socket_errors(f"data socket {where}"):
        if isinstance(target, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(left)
                sock.connect("\0" + target)
            except BaseException:
                sock.close()
                raise
            return sock
        sock = socket.create_connection(target, timeout=left)
        try:
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=server_name or target[0])
        except BaseException:
            sock.close()
            raise
        return sock


def _decode(fs: FrameSocket | UcxFrames, cls: type[M], meta: bytes) -> M:
    msg = cls()
    try:
        msg.ParseFromString(meta)
    except DecodeError as exc:
        fs.broken = True
        raise ProtocolError(f"data socket: undecodable {cls.__name__}: {exc}") from None
    return msg
