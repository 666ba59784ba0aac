"""Fuzzing the wire (issue 17): the data-socket frame parser, a real server's data
socket, and every request message of the gRPC control service.

What must hold, whatever a peer sends:

- the frame parser (FrameSocket, plus the metadata decoding the data server does) either
  parses or raises the store's own errors (TransportError and its ProtocolError,
  TimeoutError_) or EOFError at a clean frame boundary, never another type; it returns
  within the frame deadline however slowly the bytes come; and it never allocates what
  a frame claims beyond ``max_meta``;
- a real server answers fuzzed frames, before and after a valid HELLO, with ERROR frames
  (or the reply of a request that happened to be valid) and closes the connection,
  logs no unhandled exception, and keeps serving a well-behaved client;
- every gRPC method answers arbitrary request bytes and arbitrary messages with a
  status that names the fault (INVALID_ARGUMENT, UNAUTHENTICATED, NOT_FOUND, ...),
  never UNKNOWN or INTERNAL (an exception nobody handled), and keeps serving.

Hypothesis runs derandomized, with no example database, and a bounded number of examples
per test, so the file takes about 15 s on 2 cores and every run tries the same inputs.
The parser tests are hermetic (a socketpair); the tests against a server share one
``kvstore serve`` child for the module and are marked ``process``.
"""

from __future__ import annotations

import functools
import itertools
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvstore import StoreClient
from kvstore._proto import store_pb2 as pb
from kvstore.errors import TimeoutError_, TransportError
from kvstore.server.dataserver import HELLO_MAX_META
from kvstore.server.frame_codec import parse
from kvstore.wire.auth import bearer_metadata
from kvstore.wire.frames import HEADER, MAGIC, PROTOCOL, REPLY, FrameSocket, Op, ProtocolError
from tests.support.server_process import ADMIN, ALPHA, ServerProcess, base_flags

FUZZ = settings(
    derandomize=True,  # the same examples on every run: CI is reproducible
    database=None,  # no .hypothesis/ example database beside the tests
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# The metadata message of each request op (what the data socket's frame handlers parse).
OP_MESSAGES: dict[int, type[Message]] = {
    Op.HELLO: pb.Hello,
    Op.GET: pb.GetRequest,
    Op.LEASE: pb.GetRequest,
    Op.RELEASE: pb.LeaseRequest,
    Op.PUT: pb.PutRequest,
    Op.RESERVE: pb.PutRequest,
    Op.COMMIT: pb.CommitRequest,
    Op.ABORT: pb.LeaseRequest,
    Op.EXISTS: pb.KeysRequest,
    Op.MATCH: pb.KeysRequest,
    Op.TOUCH: pb.TouchRequest,
}
SERVICE = pb.DESCRIPTOR.services_by_name["Store"]
METHODS = [m.name for m in SERVICE.methods]
BAD_STATUSES = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


# -- strategies --------------------------------------------------------------------------

_U32, _U64, _I64 = 2**32 - 1, 2**64 - 1, 2**63
_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_UINT32: st.sampled_from([0, 1, _U32]) | st.integers(0, _U32),
    FieldDescriptor.TYPE_UINT64: st.sampled_from([0, 1, _U64]) | st.integers(0, _U64),
    FieldDescriptor.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: st.sampled_from([-1, -_I64]) | st.integers(-_I64, _I64 - 1),
    FieldDescriptor.TYPE_DOUBLE: st.floats(allow_nan=True, allow_infinity=True),
    FieldDescriptor.TYPE_FLOAT: st.floats(allow_nan=True, allow_infinity=True, width=32),
    # names, tiers, dtypes: short text, a known word, or a very long one
    FieldDescriptor.TYPE_STRING: st.text(max_size=24)
    | st.sampled_from(["dram", "ssd", "hbm", "uint8", "float32", "bfloat16", ALPHA.tenant])
    | st.integers(256, 20_000).map(lambda n: "m" * n),
    # keys: mostly 16 bytes (a block key), or any length
    FieldDescriptor.TYPE_BYTES: st.binary(min_size=16, max_size=16) | st.binary(max_size=40),
    FieldDescriptor.TYPE_ENUM: st.integers(-3, 5),
}


