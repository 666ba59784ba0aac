"""The vLLM connector's view of kvstore: its settings, and a store that never fails.

The connector sits on vLLM's critical path (the scheduler's lookup, the worker's loads
and saves run inside engine steps), and a KV cache is an optimisation: a store that is
down, slow or broken must cost a miss, never a failed request. :class:`ResilientStore`
turns every store error into a miss, counts it, logs one line when the store goes away
and one when it comes back, and between the two stops calling the store for
``retry_after_s`` so a dead endpoint does not add a timeout to every step.

Nothing here imports vLLM, so it is tested in the project's main environment.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, TypeVar

from kvstore.blocks import ValueInfo, host_bytes
from kvstore.client.layered import block_info
from kvstore.errors import ConfigError, InvalidValue, KVStoreError
from kvstore.keys import Namespace
from kvstore.node.store import StoreNode

__all__ = [
    "BlockStore",
    "ConnectorConfig",
    "ConnectorStats",
    "LayerWriter",
    "NodeStore",
    "ResilientStore",
    "open_client",
]

# Under vLLM's logger tree, so VLLM_LOGGING_LEVEL and vLLM's format apply to our lines.
log = logging.getLogger("vllm.kvstore")
T = TypeVar("T")
MATCH_SLICE = 512  # keys per match_prefix call: 16k tokens of 32-token blocks


class LayerWriter(Protocol):
    """A layer-by-layer write (kvstore.client.layered.LayeredPut's interface)."""

    def write(self, layer: int, values: Sequence[Any]) -> None: ...

    def write_stacked(self, layer: int, stacked: Any) -> None: ...

    def commit(self, keep: Sequence[bool] | None = None) -> list[Any]: ...

    def abort(self) -> None: ...


class BlockStore(Protocol):
    """What the connector needs from a store, namespace already bound.

    A :class:`kvstore.StoreClient` opened with ``namespace=`` is one; :class:`NodeStore`
    adapts an in-process :class:`kvstore.StoreNode`. Batch calls report each key's own
    outcome (True, False for a miss or an already stored key, or that key's error).
    """

    def batch_put(self, keys: Sequence[bytes], values: Sequence[Any]) -> list[Any]: ...

    def batch_get_into(
        self,
        keys: Sequence[bytes],
        outs: Sequence[Any],
        *,
        layers: tuple[int, int] | None = None,
    ) -> list[Any]: ...

    def match_prefix(self, keys: Sequence[bytes]) -> int: ...

    def begin_layers(
        self, keys: Sequence[bytes], *, shape: Sequence[int], dtype: Any
    ) -> LayerWriter: ...

    def remove(self, keys: Sequence[bytes]) -> int: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """The connector's ``kv_connector_extra_config``, validated once at engine start.

    Attributes:
        endpoint: ``host:port`` of a ``kvstore serve`` (shared memory when on this host).
        token: bearer token; its tenant scopes every key. Empty: ``KVSTORE_TOKEN``.
        model_id: the model part of the namespace; engines share KV only when it is
            equal. Default: vLLM's model name or path.
        timeout_s: deadline of one store call; past it the call is a miss.
        connect_timeout_s: deadline of reaching the server.
        retries: client retries of a retryable failure within ``timeout_s``.
        retry_after_s: after a failure, calls are skipped (served as misses) this long.
        max_blocks_per_call: blocks per batch call (and per staging buffer).
        layerwise: load a step's hits layer by layer in the background, each attention
            layer waiting for its own layer only, so the forward starts once layer 0 has
            landed; False loads whole blocks before the forward (the comparison point).
        layerwise_save: save each layer of a step's new blocks as the forward produces
            it, in the background (kvstore's layer-by-layer write), and commit them in
            ``wait_for_save``; False gathers and puts whole blocks in ``wait_for_save``.
        transfer_cpus: cores for the load and save threads (engine/vllm_cpus.py):
            ``auto`` runs them off the cores vLLM's OpenMP team is bound to, when it is
            bound to an explicit list; a core list pins them there; ``none`` never.
        transport: ``auto``, ``shm`` or ``tcp`` (see kvstore.config.ClientConfig).
        verify: xxh3-check every block copied out of the server's shared memory, as
            over TCP. On by default (~13 us per 720 KiB block): loaded KV goes straight
            into attention, where a scribbled block would silently change outputs.
    """

    endpoint: str
    token: str = field(default="", repr=False)
    model_id: str = ""
    timeout_s: float = 2.0
    connect_timeout_s: float = 1.0
    retries: int = 1
    retry_after_s: float = 5.0
    max_blocks_per_call: int = 64
    layerwise: bool = True
    layerwise_save: bool = True
    transfer_cpus: str = "auto"
    transport: str = "auto"
    verify: bool = True

    def __post_init__(self) -> None:
        if not self.endpoint:
            raise ConfigError("kv_connector_extra_config needs 'endpoint' (host:port)")
        for name in ("timeout_s", "connect_timeout_s", "max_blocks_per_call"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"kv_connector_extra_config {name!r} must be > 0")
        if self.retries < 0 or self.retry_after_s < 0:
            raise ConfigError("kv_connector_extra_config retries and retry_after_s must be >= 0")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> ConnectorConfig:
        """Parse the extra-config mapping strictly: unknown keys and wrong types fail."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}"
            )
        if not extra.get("endpoint"):
            raise ConfigError("kv_connector_extra_config needs 'endpoint' (host:port)")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            kind = {"str": str, "int": int, "float": float, "bool": bool}[str(known[name].type)]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise ConfigError(
                    f"kv_connector_extra_config {name!r}: expected {kind.__name__}, "
                    f"got {type(value).__name__}"
                )
            values[name] = value
        return cls(**values)


@dataclass(slots=True)
class ConnectorStats:
    """What one connector side did; read by tests and logged at shutdown."""

    lookups: int = 0  # get_num_new_matched_tokens calls that reached the store
    hit_tokens: int = 0  # tokens promised to vLLM from the store
    loaded_blocks: int = 0
    layerwise_loads: int = 0  # steps whose loads ran layer by layer beside the forward
    layer_wait_us: int = 0  # time the forward waited for a layer to land, in all
    failed_blocks: int = 0  # promised but not loaded (miss, corrupt, store down)
    saved_blocks: int = 0
    present_blocks: int = 0  # blocks put that the store already held
    layerwise_saves: int = 0  # steps whose saves went layer by layer beside the forward
    withdrawn_blocks: int = 0  # layer-wise saves dropped at the commit (their load failed)
    save_wait_us: int = 0  # time wait_for_save spent finishing the step's saves
    save_layer_us: int = 0  # time the forward spent in save_kv_layer (layer gathers)
    store_errors: int = 0  # whole calls that failed (down, timeout, protocol)
    skipped_calls: int = 0  # calls not made while the store was marked down

    def as_dict(self) -> dict[str, int]:
        """Plain dict, for logs and tests."""
        return {f.name: int(getattr(self, f.name)) for f in fields(self)}


class NodeStore:
    """An in-process :class:`StoreNode` behind the :class:`BlockStore` interface."""

    def __init__(self, node: StoreNode, namespace: Namespace) -> None:
        self.node = node
        self.namespace = namespace

    def batch_put(self, keys: Sequence[bytes], values: Sequence[Any]) -> list[Any]:
        return list(self.node.batch_put(keys, values, namespace=self.namespace))

    def batch_get_into(
        self,
        keys: Sequence[bytes],
        outs: Sequence[Any],
        *,
        layers: tuple[int, int] | None = None,
    ) -> list[Any]:
        if layers is None:
            return list(self.node.batch_get_into(keys, outs, namespace=self.namespace))
        # in process there is no transfer to pipeline: read whole blocks, hand the range
        if not outs:
            return []
        shape = self.namespace.kv_layout.block_shape()
        wholes = [outs[0].new_empty(shape) for _ in keys]
        got = list(self.node.batch_get_into(keys, wholes, namespace=self.namespace))
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


def open_client(config: ConnectorConfig, namespace: Namespace) -> BlockStore:
    """An open StoreClient for ``config``, with the connector's short deadlines."""
    from kvstore.client import StoreClient

    client = StoreClient.connect(
        config.endpoint,
        token=config.token or None,
        namespace=namespace,
        timeout_s=config.timeout_s,
        connect_timeout_s=config.connect_timeout_s,
        retries=config.retries,
        transport=config.transport,
        verify_shm=config.verify,
    )
    return client


def _in_daemon_thread(fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, name="kvstore-reconnect", daemon=True).start()


class ResilientStore:
    """A :class:`BlockStore` whose failures are misses, with a cool-down after each.

    :meth:`open` connects once at engine start (bounded by the client's connect
    timeout; a store that is down then only costs a warning). After a failure the client
    is dropped and, once ``retry_after_s`` has passed, a new one is opened in the
    background: an engine step never waits on a reconnect, only, at worst, on one call's
    timeout per cool-down. Per-key errors inside a batch (a corrupt block, a refused
    value) are that key's miss and do not mark the store down; a call that raises does.

    Thread model: calls come from one thread (one instance per connector side); the
    reconnect thread only hands over a new client. ``_lock`` guards ``_store``,
    ``_opening``, ``_down`` and ``_down_until``; store I/O runs outside it.
    """

    def __init__(
        self,
        opener: Callable[[], BlockStore],
        *,
        retry_after_s: float,
        stats: ConnectorStats,
        clock: Callable[[], float] = time.monotonic,
        spawn: Callable[[Callable[[], None]], None] = _in_daemon_thread,
    ) -> None:
        self._opener = opener
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._spawn = spawn
        self.stats = stats
        self._lock = threading.Lock()
        self._store: BlockStore | None = None
        self._opening = False
        self._down_until = 0.0
        self._down = False

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
        _close_quietly(old)
        return True

    def _reconnect(self) -> None:
        try:
            store = self._opener()
        except Exception as exc:
            self._mark_down("connect", exc)
            store = None
        with self._lock:
            self._opening = False
            if store is not None and self._store is None:
                self._store, store = store, None
        _close_quietly(store)

    def _call(self, what: str, fn: Callable[[BlockStore], T], default: T) -> T:
        with self._lock:
            store = self._store if self.available else None
            reconnect = store is None and self.available and not self._opening
            self._opening = self._opening or reconnect
        if store is None:
            self.stats.skipped_calls += 1
            if reconnect:
                self._spawn(self._reconnect)
            return default
        try:
            result = fn(store)
        except Exception as exc:  # any failure of the store is a miss, never the engine's
            self._mark_down(what, exc, store)
            return default
        if self._down:
            with self._lock:
                self._down = False
            log.info("kvstore is reachable again; loads and saves resume")
        return result

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
            log.warning(
                "kvstore %s failed (%s: %s); serving misses, retrying every %.1fs",
                what, kind, exc, self._retry_after_s,
            )  # fmt: skip
        _close_quietly(store)

    def match_prefix(self, keys: Sequence[bytes]) -> int:
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

    def get_into(
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

    def put(self, keys: Sequence[bytes], values: Sequence[Any]) -> tuple[int, int]:
        """Store each block: (newly stored, already present); (0, 0) on failure."""
        res = self._call("put", lambda s: s.batch_put(keys, values), None)
        if res is None:
            return 0, 0
        for r in res:
            if isinstance(r, Exception):
                log.debug("kvstore refused a block: %s", r)
        return sum(1 for r in res if r is True), sum(1 for r in res if r is False)

    def begin_layers(
        self, keys: Sequence[bytes], *, shape: Sequence[int], dtype: Any
    ) -> LayerWriter | None:
        """A layer-by-layer write of ``keys``, or None when the store cannot take one
        now. Errors of the writer's own calls go to :meth:`failed`."""
        return self._call("save", lambda s: s.begin_layers(keys, shape=shape, dtype=dtype), None)

    def failed(self, what: str, exc: Exception) -> None:
        """A call made outside this wrapper (a layer writer's) failed: the store is
        marked down as if it were one of this wrapper's own."""
        self._mark_down(what, exc)

    def remove(self, keys: Sequence[bytes]) -> None:
        """Drop blocks that failed to load (best effort)."""
        self._call("remove", lambda s: s.remove(keys), 0)

    def close(self) -> None:
        """Close the underlying store, if open."""
        with self._lock:
            store, self._store = self._store, None
        _close_quietly(store)


def _close_quietly(store: BlockStore | None) -> None:
    """Close a client that may be broken: its error must not mask the one that matters."""
    if store is None:
        return
    try:
        store.close()
    except Exception:
        log.debug("closing a kvstore client raised", exc_info=True)
