"""The vLLM connector's view of kvstore: its settings, its counters and its client.

The connector sits on vLLM's critical path (the scheduler's lookup, the worker's loads
and saves run inside engine steps), so every call it makes goes through the breaker of
engine/blockstore.py (``GuardedStore``, its never-raising face): a store that is down,
slow or broken costs a miss, never a failed request. This module holds what is the
connector's own: the ``kv_connector_extra_config`` it accepts, what it counts, and the
client it opens with short deadlines.

Nothing here imports vLLM, so it is tested in the project's main environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from engine.blockstore import BlockStore
from kvstore.codec import normalize_codec
from kvstore.errors import ConfigError
from kvstore.keys import Namespace

__all__ = ["ConnectorConfig", "ConnectorStats", "open_client"]


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
        save_decode: also save the full blocks of generated tokens as they complete
            (an engine that saves: kv_producer or kv_both), keyed by the chain of the
            prompt and the answer, so a chat's next turn, whose prompt holds this
            answer, finds its whole history stored. Off: prompt blocks only.
        transfer_cpus: cores for the load and save threads (engine/vllm/cpus.py):
            ``auto`` runs them off the cores vLLM's OpenMP team is bound to, when it is
            bound to an explicit list; a core list pins them there; ``none`` never.
        transport: ``auto``, ``shm`` or ``tcp`` (see kvstore.config.ClientConfig).
        verify: xxh3-check every block copied out of the server's shared memory, as
            over TCP. On by default (~13 us per 720 KiB block): loaded KV goes straight
            into attention, where a scribbled block would silently change outputs.
        kv_codec: compress stored KV (``int8`` or ``fp8``, :mod:`kvstore.codec`; empty:
            raw). Encoded after the gather and decoded before the scatter, on the KV
            tensors' device; the namespace's layout names it (``:C<codec>``), so engines
            share blocks only with engines of the same codec. A compressed block is
            opaque bytes to the store, which has no layer ranges of it: the layer-wise
            defaults are off with a codec, and asking for them with one is refused.
        register: put this ``vllm serve`` in etcd under a lease (its URL, role, model,
            store node and requests in flight), for ``kvstore vllm-router --etcd``;
            engine/vllm/membership.py. The next five keys are its settings and need it.
        etcd: ``host:port`` of etcd (empty: ``KVSTORE_ETCD``, else 127.0.0.1:2379).
        cluster: the cluster's name there (empty: ``KVSTORE_CLUSTER``, else default).
        role: ``prefill``, ``decode`` or ``both`` (empty: from ``kv_role``).
        url: the OpenAI server's URL routers dial (empty: from its --host and --port).
        lease_ttl_s: seconds the record outlives a server that died without a word.
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
    save_decode: bool = False
    transfer_cpus: str = "auto"
    transport: str = "auto"
    verify: bool = True
    kv_codec: str = ""
    register: bool = False
    etcd: str = ""
    cluster: str = ""
    role: str = ""
    url: str = ""
    lease_ttl_s: int = 10

    def __post_init__(self) -> None:
        _check_registration(self)
        if not self.endpoint:
            raise ConfigError("kv_connector_extra_config needs 'endpoint' (host:port)")
        codec = normalize_codec(self.kv_codec)  # an unknown name fails here, at start
        object.__setattr__(self, "kv_codec", codec or "")
        if codec and (self.layerwise or self.layerwise_save):
            raise ConfigError(
                f"kv_codec {codec!r} stores whole compressed blocks, which have no layer "
                "ranges: set layerwise and layerwise_save to false (or leave them out)"
            )
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
        if normalize_codec(values.get("kv_codec")):  # no layer-wise compressed transfers
            values.setdefault("layerwise", False)
            values.setdefault("layerwise_save", False)
        return cls(**values)


_REGISTRATION_KEYS = ("etcd", "cluster", "role", "url")


def _check_registration(c: ConnectorConfig) -> None:
    """The registration keys are settings of ``register`` and are refused without it,
    so a typo'd ``"register"`` never leaves a server silently out of its pool."""
    given = [k for k in _REGISTRATION_KEYS if getattr(c, k)]
    if given and not c.register:
        raise ConfigError(f'kv_connector_extra_config {given} need "register": true')
    if c.role not in ("", "prefill", "decode", "both"):
        raise ConfigError(f"kv_connector_extra_config role {c.role!r}: prefill, decode or both")
    if c.url and not c.url.startswith(("http://", "https://")):
        raise ConfigError(f"kv_connector_extra_config url {c.url!r}: expected http(s)://host:port")
    if c.lease_ttl_s < 1:
        raise ConfigError("kv_connector_extra_config 'lease_ttl_s' must be >= 1")


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
    decode_blocks: int = 0  # of the blocks planned for saving, those of generated tokens
    present_blocks: int = 0  # blocks put that the store already held
    layerwise_saves: int = 0  # steps whose saves went layer by layer beside the forward
    withdrawn_blocks: int = 0  # layer-wise saves dropped at the commit (their load failed)
    save_wait_us: int = 0  # time wait_for_save spent finishing the step's saves
    save_layer_us: int = 0  # time the forward spent in save_kv_layer (layer gathers)
    refused_blocks: int = 0  # not saved: kv_codec refused them (inf or nan in the pages)
    store_errors: int = 0  # whole calls that failed (down, timeout, protocol)
    skipped_calls: int = 0  # calls not made while the store was marked down

    def as_dict(self) -> dict[str, int]:
        """Plain dict, for logs and tests."""
        return {f.name: int(getattr(self, f.name)) for f in fields(self)}


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
