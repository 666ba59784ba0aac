"""What every engine side needs from a store, and the one circuit breaker in front of it.

Here, at engine/'s top, because three rooms use it and none may own it: the
transformers adapter and workers (engine/hf/), the vLLM connector (engine/vllm/) and the
serving workers (engine/serving/) all talk to a store through :class:`BlockStore`, and
the connector and the serving workers both put :class:`GuardedStore` in front of it.
Placed in any one of those rooms, the other two would import a sibling; placed in
kvstore/, the store would carry an engine's policy (a failure is a miss). Nothing here
imports vLLM or transformers, so it is tested in the project's main environment.

A KV cache is an optimisation: a store that is down, slow or broken must cost a miss,
never a failed request, and never a request stuck on a dead node's timeout again and
again. :class:`GuardedStore` drops a client that failed, stops calling the store for
``retry_after_s`` (calls made then are misses at once), logs one line when the store
goes away and one when it comes back, and then opens a new client: in the background
for the vLLM connector (an engine step never waits on a reconnect), in the calling
thread for a serving worker (one request can afford one connect). It has two faces:

- the :class:`BlockStore` calls (``put``, ``get_into``, ``match_prefix``, ...) raise as
  the store would (``Unavailable`` while the store is marked down), for callers that
  count a :class:`~kvstore.errors.KVStoreError` as a miss themselves (engine/hf/workers.py);
  a retryable error or ``Unavailable`` marks the store down, any other error is the
  request's and passes through;
- ``lookup``, ``load``, ``save``, ``begin_save`` and ``discard`` never raise, for the
  vLLM connector, which runs inside engine steps: any exception of a whole call is a
  miss and marks the store down; a per-key error inside a batch (a corrupt block, a
  refused value) is that key's miss only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kvstore.blocks import ValueInfo, host_bytes
from kvstore.client.layered import block_info
from kvstore.errors import InvalidValue, KVStoreError, Unavailable
from kvstore.keys import Namespace
from kvstore.node.store import StoreNode

__all__ = [
    "MATCH_SLICE",
    "BlockStore",
    "BreakerStats",
    "GuardedStore",
    "LayerWriter",
    "NodeStore",
    "NullStore",
    "StoreHealth",
]

log = logging.getLogger(__name__)
T = TypeVar("T")
MATCH_SLICE = 512  # keys per match_prefix call: 16k tokens of 32-token blocks


class LayerWriter(Protocol):
    """A layer-by-layer write (kvstore.client.layered.LayeredPut's interface)."""

    def write(self, layer: int, values: Sequence[Any]) -> None: ...

    def write_stacked(self, layer: int, stacked: Any) -> None: ...

    def commit(self, keep: Sequence[bool] | None = None) -> list[Any]: ...

    def abort(self) -> None: ...


class BlockStore(Protocol):
    """What an engine needs from a store: a :class:`kvstore.StoreClient` is one, and
    :class:`NodeStore` adapts an in-process :class:`kvstore.StoreNode`.

    Every call takes the namespace given with it, or the one bound at open when none
    is (the vLLM connector binds it; the transformers adapter passes its own). A batch
    call reports each key's own outcome (True, False for a miss or an already stored
    key, or that key's error): the adapter moves a prefix as one batch.
    """

    def put(self, key: bytes, value: Any, *, namespace: Namespace | None = None) -> bool: ...

    def get_into(self, key: bytes, out: Any, *, namespace: Namespace | None = None) -> bool: ...

    def batch_put(
        self, keys: Sequence[bytes], values: Sequence[Any], *, namespace: Namespace | None = None
    ) -> list[Any]: ...

    def batch_get_into(
        self,
        keys: Sequence[bytes],
        outs: Sequence[Any],
        *,
        namespace: Namespace | None = None,
        layers: tuple[int, int] | None = None,
    ) -> list[Any]: ...

    def match_prefix(self, keys: Sequence[bytes]) -> int: ...

    def begin_layers(
        self, keys: Sequence[bytes], *, shape: Sequence[int], dtype: Any
    ) -> LayerWriter: ...

    def remove(self, keys: Sequence[bytes]) -> int: ...

    def close(self) -> None: ...


class StoreHealth(Protocol):
    """The counters a breaker keeps (the vLLM connector's stats carry them too)."""

    store_errors: int  # whole calls that failed (down, timeout, protocol)
    skipped_calls: int  # calls not made while the store was marked down


@dataclass(slots=True)
class BreakerStats:
    """A breaker's own counters, when its owner keeps none."""

    store_errors: int = 0
    skipped_calls: int = 0


class NodeStore:
    """An in-process :class:`StoreNode` behind the :class:`BlockStore` interface."""

    def __init__(self, node: StoreNode, namespace: Namespace) -> None:
        self.node = node
        self.namespace = namespace

    def put(self, key: bytes, value: Any, *, namespace: Namespace | None = None) -> bool:
        return self.node.put(key, value, namespace=namespace or self.namespace)

    def get_into(self, key: bytes, out: Any, *, namespace: Namespace | None = None) -> bool:
        return self.node.get_into(key, out, namespace=namespace or self.namespace)

    def batch_put(
        self, keys: Sequence[bytes], values: Sequence[Any], *, namespace: Namespace | None = None
    ) -> list[Any]:
        return list(self.node.batch_put(keys, values, namespace=namespace or self.namespace))

    def batch_get_into(
        self,
        keys: Sequence[bytes],
        outs: Sequence[Any],
        *,
        namespace: Namespace | None = None,
        layers: tuple[int, int] | None = None,
    ) -> list[Any]:
        ns = namespace or self.namespace
        if layers is None:
            return list(self.node.batch_get_into(keys, outs, namespace=ns))
        # in process there is no transfer to pipeline: read whole blocks, hand the range
        if not outs:
            return []
        shape = ns.kv_layout.block_shape()
        wholes = [outs[0].new_empty(shape) for _ in keys]
        got = list(self.node.batch_get_into(keys, wholes, namespace=ns))
        a, b = layers
        for r, whole, out in zip(got, wholes, outs, strict=True):
            if r is True:
                out.copy_(whole[a:b])
        return got

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        return self.node.match_prefix(keys)

    def begin_layers(
        self, keys: Sequence[bytes], *, shape: Sequence[int], dtype: Any
    ) -> LayerWriter:
        return _NodeLayers(self.node, self.namespace, keys, block_info(shape, dtype))

    def remove(self, keys: Sequence[bytes]) -> int:
        return self.node.remove(keys)

    def close(self) -> None:
        """The node belongs to its creator; nothing to release here."""


class _NodeLayers:
    """A layer-by-layer write into an in-process node: reservations filled in place."""

    def __init__(
        self, node: StoreNode, namespace: Namespace, keys: Sequence[bytes], info: ValueInfo
    ) -> None:
        self.node, self.per = node, info.nbytes // info.shape[0]
        self.slots = [node.reserve(k, info, namespace=namespace) for k in keys]
        self.next = 0

    def write(self, layer: int, values: Sequence[Any]) -> None:
        if layer != self.next:
            raise InvalidValue(f"layer {layer} written after layers [0, {self.next})")
        k = 0
        for res, v in zip(self.slots, values, strict=True):
            src = host_bytes(v)
            k = src.nbytes // self.per
            if res is not None:
                res.payload[layer * self.per : layer * self.per + src.nbytes] = src
        self.next += k

    def write_stacked(self, layer: int, stacked: Any) -> None:
        # in process there is no wire to feed: per block, as the stacked tensor holds it
        self.write(layer, [v.contiguous() for v in stacked.transpose(0, 1)])

    def commit(self, keep: Sequence[bool] | None = None) -> list[Any]:
        flags = [True] * len(self.slots) if keep is None else list(keep)
        out: list[Any] = []
        for res, k in zip(self.slots, flags, strict=True):
            if res is None:
                out.append(False)
            elif not k:
                self.node.abort(res)
                out.append(None)
            else:
                out.append(self.node.commit(res))
        return out

    def abort(self) -> None:
        for res in self.slots:
            if res is not None:
                self.node.abort(res)


def _in_daemon_thread(fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, name="kvstore-reconnect", daemon=True).start()


class GuardedStore:
    """A :class:`BlockStore` behind a circuit breaker (see the module docstring).

    ``opener`` opens a new client. ``spawn`` runs a reconnect: a new daemon thread by
    default, so the call that starts it is a miss and never waits; None opens it in
    the calling thread, which then uses it at once. :meth:`open` connects at start
    (bounded by the client's connect timeout; a store that is down then only costs a
    warning); without it the first call connects.

    Thread model: ``_lock`` guards ``_store``, ``_opening``, ``_down`` and
    ``_down_until``; store I/O runs outside it, so calls may come from any thread.
    """

    def __init__(
        self,
        opener: Callable[[], BlockStore],
        *,
        retry_after_s: float,
        stats: StoreHealth | None = None,
        clock: Callable[[], float] = time.monotonic,
        spawn: Callable[[Callable[[], None]], None] | None = _in_daemon_thread,
        logger: logging.Logger = log,
    ) -> None:
        self._opener = opener
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._spawn = spawn
        self._log = logger
        self.stats: StoreHealth = BreakerStats() if stats is None else stats
        self._lock = threading.Lock()
        self._store: BlockStore | None = None
        self._opening = False
        self._down_until = 0.0
        self._down = False

    # -- the breaker ----------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """False while the store is marked down (calls are skipped)."""
        return self._clock() >= self._down_until

    def open(self) -> bool:
        """Connect now, in this thread; False (logged, cool-down started) on failure."""
        try:
            store = self._opener()
        except Exception as exc:
            self._mark_down("connect", exc)
            return False
        with self._lock:
            old, self._store = self._store, store
        _close_quietly(old, self._log)
        return True

    def failed(self, what: str, exc: Exception) -> None:
        """A call made outside this wrapper (a layer writer's) failed: the store is
        marked down as if it were one of this wrapper's own."""
        self._mark_down(what, exc)

    def close(self) -> None:
        """Close the underlying store, if open."""
        with self._lock:
            store, self._store = self._store, None
        _close_quietly(store, self._log)

    def _reconnect(self) -> None:
        try:
            store: BlockStore | None = self._opener()
        except Exception as exc:
            self._mark_down("connect", exc)
            store = None
        with self._lock:
            self._opening = False
            if store is not None and self._store is None:
                self._store, store = store, None
        _close_quietly(store, self._log)

    def _acquire(self) -> BlockStore | None:
        """The client to call now, or None (counted as skipped) while there is none."""
        with self._lock:
            store = self._store if self.available else None
            reconnect = store is None and self.available and not self._opening
            self._opening = self._opening or reconnect
        if reconnect:
            if self._spawn is None:
                self._reconnect()
                with self._lock:
                    store = self._store if self.available else None
            else:
                self._spawn(self._reconnect)
        if store is None:
            self.stats.skipped_calls += 1
        return store

    def _answered(self) -> None:
        if self._down:
            with self._lock:
                self._down = False
            self._log.info("kvstore is reachable again; loads and saves resume")

    def _mark_down(self, what: str, exc: Exception, store: BlockStore | None = None) -> None:
        self.stats.store_errors += 1
        with self._lock:
            self._down_until = self._clock() + self._retry_after_s
            first, self._down = not self._down, True
            if store is not None and self._store is store:
                self._store = None
            else:
                store = None
        if first:
            kind = exc.code if isinstance(exc, KVStoreError) else type(exc).__name__
            self._log.warning(
                "kvstore %s failed (%s: %s); serving misses, retrying every %.1fs",
                what, kind, exc, self._retry_after_s,
            )  # fmt: skip
        _close_quietly(store, self._log)

    def _call(self, what: str, fn: Callable[[BlockStore], T], default: T) -> T:
        """``fn`` on the client; ``default`` when skipped or when it raises anything."""
        store = self._acquire()
        if store is None:
            return default
        try:
            result = fn(store)
        except Exception as exc:  # any failure of the store is a miss, never the engine's
            self._mark_down(what, exc, store)
            return default
        self._answered()
        return result

    def _raising(self, what: str, fn: Callable[[BlockStore], T]) -> T:
        """``fn`` on the client; raises ``Unavailable`` when skipped and passes its
        errors on, marking the store down for those that say the store is gone."""
        store = self._acquire()
        if store is None:
            raise Unavailable("store marked down after a failure")
        try:
            result = fn(store)
        except KVStoreError as exc:
            if exc.retryable or isinstance(exc, Unavailable):
                self._mark_down(what, exc, store)
            raise
        self._answered()
        return result

    # -- BlockStore: raises as the store would ----------------------------------------------

    def put(self, key: bytes, value: Any, *, namespace: Namespace | None = None) -> bool:
        return bool(self._raising("put", lambda s: s.put(key, value, namespace=namespace)))

    def get_into(self, key: bytes, out: Any, *, namespace: Namespace | None = None) -> bool:
        return bool(self._raising("get", lambda s: s.get_into(key, out, namespace=namespace)))

    def batch_put(
        self, keys: Sequence[bytes], values: Sequence[Any], *, namespace: Namespace | None = None
    ) -> list[Any]:
        return self._raising("put", lambda s: s.batch_put(keys, values, **_ns(namespace)))

    def batch_get_into(
        self,
        keys: Sequence[bytes],
        outs: Sequence[Any],
        *,
        namespace: Namespace | None = None,
        layers: tuple[int, int] | None = None,
    ) -> list[Any]:
        return self._raising(
            "get", lambda s: s.batch_get_into(keys, outs, layers=layers, **_ns(namespace))
        )

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        return int(self._raising("match_prefix", lambda s: s.match_prefix(keys)))

    def begin_layers(
        self, keys: Sequence[bytes], *, shape: Sequence[int], dtype: Any
    ) -> LayerWriter:
        return self._raising("save", lambda s: s.begin_layers(keys, shape=shape, dtype=dtype))

    def remove(self, keys: Sequence[bytes]) -> int:
        return int(self._raising("remove", lambda s: s.remove(keys)))

    # -- never raises: a failure is a miss -------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Leading keys stored; 0 when the store cannot say. Asks in slices of
        ``MATCH_SLICE`` keys (under the server's default batch limit of 1024), stopping
        at the first slice not fully stored."""

        def match(s: BlockStore) -> int:
            n = 0
            for start in range(0, len(keys), MATCH_SLICE):
                part = keys[start : start + MATCH_SLICE]
                got = int(s.match_prefix(part))
                n += got
                if got < len(part):
                    break
            return n

        if not keys:
            return 0
        return self._call("match_prefix", match, 0)

    def load(
        self,
        keys: Sequence[bytes],
        outs: Sequence[Any],
        *,
        layers: tuple[int, int] | None = None,
    ) -> list[bool]:
        """True for each key copied into its ``out`` (``layers``: that layer range of
        it); a failed call is all misses."""
        res = self._call("get", lambda s: s.batch_get_into(keys, outs, layers=layers), None)
        if res is None:
            return [False] * len(keys)
        return [r is True for r in res]

    def save(self, keys: Sequence[bytes], values: Sequence[Any]) -> tuple[int, int]:
        """Store each block: (newly stored, already present); (0, 0) on failure."""
        res = self._call("put", lambda s: s.batch_put(keys, values), None)
        if res is None:
            return 0, 0
        for r in res:
            if isinstance(r, Exception):
                self._log.debug("kvstore refused a block: %s", r)
        return sum(1 for r in res if r is True), sum(1 for r in res if r is False)

    def begin_save(
        self, keys: Sequence[bytes], *, shape: Sequence[int], dtype: Any
    ) -> LayerWriter | None:
        """A layer-by-layer write of ``keys``, or None when the store cannot take one
        now. Errors of the writer's own calls go to :meth:`failed`."""
        return self._call("save", lambda s: s.begin_layers(keys, shape=shape, dtype=dtype), None)

    def discard(self, keys: Sequence[bytes]) -> None:
        """Drop blocks that failed to load (best effort)."""
        self._call("remove", lambda s: s.remove(keys), 0)


def _ns(namespace: Namespace | None) -> dict[str, Namespace]:
    """``namespace=`` only when given: a client bound at open (the vLLM connector's, a
    test's wrapper) need not take the keyword at all."""
    return {} if namespace is None else {"namespace": namespace}


def _close_quietly(store: BlockStore | None, logger: logging.Logger) -> None:
    """Close a client that may be broken: its error must not mask the one that matters."""
    if store is None:
        return
    try:
        store.close()
    except Exception:
        logger.debug("closing a kvstore client raised", exc_info=True)


class NullStore:
    """A store that holds nothing: every lookup misses. Writes either raise ``refuse``
    (a worker with no store node, where a write is a configuration error the caller
    should hear of) or, with ``refuse`` empty, are dropped and reported as already
    stored (the recompute side of a measurement, which must run the same worker code
    and keep nothing)."""

    def __init__(self, refuse: str = "") -> None:
        self.refuse = refuse

    def _write(self, n: int) -> list[Any]:
        if self.refuse:
            raise KVStoreError(self.refuse)
        return [False] * n

    def put(self, key: bytes, value: Any, *, namespace: Namespace | None = None) -> bool:
        self._write(1)
        return False

    def get_into(self, key: bytes, out: Any, *, namespace: Namespace | None = None) -> bool:
        return False

    def batch_put(
        self, keys: Sequence[bytes], values: Sequence[Any], *, namespace: Namespace | None = None
    ) -> list[Any]:
        return self._write(len(keys))

    def batch_get_into(
        self,
        keys: Sequence[bytes],
        outs: Sequence[Any],
        *,
        namespace: Namespace | None = None,
        layers: tuple[int, int] | None = None,
    ) -> list[Any]:
        return [False] * len(keys)

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        return 0

    def begin_layers(
        self, keys: Sequence[bytes], *, shape: Sequence[int], dtype: Any
    ) -> LayerWriter:
        raise KVStoreError(self.refuse or "a store that holds nothing writes no layers")

    def remove(self, keys: Sequence[bytes]) -> int:
        return 0

    def close(self) -> None:
        """Nothing is open."""
