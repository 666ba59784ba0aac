"""The parts of vLLM pools that follow the directory and need no vLLM: the connector's
``register`` settings, what a server's record says of its URL and role, a server that
cannot reach etcd, and how ``kvstore vllm-router`` builds its pools from records.
Runs in the main environment (and in .venv-vllm); tests/vllm/test_vllm_pools.py runs
the whole thing with real ``vllm serve`` processes."""

from __future__ import annotations

import socket
import time
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from engine.registry import WorkerLoad, WorkerRecord
from engine.serving.vllm_pools import Pools, PoolsConfig
from engine.vllm.membership import Membership, ServerFacts, server_role, server_url
from engine.vllm.store import ConnectorConfig
from kvstore.errors import ConfigError
from kvstore.keys import Namespace

LAYOUT = "float32:L2:H2:D32:B32:R0"


# -- the connector's settings ------------------------------------------------------------


def test_register_settings_parse_and_default_to_off() -> None:
    c = ConnectorConfig.from_extra({"endpoint": "h:1"})
    assert (c.register, c.etcd, c.role, c.url, c.lease_ttl_s) == (False, "", "", "", 10)
    c = ConnectorConfig.from_extra(
        {"endpoint": "h:1", "register": True, "etcd": "127.0.0.1:2379", "cluster": "c1",
         "role": "both", "url": "http://10.0.0.5:8100", "lease_ttl_s": 3}
    )  # fmt: skip
    assert (c.register, c.cluster, c.role, c.lease_ttl_s) == (True, "c1", "both", 3)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"etcd": "127.0.0.1:2379"}, r"\['etcd'\] need \"register\": true"),
        ({"role": "decode", "url": "http://h:1"}, r"\['role', 'url'\] need"),
        ({"register": True, "role": "prefil"}, "role 'prefil'"),
        ({"register": True, "url": "h:8000"}, "url 'h:8000'"),
        ({"register": True, "lease_ttl_s": 0}, "lease_ttl_s"),
        ({"register": "yes"}, "register.*expected bool"),
    ],
)
def test_register_settings_refuse_what_would_misplace_a_server(
    extra: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        ConnectorConfig.from_extra({"endpoint": "h:1", **extra})


# -- what the record says ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "url"),
    [
        (["api_server", "--model", "m", "--host", "127.0.0.1", "--port", "8100"],
         "http://127.0.0.1:8100"),
        (["vllm", "serve", "m", "--port=8200", "--host=10.1.2.3"], "http://10.1.2.3:8200"),
        (["api_server", "--host", "::1", "--port", "9"], "http://[::1]:9"),
        (["api_server", "--model", "m"], f"http://{socket.gethostname()}:8000"),
        (["api_server", "--host", "0.0.0.0"], f"http://{socket.gethostname()}:8000"),
        (["api_server", "--host", "h", "--ssl-certfile", "c.pem"], "https://h:8000"),
    ],
)  # fmt: skip
def test_a_servers_url_comes_from_its_command_line(argv: list[str], url: str) -> None:
    assert server_url(argv) == url


def test_a_url_that_cannot_be_told_from_the_command_line_is_refused() -> None:
    with pytest.raises(ConfigError, match="unix socket; set 'url'"):
        server_url(["api_server", "--uds", "/tmp/s"])
    with pytest.raises(ConfigError, match="not a port"):
        server_url(["api_server", "--port", "http"])


def test_a_servers_role_comes_from_its_kv_role_unless_given() -> None:
    assert [server_role("", r) for r in ("kv_producer", "kv_consumer", "kv_both")] == [
        "prefill",
        "decode",
        "both",
    ]
    assert server_role("both", "kv_consumer") == "both"
    with pytest.raises(ConfigError, match="set 'role'"):
        server_role("", None)


def _facts() -> ServerFacts:
    return ServerFacts("http://127.0.0.1:9", "decode", "m", Namespace("m", LAYOUT), 32, 4096)


