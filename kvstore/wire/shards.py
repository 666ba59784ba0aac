"""Shards: one host's node split across processes, and which shard holds a key.

Why shards: the server's per-request work is Python, and one interpreter runs it one
request at a time (about 3,500 1 MiB puts a second, RESULTS.md "where a put's time
goes"). ``kvstore serve --shards N`` runs N server processes, each a node of its own
named ``<group>.s<i>`` with 1/N of the host's DRAM, HBM and SSD, so N interpreters
serve requests side by side, as Redis scales by running one single-threaded shard per
core.

The contract both ends share is :func:`shard_of`: a key belongs to shard
``shard_of(stored key, count)`` on every client, in every process, on every machine (a
jump consistent hash over the xxh3-64 of the key as nodes store it, scoped by its
tenant: kvstore/tenants.py; never Python's ``hash()``), so a put and the later get of
the same key meet on the same shard without asking anyone, and so does a block moved
by its stored key alone (a drain), which cannot be traced back to the caller's key. Shard 0 answers
at the address users dial and lists every shard in its Info reply (``ShardRole.peers``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import xxhash

from kvstore.errors import ConfigError

__all__ = ["MAX_SHARDS", "ShardPeer", "ShardRole", "auto_shards", "shard_name", "shard_of"]

MAX_SHARDS = 64
"""Most shards of one node: past a few per core they only add processes."""

AUTO_MAX = 8
"""``--shards auto`` never starts more: eight interpreters reached the host's memory and
NIC limits in the 16-core measurements of issue 32 long before they ran out of cores."""

AUTO_MIN_DRAM = 1024**3
"""``--shards auto`` gives each shard at least this much DRAM: a shard too small to hold
many blocks evicts more than its extra interpreter gains."""

_JUMP = 2862933555777941757  # the LCG multiplier of Lamping and Veach's jump hash
_MASK = (1 << 64) - 1


def shard_of(key: bytes, count: int) -> int:
    """The shard in ``range(count)`` that holds stored (tenant-scoped) ``key`` (jump
    consistent hash: growing ``count`` by one moves only 1/count of the keys)."""
    if count <= 1:
        return 0
    h = xxhash.xxh3_64_intdigest(key)
    b, j = -1, 0
    while j < count:
        b = j
        h = (h * _JUMP + 1) & _MASK
        j = int((b + 1) * ((1 << 31) / ((h >> 33) + 1)))
    return b


def shard_name(group: str, index: int) -> str:
    """The node id of shard ``index`` of node ``group``."""
    return f"{group}.s{index}"


def auto_shards(dram_bytes: int, cpus: int | None = None) -> int:
    """How many shards ``--shards auto`` (the default) starts: one per two cores the
    process may run on (the other half is for the engines and clients beside the store
    on a serving host), at most :data:`AUTO_MAX`, each with at least
    :data:`AUTO_MIN_DRAM` of DRAM; 1 on a small host or a small node."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    by_dram = max(dram_bytes, 0) // AUTO_MIN_DRAM
    return max(1, min(cpus // 2, AUTO_MAX, by_dram))


@dataclass(frozen=True, slots=True)
class ShardPeer:
    """Where one shard of a node answers."""

    index: int
    address: str  # gRPC control address, host:port
    node_id: str


@dataclass(frozen=True, slots=True)
class ShardRole:
    """What a shard process is told by its supervisor (kvstore/server/shards.py).

    Attributes:
        group: the node's name, shared by its shards (``--node-id`` of ``kvstore serve``).
        index / count: this shard's number and how many the node has.
        peers: every shard's address, for shard 0 to hand to clients (empty elsewhere).
    """

    group: str
    index: int
    count: int
    peers: tuple[ShardPeer, ...] = field(default=())

    def __post_init__(self) -> None:
        if not 1 <= self.count <= MAX_SHARDS:
            raise ConfigError(f"shards: {self.count} is not 1 to {MAX_SHARDS}")
        if not 0 <= self.index < self.count:
            raise ConfigError(f"shard {self.index} of {self.count}: no such shard")
        if self.peers and [p.index for p in self.peers] != list(range(self.count)):
            raise ConfigError(f"shard map: expected shards 0-{self.count - 1} in order")

    @property
    def node_id(self) -> str:
        """This shard's node id."""
        return shard_name(self.group, self.index)

    def to_json(self) -> str:
        """The role as one command-line argument."""
        peers = [[p.index, p.address, p.node_id] for p in self.peers]
        doc = {"group": self.group, "index": self.index, "count": self.count, "peers": peers}
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> ShardRole:
        """Parse :meth:`to_json`'s output; ConfigError on anything else."""
        try:
            doc = json.loads(text)
            peers = tuple(ShardPeer(int(i), str(a), str(n)) for i, a, n in doc.get("peers", []))
            return cls(str(doc["group"]), int(doc["index"]), int(doc["count"]), peers)
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"shard role {text[:200]!r}: malformed ({exc})") from None
