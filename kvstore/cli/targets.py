"""Which server processes a node argument names: an address, a node id, or a sharded
node's name.

``kvstore drain`` and ``kvstore stats`` act on processes (each ``kvstore serve``
process is one node of the directory), but an operator names nodes: a node served by
``kvstore serve --shards N`` is one node to them, though N processes serve it, each
registered as ``<node>.s<i>`` (kvstore/wire/shards.py). So:

- ``HOST:PORT`` names the process there; when it answers as shard 0 of a sharded node
  (its Info lists every shard), the whole node, since shard 0's address is the one
  users dial for the node;
- a name is looked up in the cluster's directory (``--etcd``, ``--cluster``): a node id
  names that node, a shard's id that shard alone, and a sharded node's name every shard
  of it (a shard with no record is reported as missing: it cannot be reached now).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.cli.directory import read
from kvstore.directory.records import NodeInfo
from kvstore.errors import ConfigError
from kvstore.wire.shards import shard_name

__all__ = [
    "Process",
    "Target",
    "every_node",
    "from_directory",
    "from_info",
    "is_address",
    "resolve",
]


@dataclass(frozen=True, slots=True)
class Process:
    """One server process: its node id and gRPC address."""

    node_id: str
    address: str


@dataclass(frozen=True, slots=True)
class Target:
    """What one argument named.

    Attributes:
        spec: the argument as given.
        group: the sharded node's name when the argument named all of one ("" else).
        processes: the processes to act on, a sharded node's in shard order.
        missing: shards of ``group`` the directory has no record of.
    """

    spec: str
    group: str
    processes: tuple[Process, ...]
    missing: tuple[str, ...] = ()


def is_address(spec: str) -> bool:
    """``HOST:PORT`` (node names cannot hold a colon, kvstore/directory/records.py)."""
    return ":" in spec


def from_info(spec: str, info: Mapping[str, Any]) -> Target:
    """The target of an address, from the Info its process answered (a
    ``server_info`` dict: fields at their default are absent)."""
    peers = list(info.get("shards") or [])
    if int(info.get("shard_count", 0) or 0) > 1 and peers:  # shard 0: it lists them all
        peers.sort(key=lambda p: int(p.get("index", 0)))
        procs = tuple(Process(str(p.get("node_id", "")), str(p["address"])) for p in peers)
        return Target(spec, str(info.get("group", "")), procs)
    return Target(spec, "", (Process(str(info.get("node_id", "")), spec),))


def from_directory(spec: str, nodes: Mapping[str, NodeInfo]) -> Target:
    """The target of a name, from the directory's live nodes; ConfigError when no node
    or sharded node has that name."""
    info = nodes.get(spec)
    if info is not None:
        return Target(spec, "", (Process(spec, info.address),))
    shards = sorted((i for i in nodes.values() if i.group == spec), key=lambda i: i.shard)
    if not shards:
        raise ConfigError(f"no node named {spec!r} is registered (see 'kvstore nodes')")
    have = {i.shard for i in shards}
    count = max(i.shards for i in shards)
    missing = tuple(shard_name(spec, n) for n in range(count) if n not in have)
    return Target(spec, spec, tuple(Process(i.node_id, i.address) for i in shards), missing)


def resolve(
    specs: Sequence[str],
    args: argparse.Namespace,
    info_of: Callable[[str], Mapping[str, Any]],
) -> list[Target]:
    """Every argument's target: addresses through ``info_of`` (the Info of the process
    there), names through one reading of the directory that ``args`` name."""
    names = [s for s in specs if not is_address(s)]
    nodes: Mapping[str, NodeInfo] = {}
    if names:
        nodes = read(args, lambda m: m.nodes())[1]
    return [from_info(s, info_of(s)) if is_address(s) else from_directory(s, nodes) for s in specs]


def every_node(nodes: Mapping[str, NodeInfo]) -> list[Target]:
    """Every node of the directory, a sharded node once with all its shards, by name."""
    names = sorted({info.group or node_id for node_id, info in nodes.items()})
    out = []
    for name in names:
        whole = nodes.get(name)
        if whole is not None and not whole.group:
            out.append(from_directory(name, nodes))
        if any(info.group == name for info in nodes.values()):
            shards = {n: i for n, i in nodes.items() if i.group == name}
            out.append(from_directory(name, shards))
    return out
