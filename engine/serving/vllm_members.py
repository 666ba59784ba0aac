"""``kvstore vllm-router --etcd``: pools that follow the ``vllm serve`` processes
registered in etcd, as ``kvstore router`` follows its workers.

A server whose connector has ``"register": true`` writes its record under its lease at
``/kvstore/<cluster>/vllm-servers/<id>`` (engine/vllm/membership.py; the record is
engine/registry.py's ``WorkerRecord``). The router keeps a ``WorkerView`` of that
prefix (one etcd watch, read from the request path without a round trip) and, after
every change, hands the records of its model to the pools: a server that starts joins
its pool once it serves, one that stops leaves at once, one that dies leaves when its
lease lapses. Until then the pools pass over a dead server as they pass over any that
fails (engine/serving/vllm_pools.py): a request in flight there, or sent there, goes to
the next server of the pool.

The records also carry what the router's cache check needs, so it needs no flags for
it: each server's namespace and block size (its connector's), and its store node,
whose address comes from the cluster's directory (one read when a record names a node
the router has not seen).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from engine.registry import WorkerRecord, WorkerView, store_units, vllm_servers_prefix
from kvstore.errors import KVStoreError

__all__ = ["PoolMembers"]

log = logging.getLogger(__name__)

LOOKUP_PAUSE_S = 5.0

OnChange = Callable[[list[WorkerRecord], list[WorkerRecord]], None]


class PoolMembers:
    """The registered vLLM servers of one model, as prefill and decode pools.

    Concurrency: everything runs on the router's event loop; ``on_change`` is called
    there after every change of the view, with the prefill and decode records.
    """

    def __init__(self, etcd: str, cluster: str, model: str, on_change: OnChange) -> None:
        self.etcd, self.cluster, self.model = etcd, cluster, model
        self.view = WorkerView(etcd, cluster, prefix=vllm_servers_prefix(cluster))
        self.view.add_listener(self._changed)
        self._on_change = on_change
        self._stores: dict[str, str] = {}  # store unit -> address
        self._lookup: asyncio.Task[None] | None = None
        self._seen: set[str] = set()
        self._next_lookup = 0.0

    async def start(self, timeout_s: float = 10.0) -> None:
        """Load the registered servers (raises Unavailable when etcd cannot be
        reached), then follow them."""
        await self.view.start(timeout_s)

    async def stop(self) -> None:
        lookup, self._lookup = self._lookup, None
        if lookup is not None:
            lookup.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await lookup
        await self.view.stop()

    def records(self) -> list[WorkerRecord]:
        """The live records of this router's model, by id."""
        found = self.view.workers().values()
        return sorted((r for r in found if r.model == self.model), key=lambda r: r.worker_id)

    def store_address(self, node: str) -> str | None:
        """The address of store unit ``node`` (None while unknown)."""
        return self._stores.get(node)

    def _changed(self) -> None:
        records = self.records()
        ids = {r.worker_id for r in records}
        for r in records:
            if r.worker_id not in self._seen:
                log.info("%s server %s joined: %s", r.role, r.worker_id, r.address)
        for gone in sorted(self._seen - ids):
            log.info("server %s left", gone)
        self._seen = ids
        self._on_change([r for r in records if r.can_prefill], [r for r in records if r.can_decode])
        wanted = {r.store_node for r in records if r.store_node}
        loop = asyncio.get_running_loop()
        idle = self._lookup is None or self._lookup.done()
        if wanted - set(self._stores) and idle and loop.time() >= self._next_lookup:
            # records change with every load report: a node the directory lacks is
            # looked up again after a pause, not at each of them
            self._next_lookup = loop.time() + LOOKUP_PAUSE_S
            self._lookup = loop.create_task(self._find_stores())

    async def _find_stores(self) -> None:
        """Read the store nodes' addresses from the directory (once per unknown node;
        a failure is retried at the next change)."""
        try:
            self._stores.update(await store_units(self.etcd, self.cluster))
        except KVStoreError as exc:
            log.warning("store nodes not read from etcd %s: %s", self.etcd, exc)
