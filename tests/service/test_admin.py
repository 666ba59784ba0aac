"""Operator commands against real ``kvstore serve`` processes: stats, evict, drain, metrics.

Every number checked follows from what the test did: 64 KiB blocks, known tenants,
known paths (shared memory for a same-host client, the data socket for a TCP client).
Pins are real: a data connection holding a shared-memory read lease, exactly what a
same-host reader holds while it copies. What the server decides (admin rights, a
tenant's stats, evict's filters) is checked on the in-memory network too
(tests/support/memory_fixtures.py), in the hermetic run.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore import Namespace
from kvstore._proto import store_pb2 as pb
from kvstore.blocks import HEADER_SIZE
from kvstore.cli import main
from kvstore.cli.admin import parse_duration, parse_target
from kvstore.client.admin import AdminClient
from kvstore.client.transport.conn import DataConn
from kvstore.errors import ConfigError, PermissionDenied
from kvstore.wire.codec import scope_of
from kvstore.wire.frames import Op
from tests.support.background import Background
from tests.support.memory_fixtures import MemoryFactory, MemoryStore, Served
from tests.support.server_process import (
    ADMIN,
    ALPHA,
    BRAVO,
    ServerProcess,
    Token,
    base_flags,
    principal_of,
)
from tests.support.waiting import wait_until

if TYPE_CHECKING:
    from tests.support.server_fixtures import ServerFactory


NS = Namespace("m", "uint8:L1:H1:D1")
SHAPE = (1, 2, 1, 32768, 1)  # 64 KiB of uint8 in NS's layout
PAYLOAD = 65536
BLOCK = PAYLOAD + HEADER_SIZE


def key(tag: str, i: int) -> bytes:
    return f"{tag}-{i:06d}".encode().ljust(16, b".")[:16]


def value(i: int) -> np.ndarray:
    return np.full(SHAPE, i % 251, dtype=np.uint8)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    rc, out, err = run_cli(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def hold_read_lease(server: ServerProcess, token: Token, k: bytes) -> DataConn:
    """Pin one DRAM block the way a same-host reader does: a LEASE frame on a data
    connection, never released (the lease ends when the connection closes)."""
    deadline = time.monotonic() + 10
    conn = DataConn.open(("127.0.0.1", server.data_port), token.token, deadline=deadline)
    req = pb.GetRequest(scope=scope_of(NS), keys=[k])
    resp, body_len = conn.call(Op.LEASE, req, pb.GetResponse, deadline)
    assert resp.blocks[0].lease_id, "the block should be in DRAM and leased"
    if body_len:
        conn.discard(body_len)
    return conn


@pytest.fixture(autouse=True)
def admin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_TOKEN", ADMIN.token)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for the tests that only read it or refuse to change it."""
    workdir = tmp_path_factory.mktemp("admin")
    server = ServerProcess(workdir, base_flags(workdir)).start()
    try:
        with server.client(ALPHA, namespace=NS) as c:
            c.batch_put([key("s", i) for i in range(4)], [value(i) for i in range(4)])
        yield server
    finally:
        server.stop()


# -- stats and metrics --------------------------------------------------------------------


