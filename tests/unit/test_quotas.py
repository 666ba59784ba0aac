"""Quotas in the tokens file (kvstore/server/quotas.py): strict parsing, and the gateway
handing them to a real node as budgets that follow a tenant's new namespaces."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.blocks import HEADER_SIZE, checksum, describe
from kvstore.config import NodeConfig, ServerConfig
from kvstore.errors import ConfigError, InvalidValue, QuotaExceeded
from kvstore.node.store import StoreNode
from kvstore.observe.counters import NodeCounters
from kvstore.server.gateway import Gateway
from kvstore.server.quotas import Quotas
from kvstore.server.tenant_connections import TenantConnections
from kvstore.server.write_batch import UNHASHED, Filled, PayloadReceiver, WriteItem
from kvstore.tenants import Principal
from kvstore.tier_kinds import TierKind

TOKENS = """
scope_secret = "0123456789abcdef0123456789abcdef"

[[tokens]]
token = "alpha-token-0123456789"
tenant = "alpha"

[[tokens]]
token = "bravo-token-0123456789"
tenant = "bravo"
"""


def _file(tmp_path: Path, quotas: str, name: str = "tokens.toml") -> str:
    path = tmp_path / name
    path.write_text(TOKENS + quotas)
    return str(path)


def test_quotas_parse_sizes_counts_and_leave_others_unlimited(tmp_path: Path) -> None:
    path = _file(
        tmp_path,
        """