@functools.cache
def messages(desc: Descriptor) -> st.SearchStrategy[Message]:
    """Any message of type ``desc``, every field free: scalars at their edges, nested
    messages built the same way, repeated fields of up to 4 values."""
    cls = message_factory.GetMessageClass(desc)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for f in desc.fields:
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            value = messages(f.message_type)  # store.proto has no recursive message
        else:
            value = _SCALARS[f.type]
        fields[f.name] = st.lists(value, max_size=4) if f.is_repeated else value
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: cls(**kw))


def _hello_meta(token: str) -> bytes:
    return pb.Hello(token=token, protocol=PROTOCOL).SerializeToString()


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    """One frame, well formed or nearly: a known or any op, the op's own metadata
    message with free fields (or a valid HELLO, or random bytes), a declared metadata
    length that is true, at a limit, or anything, and a body length and body that may
    not agree; the bytes sent may stop short of what the header declares."""
    op = draw(st.sampled_from([int(o) for o in Op]) | st.integers(0, 255))
    cls = OP_MESSAGES.get(op & ~REPLY)
    meta_options = [st.binary(max_size=64)]
    if cls is not None:
        meta_options.insert(0, messages(cls.DESCRIPTOR).map(lambda m: m.SerializeToString()))
    if op == Op.HELLO:
        meta_options.insert(0, st.sampled_from([_hello_meta(ALPHA.token), _hello_meta("x" * 20)]))
    meta = draw(st.one_of(meta_options))
    meta_len = draw(
        st.just(len(meta))
        | st.sampled_from([0, HELLO_MAX_META, HELLO_MAX_META + 1, 16 << 20, _U32])
        | st.integers(0, _U32)
    )
    body_len = draw(st.just(0) | st.integers(0, 64) | st.sampled_from([1 << 20, _U64]))
    body = draw(st.binary(max_size=min(body_len, 64)))
    head = HEADER.pack(MAGIC, op, draw(st.integers(0, 255)), meta_len, body_len)
    data = head + meta[:meta_len] + body
    cut = draw(st.none() | st.integers(0, len(data)))  # stop short, mid-frame
    return data if cut is None else data[:cut]


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    """A well-formed request frame with free field values: a request op, its own
    metadata message, true lengths; a PUT carries the body its items add up to (when
    that is small), so the handlers behind the framing run."""
    op = draw(st.sampled_from([op for op in OP_MESSAGES if op != Op.HELLO]))
    msg = draw(messages(OP_MESSAGES[op].DESCRIPTOR))
    body = b""
    if op == Op.PUT:
        size = sum(it.meta.nbytes for it in msg.items)
        body = bytes(size) if size <= 1 << 16 else b""
    meta = msg.SerializeToString()
    return HEADER.pack(MAGIC, op, 0, len(meta), len(body)) + meta + body


streams = st.one_of(
    st.lists(frames(), min_size=1, max_size=3).map(b"".join),
    st.lists(requests() | frames(), min_size=1, max_size=4).map(b"".join),
    st.binary(min_size=1, max_size=256),  # no framing at all
    st.tuples(frames(), st.binary(max_size=32)).map(b"".join),  # a frame, then garbage
    st.tuples(st.binary(min_size=1, max_size=20), frames()).map(b"".join),  # garbage first
)


# -- the frame parser, over a socketpair (no server) -------------------------------------

FRAME_S = 0.2  # the parser's frame deadline in these tests
RECV_S = 0.25  # its per-receive timeout (set_timeout rounds up to a quarter second)
_SLACK_ALLOC = 1 << 20  # the 64 KiB read buffer, frame objects, one-time caches (first calls)
PARSED_ERRORS = (EOFError, TransportError, TimeoutError_)  # ProtocolError is a TransportError


