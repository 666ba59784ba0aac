"""The directory's records: a node's registration (:class:`NodeInfo`) and one copy of a
block (:class:`Replica`), with the checks that keep a malformed record out.

Plain data, shared by the directory implementations, the mirror and their readers.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvstore.errors import ConfigError, DirectoryError
from kvstore.tier_kinds import TierKind

__all__ = ["MUTABLE_FIELDS", "NodeInfo", "Replica", "check_name"]

_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def check_name(kind: str, value: str) -> str:
    """Cluster names and node ids become etcd key segments: 1-64 of [A-Za-z0-9._-]."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ConfigError(f"{kind} {value!r}: use 1-64 of [A-Za-z0-9._-]")
    return value


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What a node announces about itself; stored under its lease.

    Attributes:
        node_id: unique among live nodes of a cluster.
        host: host name or IP, for locality (same host means shared memory works).
        address: gRPC control-plane address (``host:port``).
        data_address: bulk-transfer address (TCP/UCX), empty when it equals ``address``.
        shm_name: the DRAM tier's shared-memory segment, for same-host clients.
        boot_id: random per process start; tells two lives of one node id apart.
        tiers: capacity in bytes of each tier the node has.
        host_id: the kernel's boot id (kvstore.wire.locality.host_id): equal on
            two nodes exactly when they share a kernel, so a client can tell which
            nodes are local to it ("" when unknown, which never matches).
        epoch: the lease the registration lives under; set by the directory (0 before).
        draining: the node is being emptied (``kvstore drain``): clients stop writing
            to it but may still read what it holds. Changed on a live registration
            with :meth:`Directory.update_node`.
        group / shard / shards: a node sharded across processes (``kvstore serve
            --shards N``, kvstore/wire/shards.py) registers each shard as a node of
            its own, named ``<group>.s<shard>``; a writer sends each key to shard
            ``shard_of(stored key, shards)`` of the group it writes to. "" / 0 / 1 for a
            whole node.
    """

    node_id: str
    host: str
    address: str
    data_address: str = ""
    shm_name: str = ""
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    tiers: Mapping[TierKind, int] = field(default_factory=dict)
    host_id: str = ""
    epoch: int = 0
    draining: bool = False
    group: str = ""
    shard: int = 0
    shards: int = 1

    def __post_init__(self) -> None:
        check_name("node_id", self.node_id)
        if not 0 <= self.shard < self.shards or (self.shards > 1 and not self.group):
            raise ConfigError(f"NodeInfo {self.node_id}: shard {self.shard} of {self.shards}")
        if not self.host:
            raise ConfigError("NodeInfo.host must not be empty")

    def with_epoch(self, epoch: int) -> NodeInfo:
        """A copy stamped with the lease it is registered under."""
        return replace(self, epoch=epoch)

    def to_json(self) -> bytes:
        """The record stored in the directory (JSON, readable with ``etcdctl get``)."""
        doc: dict[str, Any] = {
            "node_id": self.node_id,
            "host": self.host,
            "address": self.address,
            "data_address": self.data_address,
            "shm_name": self.shm_name,
            "boot_id": self.boot_id,
            "tiers": {TierKind(k).value: int(v) for k, v in self.tiers.items()},
            "host_id": self.host_id,
            "epoch": self.epoch,
            "draining": self.draining,
        }
        if self.group:
            doc.update(group=self.group, shard=self.shard, shards=self.shards)
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, *, epoch: int | None = None) -> NodeInfo:
        """Parse a stored record; ``epoch`` (the key's actual lease) wins over the body."""
        try:
            doc = json.loads(raw)
            return cls(
                node_id=doc["node_id"],
                host=doc["host"],
                address=doc.get("address", ""),
                data_address=doc.get("data_address", ""),
                shm_name=doc.get("shm_name", ""),
                boot_id=doc.get("boot_id", ""),
                tiers={TierKind(k): int(v) for k, v in doc.get("tiers", {}).items()},
                host_id=doc.get("host_id", ""),
                epoch=int(doc.get("epoch", 0)) if epoch is None else epoch,
                draining=_flag(doc.get("draining", False)),
                group=str(doc.get("group", "")),
                shard=int(doc.get("shard", 0)),
                shards=int(doc.get("shards", 1)),
            )
        except (ValueError, KeyError, TypeError, ConfigError) as exc:
            raise DirectoryError(f"malformed node record: {raw[:200]!r}") from exc


def _flag(value: Any) -> bool:
    """A JSON boolean; anything else is a malformed record (not truthiness)."""
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {value!r}")
    return value


MUTABLE_FIELDS = frozenset(
    {"host", "address", "data_address", "shm_name", "tiers", "host_id", "draining"}
)
"""NodeInfo fields :meth:`Directory.update_node` may change; the rest name the node's
life (node_id, boot_id) or are the directory's to set (epoch)."""


@dataclass(frozen=True, slots=True)
class Replica:
    """One copy of a block: which node, which tier, how many bytes (header + payload).

    Mirrors intern these (there are few distinct ones), so compare with ``==``.
    """

    node_id: str
    tier: TierKind
    size: int
