"""A serving node's place in its cluster: register, publish block events, leave.

``kvstore serve --etcd HOST:PORT --cluster NAME`` registers the node's record
(addresses, shared-memory segment, tiers, kernel and process ids) under a lease of
``node_lease_ttl_s``, then runs a :class:`~kvstore.directory.publisher.Publisher`
that drains the node's event queue into the directory, so a dead node's entries
vanish with its lease. On a clean stop it publishes what is queued and revokes the
lease, so clients stop routing to it at once instead of after the TTL.

Claiming an id held by someone else: the holder is either alive (a second server
started with the same ``--node-id``: refused at once with a ConflictError naming the
holder) or this node's own previous life, killed before it could revoke its lease.
They are told apart by asking the holder's registered address: a holder whose address
is now ours, or that refuses connections, is a dead life, and registration waits out
its lease (TTL + 1 s) instead of failing.

Draining (``kvstore drain``): :meth:`Membership.set_draining` marks the node's record
``draining`` under its lease before the admin call returns, so clients stop choosing
it for writes while it is emptied (reads of what it still holds go on). The state is
part of the registration: a lease recovery re-registers with it.

Without ``--etcd`` nobody reads the node's events, yet the node keeps appending them
to a queue bounded at a million; a small task drains and drops them, so the queue
never grows to its bound (an embedded MemoryDirectory would do the same work plus
keep a second index of every block in memory, for no reader).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Mapping
from dataclasses import replace

from kvstore.config import ServerConfig
from kvstore.directory.base import Directory, NodeInfo
from kvstore.directory.publisher import Publisher
from kvstore.errors import ConflictError, KVStoreError
from kvstore.node.store import StoreNode
from kvstore.tier_kinds import TierKind
from kvstore.wire.locality import PROBE_TIMEOUT_S, host_id, hostname

__all__ = ["Membership", "advertised_host", "join_address", "node_record"]

log = logging.getLogger(__name__)

_WILDCARDS = ("0.0.0.0", "::", "[::]", "")
DISCARD_INTERVAL_S = 0.25


def advertised_host(config: ServerConfig) -> str:
    """The host other processes should dial: ``advertise_host``, else ``host`` unless
    it is a wildcard address (then this machine's FQDN)."""
    if config.advertise_host:
        return config.advertise_host
    return socket.getfqdn() if config.host in _WILDCARDS else config.host


def join_address(host: str, port: int) -> str:
    """``host:port``, bracketing an IPv6 literal."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def node_record(
    node: StoreNode, config: ServerConfig, port: int, data_port: int, boot_id: str
) -> NodeInfo:
    """The NodeInfo a server registers: where to reach it and what it holds."""
    tiers: Mapping[str, Mapping[str, int]] = node.stats()["tiers"]
    host = advertised_host(config)
    return NodeInfo(
        node_id=node.node_id,
        host=hostname(),
        address=join_address(host, port),
        data_address=join_address(host, data_port),
        shm_name=node.shm_name or "",
        boot_id=boot_id,
        tiers={TierKind(name): int(t.get("capacity", 0)) for name, t in tiers.items()},
        host_id=host_id(),
    )


class Membership:
    """Registration plus event publishing (with ``config.etcd``), or event discarding.

    Lifecycle: ``await start()`` (raises ConflictError when the id is held by a live
    node, Unavailable when etcd cannot be reached), then ``await stop()`` (idempotent).
    Runs on the server's event loop; ``directory`` may be injected (tests, embedded).
    """

    def __init__(
        self,
        node: StoreNode,
        config: ServerConfig,
        info: NodeInfo,
        directory: Directory | None = None,
    ) -> None:
        self.node = node
        self.config = config
        self.info = info
        self.directory = directory
        self.registration: NodeInfo | None = None
        self.publisher: Publisher | None = None
        self._discard: asyncio.Task[None] | None = None

    @property
    def clustered(self) -> bool:
        """Whether this node registers in a directory."""
        return bool(self.config.etcd) or self.directory is not None

    async def start(self) -> None:
        """Join the cluster (or start discarding events when standalone)."""
        if not self.clustered:
            self._discard = asyncio.create_task(self._discard_loop(), name="kvstore-events")
            return
        if self.directory is None:
            from kvstore.directory.etcd import EtcdDirectory  # aetcd is optional

            self.directory = EtcdDirectory(
                self.config.etcd, self.config.cluster, auth=self.config.etcd_auth
            )
        try:
            await self.directory.open()
            self.registration = await self._register(self.directory)
            if self.registration.draining != self.info.draining:  # toggled meanwhile
                await self.set_draining(self.info.draining)
            self.publisher = Publisher(self.node, self.directory)
            await self.publisher.start()
        except BaseException:
            await self.stop(deregister=self.registration is not None)
            raise
        log.info(
            "node %s joined cluster %s at %s (epoch %x)",
            self.info.node_id,
            self.config.cluster,
            self.config.etcd or "embedded directory",
            self.registration.epoch,
        )

    async def stop(self, *, deregister: bool = True) -> None:
        """Revoke the lease (unless told not to) and disconnect. Queued events are not
        published first: revoking the lease removes every entry of the node anyway."""
        task, self._discard = self._discard, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        pub, self.publisher = self.publisher, None
        if pub is not None:
            await pub.stop(flush=False)
        d = self.directory
        if d is None:
            return
        self.registration = None
        with contextlib.suppress(KVStoreError, asyncio.TimeoutError):
            await asyncio.wait_for(d.close(deregister=deregister), 5.0)

    async def set_draining(self, draining: bool) -> None:
        """Announce (or withdraw) that this node is draining: clients stop choosing it
        for writes. Returns once the directory holds the new record; raises (leaving
        it to be retried by the keepalive) when the directory cannot be written.
        Standalone, or before registration, it only records the state for start()."""
        self.info = replace(self.info, draining=draining)
        d = self.directory
        if d is None or self.registration is None:
            return
        await d.update_node(self.info.node_id, draining=draining)
        self.registration = d.registration(self.info.node_id)
        log.info("node %s is %s", self.info.node_id, "draining" if draining else "serving")

    async def _register(self, d: Directory) -> NodeInfo:
        ttl = self.config.node_lease_ttl_s
        try:
            return await d.register_node(self.info, ttl=ttl)
        except ConflictError as exc:
            holder = next((n for n in await d.list_nodes() if n.node_id == self.info.node_id), None)
            if holder is not None and await self._alive(holder):
                raise ConflictError(
                    f"node id {self.info.node_id!r} is already served by a live node at "
                    f"{holder.address} (host {holder.host}); give this one another --node-id "
                    "or stop that one"
                ) from exc
        log.warning(
            "node id %s is held by a previous life that no longer answers; "
            "waiting up to %.0f s for its lease to expire",
            self.info.node_id,
            ttl + 1,
        )
        return await d.register_node(self.info, ttl=ttl, wait=ttl + 1.0)

    async def _alive(self, holder: NodeInfo) -> bool:
        """Whether the holder of our id still answers at its registered address."""
        if holder.address == self.info.address:
            return False  # we listen there now, so the holder cannot
        host, _, port = holder.address.rpartition(":")
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(host.strip("[]"), int(port)), PROBE_TIMEOUT_S
            )
        except (TimeoutError, OSError, ValueError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True

    async def _discard_loop(self) -> None:
        while True:
            self.node.take_events()
            await asyncio.sleep(DISCARD_INTERVAL_S)