def _read_frames(fs: FrameSocket, *, idle: bool) -> BaseException | None:
    """Read frames as the data server does until the parser raises; returns what it
    raised, which must be one of PARSED_ERRORS (anything else propagates), or None at a
    frame whose body is too large to read here (the server receives such a PUT body
    into its reservations, or refuses it, without this parser)."""
    try:
        while True:
            op, meta_len, body_len = fs.recv_header(idle=idle)
            meta = fs.recv_bytes(meta_len)
            cls = OP_MESSAGES.get(op)
            if cls is not None:
                parse(cls, meta)  # ProtocolError when undecodable
            if body_len > 4096:
                return None
            fs.discard(body_len)
    except PARSED_ERRORS as exc:
        return exc


def _frame_socket(sock: socket.socket, max_meta: int) -> FrameSocket:
    fs = FrameSocket(sock, max_meta=max_meta)
    fs.frame_timeout = FRAME_S
    fs.set_timeout(RECV_S)
    return fs


@settings(FUZZ, max_examples=400)
@given(data=streams, max_meta=st.sampled_from([HELLO_MAX_META, 1 << 20]))
def test_frame_parser_raises_only_store_errors_and_allocates_within_max_meta(
    data: bytes, max_meta: int
) -> None:
    """All of ``data`` sent, then the peer's side closed: the parser reads frames (as a
    server waiting for its next request: EOF between frames is a clean end)."""
    a, b = socket.socketpair()
    tracemalloc.start()
    try:
        fs = _frame_socket(b, max_meta)
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        t0 = time.monotonic()
        outcome = _read_frames(fs, idle=True)
        took = time.monotonic() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        a.close()
        b.close()
    assert outcome is None or isinstance(outcome, PARSED_ERRORS)
    assert took < 1.0, f"the parser took {took:.2f} s over {len(data)} bytes it had"
    # A claimed length is allocated only within max_meta; recv_bytes of a metadata over
    # the read buffer holds it twice for a moment (bytearray, then bytes).
    assert peak < 2 * max_meta + _SLACK_ALLOC, f"{peak} bytes allocated (max_meta {max_meta})"


@st.composite
def slow_frames(draw: st.DrawFn) -> bytes:
    """A frame whose header is valid and whose metadata (400 bytes up to the HELLO cap)
    takes at least 2 s to dribble in at a byte every 5 ms, or any fuzzed frame."""
    meta_len = draw(st.integers(400, HELLO_MAX_META))
    head = HEADER.pack(MAGIC, draw(st.integers(0, 255)), 0, meta_len, draw(st.integers(0, 64)))
    return head + (draw(st.binary(min_size=1, max_size=64)) * meta_len)[:meta_len]


@settings(FUZZ, max_examples=12)
@given(data=slow_frames() | frames().filter(lambda d: len(d) >= 40))
def test_frame_parser_cuts_off_a_dribbled_frame_at_its_deadline(data: bytes) -> None:
    """A byte every 5 ms never trips the per-receive timeout; the frame deadline ends
    it (or the parser refuses the frame, or it completes and the next one's first
    receive times out: the peer then holds the connection, silent)."""
    a, b = socket.socketpair()
    done = threading.Event()

    def dribble() -> None:
        for i in range(len(data)):
            if done.is_set():
                return
            try:
                a.sendall(data[i : i + 1])
            except OSError:
                return
            time.sleep(0.005)
        done.wait(5)  # then silent, the connection held open

    writer = threading.Thread(target=dribble, daemon=True)
    fs = _frame_socket(b, HELLO_MAX_META)
    writer.start()
    t0 = time.monotonic()
    try:
        outcome = _read_frames(fs, idle=False)
        took = time.monotonic() - t0
    finally:
        done.set()
        writer.join(5)
        a.close()
        b.close()
    assert outcome is None or isinstance(outcome, (TimeoutError_, TransportError)), outcome
    assert took < FRAME_S + RECV_S + 0.6, f"held {took:.2f} s ({len(data)} bytes dribbled)"
    magic, _, _, meta_len, _ = HEADER.unpack_from(data)
    if magic == MAGIC and 400 <= meta_len <= HELLO_MAX_META and len(data) >= HEADER.size + 400:
        # its metadata alone takes >= 2 s to come: the frame deadline is what ended it
        assert isinstance(outcome, TimeoutError_), outcome
        assert "to send one frame" in str(outcome), outcome


