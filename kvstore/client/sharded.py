"""A StoreClient's calls on a node sharded across processes: each key to its own shard.

``kvstore serve --shards N`` (kvstore/server/shards.py) serves one node from N
processes. Shard 0 answers at the address users dial and lists every shard in its Info
reply; a key lives on shard ``shard_of(stored key, N)`` (kvstore/wire/shards.py): the
key as the node stores it, scoped by the caller's tenant with the scope key Info gave
it, so every client of the tenant, and a drain that moves stored blocks, place it on
the same shard, and a put and a later get meet without asking anyone. A
StoreClient that finds ``shard_count > 1`` in shard 0's Info hands its calls to a
:class:`ShardedClient` (kvstore/client/api.py), which holds one NodeClient per shard:
shard 0's is the StoreClient itself (its connection reused), the others are opened at
their first use and must then say they are that shard of that node (ConflictError
otherwise: a stale map never sends a write to a stranger).

What goes where:

- put, get, get_into, their batch forms, begin_layers (kvstore/client/parted_layers.py),
  exists, match_prefix and remove split their keys by shard and call each shard
  involved (kvstore/client/fanout.py: directly for one, side by side for several);
  per-key results come back in the caller's order.
- match_prefix is the leading run of keys present over all shards; remove sums.
- stats is the node as one (numeric leaves summed, ``node_id`` the node's name) with
  each shard's own under ``"shards"``, in shard order; health is ``draining`` when any
  shard is; set_draining and wait_prefaulted reach every shard; server_info is shard
  0's, which lists the shards; control: kvstore/client/sharded_control.py.

Failures: a batch call's keys on a shard whose sub-call failed (down, restarting) get
that error as their result and the other shards' results stand; a shard that failed so
is skipped for a while, its keys failing at once (kvstore/client/shard_health.py); when every shard
involved failed, the call raises, as a whole node's would. exists and match_prefix
count a failed shard's keys as absent (nothing can read them now) and raise only when
every shard involved failed. Single-key calls raise as on a whole node; remove, stats,
health and set_draining raise a shard's error once every shard has answered.

Namespaces (``namespace=``) pass through, and each shard scopes keys by the caller's
token as a whole node does, so tenants stay apart shard by shard.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvstore._proto import store_pb2 as pb
from kvstore.client.base import one
from kvstore.client.fanout import FanOut, Groups, leading_run, pick, raise_any, scatter
from kvstore.client.layered import LayeredPut, block_info
from kvstore.client.parted_layers import PartedLayeredPut
from kvstore.client.shard_health import ShardSuspects
from kvstore.client.sharded_control import merge_stats, shard_control
from kvstore.client.store import NodeClient
from kvstore.errors import (
    ConfigError,
    ConflictError,
    InvalidValue,
    KVStoreError,
    Unavailable,
)
from kvstore.keys import Namespace
from kvstore.tenants import DEFAULT_TENANT, Principal
from kvstore.wire.shards import shard_of

__all__ = ["ShardedClient"]

T = TypeVar("T")
ShardCall = Callable[[NodeClient, list[int]], T]


class ShardedClient:
    """The calls of one StoreClient whose server is shard 0 of a sharded node (see the
    module docstring). Thread-safe as NodeClient is; made under the StoreClient's lock
    at open, with no I/O.

    Every call on a shard goes through ``NodeClient.<method>(client, ...)``, never
    ``client.<method>``: shard 0's client is the StoreClient, whose own methods lead
    back here."""

    def __init__(self, first: NodeClient, info: pb.InfoResponse) -> None:
        self.count = int(info.shard_count)
        self.group = info.group
        if [int(s.index) for s in info.shards] != list(range(self.count)):
            raise ConfigError(
                f"{first.address}: node {info.group!r} lists shards "
                f"{[int(s.index) for s in info.shards]}, expected 0-{self.count - 1}"
            )
        self.first = first
        # Placement is by stored key: the same for this tenant's keys and for blocks a
        # drain imports by the stored key alone (kvstore/client/sharded_control.py).
        self._scope = Principal(info.tenant or DEFAULT_TENANT, scope_key=info.scope_key).scope_all
        # The first client's connector already carries its fault plan (kvstore/faults.py):
        # the shards share it as one client, not one plan each.
        config = dataclasses.replace(first.config, faults="")
        self.nodes: list[NodeClient] = [first] + [
            NodeClient(
                s.address, namespace=first.namespace, config=config, connector=first.connector
            )
            for s in info.shards[1:]
        ]
        for c in self.nodes[1:]:  # one client: one set of counters (retries, ...)
            c.counters = first.counters
        self._ready = [True] + [False] * (self.count - 1)
        self._opening = [threading.Lock() for _ in range(self.count)]
        self.suspects = ShardSuspects(
            self.group, [c.address for c in self.nodes], first.connector.reachable, first.counters
        )
        # Each of the caller's threads (the async client has pool_size) may fan out.
        self.fan = FanOut(min(64, (self.count - 1) * first.config.pool_size))

    # -- shards ---------------------------------------------------------------------------

    def node(self, index: int) -> NodeClient:
        """Shard ``index``'s client, opened (and checked) at first use: by one caller
        at a time, after a probe, so callers of a shard that is down then fail at once
        (Unavailable, which makes it suspect) instead of each retrying its connect."""
        if self._ready[index]:
            return self.nodes[index]
        with self._opening[index]:
            if self._ready[index]:
                return self.nodes[index]
            # Each opener probes for itself (a refused connect is immediate): a check
            # of the suspects here would refuse the very trial call that check allowed.
            c = self.nodes[index]
            if not self.nodes[0].connector.reachable(c.address):
                raise Unavailable(
                    f"shard {index} of node {self.group!r} ({c.address}) does not accept "
                    "connections"
                )
            self._open_shard(index, c)
            return c

    def _open_shard(self, index: int, c: NodeClient) -> None:
        c.open()
        info = c.server_info
        said = (info.get("group", ""), int(info.get("shard", 0)), int(info.get("shard_count", 0)))
        if said != (self.group, index, self.count):
            raise ConflictError(
                f"{c.address} answers as shard {said[1]} of {said[2]} of node {said[0]!r}, "
                f"not shard {index} of {self.count} of {self.group!r}: the node changed; "
                "connect again"
            )
        self._ready[index] = True

    def split(self, keys: Sequence[bytes]) -> Groups:
        """The shards the caller's ``keys`` live on, each with the positions of its
        keys, in shard order (no keys: shard 0, so an empty call behaves as on a whole
        node)."""
        return self.split_stored(self._scope(keys))

    def split_stored(self, stored: Sequence[bytes]) -> Groups:
        """:meth:`split` for keys as the node stores them (tenant-scoped)."""
        if not stored:
            return [(0, [])]
        n = self.count
        by: dict[int, list[int]] = {}
        for i, k in enumerate(stored):
            by.setdefault(shard_of(k, n), []).append(i)
        return sorted(by.items())

    def each_group(
        self, groups: Groups, call: ShardCall[T], timeout: float | None = None
    ) -> list[T | KVStoreError]:
        """``call(shard's client, positions)`` for each group; a shard that cannot be
        opened fails as its call would. ``timeout``: the caller's, see :meth:`_on`."""
        calls = [functools.partial(self._on, s, idx, call, timeout) for s, idx in groups]
        return self.fan.run(calls)

    def each_shard(
        self, call: Callable[[NodeClient], T], timeout: float | None = None
    ) -> list[T | KVStoreError]:
        """``call(client)`` on every shard, in shard order."""
        groups: Groups = [(s, []) for s in range(self.count)]
        return self.each_group(groups, lambda c, _: call(c), timeout)

    def _on(
        self, shard: int, idx: list[int], call: ShardCall[T], timeout: float | None = None
    ) -> T:
        """``call`` on one shard, unless it is suspect; a node failure makes it so (a
        timeout under a deadline shorter than the client's own only after a second in
        a row: kvstore/client/shard_health.py)."""
        self.suspects.check(shard)
        started = self.suspects.clock()
        try:
            out = call(self.node(shard), idx)
        except KVStoreError as exc:
            hurried = timeout is not None and timeout < self.first.config.timeout_s
            self.suspects.failed(shard, exc, hurried=hurried, started=started)
            raise
        self.suspects.succeeded(shard)
        return out

    def per_key(
        self, keys: Sequence[bytes], call: ShardCall[list[Any]], timeout: float | None = None
    ) -> list[Any]:
        """A batch call split by shard, its per-key results in the caller's order."""
        groups = self.split(keys)
        if len(groups) == 1:  # every key on one shard: no thread, no reordering
            s, idx = groups[0]
            return self._on(s, idx, call, timeout)
        return scatter(len(keys), groups, self.each_group(groups, call, timeout))

    def _keys(self, keys: Sequence[bytes]) -> list[bytes]:
        return self.first._keys(keys)

    def _one(self, key: bytes, call: Callable[[NodeClient, bytes], T], timeout: float | None) -> T:
        """``call(shard's client, key)`` on the shard of a single key."""
        k = self.first._as_keys([key])[0]
        shard = shard_of(self._scope((k,))[0], self.count)
        return self._on(shard, [], lambda c, _: call(c, k), timeout)

    # -- data ------------------------------------------------------------------------------

    def put(
        self,
        key: bytes,
        value: Any,
        *,
        namespace: Namespace | None = None,
        timeout: float | None = None,
    ) -> bool:
        def call(c: NodeClient, k: bytes) -> list[bool | KVStoreError]:
            return NodeClient.batch_put(c, [k], [value], namespace=namespace, timeout=timeout)

        return bool(one(self._one(key, call, timeout)))

    def get(
        self, key: bytes, *, namespace: Namespace | None = None, timeout: float | None = None
    ) -> Any:
        def call(c: NodeClient, k: bytes) -> list[Any]:
            return NodeClient.batch_get(c, [k], namespace=namespace, timeout=timeout)

        return one(self._one(key, call, timeout))

    def get_into(
        self,
        key: bytes,
        out: Any,
        *,
        namespace: Namespace | None = None,
        timeout: float | None = None,
        layers: tuple[int, int] | None = None,
    ) -> bool:
        def call(c: NodeClient, k: bytes) -> list[bool | KVStoreError]:
            return NodeClient.batch_get_into(
                c, [k], [out], namespace=namespace, timeout=timeout, layers=layers
            )

        return bool(one(self._one(key, call, timeout)))

    def batch_put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        *,
        namespace: Namespace | None = None,
        timeout: float | None = None,
    ) -> list[bool | KVStoreError]:
        ks = self._keys(keys)
        if len(values) != len(ks):
            raise InvalidValue(f"{len(ks)} keys but {len(values)} values")

        def call(c: NodeClient, idx: list[int]) -> list[bool | KVStoreError]:
            sub_k, sub_v = pick(ks, idx), pick(values, idx)
            return NodeClient.batch_put(c, sub_k, sub_v, namespace=namespace, timeout=timeout)

        return self.per_key(ks, call, timeout)

    def batch_get(
        self,
        keys: Sequence[bytes],
        *,
        namespace: Namespace | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        ks = self._keys(keys)

        def call(c: NodeClient, idx: list[int]) -> list[Any]:
            return NodeClient.batch_get(c, pick(ks, idx), namespace=namespace, timeout=timeout)

        return self.per_key(ks, call, timeout)

    def batch_get_into(
        self,
        keys: Sequence[bytes],
        outs: Sequence[Any],
        *,
        namespace: Namespace | None = None,
        timeout: float | None = None,
        layers: tuple[int, int] | None = None,
    ) -> list[bool | KVStoreError]:
        ks = self._keys(keys)
        if len(outs) != len(ks):
            raise InvalidValue(f"{len(ks)} keys but {len(outs)} outputs")

        def call(c: NodeClient, idx: list[int]) -> list[bool | KVStoreError]:
            sub_k, sub_o = pick(ks, idx), pick(outs, idx)
            return NodeClient.batch_get_into(
                c, sub_k, sub_o, namespace=namespace, timeout=timeout, layers=layers
            )

        return self.per_key(ks, call, timeout)

    def begin_layers(
        self,
        keys: Sequence[bytes],
        *,
        shape: Sequence[int],
        dtype: Any,
        namespace: Namespace | None = None,
        timeout: float | None = None,
    ) -> LayeredPut:
        """One layered put per shard involved, behind one LayeredPut (a single shard's
        own when every key is on it)."""
        ks = self._keys(keys)
        info = block_info(shape, dtype)  # bad input: one clear error, before any shard

        def start(c: NodeClient, idx: list[int]) -> LayeredPut:
            sub = pick(ks, idx)
            kw: dict[str, Any] = {"namespace": namespace, "timeout": timeout}
            return NodeClient.begin_layers(c, sub, shape=shape, dtype=dtype, **kw)

        def kept(shard: int, idx: list[int]) -> LayeredPut | Exception:
            try:
                return self._on(shard, idx, start, timeout)
            except KVStoreError:
                raise  # that shard's failure: its keys', as in any batch
            except Exception as exc:  # a bug's: raised once the started parts are aborted
                return exc

        groups = self.split(ks)
        if len(groups) == 1:
            return self._on(groups[0][0], groups[0][1], start, timeout)
        t = self.first.config.timeout_s if timeout is None else timeout
        outcomes = self.fan.run([functools.partial(kept, s, idx) for s, idx in groups])
        return PartedLayeredPut.start(ks, info, t, [idx for _, idx in groups], outcomes, self.fan)

    # -- metadata -----------------------------------------------------------------------

    def exists(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[bool]:
        ks = self._keys(keys)

        def call(c: NodeClient, idx: list[int]) -> list[bool]:
            return NodeClient.exists(c, pick(ks, idx), timeout=timeout)

        return [r is True for r in self.per_key(ks, call, timeout)]

    def match_prefix(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        ks = self._keys(keys)
        groups = self.split(ks)

        def call(c: NodeClient, idx: list[int]) -> int:
            return NodeClient.match_prefix(c, pick(ks, idx), timeout=timeout)

        if len(groups) == 1:
            return self._on(groups[0][0], groups[0][1], call, timeout)

        outcomes = self.each_group(groups, call, timeout)
        errors = [o for o in outcomes if isinstance(o, KVStoreError)]
        if len(errors) == len(outcomes):
            raise errors[0]
        matched = [0 if isinstance(m, KVStoreError) else m for m in outcomes]  # absent
        return leading_run(len(ks), groups, matched)

    def remove(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        ks = self._keys(keys)

        def call(c: NodeClient, idx: list[int]) -> int:
            return NodeClient.remove(c, pick(ks, idx), timeout=timeout)

        return sum(raise_any(self.each_group(self.split(ks), call, timeout)))

    def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        per = raise_any(self.each_shard(lambda c: NodeClient.stats(c, timeout=timeout), timeout))
        return merge_stats(self.group, per)

    def health(self, *, timeout: float | None = None) -> str:
        said = raise_any(self.each_shard(lambda c: NodeClient.health(c, timeout=timeout), timeout))
        return "draining" if "draining" in said else said[0]

    def set_draining(self, draining: bool = True, *, timeout: float | None = None) -> bool:
        """Every shard; whether the node now drains (any shard does)."""
        call = functools.partial(NodeClient.set_draining, draining=draining, timeout=timeout)
        return any(raise_any(self.each_shard(call, timeout)))

    def wait_prefaulted(self, timeout: float | None = 30.0) -> bool:
        """Every shard this client has opened (the others have mapped nothing)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        ok = True
        for i, c in enumerate(self.nodes):
            if self._ready[i]:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                ok = NodeClient.wait_prefaulted(c, left) and ok
        return ok

    def control(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        return shard_control(self, method, request, timeout)

    @property
    def transport(self) -> str:
        """The first shard's transport that has one (they all pick alike)."""
        for i, c in enumerate(self.nodes):
            t = NodeClient.transport.__get__(c) if self._ready[i] else ""
            if t:
                return str(t)
        return ""

    def close(self) -> None:
        """Close the other shards' clients (shard 0's is the StoreClient's own)."""
        self.fan.close()
        for c in self.nodes[1:]:
            c.close()