def test_a_server_that_cannot_reach_etcd_fails_at_start_naming_it() -> None:
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{s.getsockname()[1]}"
    cfg = ConnectorConfig.from_extra({"endpoint": "h:1", "register": True, "etcd": nowhere})
    members = Membership(_facts(), cfg)
    start = time.monotonic()
    with pytest.raises(ConfigError, match=f"register: etcd at {nowhere} cannot be reached"):
        members.start(timeout_s=10.0)
    assert time.monotonic() - start < 10.0  # refused, not timed out
    members.stop()  # idempotent after a failed start


def test_the_record_counts_requests_in_flight_until_vllm_lets_them_go() -> None:
    cfg = ConnectorConfig.from_extra({"endpoint": "h:1", "register": True})
    members = Membership(_facts(), cfg)  # not started: the count is the scheduler's own
    for rid in ("a", "b", "c"):
        members.request_added(rid)
    members.request_finished("b")
    members.request_finished("b")  # vLLM calls it once; a second call changes nothing
    members.request_finished("never-added")
    assert (len(members._in_flight), members._done) == (2, 1)
    rec = members.record()
    assert (rec.role, rec.address, rec.block_tokens, rec.kv_codec) == (
        "decode", "http://127.0.0.1:9", 32, "none"
    )  # fmt: skip
    assert rec.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4  # layers, K and V, heads, dim, fp32
    assert rec.worker_id.startswith("vllm-decode-")


# -- the router's pools --------------------------------------------------------------------


def _record(wid: str, role: str, url: str, node: str = "n0", running: int = 0) -> WorkerRecord:
    return WorkerRecord(
        worker_id=wid, role=role, model="m", address=url,
        namespace={"model": "m", "layout": LAYOUT, "tenant": "default"}, store_node=node,
        block_tokens=32, load=WorkerLoad(running=running),
    )  # fmt: skip


def _etcd_pools() -> Pools:
    return Pools(PoolsConfig(prefill=[], decode=[], model="m", etcd="127.0.0.1:2379"))


def test_pools_come_from_flags_or_etcd_never_both() -> None:
    with pytest.raises(ValueError, match="not both"):
        Pools(PoolsConfig(prefill=["http://a"], decode=[], model="m", etcd="127.0.0.1:2379"))
    with pytest.raises(ValueError, match="or --etcd"):
        Pools(PoolsConfig(prefill=["http://a"], decode=[], model="m"))


def test_pools_follow_records_and_keep_each_servers_counters() -> None:
    pools = _etcd_pools()
    p0, d0 = _record("p0", "prefill", "http://p0"), _record("d0", "decode", "http://d0")
    both = _record("b0", "both", "http://b0")
    pools.follow([p0, both], [d0, both])
    assert [s.url for s in pools.prefill] == ["http://p0", "http://b0"]
    assert [s.url for s in pools.decode] == ["http://d0", "http://b0"]
    assert pools.prefill[1] is pools.decode[1]  # one server, one count, in both pools
    pools.decode[0].in_flight, pools.decode[0].failures = 2, 1
    pools.follow([p0], [replace(d0, load=WorkerLoad(running=5))])  # b0 left, d0 reported
    assert [s.url for s in pools.prefill] == ["http://p0"]
    (d,) = pools.decode
    assert (d.in_flight, d.failures, d.busy) == (2, 1, 5)


def test_least_busy_counts_the_servers_own_load_and_prefers_the_near_store() -> None:
    pools = _etcd_pools()
    a = _record("a", "decode", "http://a", node="n0", running=3)  # busy elsewhere
    b = _record("b", "decode", "http://b", node="n1")
    c = _record("c", "decode", "http://c", node="n0")
    pools.follow([], [a, b, c])
    order = [s.url for s in pools._least_busy(pools.decode)]
    assert order == ["http://b", "http://c", "http://a"]
    near = [s.url for s in pools._least_busy(pools.decode, near="n0")]
    assert near == ["http://c", "http://a", "http://b"]
    ns, block, store = pools.check_target(pools.decode[1])
    assert (ns, block, store) == (Namespace("m", LAYOUT, "default"), 32, "")  # node unknown


