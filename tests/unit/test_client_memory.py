"""The client's own logic, hermetic: a real NodeClient over the in-memory network
(tests/support/memory_net.py) against a real Gateway and StoreNode, no socket. The
same behaviours over sockets are in tests/service/."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from kvstore import Namespace, StoreClient, prefix_keys
from kvstore.client.faults import FaultyConnector
from kvstore.config import NodeConfig
from kvstore.errors import (
    AuthError,
    ClosedError,
    ConfigError,
    InvalidValue,
    LayoutMismatch,
    LimitExceeded,
    TimeoutError_,
    TransportError,
    Unavailable,
)
from kvstore.faults import Fault, FaultPlan
from kvstore.node.store import StoreNode
from kvstore.server.auth import TokenTable
from kvstore.tenants import Principal
from tests.support.memory_net import TOKEN, MemoryNetwork, MemoryServer

NS = Namespace("tiny", "fp32:L2:H2:D16:B16", "t")
SHAPE = (2, 2, 2, 16, 16)
ADDR = "node-a:7400"


def keys(n: int, seed: int = 0) -> list[bytes]:
    return list(prefix_keys([seed] * 5 + list(range(n * 16)), 16, NS))[:n]


def block(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i))


@pytest.fixture
def net() -> Iterator[MemoryNetwork]:
    n = MemoryNetwork()
    node = StoreNode(NodeConfig(node_id="a", dram_bytes=1 << 20, warm=False))
    tokens = TokenTable({TOKEN: Principal("default", admin=True), "beta-token": Principal("beta")})
    n.add(MemoryServer(node, ADDR, tokens=tokens))
    yield n
    n.close()


def client(net: MemoryNetwork, **kw: object) -> StoreClient:
    kw.setdefault("token", TOKEN)
    kw.setdefault("namespace", NS)
    return StoreClient(ADDR, connector=kw.pop("connector", net), **kw)  # type: ignore[arg-type]


def test_batches_report_each_key_on_its_own(net: MemoryNetwork) -> None:
    k = keys(4)
    with client(net).open() as c:
        assert c.transport == "" and c.state == "open"
        bad = torch.zeros(3)  # disagrees with the namespace's layout
        res = c.batch_put(k[:3], [block(0), bad, block(2)])
        assert res[0] is True and res[2] is True and isinstance(res[1], LayoutMismatch)
        assert c.batch_put(k[:1], [block(0)]) == [False]  # stored already
        outs = [torch.empty(SHAPE) for _ in range(4)]
        assert c.batch_get_into(k, outs) == [True, False, True, False]
        assert torch.equal(outs[0], block(0)) and torch.equal(outs[2], block(2))
        got = c.batch_get(k)
        assert got[1] is None and torch.equal(got[2], block(2))
        assert c.exists(k) == [True, False, True, False] and c.match_prefix(k) == 1
        assert c.transport == "memory"
        with pytest.raises(InvalidValue):
            c.batch_get_into(k, outs[:2])  # refused before anything moves
        with pytest.raises(LimitExceeded):
            c.exists([k[0]] * 1025)  # over the server's max_batch, said by Info
        assert c.remove(k[:1]) == 1 and c.exists(k[:1]) == [False]


def test_namespaces_and_tenants_scope_keys(net: MemoryNetwork) -> None:
    k = keys(1)
    other_ns = Namespace("other", "fp32:L2:H2:D16:B16", "t")
    with client(net).open() as c:
        c.put(k[0], block(1))
        assert c.get(k[0], namespace=other_ns) is None  # another model's block: a miss
        assert torch.equal(c.get(k[0]), block(1))
        stats = c.stats()["server"]
        assert stats["hits_dram@default"] >= 1 and stats["misses@default"] == 1
    with client(net, token="beta-token").open() as b:  # same key, another tenant
        assert b.get(k[0]) is None and b.exists(k) == [False]
        b.put(k[0], block(2))
        assert torch.equal(b.get(k[0]), block(2))
        assert "hits_dram@default" not in b.stats()["server"]  # only its own counters
    with client(net).open() as c:
        assert torch.equal(c.get(k[0]), block(1))


def test_lifecycle_errors_are_precise(net: MemoryNetwork) -> None:
    c = client(net)
    with pytest.raises(ClosedError, match="not open"):
        c.get(keys(1)[0])
    c.open()
    c.close()
    with pytest.raises(ClosedError, match="is closed"):
        c.exists(keys(1))
    with pytest.raises(ClosedError):
        c.open()  # a closed client does not come back
    with pytest.raises(AuthError):
        client(net, token="not-a-token", connect_timeout_s=0.5).open()
    with pytest.raises(ConfigError, match="faults"):
        client(net, faults="read:bogus=1")


def test_retries_ride_out_a_restart_within_the_deadline(net: MemoryNetwork) -> None:
    k = keys(1)
    plan = FaultPlan(Fault("write", error=TransportError("reset (injected)"), times=2))
    with client(net, connector=FaultyConnector(net, plan), backoff_s=0.001).open() as c:
        assert c.put(k[0], block(3))  # two resets, then the third try lands
        assert plan.fired["write"] == 2 and c.counters.snapshot()["retries"] == 2
        plan.add(Fault("read", error=Unavailable("down (injected)")))
        with pytest.raises(Unavailable):
            c.get(k[0])  # retries are bounded: 1 + 3 tries, then the error
        assert plan.fired["read"] == 4


def test_a_link_to_a_stopped_server_breaks_and_a_new_one_is_opened(
    net: MemoryNetwork,
) -> None:
    k = keys(1)
    with client(net, backoff_s=0.001, retries=5).open() as c:
        c.put(k[0], block(4))
        links = c._pool
        net.stop(ADDR)
        with pytest.raises(Unavailable):
            c.get(k[0], timeout=0.2)
        net.start(ADDR)
        assert torch.equal(c.get(k[0]), block(4))
        assert links is c._pool and links.opened == 2  # type: ignore[union-attr]


def test_a_stalled_call_times_out_at_its_deadline(net: MemoryNetwork) -> None:
    plan = FaultPlan(Fault("read", delay_s=0.3, error=TimeoutError_("stalled (injected)")))
    with client(net, connector=FaultyConnector(net, plan), retries=0).open() as c:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError_):
            c.get(keys(1)[0], timeout=0.1)
        assert time.monotonic() - t0 < 1.0
        plan.clear()
        assert c.get(keys(1)[0]) is None


def test_a_batch_cut_mid_way_never_hands_over_bytes_it_did_not_get(
    net: MemoryNetwork,
) -> None:
    k = keys(4)
    with client(net).open() as c:
        c.batch_put(k, [block(i) for i in range(4)])
    plan = FaultPlan(Fault("read", after_keys=2, per_key=True, error=TransportError("cut")))
    with client(net, connector=FaultyConnector(net, plan)).open() as c:
        outs = [torch.zeros(SHAPE) for _ in range(4)]
        res = c.batch_get_into(k, outs)
        assert res[:2] == [True, True] and all(isinstance(r, TransportError) for r in res[2:])
        assert torch.equal(outs[1], block(1)) and not outs[3].any()


def test_fault_plans_parse_from_text() -> None:
    plan = FaultPlan.parse("read@node-a:error=transport:times=1,control.*:delay=0.01:skip=1")
    assert plan.take("read", "node-b") is None
    f = plan.take("read", "node-a")
    assert f is not None and isinstance(f.error, TransportError)
    assert plan.take("read", "node-a") is None  # one shot
    assert plan.take("control.Info", "x") is None  # skipped once
    assert plan.take("control.Stats", "x") is not None


def test_layer_ranges_over_the_in_memory_network(net: MemoryNetwork) -> None:
    """get_into with ``layers`` lands block[a:b] (the seam's real implementation), and
    a fault after the first key never hands the rest over."""
    ks, blocks = keys(3, seed=9), [block(30 + i) for i in range(3)]
    with client(net) as c:
        assert c.batch_put(ks, blocks) == [True, True, True]
        outs = [torch.empty((1, *SHAPE[1:])) for _ in ks]
        assert c.batch_get_into(ks, outs, layers=(1, 2)) == [True, True, True]
        assert all(torch.equal(o, b[1:2]) for o, b in zip(outs, blocks, strict=True))
        wrong = c.batch_get_into(ks[:1], [torch.empty(SHAPE)], layers=(0, 1))
        assert isinstance(wrong[0], LayoutMismatch)
        with pytest.raises(InvalidValue):
            c.get_into(ks[0], outs[0], layers=(2, 1))
    plan = FaultPlan(Fault("read", after_keys=1, per_key=True, error=TransportError("cut")))
    with client(net, connector=FaultyConnector(net, plan)) as c:
        outs = [torch.zeros((1, *SHAPE[1:])) for _ in ks]
        r = c.batch_get_into(ks, outs, layers=(0, 1))
        assert r[0] is True and torch.equal(outs[0], blocks[0][0:1])
        assert all(isinstance(x, TransportError) for x in r[1:]), r
        assert all(not o.any() for o in outs[1:])  # nothing of theirs was handed over


def test_layer_by_layer_writes_over_the_in_memory_network(net: MemoryNetwork) -> None:
    """The layered write's client logic (order, checksum stream, keep, abort) against a
    real Gateway: what it stores equals a whole put, withdrawn and aborted items free
    their space."""
    k, data = keys(3, seed=7), [block(10 + i) for i in range(3)]
    node = net.server(ADDR).gateway.node
    with client(net).open() as c:
        with c.begin_layers(k, shape=SHAPE, dtype=torch.float32) as w:
            w.write(0, [d[:1] for d in data])
            assert c.exists(k) == [False] * 3  # nothing visible before the commit
            w.write(1, [d[1:] for d in data])
            assert w.commit(keep=[True, False, True]) == [True, None, True]
        assert c.exists(k) == [True, False, True]
        assert torch.equal(c.get(k[2]), data[2])
        used = node.stats()["tiers"]["dram"]["used"]
        with c.begin_layers([k[1]], shape=SHAPE, dtype=torch.float32) as w:
            w.write(0, [data[1][:1]])
        assert node.stats()["tiers"]["dram"]["used"] == used  # aborted on leaving
        assert c.exists(k) == [True, False, True]
        plan = FaultPlan(Fault("write", error=TransportError("reset (injected)")))
        faulty = client(net, connector=FaultyConnector(net, plan))
        with faulty.open(), pytest.raises(TransportError):
            faulty.begin_layers(k, shape=SHAPE, dtype=torch.float32)