# -- a real server -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("fuzz-server")
    server = ServerProcess(workdir, {**base_flags(workdir), "io_timeout_s": 2}).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(fuzz_server: ServerProcess) -> Iterator[StoreClient]:
    """The well-behaved client: TCP data socket, one connection kept across examples."""
    with fuzz_server.client(ALPHA, transport="tcp") as c:
        yield c


_keys = itertools.count()


def _log_mark(server: ServerProcess) -> int:
    return server.log.stat().st_size


def _still_serves(server: ServerProcess, client: StoreClient, mark: int) -> None:
    """The server is alive, logged no unhandled exception since ``mark`` (its log's
    size before the example), and a put then a get of correct bytes works (the kept
    client, over a data socket open all along)."""
    assert server.proc is not None and server.proc.poll() is None, "the server died"
    with server.log.open("rb") as f:
        f.seek(mark)
        log = f.read().decode(errors="replace")
    assert "Traceback" not in log, log[max(log.index("Traceback") - 300, 0) :][:3000]
    key = next(_keys).to_bytes(8, "little") * 2
    value = np.frombuffer(key * 4, dtype=np.uint8)
    assert client.put(key, value)
    assert np.array_equal(client.get(key), value)


def _hello(fs: FrameSocket) -> None:
    fs.send(Op.HELLO, _hello_meta(ALPHA.token))
    op, meta_len, _ = fs.recv_header()
    assert op == Op.INFO, op
    fs.recv_bytes(meta_len)


def _exchange(server: ServerProcess, data: bytes, *, hello: bool) -> list[int]:
    """Send ``data`` on a fresh data socket (after a valid HELLO or not), close our
    sending side, and read every frame the server sends until it closes; their ops."""
    s = socket.create_connection(("127.0.0.1", server.data_port), timeout=10)
    fs = FrameSocket(s, max_meta=32 << 20)
    fs.set_timeout(10)  # a hang is a TimeoutError_, which fails the test
    ops: list[int] = []
    try:
        if hello:
            _hello(fs)
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # the server refused and closed before we were done
            pass
        while True:
            try:
                op, meta_len, body_len = fs.recv_header()
            except EOFError:
                break
            except ProtocolError:  # the server itself sent something malformed
                raise
            except TransportError:  # reset: it closed with our bytes unread
                break
            meta = fs.recv_bytes(meta_len)
            if op == Op.ERROR:
                assert pb.Status.FromString(meta).code, "an ERROR frame without a code"
            fs.discard(body_len)
            ops.append(op)
    finally:
        fs.close()
    return ops


_REPLIES = {Op.ERROR, Op.INFO} | {op | REPLY for op in OP_MESSAGES if op != Op.HELLO}


@pytest.mark.process
@settings(FUZZ, max_examples=400)
@given(
    data=streams | st.lists(requests(), min_size=1, max_size=4).map(b"".join), hello=st.booleans()
)
def test_fuzzed_frames_get_an_error_or_a_close_and_the_server_keeps_serving(
    fuzz_server: ServerProcess, client: StoreClient, data: bytes, hello: bool
) -> None:
    mark = _log_mark(fuzz_server)
    ops = _exchange(fuzz_server, data, hello=hello)
    event("server sent " + (",".join(sorted({Op(op & ~REPLY).name for op in ops})) or "nothing"))
    assert set(ops) <= _REPLIES, ops
    if not hello:  # nothing but ERROR before a HELLO with a valid token got INFO
        before = ops[: ops.index(Op.INFO)] if Op.INFO in ops else ops
        assert set(before) <= {Op.ERROR}, ops
    _still_serves(fuzz_server, client, mark)


