"""A 60 s soak (benchmarks/soak.py): two clients, three nodes, a fault every 15 s (a
node SIGKILLed and restarted, one SIGSTOPped past its lease, etcd restarted). Every
read is checked byte for byte; no wrong bytes, no process or segment leaks, and a
frozen node leaves every client's mirror within TTL + 1 s."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from benchmarks.soak import SoakConfig, run, table
from tests.support.etcd_fixtures import require_etcd

pytest.importorskip("aetcd")

pytestmark = pytest.mark.process

RPC_WORKERS = 8  # ServerConfig.workers, the default: the most kvstore-rpc threads a server runs
GRPC_AIO_THREADS = {"grpc_global_tim", "event_engine", "lifeguard", "python"}
GRPC_AIO_FDS = 10  # its epoll/eventfd descriptors and a few sockets: seen 7, bounded


def test_a_minute_of_faults_reads_no_wrong_bytes_and_leaks_nothing(tmp_path: Path) -> None:
    require_etcd()
    cfg = SoakConfig(
        clients=2,
        seconds=60.0,
        fault_every=15.0,
        warmup_s=8.0,
        lease_ttl_s=2.0,
        stop_s=5.0,
        etcd_down_s=2.0,
        faults=("stop", "etcd", "kill"),
    )
    report = run(cfg, root=tmp_path, log=lambda _: None)
    print(table(report))  # shown with -s, and kept in the failure report
    totals = report["totals"]

    assert report["worker_failures"] == []
    assert totals["ops"] > 1000, totals
    assert (totals["wrong_reads"], totals["wrong_bytes"]) == (0, 0), totals
    assert totals["replicated_get_errors"] == 0, report["phases"]  # another replica lived
    phases = report["phases"]
    assert phases["kill"]["count"] == phases["stop"]["count"] == phases["etcd"]["count"] == 1
    for kind in ("kill", "stop", "etcd"):
        assert None not in phases[kind]["converge_s"], (kind, phases[kind])
    left = phases["stop"]["left_mirrors_s"]
    # The TTL + 1 s target is held on a quiet cluster by test_partitions; here the
    # watcher polls every client's mirror while they load both cores, so 1 s more.
    assert left and left[0] is not None and left[0] <= cfg.lease_ttl_s + 2.0, left

    assert report["leaked_segments"] == []
    for node, s in report["servers"].items():
        before, after = s["before"], s["after"]
        if s["restarts"]:
            continue  # a new life: its own start is not this baseline
        assert after["fds"] <= before["fds"], (node, s)  # every connection's socket went
        # Threads that outlive the clients can only be pools grown on demand to their
        # bound: the server's kvstore-rpc workers (8) and gRPC's event engine.
        grown = Counter(after["thread_names"]) - Counter(before["thread_names"])
        assert set(grown) <= {"python", "event_engine"}, (node, s)
        assert grown["python"] <= RPC_WORKERS and grown["event_engine"] <= 4, (node, s)
    client = report["client_process"]
    before, after = client["before"], client["after"]
    extra = Counter(after["thread_names"]) - Counter(before["thread_names"])
    # Often after an etcd restart, gRPC's process-wide aio state (its poller, event-engine
    # and timer threads, ~7 fds) outlives the clients, all closed; it does not grow with
    # more runs in one process (reported in issue 18). Anything else is a leak.
    assert set(extra) <= GRPC_AIO_THREADS and extra["python"] <= 1, client
    opened = sorted(set(after["sockets"]) - set(before["sockets"]))
    # No socket to etcd outlives the closed clients, etcd restart or not (issue 33: a
    # failed call held by a reference cycle kept a closed channel's connection until the
    # cyclic GC ran; tests/cluster/test_etcd_sockets.py holds that without the GC).
    etcd_port = str(report["endpoints"]["etcd"]).rpartition(":")[2]
    to_etcd = [o for o in opened if o.split("->")[-1].split()[0].endswith(f":{etcd_port}")]
    assert to_etcd == [], (to_etcd, report.get("endpoints"), client)
    allowed = GRPC_AIO_FDS if extra else 0
    files = sorted(set(after["files"]) - set(before["files"]))
    kinds = (before["fd_kinds"], after["fd_kinds"], files)  # which descriptor stayed
    assert after["fds"] <= before["fds"] + allowed, (kinds, opened, dict(extra), after["fds"])
