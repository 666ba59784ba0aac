"""Cluster membership and the block directory (see :mod:`kvstore.directory.base`).

``MemoryDirectory`` serves it in process; ``EtcdDirectory`` (imported lazily, since it
needs aetcd) serves it from etcd. Both hand out a :class:`Mirror` for fast local reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.directory.base import DEFAULT_TTL, BlockSnapshot, Directory, NodeInfo, Replica
from kvstore.directory.memory import MemoryBackend, MemoryDirectory
from kvstore.directory.mirror import Mirror
from kvstore.directory.publisher import Publisher

if TYPE_CHECKING:
    from kvstore.directory.etcd import EtcdDirectory

__all__ = [
    "DEFAULT_TTL",
    "BlockSnapshot",
    "Directory",
    "EtcdDirectory",
    "MemoryBackend",
    "MemoryDirectory",
    "Mirror",
    "NodeInfo",
    "Publisher",
    "Replica",
]


def __getattr__(name: str) -> Any:
    if name == "EtcdDirectory":  # aetcd is an optional dependency
        from kvstore.directory.etcd import EtcdDirectory

        return EtcdDirectory
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
