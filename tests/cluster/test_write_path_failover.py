"""A hung node must not take a cluster call's whole deadline (issue 18): etcd plus two
``kvstore serve`` processes on 127.0.0.1, one of them SIGSTOPped (a frozen process: it
still accepts TCP connections but answers nothing). A put fails over to the other node
and a get to the other replica, both well before the caller's deadline. The stopped
node is resumed and ended by its PID at the end.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore import StoreClient
from kvstore.client.cluster import ClusterClient
from kvstore.directory.etcd_process import EtcdProcess
from kvstore.tier_kinds import TierKind
from tests.support.server_process import ALPHA, ServerProcess, base_flags, principal_of
from tests.support.waiting import wait_until

pytest.importorskip("aetcd")

SCOPE = principal_of(ALPHA)
DEADLINE_S = 3.0


def _value(key: bytes) -> np.ndarray:
    return np.frombuffer(hashlib.sha512(key).digest() * 64, dtype=np.uint8).copy()


@pytest.fixture
def nodes(
    etcd_server: EtcdProcess, tmp_path: Path, cluster_name: str
) -> Iterator[dict[str, ServerProcess]]:
    """Nodes ``a`` and ``b``; leases long enough that a frozen node stays listed."""
    started: dict[str, ServerProcess] = {}
    try:
        for node_id in ("a", "b"):
            workdir = tmp_path / node_id
            workdir.mkdir()
            flags = {
                **base_flags(workdir),
                "node_id": node_id,
                "dram_bytes": "16MiB",
                "ssd_bytes": "32MiB",
                "etcd": etcd_server.endpoint,
                "cluster": cluster_name,
                "node_lease_ttl_s": 30,
            }
            started[node_id] = ServerProcess(workdir, flags).start()
        yield started
    finally:
        for s in started.values():
            if s.proc is not None and s.proc.poll() is None:
                os.kill(s.pid, signal.SIGCONT)  # a stopped process cannot take SIGTERM
            s.stop()


def _stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` has stopped (a SIGSTOP lands on each thread as
    it next runs; one busy-polling a socket may still answer a request meanwhile)."""
    tasks = Path(f"/proc/{pid}/task")
    return all(
        (t / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T" for t in tasks.iterdir()
    )


def _client(etcd: str, cluster: str, **kw: object) -> ClusterClient:
    """Over TCP: a same-host client would read a frozen node's DRAM straight from its
    shared memory, which needs no answer from it."""
    return StoreClient.from_etcd(  # type: ignore[no-any-return]
        etcd, cluster=cluster, token=ALPHA.token, timeout_s=DEADLINE_S, transport="tcp", **kw
    )


def test_a_hung_node_costs_a_share_of_the_deadline_not_all_of_it(
    nodes: dict[str, ServerProcess], etcd_server: EtcdProcess, cluster_name: str
) -> None:
    both = os.urandom(16)
    with (
        _client(etcd_server.endpoint, cluster_name, node_id="a") as reader,
        _client(etcd_server.endpoint, cluster_name, node_id="a") as writer,
        _client(etcd_server.endpoint, cluster_name, node_id="b") as cb,
        _client(etcd_server.endpoint, cluster_name, node_id="a") as remover,
    ):
        assert writer.put(both, _value(both)) and cb.put(both, _value(both))

        def listed() -> bool:
            reps = {r.node_id: r.tier for r in reader.mirror.replicas(SCOPE.scope(both))}
            return reps == {"a": TierKind.DRAM, "b": TierKind.DRAM}

        wait_until(listed, "both copies in the mirror")
        out = np.empty_like(_value(both))
        assert reader.get_into(both, out)  # from a (nearest by node id): connection open
        assert reader.counters.get("served.a") == 1
        assert remover.get_into(both, out)  # its connection to a is open too

        os.kill(nodes["a"].pid, signal.SIGSTOP)
        try:
            wait_until(lambda: _stopped(nodes["a"].pid), "node a frozen")
            t0 = time.monotonic()
            assert reader.get_into(both, out) and np.array_equal(out, _value(both))
            took_get = time.monotonic() - t0
            assert reader.counters.get("served.b") == 1, reader.counters.snapshot()

            fresh = os.urandom(16)
            t0 = time.monotonic()
            assert writer.put(fresh, _value(fresh)) is True  # a first, then b
            took_put = time.monotonic() - t0
            assert writer.counters.get("node_failures") == 1

            t0 = time.monotonic()  # remove asks every live node: a hung one costs a share
            assert remover.remove([fresh]) >= 1  # b's copy went (a, frozen, may store
            # the put it had half-received once it runs again)
            took_remove = time.monotonic() - t0
        finally:
            os.kill(nodes["a"].pid, signal.SIGCONT)
        print(f"get failed over in {took_get:.2f} s, put in {took_put:.2f} s")
        assert took_get < 0.75 * DEADLINE_S
        assert took_put < 0.75 * DEADLINE_S
        assert took_remove < 0.75 * DEADLINE_S
