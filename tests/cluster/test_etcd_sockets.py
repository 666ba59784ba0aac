"""No socket to etcd outlives the cluster clients and directories that closed, however
many times etcd restarted under them (issue 33).

gRPC lets go of a channel's connection once the channel is closed *and* every call made
on it is freed. A call that failed during the outage (the watch, a publish, a range) or
a keepalive stream, held by a reference cycle, is freed only when the cyclic GC happens
to run: until then the closed channel kept its new connection, and the process a socket
to etcd (2 of 5 soak runs). The automatic GC is off here, so such a cycle fails the test
every time rather than by chance. With etcd auth, every call also passes through the
token interceptors (kvstore/directory/etcd_client.py), and etcd forgets tokens when it
restarts.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections.abc import Iterator

import pytest

from benchmarks.soak_report import proc_facts
from kvstore import StoreClient
from kvstore.config import EtcdAuth
from kvstore.directory import NodeInfo
from kvstore.directory.background import BackgroundDirectory
from kvstore.directory.etcd_process import EtcdProcess, EtcdUser
from kvstore.errors import KVStoreError
from kvstore.events import BlockStored
from kvstore.tier_kinds import TierKind
from tests.support.waiting import wait_until

pytest.importorskip("aetcd")

from kvstore.directory.etcd import EtcdDirectory

ROUNDS = 3  # restarts, each with clients opened before and closed after it
CLUSTER = "sockets"
USER = EtcdAuth(user="sockets-user", password="sockets-password-0123")


@pytest.fixture
def no_automatic_gc() -> Iterator[None]:
    """Only reference counting frees objects while the test runs."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def sockets_to(port: int) -> list[str]:
    """This process's sockets whose far end is ``port``, counted as the soak does."""
    ends = proc_facts(os.getpid()).sockets
    return [s for s in ends if s.split("->")[-1].split()[0].endswith(f":{port}")]


def _publish_one(node: BackgroundDirectory, node_id: str) -> int:
    """Publish one new block entry for ``node_id``; the revision where it is visible."""
    events = [BlockStored(os.urandom(16), TierKind.DRAM, 8, b"")]
    return node.call(lambda: node.directory.publish(node_id, events))  # type: ignore[union-attr]


def _publisher(node: BackgroundDirectory, node_id: str, stop: threading.Event) -> None:
    """Publish a block every 20 ms through the outage (failures are expected)."""
    while not stop.is_set():
        with contextlib.suppress(KVStoreError):
            _publish_one(node, node_id)
        time.sleep(0.02)


def _publish_after_restart(node: BackgroundDirectory, node_id: str) -> int:
    """A revision written after etcd came back (retried while it settles)."""
    deadline = time.monotonic() + 15.0
    while True:
        try:
            return _publish_one(node, node_id)
        except KVStoreError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _one_round(etcd: EtcdProcess, auth: EtcdAuth, r: int) -> None:
    """A cluster client and a registered, publishing node directory across one restart;
    both are closed once the client's watch has seen a write made after it."""
    creds = {"etcd_user": auth.user, "etcd_password": auth.password}
    client = StoreClient.from_etcd(etcd.endpoint, cluster=CLUSTER, connect_timeout_s=5.0, **creds)
    node = BackgroundDirectory(
        lambda: EtcdDirectory(etcd.endpoint, CLUSTER, auth=auth), timeout=5.0
    )
    stop = threading.Event()
    publisher = threading.Thread(target=_publisher, args=(node, f"n{r}", stop))
    try:
        node.start()
        info = NodeInfo(f"n{r}", "127.0.0.1", "127.0.0.1:9")
        node.call(lambda: node.directory.register_node(info, ttl=2))  # type: ignore[union-attr]
        publisher.start()
        etcd.restart(down_for=1.0)
        revision = _publish_after_restart(node, f"n{r}")
        assert client.mirror.wait_for_revision_sync(revision, 15.0), "the watch never resumed"
    finally:
        stop.set()
        if publisher.is_alive():
            publisher.join()
        client.close()
        node.close()


@pytest.mark.parametrize("with_auth", [False, True], ids=["plain", "auth"])
def test_no_socket_to_etcd_outlives_closed_clients_across_etcd_restarts(
    etcd_private: EtcdProcess, no_automatic_gc: None, with_auth: bool
) -> None:
    auth = EtcdAuth()
    if with_auth:
        etcd_private.enable_auth("root-password-0123", [EtcdUser(USER.user, USER.password, b"/")])
        auth = USER
    port = etcd_private.client_port
    for r in range(ROUNDS):
        _one_round(etcd_private, auth, r)
        # Closing is finished by gRPC's own threads a moment after close() returns.
        try:
            wait_until(lambda: not sockets_to(port), "every socket to etcd to close", 5.0)
        except AssertionError:
            raise AssertionError(f"round {r}: left open {sockets_to(port)}") from None
