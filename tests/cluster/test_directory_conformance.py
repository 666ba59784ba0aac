"""One conformance suite for every Directory: the embedded one and etcd.

Each test gets ``make``: a factory of open-able directories that all see the same
cluster (several clients of one backend, or of one etcd under a cluster name of
the test's own). Coroutines run under ``asyncio.run``; waits are on revisions or
bounded polls of the mirror, never bare sleeps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from kvstore.directory import Directory, MemoryBackend, MemoryDirectory, Mirror, NodeInfo, Replica
from kvstore.directory.publisher import Publisher
from kvstore.errors import (
    ClosedError,
    ConfigError,
    ConflictError,
    InvalidValue,
    LeaseExpired,
    NotFound,
)
from kvstore.events import BlockMoved, BlockRemoved, BlockStored
from kvstore.node.store import StoreNode
from kvstore.tier_kinds import TierKind

TTL = 2
DRAM, SSD, HBM = TierKind.DRAM, TierKind.SSD, TierKind.HBM
T = TypeVar("T")
Make = Callable[[], Directory]


def run(coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def info(node_id: str, host: str = "h1") -> NodeInfo:
    return NodeInfo(node_id, host, f"{host}:7400", tiers={DRAM: 1 << 30, SSD: 1 << 34})


def stored(ks: list[bytes], tier: TierKind = DRAM, size: int = 4096) -> list[BlockStored]:
    return [BlockStored(k, tier, size, b"") for k in ks]


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> float:
    """Poll ``cond`` until true; returns the seconds it took (fails on timeout)."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def seen(d: Directory, rev: int) -> Mirror:
    m = await d.mirror()
    assert await m.wait_for_revision(rev, 5.0)
    return m


@pytest.fixture(params=["memory", pytest.param("etcd", marks=pytest.mark.process)])
def make(request: pytest.FixtureRequest, cluster_name: str) -> Iterator[Make]:
    if request.param == "memory":
        backend = MemoryBackend()
        yield lambda: MemoryDirectory(backend, cluster_name)
        backend.close()
        return
    from kvstore.directory.etcd import EtcdDirectory

    server = request.getfixturevalue("etcd_server")
    yield lambda: EtcdDirectory(server.endpoint, cluster_name)


# -- membership -------------------------------------------------------------------------


def test_register_lists_node_with_epoch(make: Make) -> None:
    async def body() -> None:
        async with make() as a, make() as reader:
            got = await a.register_node(info("n1"), ttl=TTL)
            assert got.epoch != 0 and got.node_id == "n1"
            assert a.registration("n1") == got
            assert [n.node_id for n in await reader.list_nodes()] == ["n1"]
            listed = (await reader.list_nodes())[0]
            assert listed.epoch == got.epoch and listed.tiers == {DRAM: 1 << 30, SSD: 1 << 34}
            m = await reader.mirror()
            await until(lambda: m.node("n1") is not None)
            assert m.node("n1") == got

    run(body())


def test_second_claim_of_live_id_is_refused(make: Make) -> None:
    async def body() -> None:
        async with make() as a, make() as b:
            first = await a.register_node(info("dup", host="h1"), ttl=TTL)
            with pytest.raises(ConflictError, match="held by a live node"):
                await b.register_node(info("dup", host="h2"), ttl=TTL)
            with pytest.raises(ConflictError):
                await a.register_node(info("dup"), ttl=TTL)
            with pytest.raises(ConflictError):  # a live holder does not lapse while waiting
                await b.register_node(info("dup", host="h2"), ttl=TTL, wait=0.5)
            assert [n.host for n in await b.list_nodes()] == ["h1"]
            assert (await b.list_nodes())[0].epoch == first.epoch

    run(body())


def test_deregister_and_close_remove_everything_at_once(make: Make) -> None:
    async def body() -> None:
        async with make() as reader:
            m = await reader.mirror()
            a = make()
            await a.open()
            await a.register_node(info("n1"), ttl=TTL)
            await a.register_node(info("n2"), ttl=TTL)
            await seen(reader, await a.publish("n1", stored(keys(50))))
            await seen(reader, await a.publish("n2", stored(keys(20))))
            assert len(m) == 70
            await a.deregister("n1")
            await until(lambda: len(m) == 20 and m.node("n1") is None)
            await a.close()  # deregisters n2 too
            await until(lambda: len(m) == 0 and not m.nodes())
            assert await reader.list_nodes() == []

    run(body())


