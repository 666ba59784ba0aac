"""Write units: what a cluster writer chooses between, a whole node or a sharded one.

A node served by ``kvstore serve --shards N`` registers each shard as a node of its
own (``<group>.s<i>``, kvstore/wire/shards.py), but a writer must treat the N of them
as one: every client, on every host, sends key ``k`` to shard ``shard_of(s, N)`` of
the group it writes to (``s``: ``k`` as nodes store it, scoped by the writer's
tenant), so a single-address client of that node (which routes by ``shard_of`` alone,
without the directory) finds the block where a cluster client put it. Choosing
shards one by one would scatter a prompt's blocks over the shards of different nodes
and break that.

:func:`write_units` folds the directory's node records into units; :meth:`WriteUnit.
split` places a batch's keys on the unit's shards. Reads need neither: the directory
lists each block under the shard that holds it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvstore.directory.records import NodeInfo, Replica
from kvstore.wire.shards import shard_of

__all__ = ["WriteUnit", "unit_names", "unit_prefix", "write_units"]


@dataclass(frozen=True, slots=True)
class WriteUnit:
    """One choice of writer.

    Attributes:
        name: the node id of a whole node, or the group name of a sharded one.
        shards: the node id of shard ``i`` at index ``i`` (``(name,)`` for a whole
            node); "" where that shard has no record now (down, or not back yet).
        host_id: the kernel the unit runs on (its shards share one).
        draining: some shard is draining (``kvstore drain``): the unit takes no writes.
    """

    name: str
    shards: tuple[str, ...]
    host_id: str = ""
    draining: bool = False

    @property
    def sharded(self) -> bool:
        """Whether keys are placed by ``shard_of`` (a group, even of one shard)."""
        return self.shards != (self.name,)

    def split(
        self, keys: Sequence[bytes], todo: Sequence[int], usable: Callable[[str], bool]
    ) -> tuple[dict[str, list[int]], list[int]]:
        """Place the keys at positions ``todo`` (``keys``: stored, tenant-scoped keys, as
        every client of the node places them): per node, the positions it takes (in
        order), and the positions whose shard is missing or not ``usable`` now (for the
        next unit of the write order)."""
        if not self.sharded:
            return ({self.name: list(todo)}, []) if usable(self.name) else ({}, list(todo))
        ok = {n: bool(n) and usable(n) for n in self.shards}
        plan: dict[str, list[int]] = {}
        rest: list[int] = []
        count = len(self.shards)
        for i in todo:
            node = self.shards[shard_of(keys[i], count)]
            if ok[node]:
                plan.setdefault(node, []).append(i)
            else:
                rest.append(i)
        return plan, rest


def write_units(
    nodes: Mapping[str, NodeInfo], skipped: list[str] | None = None
) -> dict[str, WriteUnit]:
    """The directory's nodes as write units, by name. A group whose shards disagree on
    how many it has (a node restarted with another ``--shards`` while old records wait
    out their leases) is left out, and named in ``skipped``: a key placed by the wrong
    count would sit where single-address readers never look. A whole node named like a
    group yields to it."""
    whole: dict[str, WriteUnit] = {}
    groups: dict[str, list[NodeInfo]] = {}
    for node_id, info in nodes.items():
        if info.group:
            groups.setdefault(info.group, []).append(info)
        else:
            whole[node_id] = WriteUnit(node_id, (node_id,), info.host_id, info.draining)
    for group, infos in groups.items():
        counts = {i.shards for i in infos}
        if len(counts) != 1:
            if skipped is not None:
                skipped.append(group)
            continue
        slots = [""] * counts.pop()
        for i in infos:
            slots[i.shard] = i.node_id
        draining = any(i.draining for i in infos)
        whole[group] = WriteUnit(group, tuple(slots), infos[0].host_id, draining)
    return whole


def unit_names(nodes: Mapping[str, NodeInfo]) -> dict[str, str]:
    """Node id -> the name of its write unit (its group for a shard, else itself)."""
    return {n: info.group or n for n, info in nodes.items()}


def unit_addresses(nodes: Mapping[str, NodeInfo]) -> dict[str, str]:
    """Write unit name -> the address a client dials for it: a whole node's own, a
    sharded node's shard 0 (whose Info lists every shard: kvstore/client/sharded.py).
    A sharded node whose shard 0 is not registered (restarting) is left out."""
    out = {n: info.address for n, info in nodes.items() if not info.group}
    out.update(
        {info.group: info.address for info in nodes.values() if info.group and info.shard == 0}
    )
    return out


def unit_prefix(lookup: Sequence[tuple[Replica, ...]], names: Mapping[str, str]) -> dict[str, int]:
    """Per write unit, how many leading blocks some node of it holds (``lookup``: the
    mirror's replicas of each key, in order). A sharded node holds a prompt's blocks
    spread over its shards, so counting per shard would stop at the first block another
    shard took; units holding none are absent."""
    out: dict[str, int] = {}
    alive: set[str] | None = None
    for i, reps in enumerate(lookup):
        here = {names[r.node_id] for r in reps if r.node_id in names}
        if alive is None:
            alive = here
        else:
            for gone in alive - here:
                out[gone] = i
            alive &= here
        if not alive:
            return out
    for name in alive or ():
        out[name] = len(lookup)
    return out
