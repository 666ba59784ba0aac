"""``vllm serve`` pools that follow the directory (issue 33): servers whose connector has
``"register": true`` put themselves in a real etcd, and ``kvstore vllm-router --etcd``
follows them. Real ``vllm serve`` processes (vLLM's OpenAI server module, CPU build), a
real ``kvstore serve`` registered in the same etcd, the ``openai`` client against the
router. Runs in .venv-vllm (``make test-vllm``).

The router starts first, with an empty pool; a prefill server and a decode server
(``killed``: a short lease) start after it, with a server told to register in an etcd
that is not there. The tests then read the records, start a second decode server
(``stopped``: a long lease, a draining stop), kill the first with requests in flight
there, and stop the second. Each test needs only the fixtures it names; in file order
they follow one pool through its life.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from engine.registry import WorkerRecord, vllm_servers_prefix  # noqa: E402
from tests.support.etcd_fixtures import EtcdProcess  # noqa: E402
from tests.support.server_process import ServerProcess, base_flags  # noqa: E402
from tests.support.vllm_fixtures import BLOCK, write_tiny_llama  # noqa: E402
from tests.support.vllm_serve import ApiServer, connector, etcd_router, free_port  # noqa: E402

pytest_plugins = ["tests.support.etcd_fixtures"]
pytestmark = pytest.mark.process

CLUSTER = "vllm-pools"
KILLED_TTL_S = 3  # the decode server killed below leaves when this lapses
STOPPED_TTL_S = 60  # the one stopped below must leave long before this could lapse


def _records(etcd: EtcdProcess) -> dict[str, WorkerRecord]:
    """The registered vLLM servers, by URL, read from etcd itself (its JSON gateway)."""
    prefix = vllm_servers_prefix(CLUSTER)
    end = prefix[:-1] + bytes([prefix[-1] + 1])
    body = {"key": base64.b64encode(prefix).decode(), "range_end": base64.b64encode(end).decode()}
    got = httpx.post(f"http://{etcd.endpoint}/v3/kv/range", json=body, timeout=10).json()
    recs = [WorkerRecord.from_json(base64.b64decode(kv["value"])) for kv in got.get("kvs", [])]
    return {r.address: r for r in recs}


def _load(pool: dict[str, Any], url: str) -> tuple[int, int]:
    """(requests in flight, requests done) as the server's record says; (-1, -1) if none."""
    rec = _records(pool["etcd"]).get(url)
    return (rec.load.running, rec.load.done) if rec is not None else (-1, -1)


def _pools(router: str) -> dict[str, list[str]]:
    """The router's pools: role -> server URLs."""
    health = httpx.get(router + "/health", timeout=10).json()
    return {role: [s["url"] for s in servers] for role, servers in health["pools"].items()}


