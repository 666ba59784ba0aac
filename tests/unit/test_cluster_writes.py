"""ClusterWrites.batch_put (kvstore/client/cluster_writes.py) over scripted members: a
node that refuses the whole call (a request error, not a node failure) fails its own
keys; the keys other nodes stored stand, and are remembered."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.client.cluster_writes import ClusterWrites
from kvstore.client.fanout import FanOut
from kvstore.errors import KVStoreError, PermissionDenied


class Node:
    def __init__(self, refuse: KVStoreError | None) -> None:
        self.refuse = refuse

    def batch_put(self, keys: list[bytes], values: Sequence[Any], timeout: float) -> list[bool]:
        if self.refuse is not None:
            raise self.refuse
        return [True] * len(keys)


class Unit:
    """Keys 0 and 1 on node a, the rest on node b."""

    def split(
        self, keys: Sequence[bytes], todo: Sequence[int], usable: Callable[[str], bool]
    ) -> tuple[dict[str, list[int]], list[int]]:
        return {"a": [i for i in todo if i < 2], "b": [i for i in todo if i >= 2]}, []


class Members:
    def __init__(self) -> None:
        self.nodes = {"a": Node(None), "b": Node(PermissionDenied("not on this node"))}
        self.suspected: list[str] = []

    def write_plan(self) -> list[Unit]:
        return [Unit()]

    def usable(self, node_id: str) -> bool:
        return True

    def client(self, node_id: str) -> Node:
        return self.nodes[node_id]

    def suspect(self, node_id: str, exc: BaseException | None) -> None:
        self.suspected.append(node_id)


def test_a_node_refusing_the_call_fails_its_keys_and_the_rest_are_stored() -> None:
    remembered: list[tuple[bytes, str]] = []
    members = Members()
    writes = ClusterWrites(
        members,  # type: ignore[arg-type]
        FanOut(2),
        lambda key, node: remembered.append((key, node)),
        "c",
    )
    keys = [b"k0", b"k1", b"k2", b"k3"]
    out = writes.batch_put(keys, keys, [b"v"] * 4, time.monotonic() + 5)
    assert out[:2] == [True, True]
    assert all(isinstance(r, PermissionDenied) for r in out[2:])
    assert remembered == [(b"k0", "a"), (b"k1", "a")]
    assert members.suspected == []  # a request's error, not a node's failure
