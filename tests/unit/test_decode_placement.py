"""The router's decode choice (engine/serving/placement.py choose_decode): fewest
running first; at equal load the worker nearest the blocks (the prefill worker's store
node or host, then its zone, then anywhere); then the most free KV; never a worker
without room for the request's KV."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine.planning.scheduler import Refusal
from engine.registry import WorkerLoad, WorkerRecord
from engine.serving.placement import Outstanding, choose_decode, proximity

NS = {"model": "tiny", "layout": "fp32:L2:H2:D32:B16", "tenant": ""}


@dataclass(frozen=True)
class Node:
    """The one field of a directory NodeInfo that placement reads."""

    host_id: str


def worker(
    wid: str,
    *,
    role: str = "decode",
    node: str = "",
    host: str = "",
    zone: str = "",
    running: int = 0,
    free: int = 4096,
) -> WorkerRecord:
    return WorkerRecord(
        worker_id=wid,
        role=role,
        model="tiny",
        address=f"http://127.0.0.1/{wid}",
        namespace=NS,
        store_node=node,
        host_id=host or f"host-{wid}",
        zone=zone,
        load=WorkerLoad(running=running, free_kv_tokens=free, kv_capacity_tokens=8192),
    )


PREFILL = worker("p0", role="prefill", node="n0", host="hostA", zone="z1")
NODES = {"n0": Node("hostA"), "n1": Node("hostB")}


def pick(workers: list[WorkerRecord], kv: int = 100, out: Outstanding | None = None) -> str:
    chosen = choose_decode(workers, kv, PREFILL, out or Outstanding(), NODES)
    assert isinstance(chosen, WorkerRecord), chosen
    return chosen.worker_id


def test_proximity_ranks_node_host_zone_elsewhere() -> None:
    same_node = worker("d0", node="n0")
    same_host = worker("d1", node="n9", host="hostA")
    node_host = worker("d2", host="hostA")  # no node of its own, on n0's host
    same_zone = worker("d3", node="n1", host="hostB", zone="z1")
    elsewhere = worker("d4", node="n1", host="hostB", zone="z2")
    got = [proximity(w, PREFILL, NODES) for w in (same_node, same_host, node_host, same_zone)]
    assert got == [0, 0, 0, 1]
    assert proximity(elsewhere, PREFILL, NODES) == 2
    assert proximity(elsewhere, None, NODES) == 0  # a short prompt: no blocks to be near


@pytest.mark.parametrize(
    ("candidates", "expected"),
    [
        # equal load: the same node beats the same zone beats elsewhere, whatever the order
        (
            [
                worker("far", node="n1", host="hostB", zone="z2"),
                worker("zone", node="n1", host="hostB", zone="z1"),
                worker("near", node="n0"),
            ],
            "near",
        ),
        (
            [
                worker("far", node="n1", host="hostB", zone="z2"),
                worker("zone", node="n1", host="hostB", zone="z1"),
            ],
            "zone",
        ),
        # fewer running requests outweigh nearness
        ([worker("near", node="n0", running=2), worker("far", zone="z2", running=1)], "far"),
        # equally near and loaded: the most free KV
        ([worker("small", zone="z1", free=1000), worker("big", zone="z1", free=3000)], "big"),
    ],
)
def test_decode_choice_order(candidates: list[WorkerRecord], expected: str) -> None:
    assert pick(candidates) == expected


def test_a_worker_without_room_is_skipped_and_none_is_refused() -> None:
    near, far = worker("near", node="n0", free=50), worker("far", zone="z2", free=500)
    assert pick([near, far], kv=100) == "far"
    refused = choose_decode([near, far], 1000, PREFILL, Outstanding(), NODES)
    assert isinstance(refused, Refusal) and "1000" in str(refused)


def test_what_this_router_sent_counts_before_etcd_says_so() -> None:
    """Requests the router sent and has not seen finish count as running and as KV used:
    the etcd load report lags, and two quick requests must not pile onto one worker."""
    near, zone = worker("near", node="n0"), worker("zone", zone="z1")
    out = Outstanding()
    assert pick([near, zone], out=out) == "near"
    out.add("near", running=1, kv=100)
    assert pick([near, zone], out=out) == "zone"
    out.add("zone", running=1, kv=8100)  # 92 of zone's 8192 tokens of capacity left
    assert pick([near, zone], kv=200, out=out) == "near"