def test_killed_node_vanishes_within_ttl_and_restart_gets_new_epoch(make: Make) -> None:
    async def body() -> None:
        async with make() as reader:
            m = await reader.mirror()
            a = make()
            await a.open()
            old = await a.register_node(info("n1"), ttl=TTL)
            ks = keys(30)
            await seen(reader, await a.publish("n1", stored(ks)))
            await a.close(deregister=False)  # keepalive stops, as in a crash
            b = make()
            await b.open()
            with pytest.raises(ConflictError):
                await b.register_node(info("n1"), ttl=TTL)
            took = await until(lambda: len(m) == 0 and m.node("n1") is None, TTL + 3)
            assert took <= TTL + 1.0
            new = await b.register_node(info("n1"), ttl=TTL, wait=TTL + 1)
            assert new.epoch != old.epoch
            await seen(reader, await b.publish("n1", stored(ks[:3])))
            assert m.longest_prefix(ks) == {"n1": 3}
            assert m.node("n1") is not None and m.node("n1").epoch == new.epoch  # type: ignore[union-attr]
            await b.close()

    run(body())


def test_restart_waits_out_previous_life(make: Make) -> None:
    async def body() -> None:
        a, b = make(), make()
        await a.open()
        await b.open()
        old = await a.register_node(info("n1"), ttl=TTL)
        await a.close(deregister=False)
        start = time.monotonic()
        new = await b.register_node(info("n1"), ttl=TTL, wait=TTL + 2)
        assert time.monotonic() - start <= TTL + 1.0
        assert new.epoch != old.epoch and new.boot_id != old.boot_id
        await b.close()

    run(body())


def test_lost_lease_recovers_with_new_epoch_and_republishes(make: Make) -> None:
    async def body() -> None:
        async with make() as a, make() as reader:
            m = await reader.mirror()
            old = await a.register_node(info("n1"), ttl=TTL)
            ks = keys(40)
            await seen(reader, await a.publish("n1", stored(ks[:30])))
            await reader._revoke(old.epoch)  # type: ignore[attr-defined]  # the lease is lost
            await until(lambda: len(m) == 0)
            rev = await a.publish("n1", stored(ks[30:]))  # finds the loss, re-registers
            assert a.registration("n1").epoch != old.epoch
            await seen(reader, rev)
            assert m.longest_prefix(ks) == {"n1": 40}
            assert m.node("n1").epoch == a.registration("n1").epoch  # type: ignore[union-attr]

    run(body())


# -- updating a live record (drain) ----------------------------------------------------------


def test_update_node_changes_the_record_in_place(make: Make) -> None:
    async def body() -> None:
        async with make() as a, make() as reader:
            m = await reader.mirror()
            got = await a.register_node(info("n1"), ttl=TTL)
            ks = keys(20)
            await seen(reader, await a.publish("n1", stored(ks)))
            assert m.node("n1") is not None and not m.node("n1").draining  # type: ignore[union-attr]
            rev = await a.update_node("n1", draining=True)
            await seen(reader, rev)
            now = m.node("n1")
            assert now is not None and now.draining
            assert now == dataclasses.replace(got, draining=True)  # same life, same epoch
            assert a.registration("n1").draining
            assert [n.draining for n in await reader.list_nodes()] == [True]
            assert len(m) == 20  # block entries untouched
            assert await a.update_node("n1", draining=True) == rev  # no change: no write
            await seen(reader, await a.update_node("n1", draining=False))
            assert not m.node("n1").draining  # type: ignore[union-attr]
            with pytest.raises(InvalidValue, match="boot_id"):
                await a.update_node("n1", boot_id="other")
            with pytest.raises(InvalidValue, match="epoch"):
                await a.update_node("n1", epoch=1)
            with pytest.raises(NotFound):
                await a.update_node("nobody", draining=True)
            assert m.node("n1") == got

    run(body())


def test_update_survives_a_lost_lease(make: Make) -> None:
    async def body() -> None:
        async with make() as a, make() as reader:
            m = await reader.mirror()
            old = await a.register_node(info("n1"), ttl=TTL)
            await a.update_node("n1", draining=True)
            await reader._revoke(old.epoch)  # type: ignore[attr-defined]  # the lease is lost
            await until(lambda: m.node("n1") is None)
            await seen(reader, await a.publish("n1", stored(keys(3))))  # re-registers
            again = m.node("n1")
            assert again is not None and again.epoch != old.epoch and again.draining
            # lost again, and the update is what finds out: it re-registers with itself
            await reader._revoke(again.epoch)  # type: ignore[attr-defined]
            await until(lambda: m.node("n1") is None)
            await seen(reader, await a.update_node("n1", draining=False))
            third = m.node("n1")
            assert third is not None and not third.draining
            assert third.epoch not in (old.epoch, again.epoch) and len(m) == 3

    run(body())