def _wait(what: str, cond: Callable[[], bool], timeout_s: float = 60.0) -> float:
    """Seconds until ``cond()`` holds; fails naming ``what`` past ``timeout_s``."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)
    return time.monotonic() - start


def _prompt(seed: int, n: int) -> list[int]:
    import random

    rnd = random.Random(seed)
    return [rnd.randrange(4, 500) for _ in range(n)]


def _server(
    pool: dict[str, Any], name: str, role: str, ttl: int, *args: str, etcd: str = ""
) -> ApiServer:
    kv = connector(role, pool["store"], register=True, etcd=etcd or pool["etcd"].endpoint,
                   cluster=CLUSTER, lease_ttl_s=ttl)  # fmt: skip
    return ApiServer(pool["model"], pool["root"], name, kv, "float32", extra_args=args)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, etcd_server: EtcdProcess) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("vllm-pools")
    (root / "store").mkdir()
    store = ServerProcess(
        root / "store",
        {**base_flags(root / "store"), "etcd": etcd_server.endpoint, "cluster": CLUSTER,
         "node_id": "n0"},
    ).start()  # fmt: skip
    p: dict[str, Any] = {"root": root, "model": write_tiny_llama(root / "tiny"),
                         "store": store, "etcd": etcd_server, "servers": []}  # fmt: skip
    try:
        with etcd_router(root, p["model"], etcd_server.endpoint, CLUSTER) as router:
            p["router"] = router
            assert _pools(router) == {"prefill": [], "decode": []}
            nowhere = f"127.0.0.1:{free_port()}"  # no etcd listens there
            p["prefill"] = _server(p, "prefill", "kv_producer", 10)
            p["killed"] = _server(p, "killed", "kv_consumer", KILLED_TTL_S)
            p["no-etcd"] = _server(p, "no-etcd", "kv_consumer", 10, etcd=nowhere)
            p["nowhere"] = nowhere
            p["servers"] += [p["prefill"], p["killed"], p["no-etcd"]]
            p["prefill"].wait_ready()
            p["killed"].wait_ready()
            yield p
    finally:
        for s in p["servers"]:
            s.stop()
        store.stop()


@pytest.fixture(scope="module")
def stopped(pool: dict[str, Any]) -> ApiServer:
    """A second decode server, started once the pool serves; it drains on a stop."""
    server = _server(pool, "stopped", "kv_consumer", STOPPED_TTL_S, "--shutdown-timeout", "30")
    pool["servers"].append(server)
    server.wait_ready()
    return server


def _complete(router: str, model: Path, prompt: list[int], max_tokens: int) -> Any:
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0)
    return client.completions.with_raw_response.create(
        model=str(model), prompt=prompt, max_tokens=max_tokens, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip


def test_a_registered_server_is_in_etcd_with_its_facts_and_serves(pool: dict[str, Any]) -> None:
    """URL, role, model, the store node beside it and its load; in the router's pools
    once it serves, and a request goes through it."""
    prefill, decode = pool["prefill"], pool["killed"]
    both = {"prefill": [prefill.url], "decode": [decode.url]}
    _wait("both servers in the router's pools", lambda: _pools(pool["router"]) == both)
    recs = _records(pool["etcd"])
    assert set(recs) == {prefill.url, decode.url}
    for server, role in ((prefill, "prefill"), (decode, "decode")):
        rec = recs[server.url]
        assert (rec.role, rec.model, rec.store_node) == (role, str(pool["model"]), "n0")
        assert rec.load.running == 0
        assert rec.block_tokens == BLOCK and rec.namespace["layout"].startswith("float32:L")
    prompt = _prompt(1, 2 * BLOCK + 3)
    raw = _complete(pool["router"], pool["model"], prompt, 8)
    assert raw.headers["x-kvstore-prefill"] == prefill.url
    assert raw.headers["x-kvstore-decode"] == decode.url
    assert raw.headers["x-kvstore-cached-blocks"] == "0/2"
    assert raw.parse().usage.completion_tokens == 8
    # the cache check asks the store node the record names, in the record's namespace
    again = _complete(pool["router"], pool["model"], prompt, 8)
    assert again.headers["x-kvstore-cached-blocks"] == "2/2"
    assert again.headers["x-kvstore-prefill"] == "skipped"
    assert again.parse().choices[0].text == raw.parse().choices[0].text
    # its load: done and no longer in flight (in flight: the kill test's barrier)
    _wait("the decode server's record counts both done", lambda: _load(pool, decode.url) == (0, 2))


def test_a_server_told_to_register_without_etcd_fails_at_start(pool: dict[str, Any]) -> None:
    server = pool["no-etcd"]
    assert server.proc.wait(300) != 0
    log = server.log.read_text()
    assert f"register: etcd at {pool['nowhere']} cannot be reached" in log
    assert server.url not in _records(pool["etcd"])


def test_a_server_started_later_joins_its_pool_and_gets_requests(
    pool: dict[str, Any], stopped: ApiServer
) -> None:
    router = pool["router"]
    _wait("the new server in the decode pool", lambda: stopped.url in _pools(router)["decode"])
    prompt = _prompt(2, 3 * BLOCK + 1)
    answers = {}
    for _ in range(2):  # idle servers take turns
        raw = _complete(router, pool["model"], prompt, 16)
        answers[raw.headers["x-kvstore-decode"]] = raw.parse().choices[0].text
    assert stopped.url in answers
    assert len(set(answers.values())) == 1  # the same greedy answer wherever it ran


def test_a_killed_server_leaves_its_pool_within_its_lease_and_its_requests_fail_over(
    pool: dict[str, Any], stopped: ApiServer
) -> None:
    """SIGKILL (the API server and its engine) with a request in flight on each decode
    server: the killed server's request is answered by the other; the killed server
    leaves the pool once its lease lapses, and requests sent meanwhile are answered."""
    router, killed, model = pool["router"], pool["killed"], pool["model"]
    both = {killed.url, stopped.url}
    _wait("both decode servers pooled", lambda: set(_pools(router)["decode"]) == both)
    start = time.monotonic()
    _complete(router, model, _prompt(3, BLOCK), 64)
    per_token_s = (time.monotonic() - start) / 64
    # long enough to be caught in flight on any machine: ~5 s of this one's decoding
    max_tokens = int(min(3000, max(256, 5.0 / per_token_s)))
    results: list[Any] = []

    def ask(seed: int) -> None:
        results.append(_complete(router, model, _prompt(seed, BLOCK + 5), max_tokens))

    threads = [threading.Thread(target=ask, args=(seed,)) for seed in (4, 5)]
    for t in threads:
        t.start()

    def both_busy() -> bool:
        return all(_load(pool, url)[0] >= 1 for url in (killed.url, stopped.url))

    _wait("a request in flight on each decode server, as their records say", both_busy)
    for pid in killed.pids():
        os.kill(pid, signal.SIGKILL)
    killed.proc.wait(30)
    killed_at = time.monotonic()
    after = _complete(router, model, _prompt(6, BLOCK + 2), 4)  # sent while it lingers
    assert after.headers["x-kvstore-decode"] == stopped.url
    for t in threads:
        t.join(300)
    assert [r.headers["x-kvstore-decode"] for r in results] == [stopped.url] * 2
    assert all(r.parse().usage.completion_tokens == max_tokens for r in results)
    _wait("the killed server out of the pool", lambda: killed.url not in _pools(router)["decode"])
    assert time.monotonic() - killed_at <= KILLED_TTL_S + 10  # its lease, and a margin
    assert killed.url not in _records(pool["etcd"])


def test_a_clean_stop_deregisters_at_once(pool: dict[str, Any], stopped: ApiServer) -> None:
    """SIGTERM: the record goes when the engine gets the signal, long before its lease
    (refreshed every third of STOPPED_TTL_S) could lapse; the pool is then empty."""
    router = pool["router"]
    _wait("the server pooled", lambda: stopped.url in _pools(router)["decode"])
    stopped.proc.send_signal(signal.SIGTERM)
    gone = _wait("its record out of etcd", lambda: stopped.url not in _records(pool["etcd"]))
    assert gone < STOPPED_TTL_S / 2
    _wait("the server out of the pool", lambda: stopped.url not in _pools(router)["decode"], 10)
    assert stopped.proc.wait(60) == 0
    with pytest.raises(openai.APIStatusError) as refused:
        _complete(router, pool["model"], _prompt(7, BLOCK), 2)
    assert refused.value.status_code == 503
    assert json.loads(refused.value.response.text)["error"]["message"] == (
        "no decode server in the pool"
    )
