"""ClusterClient: one blocking client for a whole cluster, found through its directory.

``StoreClient.from_etcd("127.0.0.1:2379", cluster="c1", token=...)`` returns one. It
keeps the cluster directory's watch-fed :class:`~kvstore.directory.mirror.Mirror`
current on a private event-loop thread (kvstore/directory/background.py) and one
:class:`~kvstore.client.store.NodeClient` per node, opened on first use. The methods are
StoreClient's, answered cluster-wide:

- **puts** go to one node per client, chosen once and kept while it lives, so a
  prompt's chained blocks stay together on one node (what makes per-node prefix
  matching, and a cache-aware scheduler, work): the ``node_id`` given, else a node
  on this kernel (same boot id), else any; ties broken by rendezvous hashing of this
  process's identity, so clients spread over nodes but each is stable. A dead node
  passes the write to the next in that order; a draining node (its directory record
  says so) is skipped, so the writer moves off it as soon as the mirror sees the drain.
  A node sharded across processes (``kvstore serve --shards N``) is one choice: each
  key goes to its shard ``shard_of(stored key, N)`` (every client agrees, a single-address
  client of that node included), shards in parallel, and a down shard's keys to the
  next node in the order (kvstore/client/groups.py).
- **gets** go to the nearest replica the mirror knows (same host before other hosts;
  HBM before DRAM before SSD) and fall back to the next one on a miss, a dead node or
  a failed transfer; keys held by different nodes are fetched from them in parallel.
  A shard is a node here: the directory lists each block under the shard holding it.
  Bytes are only ever handed over after the node client verified them, so a fallback
  can cost a miss, never wrong bytes.
- **exists / match_prefix** are answered from the mirror, without a round trip.
  ``match_prefix`` counts leading blocks present on some live node (what ``get`` can
  serve); :meth:`ClusterClient.longest_prefix` gives the per-node counts a scheduler
  wants. Both see this client's own recent puts at once, before the directory does.
- **remove** goes to every live node; **stats** gathers every node's stats.

Directory keys are tenant-scoped (kvstore/server/auth.py), so the client learns its tenant
from the first node it opens and scopes keys the same way to look them up.

Which node to ask, whether it is alive (a node that fails a call is skipped for a
while) and its client live in kvstore/client/members.py.

Deadlines: a call's time is shared among the nodes it may still try. An attempt on one
node gets the time left divided by the nodes left to try (itself included; the last
one gets all of it), so a node that hangs (SIGSTOPped, wedged) costs its share and the
call fails over to the next node or replica before the caller's deadline.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Self

from kvstore.blocks import layer_range
from kvstore.client.base import ClientBase, ClientState, one
from kvstore.client.cluster_writes import ClusterWrites, raise_other
from kvstore.client.connector import Connector
from kvstore.client.fanout import FanOut, share
from kvstore.client.groups import unit_names, unit_prefix
from kvstore.client.layered import LayerWrite
from kvstore.client.members import NODE_FAILURES, Members
from kvstore.client.store import NodeClient
from kvstore.config import ClientConfig
from kvstore.directory.background import BackgroundDirectory
from kvstore.directory.base import Directory, NodeInfo
from kvstore.directory.mirror import Mirror
from kvstore.errors import InvalidValue, KVStoreError, Unavailable
from kvstore.keys import Namespace
from kvstore.observe.counters import NodeCounters
from kvstore.wire.locality import hostname

__all__ = ["ClusterClient"]

log = logging.getLogger(__name__)

RECENT_S = 5.0  # own puts count as present this long, covering directory lag
RECENT_MAX = 1 << 16

NodeCall = Callable[[NodeClient, list[int], float], list[Any]]


class ClusterClient(ClientBase):
    """Blocking client of every node of one cluster. Thread-safe.

    Concurrency contract: ``_lock`` guards ``_state`` and ``_recent``; no I/O happens
    under it. ``members`` and the mirror have their own locks.
    """

    _name = "ClusterClient"
    _open_with = "StoreClient.from_etcd(...) or 'with ClusterClient(...)'"

    def __init__(
        self,
        endpoint: str = "127.0.0.1:2379",
        cluster: str = "default",
        *,
        token: str | None = None,
        namespace: Namespace | None = None,
        config: ClientConfig | None = None,
        node_id: str | None = None,
        directory: Callable[[], Directory] | None = None,
        connector: Connector | None = None,
        **overrides: Any,
    ) -> None:
        super().__init__()
        self.config = ClientConfig.resolve(config, token, **overrides)
        self.endpoint, self.cluster = endpoint, cluster
        self.namespace = namespace
        self.node_id = node_id
        self.connector = connector  # how node clients reach nodes (None: sockets)
        self.counters = NodeCounters()  # node_failures, fallbacks, served.<node>
        self._bg = BackgroundDirectory(
            directory or self._etcd_factory, timeout=self.config.connect_timeout_s
        )
        self._mirror: Mirror | None = None
        self._members: Members | None = None
        self._write_path: ClusterWrites | None = None
        self._lock = threading.Lock()
        self._recent: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self._hostname = hostname()
        self._fan = FanOut(self.config.pool_size)  # parallel calls on several nodes

    def _etcd_factory(self) -> Directory:
        from kvstore.directory.etcd import EtcdDirectory  # aetcd is optional

        return EtcdDirectory(
            self.endpoint, self.cluster, auth=self.config.etcd_auth,
            timeout=self.config.connect_timeout_s,
        )  # fmt: skip

    # -- lifecycle -----------------------------------------------------------------------

    def open(self) -> Self:
        """Load the directory (bounded by ``connect_timeout_s``) and open the node puts
        go to, which tells the client its tenant; a refused token fails here."""
        if self._already_open():
            return self
        self._mirror = self._bg.start()
        # Node clients fail fast: the cluster's answer to a dead node is another node.
        node_config = dataclasses.replace(
            self.config, retries=0, connect_timeout_s=min(self.config.connect_timeout_s, 2.0)
        )
        self._members = Members(
            self._mirror,
            node_config,
            self.counters,
            namespace=self.namespace,
            node_id=self.node_id,
            connector=self.connector,
        )
        self._write_path = ClusterWrites(self._members, self._fan, self._remember, self.cluster)
        self._state = ClientState.OPEN
        try:
            self._members.principal()
        except Unavailable as exc:
            log.info("no cluster node reachable yet (%s); will retry on first use", exc)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Close every node client and stop the directory watch; idempotent."""
        with self._lock:
            self._state = ClientState.CLOSED
        if self._members is not None:
            self._members.close()
        self._fan.close()
        self._bg.close()

    @property
    def mirror(self) -> Mirror:
        """The live view of the directory (thread-safe reads)."""
        self._check_open()
        assert self._mirror is not None
        return self._mirror

    @property
    def members(self) -> Members:
        """The node clients and their liveness."""
        self._check_open()
        assert self._members is not None
        return self._members

    def nodes(self) -> dict[str, NodeInfo]:
        """Live nodes by id, from the mirror."""
        return self.mirror.nodes()

    # -- data ------------------------------------------------------------------------------

    def put(self, key: bytes, value: Any, *, timeout: float | None = None) -> bool:
        """Store one block on this client's write node; False if it had it already."""
        return bool(one(self.batch_put([key], [value], timeout=timeout)))

    def get(self, key: bytes, *, timeout: float | None = None) -> Any:
        """A new value from the nearest replica that has it, or None."""
        return one(self.batch_get([key], timeout=timeout))

    def get_into(
        self,
        key: bytes,
        out: Any,
        *,
        timeout: float | None = None,
        layers: tuple[int, int] | None = None,
    ) -> bool:
        """Copy a block (or layers [a, b) of it) from the nearest replica into ``out``;
        False on a miss."""
        return bool(one(self.batch_get_into([key], [out], timeout=timeout, layers=layers)))

    def batch_put(
        self, keys: Sequence[bytes], values: Sequence[Any], *, timeout: float | None = None
    ) -> list[bool | KVStoreError]:
        """Store each pair on the write node (the next live one if it fails; on a
        sharded node, each key on its shard, a down shard's keys on the next node):
        True stored, False already present there, or that key's error."""
        ks, scoped = self._keys(keys)
        if len(values) != len(ks):
            raise InvalidValue(f"{len(ks)} keys but {len(values)} values")
        return self._writes().batch_put(ks, scoped, values, self._deadline(timeout))

    def begin_layers(
        self,
        keys: Sequence[bytes],
        *,
        shape: Sequence[int],
        dtype: Any,
        timeout: float | None = None,
    ) -> LayerWrite:
        """A layer-by-layer write (kvstore/client/layered.py) on the write node, or the
        next live one if it cannot start there (on a sharded node, one write per shard
        holding keys, used as one: kvstore/client/parted_layers.py): once bytes have
        left, a failure is the write's, not retried elsewhere. Stored keys count as
        present for this client's reads at once, as after ``batch_put``."""
        ks, scoped = self._keys(keys)
        return self._writes().begin_layers(ks, scoped, shape, dtype, self._deadline(timeout))

    def _writes(self) -> ClusterWrites:
        self._check_open()
        assert self._write_path is not None
        return self._write_path

    def batch_get(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[Any]:
        """New values: each a value, None (miss everywhere) or that key's error."""
        ks, scoped = self._keys(keys)

        def call(c: NodeClient, idx: list[int], t: float) -> list[Any]:
            return c.batch_get([ks[i] for i in idx], timeout=t)

        return self._read(scoped, None, call, timeout)

    def batch_get_into(
        self,
        keys: Sequence[bytes],
        outs: Sequence[Any],
        *,
        timeout: float | None = None,
        layers: tuple[int, int] | None = None,
    ) -> list[bool | KVStoreError]:
        """get_into for each pair: True hit, False miss everywhere, or that key's error
        (``layers``: a layer range of each block, as NodeClient.batch_get_into)."""
        ks, scoped = self._keys(keys)
        if len(outs) != len(ks):
            raise InvalidValue(f"{len(ks)} keys but {len(outs)} outputs")
        span = layer_range(layers)

        def call(c: NodeClient, idx: list[int], t: float) -> list[Any]:
            sub_o = [outs[i] for i in idx]
            return c.batch_get_into([ks[i] for i in idx], sub_o, timeout=t, layers=span)

        return self._read(scoped, False, call, timeout)

    # -- metadata (from the mirror) ------------------------------------------------------

    def exists(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[bool]:
        """Whether each key has a copy on a live node (per the mirror and own puts)."""
        _, scoped = self._keys(keys)
        nodes = self.mirror.nodes()
        now = time.monotonic()
        bad = self.members.suspects()
        with self._lock:
            recent = [self._recent.get(k) for k in scoped]
        out = []
        for reps, mine in zip(self.mirror.lookup(scoped), recent, strict=True):
            held = any(r.node_id in nodes and r.node_id not in bad for r in reps)
            if not held and mine is not None:
                held = now - mine[1] < RECENT_S and mine[0] in nodes and mine[0] not in bad
            out.append(held)
        return out

    def match_prefix(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """How many leading keys some live node holds: the prefix ``get`` can serve."""
        n = 0
        for present in self.exists(keys):
            if not present:
                break
            n += 1
        return n

    def longest_prefix(self, keys: Sequence[bytes]) -> dict[str, int]:
        """Per node, how many leading keys it holds (from the mirror only). A sharded
        node counts as one, under its group's name: its shards hold the prompt's
        blocks between them."""
        _, scoped = self._keys(keys)
        mirror = self.mirror
        nodes = mirror.nodes()
        if not any(info.group for info in nodes.values()):
            return mirror.longest_prefix(scoped)
        return unit_prefix(mirror.lookup(scoped), unit_names(nodes))

    def remove(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """Remove the blocks from every live node; returns how many copies went."""
        ks, scoped = self._keys(keys)
        with self._lock:
            for k in scoped:
                self._recent.pop(k, None)
        deadline = self._deadline(timeout)
        removed, members = 0, self.members
        live = list(members.live())
        for i, node_id in enumerate(live):
            left = share(deadline, len(live) - i)  # a hung node costs only its share
            try:
                removed += members.client(node_id).remove(ks, timeout=left)
            except NODE_FAILURES as exc:
                members.suspect(node_id, exc)  # a dead node's copies die with its lease
        return removed

    def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Every live node's stats (or its error), the mirror's and this client's."""
        deadline = self._deadline(timeout)
        per_node: dict[str, Any] = {}
        members = self.members
        live = list(members.live())
        for i, node_id in enumerate(live):
            left = share(deadline, len(live) - i)
            try:
                per_node[node_id] = members.client(node_id).stats(timeout=left)
            except NODE_FAILURES as exc:
                members.suspect(node_id, exc)
                per_node[node_id] = {"error": str(exc), "code": exc.code}
        return {
            "cluster": self.cluster,
            "writer": members.writer,
            "nodes": per_node,
            "mirror": self.mirror.stats(),
            "client": self.counters.snapshot(),
        }

    # -- reads -------------------------------------------------------------------------

    def _read(
        self, scoped: list[bytes], miss: Any, call: NodeCall, timeout: float | None
    ) -> list[Any]:
        """Per key, try replicas nearest first until one hits; nodes in parallel."""
        deadline = self._deadline(timeout)
        results: list[Any] = [miss] * len(scoped)
        orders = [self._read_order(k) for k in scoped]
        pos = [0] * len(scoped)
        pending = [i for i, o in enumerate(orders) if o]
        members = self.members
        while pending:
            self._check_open()  # closed meanwhile: say so rather than report misses
            groups: dict[str, list[int]] = {}
            for i in pending:
                order = orders[i]
                while pos[i] < len(order) and not members.usable(order[pos[i]]):
                    pos[i] += 1
                if pos[i] < len(order):
                    groups.setdefault(order[pos[i]], []).append(i)
            pending = []
            tries = {  # per node: the most replicas one of its keys may still try
                n: max(len(orders[i]) - pos[i] for i in idx) for n, idx in groups.items()
            }
            for node_id, idx, out in self._fan_out(groups, call, deadline, tries):
                if isinstance(out, KVStoreError):
                    members.suspect(node_id, out)
                    out = [out] * len(idx)
                for i, r in zip(idx, out, strict=True):
                    if r is None or r is False or isinstance(r, NODE_FAILURES):
                        pos[i] += 1  # a miss there, or a failed transfer: a miss so far
                        pending.append(i)
                        self.counters.inc("fallbacks")
                    else:
                        results[i] = r
                        if not isinstance(r, KVStoreError):
                            self.counters.inc(f"served.{node_id}")
        return results

    def _fan_out(
        self,
        groups: dict[str, list[int]],
        call: NodeCall,
        deadline: float,
        tries: dict[str, int],
    ) -> list[tuple[str, list[int], Any]]:
        """Run ``call`` once per node (in parallel when several), each within its share
        of the time left (``tries``: the replicas its keys may still try); a node-level
        failure comes back as the error instead of a result list."""

        def one(item: tuple[str, list[int]]) -> Any:
            node_id, idx = item
            left = share(deadline, tries[node_id])  # past the deadline: the call times out
            return call(self.members.client(node_id), idx, left)

        done = self._fan.each(groups, one)
        raise_other(done)
        return [(n, idx, out) for (n, idx), out in done]

    def _read_order(self, scoped: bytes) -> list[str]:
        """Replicas of one key, nearest first, plus this client's own recent put."""
        order = [r.node_id for r in self.mirror.ranked(scoped, None, self._hostname)]
        with self._lock:
            mine = self._recent.get(scoped)
        if mine is not None and mine[0] not in order and time.monotonic() - mine[1] < RECENT_S:
            order.append(mine[0])
        return order

    # -- machinery ---------------------------------------------------------------------

    def _keys(self, keys: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
        """The keys as 16-byte keys, and as the directory knows them (tenant-scoped).
        Unavailable when no node can be reached to learn the tenant from."""
        ks = self._as_keys(keys)
        principal = self.members.principal()
        if principal is None:
            raise Unavailable(f"no node of cluster {self.cluster!r} can be reached")
        return ks, principal.scope_all(ks)

    def _remember(self, scoped: bytes, node_id: str) -> None:
        with self._lock:
            self._recent[scoped] = (node_id, time.monotonic())
            self._recent.move_to_end(scoped)
            if len(self._recent) > RECENT_MAX:
                self._recent.popitem(last=False)