def test_a_stale_life_cannot_overwrite_a_newer_registration(make: Make) -> None:
    async def body() -> None:
        async with make() as a, make() as b, make() as reader:
            old = await a.register_node(info("n1", host="h1"), ttl=TTL)
            await a.deregister("n1")  # the old life ends (its lease is gone)
            new = await b.register_node(info("n1", host="h2"), ttl=TTL)
            stale = dataclasses.replace(old, draining=True)
            with pytest.raises(LeaseExpired):  # its lease is gone
                await a._update_node(stale, old.epoch)  # type: ignore[attr-defined]
            live = await a._grant(TTL)  # type: ignore[attr-defined]
            with pytest.raises(LeaseExpired):  # a live lease, but not the record's
                await a._update_node(stale.with_epoch(live), live)  # type: ignore[attr-defined]
            await a._revoke(live)  # type: ignore[attr-defined]
            assert await reader.list_nodes() == [new]
            assert not new.draining and new.host == "h2"

    run(body())


# -- publishing and reads ------------------------------------------------------------------


def test_publish_stored_moved_removed(make: Make) -> None:
    async def body() -> None:
        async with make() as a, make() as reader:
            await a.register_node(info("n1"), ttl=TTL)
            ks = keys(300)  # more than one 128-op transaction
            m = await seen(reader, await a.publish("n1", stored(ks, size=1000)))
            assert len(m) == 300 and m.revision >= 1
            rev = await a.publish(
                "n1",
                [
                    BlockMoved(ks[0], DRAM, SSD),
                    BlockRemoved(ks[1], DRAM),
                    *stored([ks[2]], HBM, 77),
                    BlockStored(ks[3], DRAM, 5, b""),  # stored and removed: coalesced away
                    BlockRemoved(ks[3], DRAM),
                ],
            )
            await seen(reader, rev)
            assert m.replicas(ks[0]) == (Replica("n1", SSD, 1000),)
            assert m.replicas(ks[1]) == () and m.replicas(ks[3]) == ()
            assert m.replicas(ks[2]) == (Replica("n1", HBM, 77),)
            got = await reader.lookup([ks[0], ks[1], ks[4]])
            assert got == [(Replica("n1", SSD, 1000),), (), (Replica("n1", DRAM, 1000),)]
            assert a.pending("n1") == 0

    run(body())


def test_nearest_prefers_node_then_host_then_tier(make: Make) -> None:
    async def body() -> None:
        async with make() as a, make() as reader:
            for nid, host in (("a", "h1"), ("b", "h1"), ("c", "h2"), ("d", "h2")):
                await a.register_node(info(nid, host), ttl=TTL)
            k = keys(1)[0]
            await a.publish("a", stored([k], SSD))
            await a.publish("b", stored([k], DRAM))
            await a.publish("c", stored([k], HBM))
            m = await seen(reader, await a.publish("d", stored([k], DRAM)))
            assert len(m.replicas(k)) == 4
            assert m.nearest(k, "a", "h1") == Replica("a", SSD, 4096)  # same node first
            assert m.nearest(k, "x", "h1") == Replica("b", DRAM, 4096)  # then same host
            assert m.nearest(k, "x", "h2") == Replica("c", HBM, 4096)  # fastest tier there
            assert [r.node_id for r in m.ranked(k, None, "h9")] == ["c", "b", "d", "a"]
            assert await reader.nearest(keys(1)[0]) is None
            await a.deregister("c")
            await until(lambda: len(m.replicas(k)) == 3)
            assert m.nearest(k, "x", "h2") == Replica("d", DRAM, 4096)

    run(body())


def test_longest_prefix_per_node(make: Make) -> None:
    async def body() -> None:
        async with make() as a, make() as reader:
            for nid in ("a", "b", "c"):
                await a.register_node(info(nid), ttl=TTL)
            ks = keys(64)
            await a.publish("a", stored(ks))
            await a.publish("b", stored(ks[:32]))
            await a.publish("c", stored(ks[:10] + ks[11:40]))  # a hole at 10
            m = await seen(reader, await a.publish("c", stored(keys(5))))
            assert m.longest_prefix(ks) == {"a": 64, "b": 32, "c": 10}
            assert await reader.longest_prefix(ks[:8]) == {"a": 8, "b": 8, "c": 8}
            assert m.longest_prefix(ks[1:]) == {"a": 63, "b": 31, "c": 9}
            assert m.longest_prefix(keys(3)) == {}
            assert m.longest_prefix([]) == {}

    run(body())