# -- LoRA adapters for the cache check (engine/serving/vllm_adapters.py) -------------------


def _models_list(*adapters: tuple[str, str]) -> dict[str, Any]:
    """A ``/v1/models`` body as vLLM writes it: the base model, then each adapter with
    its path (``root``) and base model (``parent``)."""
    cards = [{"id": "tiny", "root": "/models/tiny", "parent": None}]
    cards += [{"id": n, "root": p, "parent": "tiny"} for n, p in adapters]
    return {"object": "list", "data": cards}


def test_adapters_name_their_path_as_the_connector_does_and_are_read_again() -> None:
    import asyncio

    from engine.serving.vllm_adapters import BASE, REFRESH_S, UNKNOWN, Adapters

    now = [0.0]
    served = [_models_list(("sql", "/adapters/sql"))]
    calls: list[float] = []

    async def fetch() -> dict[str, Any]:
        calls.append(now[0])
        return served[-1]

    async def body() -> None:
        a = Adapters(fetch, {"/models/tiny"}, clock=lambda: now[0])
        assert await a.lora("/models/tiny") == BASE and await a.lora(None) == BASE
        assert calls == []  # the base model needs no list
        assert await a.lora("sql") == "sql@/adapters/sql"
        assert await a.lora("tiny") == BASE  # the base model's served name, learned
        assert await a.lora("chat") is UNKNOWN and len(calls) == 1  # asked again later
        served.append(_models_list(("sql", "/adapters/sql"), ("chat", "/adapters/chat")))
        now[0] += REFRESH_S
        assert await a.lora("chat") == "chat@/adapters/chat" and len(calls) == 2
        assert await a.lora("sql") == "sql@/adapters/sql" and len(calls) == 2
        served.append(_models_list(("sql", "/adapters/sql-v2")))  # loaded again elsewhere
        now[0] += REFRESH_S
        assert await a.lora("sql") == "sql@/adapters/sql-v2" and len(calls) == 3
        assert await a.lora("chat") is UNKNOWN  # unloaded

    asyncio.run(body())


def test_a_model_list_that_cannot_be_read_leaves_requests_unchecked() -> None:
    import asyncio

    from engine.serving.vllm_adapters import UNKNOWN, Adapters

    async def fetch() -> dict[str, Any]:
        raise OSError("connection refused")

    async def body() -> None:
        a = Adapters(fetch, {"tiny"})
        assert await a.lora("sql") is UNKNOWN
        assert await a.lora("tiny") == ""

    asyncio.run(body())


@pytest.mark.process
def test_a_lora_prompts_check_uses_the_adapters_chain(store_server: Any) -> None:
    """The router checks an adapter's prompt with the connector's keys (engine/vllm/keys.py):
    rooted in the adapter's name and path. Blocks stored under it are found under it
    only: not as the base model's, nor as the same adapter loaded from elsewhere."""
    from engine.vllm.keys import chain_root
    from kvstore import prefix_keys
    from tests.support.server_process import ALPHA

    ns = Namespace("tiny-lora-check", LAYOUT)
    ids = list(range(100))
    sql = prefix_keys(ids, 32, ns, parent=chain_root(ns, 32, lora="sql@/adapters/sql"))
    with store_server.client(ALPHA, namespace=ns) as c:
        shape = ns.kv_layout.block_shape()
        assert c.batch_put(sql, [np.ones(shape, np.float32)] * 3) == [True] * 3
    pools = _etcd_pools()
    pools.config.token = ALPHA.token
    try:
        target = (ns, 32, store_server.address)
        assert pools.cached_blocks(ids, target, lora="sql@/adapters/sql") == (3, 3)
        assert pools.cached_blocks(ids, target) == (0, 3)
        assert pools.cached_blocks(ids, target, lora="sql@/elsewhere") == (0, 3)
    finally:
        for client in pools._stores.values():
            client.close()