# -- every gRPC method -------------------------------------------------------------------

_TOKENS = st.sampled_from([ALPHA.token, ADMIN.token, None, "not-a-token-0123456789"])


@pytest.fixture(scope="module")
def channel(fuzz_server: ServerProcess) -> Iterator[grpc.Channel]:
    ch = grpc.insecure_channel(fuzz_server.address)
    try:
        yield ch
    finally:
        ch.close()


def _call(channel: grpc.Channel, method: str, request: bytes, token: str | None) -> None:
    """One raw call; it must succeed or fail with a status that names the fault."""
    call = channel.unary_unary(
        f"/{SERVICE.full_name}/{method}", request_serializer=None, response_deserializer=None
    )
    metadata = bearer_metadata(token) if token is not None else ()
    try:
        call(request, metadata=metadata, timeout=10)
    except grpc.RpcError as exc:
        event(f"{method}: {exc.code().name}")
        assert exc.code() not in BAD_STATUSES, f"{method}: {exc.code()} {exc.details()}"
        assert exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED, f"{method} hung"
    else:
        event(f"{method}: OK")


def _after_call(
    channel: grpc.Channel, server: ServerProcess, client: StoreClient, method: str, mark: int
) -> None:
    if method == "Drain":  # a fuzzed admin Drain may have left the node refusing writes
        reset = channel.unary_unary(
            f"/{SERVICE.full_name}/Drain",
            request_serializer=pb.DrainRequest.SerializeToString,
            response_deserializer=pb.DrainResponse.FromString,
        )
        reset(pb.DrainRequest(draining=False), metadata=bearer_metadata(ADMIN.token), timeout=10)
    health = channel.unary_unary(
        f"/{SERVICE.full_name}/Health",
        request_serializer=pb.HealthRequest.SerializeToString,
        response_deserializer=pb.HealthResponse.FromString,
    )
    reply = health(pb.HealthRequest(), metadata=bearer_metadata(ALPHA.token), timeout=10)
    assert reply.status == pb.HealthResponse.SERVING
    _still_serves(server, client, mark)


@pytest.mark.process
@settings(FUZZ, max_examples=300)
@given(method=st.sampled_from(METHODS), request=st.binary(max_size=128), token=_TOKENS)
def test_every_rpc_answers_arbitrary_bytes_with_a_proper_status(
    fuzz_server: ServerProcess,
    client: StoreClient,
    channel: grpc.Channel,
    method: str,
    request: bytes,
    token: str | None,
) -> None:
    mark = _log_mark(fuzz_server)
    _call(channel, method, request, token)
    _after_call(channel, fuzz_server, client, method, mark)


@st.composite
def rpc_requests(draw: st.DrawFn) -> tuple[str, bytes]:
    method = SERVICE.methods_by_name[draw(st.sampled_from(METHODS))]
    return method.name, draw(messages(method.input_type)).SerializeToString()


@pytest.mark.process
@settings(FUZZ, max_examples=500)
@given(call=rpc_requests(), token=st.sampled_from([ALPHA.token, ADMIN.token]))
def test_every_rpc_answers_arbitrary_messages_with_a_proper_status(
    fuzz_server: ServerProcess,
    client: StoreClient,
    channel: grpc.Channel,
    call: tuple[str, bytes],
    token: str,
) -> None:
    method, request = call
    mark = _log_mark(fuzz_server)
    _call(channel, method, request, token)
    _after_call(channel, fuzz_server, client, method, mark)


def test_every_request_op_is_fuzzed_with_its_own_message() -> None:
    """A new op with metadata must join OP_MESSAGES (and so the fuzzed frames)."""
    answers = {Op.INFO, Op.ERROR}
    assert {op for op in Op if op not in answers} == set(OP_MESSAGES)