def test_sync_writes_only_differences(make: Make) -> None:
    async def body() -> None:
        async with make() as a, make() as reader:
            await a.register_node(info("n1"), ttl=TTL)
            ks = keys(10)
            m = await seen(reader, await a.publish("n1", stored(ks[:6], size=10)))
            snap: dict[bytes, tuple[TierKind, int | None]] = {k: (DRAM, None) for k in ks[2:6]}
            snap[ks[6]] = (SSD, 99)  # new
            snap[ks[5]] = (SSD, None)  # moved, size kept
            await seen(reader, await a.sync("n1", snap))
            assert m.lookup(ks[:2]) == [(), ()]
            assert m.replicas(ks[2]) == (Replica("n1", DRAM, 10),)
            assert m.replicas(ks[5]) == (Replica("n1", SSD, 10),)
            assert m.replicas(ks[6]) == (Replica("n1", SSD, 99),)
            assert len(m) == 5

    run(body())


def test_mirror_reads_from_another_thread(make: Make) -> None:
    async def body() -> None:
        async with make() as a, make() as reader:
            await a.register_node(info("n1"), ttl=TTL)
            m = await reader.mirror()
            ks = keys(64)
            errors: list[BaseException] = []
            stop = threading.Event()
            target = [0]

            def reader_thread() -> None:
                try:
                    while not stop.is_set():
                        n = m.longest_prefix(ks).get("n1", 0)
                        assert 0 <= n <= 64
                        m.nearest(ks[0], "n1", "h1")
                    assert m.wait_for_revision_sync(target[0], 5.0)
                except BaseException as exc:
                    errors.append(exc)

            t = threading.Thread(target=reader_thread)
            t.start()
            for i in range(0, 64, 8):
                target[0] = await a.publish("n1", stored(ks[i : i + 8]))
            stop.set()
            await asyncio.to_thread(t.join, 10)
            assert not errors
            await m.wait_for_revision(target[0], 5.0)
            assert m.longest_prefix(ks) == {"n1": 64}

    run(body())


def test_lifecycle_and_validation(make: Make) -> None:
    async def body() -> None:
        d = make()
        with pytest.raises(ClosedError):
            await d.register_node(info("n1"))
        async with d:
            with pytest.raises(NotFound):
                await d.publish("nope", stored(keys(1)))
            with pytest.raises(NotFound):
                d.registration("nope")
        with pytest.raises(ClosedError):
            await d.mirror()
        with pytest.raises(ClosedError):
            await d.open()

    run(body())
    with pytest.raises(ConfigError):
        NodeInfo("bad/id", "h", "h:1")
    with pytest.raises(ConfigError):
        MemoryDirectory(cluster="no spaces")


# -- the publisher, against a real StoreNode --------------------------------------------------


def _node(node_id: str, event_queue: int = 1 << 16) -> StoreNode:
    return StoreNode(node_id=node_id, dram_bytes=8 << 20, warm=False, event_queue=event_queue)


def _published(m: Mirror, node_id: str) -> dict[bytes, TierKind]:
    return {k: r.tier for k, r in m.entries(node_id)}


def test_publisher_follows_a_store_node(make: Make) -> None:
    async def body() -> None:
        node = _node("pub1")
        async with make() as a, make() as reader:
            await a.register_node(info("pub1"), ttl=TTL)
            m = await reader.mirror()
            async with Publisher(node, a, interval=0.002) as pub:
                ks = keys(200)
                for k in ks:
                    node.put(k, os.urandom(1000))
                node.remove(ks[:20])
                want = dict.fromkeys(node.keys(), DRAM)
                await until(lambda: _published(m, "pub1") == want)
                assert m.replicas(ks[50])[0].size > 1000  # header + payload
            assert pub.resyncs == 0 and pub.error is None
        node.close()

    run(body())


def test_publisher_resyncs_after_dropped_events(make: Make) -> None:
    async def body() -> None:
        node = _node("pub2", event_queue=16)  # overflows at once
        async with make() as a, make() as reader:
            await a.register_node(info("pub2"), ttl=TTL)
            m = await reader.mirror()
            ks = keys(100)
            for k in ks:
                node.put(k, b"x" * 100)
            node.remove(ks[:10])
            assert node.events.dropped > 0
            pub = Publisher(node, a)
            while await pub.run_once():
                pass
            assert pub.resyncs == 1
            await seen(reader, pub.revision)
            assert _published(m, "pub2") == dict.fromkeys(node.keys(), DRAM)
            node.put(keys(1)[0], b"y")  # the stream is trusted again afterwards
            await pub.run_once()
            await seen(reader, pub.revision)
            assert len(m.entries("pub2")) == 91
        node.close()

    run(body())


def test_publisher_start_needs_registration(make: Make) -> None:
    async def body() -> None:
        node = _node("pub3")
        async with make() as a:
            with pytest.raises(NotFound):
                await Publisher(node, a).start()
        node.close()

    run(body())