[quotas.alpha]
dram = "4MiB"
ssd = 1048576
reservations = 8
reserved_bytes = "512KiB"
connections = 3
""",
    )
    quotas = Quotas.load(path)
    a = quotas.get("alpha")
    assert a is not None
    assert dict(a.tier_bytes) == {TierKind.DRAM: 4 << 20, TierKind.SSD: 1 << 20}
    assert (a.reservations, a.reserved_bytes, a.connections) == (8, 512 << 10, 3)
    assert quotas.share(4).get("alpha").connections == 3  # type: ignore[union-attr]  # per shard
    assert quotas.get("bravo") is None  # no table: unlimited
    assert len(Quotas.from_config(ServerConfig(tokens_file=path))) == 1
    assert len(Quotas.from_config(ServerConfig(allow_anonymous=True))) == 0


def test_quotas_read_json_too(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    path.write_text(
        '{"tokens": [{"token": "alpha-token-0123456789", "tenant": "alpha"}],'
        ' "quotas": {"alpha": {"dram": "1GiB"}}}'
    )
    q = Quotas.load(str(path)).get("alpha")
    assert q is not None and dict(q.tier_bytes) == {TierKind.DRAM: 1 << 30}
    path.write_text('{"tokens": [], "quotas": "all of it"}')
    with pytest.raises(ConfigError, match="must be a table"):
        Quotas.load(str(path))


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('[quotas.alpha]\ndram = "4 parsecs"', "cannot parse size"),
        ('[quotas.alpha]\ndram = "0"', "must be > 0"),
        ("[quotas.alpha]\ndram = -5", "must be >= 0"),
        ("[quotas.alpha]\ndram = true", "expected a size"),
        ('[quotas.alpha]\nram = "4GiB"', "unknown limit"),
        ("[quotas.alpha]\nreservations = 0", "whole number > 0"),
        ("[quotas.alpha]\nreservations = 1.5", "whole number > 0"),
        ('[quotas.alpha]\nreservations = "8"', "whole number > 0"),
        ("[quotas.alpha]\nconnections = 0", "connections: expected a whole number > 0"),
        ('[quotas.carol]\ndram = "4GiB"', "no token in this file is for tenant 'carol'"),
        ('[quotas]\nalpha = "4GiB"', "expected a table of limits"),
    ],
)
def test_bad_quotas_are_refused_naming_the_entry(tmp_path: Path, table: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as exc:
        Quotas.load(_file(tmp_path, "\n" + table + "\n"))
    assert "tokens_file" in str(exc.value)


# -- the gateway over a real node ---------------------------------------------------------

LAYOUT = "float32:L1:H1:D16:B16"
VALUE = np.zeros((1, 2, 1, 16, 16), dtype=np.float32)  # 2 KiB
SIZE = HEADER_SIZE + VALUE.nbytes


def _put(gw: Gateway, p: Principal, model: str, key: bytes) -> bool | Exception:
    item = WriteItem(key, describe(VALUE), checksum(VALUE), VALUE.nbytes)

    return gw.write(p, model, LAYOUT, [item], _Value())[0]


class _Value(PayloadReceiver):
    """VALUE copied into each reservation; the bytes of a skipped one noted."""

    def __init__(self) -> None:
        self.skipped: list[int] = []

    def receive(self, target: Any, nbytes: int) -> Filled:
        target.data[:] = VALUE.view(np.uint8).reshape(-1)
        return UNHASHED  # the item's own checksum; the commit hashes what landed

    def skip(self, nbytes: int) -> None:
        self.skipped.append(nbytes)


@pytest.fixture
def gateway(tmp_path: Path):  # type: ignore[no-untyped-def]
    path = _file(tmp_path, f"\n[quotas.alpha]\ndram = {4 * SIZE}\nreservations = 2\n")
    config = ServerConfig(port=0, tokens_file=path)
    with StoreNode(NodeConfig(dram_bytes=1 << 20, warm=False)) as node:
        gw = Gateway(node, config, quotas=Quotas.from_config(config))
        yield gw
        gw.close()


def test_a_tenant_quota_spans_its_namespaces(gateway: Gateway) -> None:
    alpha, bravo = Principal("alpha"), Principal("bravo")
    keys = [bytes([i]) * 16 for i in range(12)]
    for i, k in enumerate(keys):  # two models, one quota
        assert _put(gateway, alpha, f"m{i % 2}", k) is True
    for k in keys:
        assert _put(gateway, bravo, "m0", k) is True  # bravo: no quota
    _, server = gateway.stats(alpha)
    assert server["quota_used_dram@alpha"] == 4 * SIZE
    assert "quota_used_dram@bravo" not in server
    assert gateway.node.stats()["counters"]["quota_evictions_dram"] == 8


def test_a_tenant_with_a_quota_must_name_a_scope(gateway: Gateway) -> None:
    item = WriteItem(b"k" * 16, describe(VALUE), checksum(VALUE), VALUE.nbytes)
    rx = _Value()
    out = gateway.write(Principal("alpha"), "", "", [item], rx)
    assert isinstance(out[0], InvalidValue) and "has a quota" in str(out[0])
    assert rx.skipped == [VALUE.nbytes]  # its bytes were read past, the stream stays in step


def test_leased_writes_in_flight_are_bounded_per_tenant(gateway: Gateway) -> None:
    alpha = Principal("alpha")
    items = [WriteItem(bytes([i]) * 16, describe(VALUE), 0, VALUE.nbytes) for i in range(3)]
    out = gateway.reserve_leased(alpha, "m", LAYOUT, items, owner=1)
    assert [type(x).__name__ for x in out] == ["Lease", "Lease", "QuotaExceeded"]
    assert isinstance(out[2], QuotaExceeded)
    _, server = gateway.stats(alpha)
    assert server["quota_inflight@alpha"] == 2
    assert server["quota_refusals@alpha"] == 1
    # a write lease lasts as long as its batch takes at the floor rate, plus the grace
    lease = out[0]
    assert not isinstance(lease, Exception) and lease is not None
    left_s = (lease.expires_ns - time.monotonic_ns()) / 1e9
    assert 4.0 < left_s < gateway.fill_deadline_s(3 * VALUE.nbytes) + 0.01 < 6.0  # not 30 s
    assert gateway.end_connection(1) == 2
    assert gateway.stats(alpha)[1]["quota_inflight@alpha"] == 0


def test_a_fill_lease_past_its_deadline_is_cut_by_the_reaper() -> None:
    from kvstore.server.leases import Lease, LeaseKind, LeaseTable

    cut = threading.Event()
    ended: list[Lease] = []

    def end(lease: Lease) -> None:
        ended.append(lease)
        lease.obj()

    table = LeaseTable(30.0, end, shortest_s=0.2)  # the reaper looks every 0.05 s
    table.start_reaper()
    try:
        t0 = time.monotonic()
        lease = table.grant(LeaseKind.FILL, cut.set, "alpha", owner=7, ttl_s=0.1)
        assert cut.wait(2.0), "the stalled fill was never cut"
        assert 0.1 <= time.monotonic() - t0 < 1.5  # cut near its 0.1 s, not at the 30 s TTL
        assert table.take(lease.id, "alpha", LeaseKind.FILL) is None  # the reaper took it
        assert [x.kind for x in ended] == [LeaseKind.FILL] and table.expired == 1
    finally:
        table.close()


def test_a_tenants_connections_are_held_to_its_quota(tmp_path: Path) -> None:
    quotas = Quotas.load(_file(tmp_path, "\n[quotas.alpha]\nconnections = 2\n"))
    counters = NodeCounters()
    conns = TenantConnections(quotas, counters)
    conns.admit(1, "alpha")
    conns.admit(2, "alpha")
    with pytest.raises(QuotaExceeded, match=r"tenant 'alpha' has 2 data connections open"):
        conns.admit(3, "alpha")
    for i in range(10, 20):
        conns.admit(i, "bravo")  # no limit of its own
    assert (conns.open("alpha"), conns.open("bravo")) == (2, 10)
    conns.release(3)  # refused, never counted: nothing to give back
    conns.release(1)
    conns.admit(4, "alpha")  # a slot freed by a close is taken again
    assert conns.open("alpha") == 2
    assert counters.get("connections_refused", tenant="alpha") == 1