def _traffic(server: ServerProcess) -> None:
    """alpha: 6 puts + 8 gets over shm, 1 + 1 over TCP; bravo: 3 + 4 over TCP."""
    with server.client(ALPHA, namespace=NS) as c:
        assert all(c.batch_put([key("a", i)], [value(i)])[0] for i in range(6))
        assert c.transport == "shm"
        got = [c.get(key("a", i)) for i in range(8)]  # 6 hits, 2 misses
        assert [g is not None for g in got] == [True] * 6 + [False] * 2
    with server.client(ALPHA, namespace=NS, transport="tcp") as c:
        assert c.put(key("g", 0), value(7))
        assert (c.get(key("g", 0)) == value(7)).all()
    with server.client(BRAVO, namespace=NS, transport="tcp") as c:
        assert all(c.put(key("b", i), value(i)) for i in range(3))
        out = np.empty(SHAPE, dtype=np.uint8)
        assert [c.get_into(key("b", i), out) for i in range(4)] == [True] * 3 + [False]


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_stats_and_scraped_metrics_agree_with_traffic(
    server_factory: ServerFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    server = server_factory(env={"KVSTORE_METRICS_PORT": "0"})  # the deploy files' name
    port = server.facts["metrics_port"]
    assert isinstance(port, int) and port > 0
    _traffic(server)
    doc = cli_json(capsys, "stats", "--node", server.address)["nodes"][0]
    assert doc["blocks"] == 10 and doc["tiers"]["dram"]["blocks"] == 10
    assert (doc["hits"], doc["misses"], doc["lookups"]) == (10, 3, 13)
    assert doc["tiers"]["dram"]["hits"] == 10 and doc["puts"] == 10
    assert doc["bytes_in"] == {"inproc": 0, "shm": 6 * PAYLOAD, "tcp": 4 * PAYLOAD, "ucx": 0}
    assert doc["bytes_out"] == {"inproc": 0, "shm": 6 * PAYLOAD, "tcp": 4 * PAYLOAD, "ucx": 0}
    alpha = cli_json(capsys, "stats", "--node", server.address, "--tenant", "alpha")["nodes"][0]
    assert (alpha["hits"], alpha["misses"], alpha["puts"]) == (7, 2, 7)
    assert alpha["bytes_in"] == {"shm": 6 * PAYLOAD, "tcp": PAYLOAD, "ucx": 0}

    m = scrape(port)

    def v(name: str, **labels: str) -> float:
        return m[(name, frozenset(labels.items()))]

    for d in ("in", "out"):
        assert v("kvstore_transfer_bytes_total", direction=d, path="shm") == 6 * PAYLOAD
        assert v("kvstore_transfer_bytes_total", direction=d, path="tcp") == 4 * PAYLOAD
        t = "kvstore_tenant_transfer_bytes_total"
        assert v(t, direction=d, path="tcp", tenant="alpha") == PAYLOAD
        assert v(t, direction=d, path="tcp", tenant="bravo") == 3 * PAYLOAD
    assert v("kvstore_hits_total", tier="dram") == 10 and v("kvstore_misses_total") == 3
    assert v("kvstore_lookups_total") == 13
    for tenant, hits, misses, puts in (("alpha", 7, 2, 7), ("bravo", 3, 1, 3)):
        assert v("kvstore_tenant_hits_total", tier="dram", tenant=tenant) == hits
        assert v("kvstore_tenant_misses_total", tenant=tenant) == misses
        assert v("kvstore_tenant_puts_total", tenant=tenant) == puts
        assert v("kvstore_tenant_put_bytes_total", tenant=tenant) == puts * PAYLOAD
    requests = {("get", "shm"): 8, ("put", "shm"): 6, ("get", "tcp"): 5, ("put", "tcp"): 4}
    for (op, path), n in requests.items():
        assert v("kvstore_request_duration_seconds_count", op=op, path=path) == n, (op, path)
        inf = v("kvstore_request_duration_seconds_bucket", op=op, path=path, le="+Inf")
        assert inf == n


def test_a_tenant_token_sees_only_its_own_tenant(
    shared: ServerProcess, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with shared.client(BRAVO, namespace=NS) as c:
        c.get(key("s", 0))  # a miss for bravo: keys are scoped by tenant
    monkeypatch.setenv("KVSTORE_TOKEN", ALPHA.token)
    doc = cli_json(capsys, "stats", "--node", shared.address)["nodes"][0]
    assert doc["blocks"] >= 4
    with shared.client(ALPHA) as c:
        server = c.stats()["server"]
    assert any(k.endswith("@alpha") for k in server)
    assert not any("@" in k and not k.endswith("@alpha") for k in server)
    rc, _, err = run_cli(capsys, "stats", "--node", shared.address, "--tenant", "bravo")
    assert rc == 1 and "own tenant" in err and err.count("\n") == 2


def test_a_tenants_stats_name_only_its_own_tenant(memory_server: MemoryStore) -> None:
    """The server's half of the test above, on the in-memory network: a tenant's Stats
    carry its own ``@tenant`` books only; an admin's carry every tenant's."""
    for token in (ALPHA, BRAVO):
        with memory_server.client(token, namespace=NS) as c:
            assert c.put(key("t", 0), value(0))
            assert c.get(key("t", 1)) is None
    with memory_server.client(ALPHA) as c:
        server = c.stats()["server"]
    assert server["puts@alpha"] >= 1 and server["misses@alpha"] >= 1
    assert not any("@" in k and not k.endswith("@alpha") for k in server)
    with memory_server.client(ADMIN) as c:
        server = c.stats()["server"]
    assert server["puts@alpha"] >= 1 and server["puts@bravo"] >= 1


# -- refusals and help --------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ("evict", "--tier", "dram", "--to", "0%"),
        ("drain", "{addr}", "--drop"),
    ],
)
def test_admin_commands_refuse_a_tenant_token(
    shared: ServerProcess,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: tuple[str, ...],
) -> None:
    monkeypatch.setenv("KVSTORE_TOKEN", ALPHA.token)
    args = [a.format(addr=shared.address) for a in argv]
    if args[0] == "evict":
        args += ["--node", shared.address]
    rc, out, err = run_cli(capsys, *args)
    lines = err.strip().splitlines()
    assert rc == 1 and out == ""
    assert len(lines) == 2 and "needs an admin token" in lines[0]
    assert lines[1].startswith("hint: use an admin token")
    with shared.client(ALPHA) as c:
        assert c.health() == "serving"


