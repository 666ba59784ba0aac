"""The UCX data plane (kvstore/wire/ucx.py) against real ``kvstore serve --transport ucx``
processes: UCX limited to tcp and to shared memory, and across two network namespaces
joined by a veth pair; then faults: a peer killed mid-transfer, a stalled peer, garbage,
and connections that come and go without leaking endpoints.

Skipped, with the reason, where ucxx is not installed. UCX talks over loopback only
(tests/conftest.py sets UCX_NET_DEVICES=lo), except between namespace hosts, where the
server and the client name their veth device.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore._proto import store_pb2 as pb
from kvstore.client.transport.conn import DataConn
from kvstore.config import ServerConfig
from kvstore.errors import ConfigError, KVStoreError, TimeoutError_, Unavailable
from kvstore.wire.frames import HEADER, MAGIC, PROTOCOL, REPLY, Op
from kvstore.wire.ucx import UcxFrames
from kvstore.wire.ucx import available as ucx_available
from tests.support.server_fixtures import ServerFactory
from tests.support.server_process import ALPHA, ServerProcess
from tests.support.waiting import wait_until

pytestmark = pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed")

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


def _key(name: str) -> bytes:
    return name.encode().ljust(16, b".")[:16]


def _run_client(
    address: str,
    env: dict[str, str],
    argv_prefix: list[str] | None = None,
    transport: str = "ucx",
) -> Any:
    """tests/support/ucx_client.py in its own process (UCX settings are per process)."""
    argv = [*(argv_prefix or []), sys.executable, "-m", "tests.support.ucx_client", address]
    argv.append(transport)
    out = subprocess.run(
        argv, capture_output=True, text=True, cwd=ROOT, env={**os.environ, **env}, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tls", ["tcp", ""])
def test_blocks_round_trip_over_ucx(server_factory: ServerFactory, tls: str) -> None:
    """UCX limited to tcp, and left to choose: every byte comes back, and the server
    counts the payloads on path ucx."""
    env = {"UCX_TLS": tls} if tls else {}
    server = server_factory(env=env, transport="ucx")
    facts = _run_client(server.address, env)
    assert facts["failed"] == []
    assert facts["transport"] == "ucx"
    assert facts["bytes_in_ucx"] >= 13 * MiB and facts["bytes_out_ucx"] >= 18 * MiB


@pytest.mark.parametrize("tls", ["sm", "posix,sysv,cma"])
def test_shared_memory_alone_is_declined_with_a_clear_error(
    server_factory: ServerFactory, tls: str
) -> None:
    """No shared-memory transport offers UCX peer-failure handling, which kvstore
    requires (kvstore/wire/ucx.py): a server limited to them declines UCX, a client
    that insists is told why, and one on auto keeps working over the socket."""
    server = server_factory(env={"UCX_TLS": tls}, transport="ucx")
    with (
        server.client(ALPHA, transport="ucx", retries=0) as c,
        pytest.raises(Unavailable, match="declined UCX"),
    ):
        c.exists([_key("sm-only")])
    with server.client(ALPHA, transport="tcp") as c:
        assert c.put(_key("sm-only"), b"over the socket")
        assert c.get(_key("sm-only")) == b"over the socket"


def test_auto_stays_on_shared_memory_on_the_same_host(server_factory: ServerFactory) -> None:
    server = server_factory(transport="ucx")
    with server.client(ALPHA) as c:
        assert c.server_info["ucx"] is True
        c.put(_key("auto-same-host"), np.ones(1024, np.uint8))
        assert c.transport == "shm"  # one copy through the segment beats any carrier


def test_ucx_asked_of_a_server_without_it_is_a_clear_error(store_server: ServerProcess) -> None:
    with (
        store_server.client(ALPHA, transport="ucx", retries=0) as c,
        pytest.raises(Unavailable, match="offers no UCX"),
    ):
        c.exists([_key("no-ucx")])


def test_a_client_of_another_ucx_framing_stays_on_its_socket(
    store_server_ucx: ServerProcess,
) -> None:
    """A HELLO with a UCX address but another framing version (an older client): the
    server does not move the connection, INFO says so, and the socket keeps working."""
    import socket as socket_

    from kvstore.wire.frames import FrameSocket
    from kvstore.wire.ucx import UcxWorker

    link = UcxWorker()
    sock = socket_.create_connection(("127.0.0.1", store_server_ucx.data_port), timeout=10)
    fs = FrameSocket(sock, max_meta=1 << 20)
    try:
        fs.set_timeout(10)
        hello = pb.Hello(token=ALPHA.token, protocol=PROTOCOL, ucx_address=link.address)
        hello.ucx_wire = 1
        fs.send(Op.HELLO, hello.SerializeToString())
        op, meta_len, _ = fs.recv_header()
        info = pb.InfoResponse.FromString(fs.recv_bytes(meta_len))
        assert op == Op.INFO and info.ucx and not info.ucx_address
        fs.send(Op.EXISTS, pb.KeysRequest(keys=[_key("x")]).SerializeToString())
        op, meta_len, _ = fs.recv_header()
        assert op == Op.EXISTS | REPLY
        assert list(pb.ExistsResponse.FromString(fs.recv_bytes(meta_len)).present) == [False]
    finally:
        fs.close()
        link.close()


def test_a_request_larger_than_the_control_buffer(store_server_ucx: ServerProcess) -> None:
    """Requests and replies whose control message outgrows the control buffer (its
    tail goes under the overflow tag): 1,024 small values put and read back at once,
    their metadata and bodies in one control message each way."""
    keys = [_key(f"many-{i}") for i in range(1024)]
    values = [f"value {i}".encode().ljust(60, b"-") for i in range(1024)]
    with store_server_ucx.client(ALPHA, transport="ucx") as c:
        assert c.batch_put(keys, values) == [True] * 1024
        assert c.batch_get(keys) == values
        assert c.exists([*keys[:3], _key("not-there")]) == [True, True, True, False]


def test_ucx_with_tls_is_refused_at_configuration() -> None:
    with pytest.raises(ConfigError, match="in the clear"):
        ServerConfig(transport="ucx", tls_cert=__file__, tls_key=__file__, auth_token="t" * 16)
    with pytest.raises(ConfigError, match="tcp or ucx"):
        ServerConfig(transport="rdma", auth_token="t" * 16)


def test_a_server_killed_mid_transfer_is_an_error_at_once(server_factory: ServerFactory) -> None:
    """SIGKILL while a client streams 4 MiB gets: the call in flight fails within a
    second or two (the connection's socket closes with the process), not at its 20 s
    deadline, and no get ever returned other bytes."""
    server = server_factory(transport="ucx")
    value = np.random.default_rng(5).integers(0, 255, 4 * MiB, dtype=np.uint8)
    errors: list[tuple[float, KVStoreError]] = []
    wrong = []
    started = threading.Event()
    with server.client(ALPHA, transport="ucx", timeout_s=20, retries=0) as c:
        assert c.put(_key("killed-mid"), value)

        def reader() -> None:
            out = np.empty_like(value)
            while True:
                out[:] = 0
                try:
                    ok = c.get_into(_key("killed-mid"), out)
                except KVStoreError as exc:
                    errors.append((time.monotonic(), exc))
                    return
                if ok is not True or not np.array_equal(out, value):
                    wrong.append(ok)
                started.set()

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        assert started.wait(10)
        killed = time.monotonic()
        server.stop(signal.SIGKILL)
        t.join(15)
    assert wrong == []
    assert errors, "the reader never saw the server go"
    assert errors[0][0] - killed < 5.0, errors


def test_a_client_killed_mid_put_leaves_nothing_behind(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    """A client process SIGKILLed while it writes 4 MiB blocks: the server aborts the
    reservation it was filling (DRAM back to what the committed blocks use), drops the
    connection, and serves the next client."""
    server = server_factory(transport="ucx")
    script = (
        "import sys, numpy as np\n"
        "from kvstore import StoreClient\n"
        f"c = StoreClient.connect({server.address!r}, token={ALPHA.token!r}, transport='ucx')\n"
        "v = np.ones(4 << 20, np.uint8)\n"
        "i = 0\n"
        "while i < 100000:\n"
        "    c.put(('k%015d' % i).encode(), v); i += 1\n"
        "    if i == 1: print('ready', flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)  # one put committed (said "ready"), the next ones under way
    finally:
        proc.kill()
        proc.wait(10)
    with server.client(ALPHA) as c:
        c.exists([_key("watcher")])  # this client's own data connection: the one left
        wait_until(lambda: c.stats()["server"]["connections"] == 1, "the dead client's conn gone")
        stats = c.stats()
        blocks = stats["tiers"]["dram"]["blocks"] + stats["tiers"].get("ssd", {}).get("blocks", 0)
        assert blocks >= 1
        # what DRAM holds is whole committed blocks, nothing half-written
        dram = stats["tiers"]["dram"]
        assert dram["used"] <= dram["blocks"] * (4 * MiB + 4096)
    with server.client(ALPHA, transport="ucx") as c:
        assert c.put(_key("after-kill"), np.arange(256, dtype=np.uint8))
        assert np.array_equal(c.get(_key("after-kill")), np.arange(256, dtype=np.uint8))


def test_a_stalled_server_times_out_then_the_client_recovers(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(transport="ucx")
    proc = server.proc
    assert proc is not None
    value = np.arange(MiB, dtype=np.uint8)
    with server.client(ALPHA, transport="ucx", timeout_s=0.5, retries=0) as c:
        assert c.put(_key("stall"), value)
        proc.send_signal(signal.SIGSTOP)
        try:
            out = np.zeros_like(value)
            with pytest.raises(TimeoutError_):
                c.get_into(_key("stall"), out)
        finally:
            proc.send_signal(signal.SIGCONT)
        out = np.zeros_like(value)
        assert c.get_into(_key("stall"), out) is True and np.array_equal(out, value)
        assert c.transport == "ucx"


def _ucx_conn(server: ServerProcess) -> DataConn:
    conn = DataConn.open(
        ("127.0.0.1", server.data_port), ALPHA.token, deadline=time.monotonic() + 10, ucx=True
    )
    assert isinstance(conn.fs, UcxFrames)
    return conn


def test_garbage_over_ucx_closes_that_connection_only(store_server_ucx: ServerProcess) -> None:
    conn = _ucx_conn(store_server_ucx)
    conn.fs.set_timeout(5)
    conn.fs.send_raw(os.urandom(64))
    op, meta_len, _ = conn.fs.recv_header()
    assert op == Op.ERROR
    assert "magic" in pb.Status.FromString(conn.fs.recv_bytes(meta_len)).message
    with pytest.raises(EOFError):
        conn.fs.recv_header()
    conn.close()
    with store_server_ucx.client(ALPHA, transport="ucx") as c:
        assert c.put(_key("after-garbage"), b"still serving")
        assert c.get(_key("after-garbage")) == b"still serving"


def test_a_put_that_stalls_over_ucx_is_cut_and_its_space_reclaimed(
    server_factory: ServerFactory,
) -> None:
    """A writer that announces 4 MiB and sends 1: its FILL lease (put_grace_s) runs
    out, the server cuts the connection and aborts the reservation."""
    server = server_factory(transport="ucx", put_grace_s=0.5, put_floor_bytes=1 << 30)
    with server.client(ALPHA) as c:
        baseline = c.stats()["tiers"]["dram"]["used"]
        conn = _ucx_conn(server)
        conn.fs.set_timeout(5)
        meta = pb.ValueMeta(dtype="uint8", shape=[4 * MiB], kind=0, nbytes=4 * MiB)
        req = pb.PutRequest(items=[pb.PutItem(key=_key("stalled-put"), meta=meta, checksum=1)])
        conn.fs.send(Op.PUT, req.SerializeToString(), [np.ones(MiB, np.uint8)], 4 * MiB)
        with pytest.raises((EOFError, KVStoreError)):
            conn.fs.recv_header()  # cut: the socket closes under the frames
        conn.close()
        wait_until(lambda: c.stats()["tiers"]["dram"]["used"] == baseline, "space reclaimed")
        assert c.exists([_key("stalled-put")]) == [False]


def test_a_batch_put_that_stalls_over_ucx_leaves_nothing(server_factory: ServerFactory) -> None:
    """A batch whose payloads are received at once (Gateway.write_at_once): two items
    announced, the first sent whole, the second never. The FILL lease runs out, every
    reservation of the batch is aborted, and neither item is stored."""
    server = server_factory(transport="ucx", put_grace_s=0.5, put_floor_bytes=1 << 30)
    with server.client(ALPHA) as c:
        baseline = c.stats()["tiers"]["dram"]["used"]
        conn = _ucx_conn(server)
        conn.fs.set_timeout(5)
        meta = pb.ValueMeta(dtype="uint8", shape=[MiB], kind=0, nbytes=MiB)
        keys = [_key("stalled-a"), _key("stalled-b")]
        req = pb.PutRequest(items=[pb.PutItem(key=k, meta=meta, checksum=1) for k in keys])
        conn.fs.send(Op.PUT, req.SerializeToString(), [np.ones(MiB, np.uint8)], 2 * MiB)
        with pytest.raises((EOFError, KVStoreError)):
            conn.fs.recv_header()
        conn.close()
        wait_until(lambda: c.stats()["tiers"]["dram"]["used"] == baseline, "space reclaimed")
        assert c.exists(keys) == [False, False]


def test_a_payload_with_another_tag_is_never_stored(server_factory: ServerFactory) -> None:
    """Payloads only count on the connection's own tag: a PUT whose payload comes under
    any other tag (a peer that guessed the worker's address but not the tag) stores
    nothing; the server waits for the real payload until the put's FILL lease runs
    out, cuts the connection and reclaims the space."""
    server = server_factory(transport="ucx", put_grace_s=0.5, put_floor_bytes=1 << 30)
    with server.client(ALPHA) as c:
        baseline = c.stats()["tiers"]["dram"]["used"]
        conn = _ucx_conn(server)
        fs = conn.fs
        assert isinstance(fs, UcxFrames)
        fs.set_timeout(5)
        fs.payloads.tag = type(fs.payloads.tag)(((fs.tag & ~3) ^ (1 << 40)) | 1)  # a stranger's
        meta = pb.ValueMeta(dtype="uint8", shape=[MiB], kind=0, nbytes=MiB)
        req = pb.PutRequest(items=[pb.PutItem(key=_key("stranger"), meta=meta, checksum=1)])
        fs.send(Op.PUT, req.SerializeToString(), [np.ones(MiB, np.uint8)], MiB, wait=False)
        with pytest.raises((EOFError, KVStoreError)):
            fs.recv_header()
        conn.close()
        wait_until(lambda: c.stats()["tiers"]["dram"]["used"] == baseline, "space reclaimed")
        assert c.exists([_key("stranger")]) == [False]


def test_connections_that_come_and_go_leak_nothing(store_server_ucx: ServerProcess) -> None:
    """Forty UCX connections opened and closed: the server's open descriptors (each
    worker holds an epoll and an event descriptor) and its connection count come back."""
    pid = store_server_ucx.pid

    def fds() -> int:
        return len(os.listdir(f"/proc/{pid}/fd"))

    def cycle() -> None:
        with store_server_ucx.client(ALPHA, transport="ucx", pool_size=1) as c:
            c.exists([_key("leak")])

    for _ in range(3):  # UCX's own process-wide descriptors appear with the first worker
        cycle()
    with store_server_ucx.client(ALPHA) as watcher:
        watcher.exists([_key("watcher")])  # its own data connection: the one left
        wait_until(lambda: watcher.stats()["server"]["connections"] == 1, "warm-up conns gone")
        before = fds()
        for _ in range(40):
            cycle()
        wait_until(lambda: watcher.stats()["server"]["connections"] == 1, "connections gone")
        wait_until(lambda: fds() <= before + 4, f"descriptors back near {before}")


def test_frames_out_of_step_are_caught(store_server_ucx: ServerProcess) -> None:
    """A reply header whose magic is wrong is a protocol error, not a payload."""
    conn = _ucx_conn(store_server_ucx)
    try:
        fs = conn.fs
        fs.set_timeout(5)
        bogus = HEADER.pack(b"NOPE", Op.EXISTS, 0, 0, 0)
        assert HEADER.unpack(bogus)[0] != MAGIC
        fs.send_raw(bogus)
        op, meta_len, _ = fs.recv_header()
        assert op == Op.ERROR
        assert "magic" in pb.Status.FromString(fs.recv_bytes(meta_len)).message
    finally:
        conn.close()


@pytest.fixture(scope="module")
def store_server_ucx(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One UCX-offering server for this module's lighter tests."""
    from tests.support.server_process import base_flags

    workdir = tmp_path_factory.mktemp("ucx-server")
    server = ServerProcess(workdir, {**base_flags(workdir), "transport": "ucx"}).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.process
def test_across_two_network_namespaces(tmp_path: Path) -> None:
    """Two hosts (network namespaces, each its own hostname and boot id) joined by a
    veth pair through a bridge: the server binds its data address, both ends tell UCX to
    use their veth device, and the client on the other host moves its connection to
    UCX over tcp, asked to (``ucx``) and by itself (``auto``)."""
    from kvstore.procs.children import serve_argv, wait_ready
    from tests.support.netns import Lab, unavailable

    reason = unavailable()
    if reason is not None:
        pytest.skip(f"needs network namespaces: {reason}")
    tokens = tmp_path / "tokens.toml"
    from tests.support.server_process import write_tokens

    write_tokens(tokens)
    with Lab(tmp_path) as lab:
        a, b = lab.add_host("srv", nets=("data",)), lab.add_host("cli", nets=("data",))
        ucx_env = ["env", f"UCX_NET_DEVICES={a.dev('data')}", "UCX_TLS=tcp"]
        flags = {
            "host": a.ip("data"),
            "port": 7400,
            "data_port": 7401,
            "tokens_file": tokens,
            "dram_bytes": "64MiB",
            "transport": "ucx",
        }
        child = lab.spawn(a, "srv", [*ucx_env, *serve_argv(flags)], tmp_path / "srv.log")
        wait_ready([child], time.monotonic() + 60)
        for transport in ("ucx", "auto"):  # auto: another host offering UCX, ucxx here
            facts = _run_client(
                f"{a.ip('data')}:7400", {}, argv_prefix=[*b.wrap(ucx_env)], transport=transport
            )
            assert facts["failed"] == []
            assert facts["transport"] == "ucx"


def test_a_cuda_tensor_as_source_and_destination(store_server_ucx: ServerProcess) -> None:
    """On a machine with a GPU: a CUDA tensor put over UCX and read back into another
    CUDA tensor. The bytes pass through host memory on both ends (blocks.py stages
    device tensors); GPU memory registered with UCX (GPUDirect) is not used yet."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    src = torch.randn(2, 2, 2, 16, 64, device="cuda").to(torch.bfloat16)
    with store_server_ucx.client(ALPHA, transport="ucx") as c:
        assert c.put(_key("cuda-block"), src) is True
        out = torch.zeros_like(src)
        assert c.get_into(_key("cuda-block"), out) is True
        assert out.device.type == "cuda" and torch.equal(out, src)