@pytest.fixture(scope="module")
def store_server(shared: ServerProcess) -> ServerProcess:
    """``any_server``'s real case: the module's shared server."""
    return shared


def test_the_server_refuses_admin_rpcs_to_a_tenant(any_server: Served) -> None:
    """The CLI checks first, but the server is the authority."""
    shared = any_server
    with shared.client(ALPHA, namespace=NS) as c:
        c.batch_put([key("s", i) for i in range(4)], [value(i) for i in range(4)])
    with shared.client(ALPHA) as c:
        admin = AdminClient(c)
        calls = (
            lambda: admin.evict("dram", 0),
            lambda: admin.scan(10),
            lambda: admin.export([key("s", 0)]),
            lambda: admin.purge([key("s", 0)]),
            lambda: c.set_draining(True),
        )
        for call in calls:
            with pytest.raises(PermissionDenied):
                call()
    with shared.client(ADMIN) as c:
        assert len(AdminClient(c).scan(100)) >= 4


def test_every_admin_command_shows_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in ("stats", "evict", "drain", "nodes", "ls"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        out = capsys.readouterr().out
        assert "example" in out and f"kvstore {cmd} " in out.split("example", 1)[1]


def test_parse_target_and_duration() -> None:
    cap = 1000
    assert parse_target("70%", None, 900, cap) == 700
    assert parse_target("1KiB", None, 900, cap) == 1024
    assert parse_target(None, "300", 900, cap) == 600
    assert parse_target(None, "2KiB", 900, cap) == 0
    assert parse_target(None, None, 900, cap) == 0
    assert parse_duration("10m") == 600 and parse_duration("1.5h") == 5400
    for bad in ("ten", "5y"):
        with pytest.raises(ConfigError):
            parse_duration(bad)
    with pytest.raises(ConfigError):
        parse_target("170%", None, 0, cap)


# -- evict --------------------------------------------------------------------------------


def test_evict_to_a_byte_target_never_takes_a_pinned_block(
    server_factory: ServerFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    server = server_factory()
    keys = [key("e", i) for i in range(20)]
    with server.client(ALPHA, namespace=NS) as c:
        c.batch_put(keys, [value(i) for i in range(20)])
    pin = hold_read_lease(server, ALPHA, keys[0])
    node = ("--node", server.address)
    try:
        used = cli_json(capsys, "stats", *node)["nodes"][0]["tiers"]["dram"]["used"]
        dry = cli_json(capsys, "evict", *node, "--tier", "dram", "--bytes", "640KiB", "--dry-run")
        r = dry["results"][0]
        assert r["dry_run"] and r["moved"] >= 9 and r["used_after"] <= r["target"]
        assert r["target"] == used - 640 * 1024 and len(r["blocks"]) == 10
        assert cli_json(capsys, "stats", *node)["nodes"][0]["tiers"]["dram"]["used"] == used

        r = cli_json(capsys, "evict", *node, "--tier", "dram", "--bytes", "640KiB")["results"][0]
        assert r["used_after"] <= r["target"] and r["demoted"] == r["moved"] >= 9
        rc, out, _ = run_cli(capsys, "evict", *node, "--tier", "dram", "--to", "0%")
        assert rc == 0 and "skipped 1 pinned block\n" in out, out
        with server.client(ALPHA, namespace=NS) as c:
            tiers = c.stats()["tiers"]
            assert (tiers["dram"]["blocks"], tiers["ssd"]["blocks"]) == (1, 19)
            assert c.get(keys[0]) is not None  # the pinned block stayed readable
    finally:
        pin.close()

    # The server ends the lease when it sees the connection close: wait for that.
    def still_pinned() -> int:
        dry = cli_json(capsys, "evict", *node, "--tier", "dram", "--to", "0%", "--dry-run")
        return int(dry["results"][0]["skipped_pinned"])

    wait_until(lambda: not still_pinned(), "the closed connection's lease to end", within=5)
    r = cli_json(capsys, "evict", *node, "--tier", "dram", "--to", "0%")["results"][0]
    assert r["skipped_pinned"] == 0 and r["used_after"] == 0


def test_evict_filters_by_tenant_model_and_age(
    server_factory: ServerFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    server = server_factory()
    other = Namespace("other-model", NS.layout)
    with server.client(ALPHA, namespace=NS) as c:
        c.batch_put([key("a", i) for i in range(6)], [value(i) for i in range(6)])
        c.batch_put([key("o", i) for i in range(2)], [value(i) for i in range(2)], namespace=other)
    with server.client(BRAVO, namespace=NS) as c:
        c.batch_put([key("b", i) for i in range(4)], [value(i) for i in range(4)])
    node = ("--node", server.address)
    assert cli_json(capsys, "evict", *node, "--tier", "dram", "--to", "0%")["results"][0]["moved"]
    ssd = ("evict", *node, "--tier", "ssd")
    r = cli_json(capsys, *ssd, "--tenant", "alpha", "--older-than", "1h")["results"][0]
    assert r["moved"] == 0  # nothing has been idle for an hour
    r = cli_json(capsys, *ssd, "--tenant", "bravo", "--dry-run", "--list", "100")["results"][0]
    assert (r["dropped"], len(r["blocks"])) == (4, 4)
    r = cli_json(capsys, *ssd, "--tenant", "bravo")["results"][0]
    assert r["dropped"] == 4 and r["skipped_pinned"] == 0
    r = cli_json(capsys, *ssd, "--tenant", "alpha", "--namespace", "other-model")["results"][0]
    assert r["dropped"] == 2
    with server.client(ALPHA, namespace=NS) as c:
        assert c.exists([key("a", i) for i in range(6)]) == [True] * 6
        assert c.exists([key("o", 0)]) == [False]
    with server.client(BRAVO, namespace=NS) as c:
        assert c.exists([key("b", i) for i in range(4)]) == [False] * 4


def test_evict_filters_select_by_tenant_model_and_age(memory_factory: MemoryFactory) -> None:
    """The filters of the test above, through AdminClient on the in-memory network: the
    server's selection without the CLI or a process."""
    server = memory_factory()
    other = Namespace("other-model", NS.layout)
    with server.client(ALPHA, namespace=NS) as c:
        c.batch_put([key("a", i) for i in range(6)], [value(i) for i in range(6)])
        c.batch_put([key("o", i) for i in range(2)], [value(i) for i in range(2)], namespace=other)
    with server.client(BRAVO, namespace=NS) as c:
        c.batch_put([key("b", i) for i in range(4)], [value(i) for i in range(4)])
    with server.client(ADMIN) as c:
        admin = AdminClient(c)
        assert admin.evict("dram")["moved"] == 12
        assert admin.evict("ssd", tenant="alpha", idle_s=3600)["moved"] == 0  # none idle
        r = admin.evict("ssd", tenant="bravo", dry_run=True, list_limit=100)
        assert (r["dropped"], len(r["blocks"])) == (4, 4)
        r = admin.evict("ssd", tenant="bravo")
        assert r["dropped"] == 4 and r["skipped_pinned"] == 0
        assert admin.evict("ssd", tenant="alpha", model="other-model")["dropped"] == 2
        assert admin.evict("ssd", tenant="nobody")["dropped"] == 0
    with server.client(ALPHA, namespace=NS) as c:
        assert c.exists([key("a", i) for i in range(6)]) == [True] * 6
        assert c.exists([key("o", 0)]) == [False]
    with server.client(BRAVO, namespace=NS) as c:
        assert c.exists([key("b", i) for i in range(4)]) == [False] * 4


def test_namespace_filters_select_ssd_blocks_after_a_crash_restart(
    server_factory: ServerFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """The names behind namespace fingerprints are kept beside the SSD tier: after a
    restart, evict and scan by tenant and model select the reloaded blocks before any
    client has used those scopes again."""
    server = server_factory()
    other = Namespace("other-model", NS.layout)
    want: dict[tuple[str, str], set[bytes]] = {}
    for token, ns, tag, n in ((ALPHA, NS, "a", 5), (ALPHA, other, "o", 3), (BRAVO, NS, "b", 4)):
        ks = [key(tag, i) for i in range(n)]
        with server.client(token, namespace=ns) as c:
            assert c.batch_put(ks, [value(i) for i in range(n)]) == [True] * n
        want[(token.tenant, ns.model)] = {principal_of(token).scope(k) for k in ks}
    with server.client(BRAVO, namespace=other) as c:
        assert c.batch_put([key("p", i) for i in range(2)], [value(i) for i in range(2)])
    want[("bravo", "other-model")] = {principal_of(BRAVO).scope(key("p", i)) for i in range(2)}
    with server.client(ALPHA) as c:  # no scope: no tenant or model filter selects it
        assert c.put(key("n", 0), b"x" * 1000)
    node = ("--node", server.address)
    assert (
        cli_json(capsys, "evict", *node, "--tier", "dram", "--to", "0%")["results"][0]["moved"]
        == 15
    )
    server.restart(signal.SIGKILL)  # a crash: what is known is what reached the disk

    with server.client(ADMIN) as c:  # an admin client names no scope
        admin = AdminClient(c)

        def scan(tenant: str = "", model: str = "") -> set[bytes]:
            return {b.key for b in admin.scan(100, "ssd", tenant=tenant, model=model)}

        assert len(scan()) == 15
        assert scan(tenant="alpha") == want[("alpha", "m")] | want[("alpha", "other-model")]
        assert scan(model="m") == want[("alpha", "m")] | want[("bravo", "m")]
        assert scan(tenant="bravo", model="other-model") == want[("bravo", "other-model")]
        assert scan(tenant="nobody") == set()
    ssd = ("evict", *node, "--tier", "ssd", "--list", "100")
    r = cli_json(capsys, *ssd, "--namespace", "other-model", "--tenant", "alpha")["results"][0]
    assert r["dropped"] == 3
    assert {bytes.fromhex(b["key"]) for b in r["blocks"]} == want[("alpha", "other-model")]
    r = cli_json(capsys, *ssd, "--tenant", "bravo")["results"][0]
    assert r["dropped"] == 6
    with server.client(ADMIN) as c:
        left = {b.key for b in AdminClient(c).scan(100)}
    assert left == want[("alpha", "m")] | {principal_of(ALPHA).scope(key("n", 0))}


# -- drain --------------------------------------------------------------------------------


class _Load(Background):
    """Clients hammering both nodes while a drain runs; every failure is kept."""

    def __init__(self, source: ServerProcess, target: ServerProcess, keys: list[bytes]):
        self.source, self.target, self.keys = source, target, keys
        self.errors: list[BaseException] = []
        self.reads = self.hits = self.misses = self.writes = 0
        super().__init__(self._read, self._read, self._write)

    def _read(self) -> None:
        rng = np.random.default_rng(threading.get_ident())
        try:
            with self.source.client(ALPHA, namespace=NS) as c:
                while not self.stop.is_set():
                    idx = rng.integers(0, len(self.keys), 8)
                    got = c.batch_get([self.keys[i] for i in idx])
                    for i, g in zip(idx, got, strict=True):
                        assert g is None or np.array_equal(g, value(int(i))), "wrong bytes"
                    c.exists([self.keys[i] for i in idx])
                    self.reads += 1
                    self.hits += sum(g is not None for g in got)
                    self.misses += sum(g is None for g in got)
        except BaseException as exc:
            self.errors.append(exc)

    def until(self, *, reads: int, writes: int, within: float = 20.0) -> None:
        """Wait until the load has done this many reads and writes (or failed)."""
        wait_until(
            lambda: (self.reads >= reads and self.writes >= writes) or self.errors,
            f"the load to reach {reads} reads and {writes} writes",
            within=within,
        )

    def _write(self) -> None:
        try:
            with self.target.client(ALPHA, namespace=NS) as c:
                while not self.stop.is_set():
                    assert c.put(key("w", self.writes), value(self.writes))
                    self.writes += 1
        except BaseException as exc:
            self.errors.append(exc)


def test_drain_moves_every_block_and_no_request_fails(
    server_factory: ServerFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    source, target = server_factory(), server_factory()
    keys = [key("d", i) for i in range(160)]
    with source.client(ALPHA, namespace=NS) as c:
        c.batch_put(keys, [value(i) for i in range(160)])
    with source.client(BRAVO, namespace=NS) as c:
        c.batch_put([key("d", i) for i in range(10)], [value(1000 + i) for i in range(10)])
    with source.client(ADMIN) as c:
        AdminClient(c).evict("dram", 85 * BLOCK)  # about half of them on SSD
        assert c.stats()["tiers"]["ssd"]["blocks"] > 50
    with _Load(source, target, keys) as load:
        load.until(reads=5, writes=5)  # reads and writes are under way before the drain
        rc, out, err = run_cli(capsys, "drain", source.address, "--to", target.address)
        load.until(reads=load.reads + 5, writes=load.writes + 5)  # ... and after it
    assert load.errors == [] and load.reads > 10 and load.writes > 10
    assert load.hits > 0 and load.misses > 0  # reads before, during and after the moves
    assert rc == 0, err
    assert "moved 170 blocks" in out and ": 0 blocks left" in out, out
    with source.client(ADMIN) as c:
        st = c.stats()
        assert st["blocks"] == 0 and st["server"]["draining"] == 1
    with target.client(ALPHA, namespace=NS) as c:  # the owner's own keys find them there
        got = c.batch_get(keys)
        assert all(np.array_equal(g, value(i)) for i, g in enumerate(got))
    with target.client(BRAVO, namespace=NS) as c:
        assert np.array_equal(c.get(key("d", 3)), value(1003))
    with source.client(ALPHA, namespace=NS) as c:
        assert c.get(keys[0]) is None  # a clean miss on the drained node
    assert run_cli(capsys, "drain", source.address, "--undo")[0] == 0
    with source.client(ALPHA) as c:
        assert c.health() == "serving"


# -- the table in a real terminal ---------------------------------------------------------


def test_stats_table_fits_an_80_column_terminal(shared: ServerProcess, tmp_path: Path) -> None:
    import shutil
    import subprocess
    import sys

    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (make system-deps installs it)")
    sock, session = f"kvstore-test-{tmp_path.name}", "stats"
    cmd = (
        f"env KVSTORE_TOKEN={ADMIN.token} {sys.executable} -m kvstore.cli stats "
        f"--node {shared.address} --node {shared.address}; sleep 60"
    )
    tmux = ["tmux", "-L", sock]
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", session, "-x", "80", "-y", "60", cmd], check=True
    )
    try:
        screen = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            screen = subprocess.run(
                [*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True
            ).stdout
            if screen.count("transport") == 2 and screen.count("\ntcp ") == 2:
                break
            time.sleep(0.2)
        lines = screen.rstrip("\n").splitlines()
        assert screen.count("transport") == 2, screen
        assert all(len(line) <= 80 for line in lines), screen
        assert "…" not in screen, screen  # nothing truncated
        header = next(line for line in lines if line.lstrip().startswith("tier"))
        for column in ("capacity", "used", "blocks", "hits", "demoted", "promoted", "evicted"):
            assert column in header
        assert any(line.startswith("dram") for line in lines)
        assert any(line.startswith("ssd") for line in lines)
        assert "hit rate" in screen
    finally:
        subprocess.run([*tmux, "kill-server"], check=False)
