"""Typed, validated configuration; the only module that reads ``KVSTORE_*`` variables.

Sizes are strings like ``4GiB``, ``512MiB`` or ``1.5GB`` parsed strictly (binary
units are powers of 1024, decimal ones powers of 1000); a typo is a ConfigError
naming the setting, raised at start-up rather than at the first request.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvstore.errors import ConfigError

__all__ = [
    "POLICY_NAMES",
    "ENV_PREFIX",
    "ClientConfig",
    "ClusterConfig",
    "EtcdAccess",
    "EtcdAuth",
    "NodeConfig",
    "ServerConfig",
    "child_env",
    "resolve_config",
    "parse_size",
    "read_config_file",
]

ENV_PREFIX = "KVSTORE_"
# Eviction policies by name; kvstore/tiers/policy.py registers one class for each.
POLICY_NAMES = ("lru", "fifo", "s3fifo")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int, name: str = "size") -> int:
    """``"4GiB"`` -> 4294967296. Integers pass through; negatives and junk are refused."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name}: size must be >= 0, got {value}")
        return value
    m = _SIZE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{name}: cannot parse size {value!r} (try '512MiB' or '4GiB')")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _parse_bool(value: str | bool, name: str) -> bool:
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}: expected true/false, got {value!r}")


SHARED_MEMORY = ("auto", "all_tenants", "off")  # ServerConfig.shared_memory


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Everything a StoreNode needs. Build with ``NodeConfig.load(...)`` at the edge.

    Attributes:
        node_id: unique within a cluster; names the node in the directory.
        dram_bytes: size of the DRAM slab (shared memory), allocated and warmed at start.
        hbm_bytes: size of the HBM slab; 0 disables it (and it needs CUDA).
        hbm_device: the device holding the HBM slab: ``cuda`` (the current one) or
            ``cuda:<n>``; ``cpu`` runs the HBM tier's code (deferred checksums, the
            copy engine's ordering, same-host writes landing in DRAM) on host memory,
            for machines without CUDA such as CI; it is never faster than DRAM.
        ssd_path: directory of the SSD tier; empty disables it.
        ssd_bytes: capacity of the SSD tier.
        policy: eviction policy name for every tier (see kvstore.tiers.policy).
        max_value_bytes: the largest single block accepted.
        warm: touch every page of the memory tiers at start.
        shm_name: name of the DRAM segment under /dev/shm (default: derived from the pid).
        shared_dram: keep the DRAM slab in a /dev/shm segment that same-host clients
            map (readable by every process of the node's Unix user); False keeps it in
            this process's private memory. ``kvstore serve`` decides it from its tenants
            (``ServerConfig.shared_memory``).
        event_queue: bound of the event queue before old events are dropped.
    """

    node_id: str = "node-0"
    dram_bytes: int = 256 * 1024**2
    hbm_bytes: int = 0
    hbm_device: str = "cuda"
    ssd_path: str = ""
    ssd_bytes: int = 0
    policy: str = "lru"
    max_value_bytes: int = 64 * 1024**2
    warm: bool = True
    shm_name: str = ""
    shared_dram: bool = True
    event_queue: int = 1 << 20

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", self.node_id):
            raise ConfigError(f"node_id {self.node_id!r}: use 1-64 of [A-Za-z0-9._-]")
        if self.dram_bytes <= 0 and self.hbm_bytes <= 0:
            raise ConfigError("dram_bytes: a node needs a DRAM (or HBM) tier of > 0 bytes")
        if not re.fullmatch(r"cuda(:[0-9]{1,3})?|cpu", self.hbm_device):
            raise ConfigError(f"hbm_device {self.hbm_device!r}: use cuda, cuda:<n> or cpu")
        if self.policy.lower() not in POLICY_NAMES:
            raise ConfigError(f"policy {self.policy!r}: choose one of {', '.join(POLICY_NAMES)}")
        if self.ssd_path and self.ssd_bytes <= 0:
            raise ConfigError("ssd_bytes: must be > 0 when ssd_path is set")
        if self.max_value_bytes <= 0:
            raise ConfigError("max_value_bytes: must be > 0")
        if self.shm_name and not re.fullmatch(r"[A-Za-z0-9._-]{1,200}", self.shm_name):
            raise ConfigError(f"shm_name {self.shm_name!r}: use [A-Za-z0-9._-]")
        if self.shm_name and not self.shared_dram:
            raise ConfigError("shm_name: set, but shared_dram is off for this node")

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> NodeConfig:
        """Defaults, then ``KVSTORE_<FIELD>`` variables, then explicit overrides."""
        return resolve_config(cls, env=env, flags=overrides)

    def replace(self, **changes: Any) -> NodeConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _coerce(cls: type, name: str, value: Any) -> Any:
    """Turn an env/flag string into the field's type, with the field named on error."""
    if name.endswith("_bytes"):
        return parse_size(value, name)
    default = {f.name: f.default for f in fields(cls)}[name]
    if isinstance(default, bool):
        return _parse_bool(value, name)
    if isinstance(default, int):
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: expected an integer, got {value!r}") from None
    return str(value)


# -- etcd credentials ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EtcdAuth:
    """How one process authenticates to etcd and whether it speaks TLS to it: what
    kvstore/directory/etcd_client.py needs to open a channel. Built from the ``etcd_*``
    settings of :class:`EtcdAccess` (every config that reaches etcd carries them).

    Attributes:
        user / password: an etcd user; etcd's auth must be enabled and the user's role
            grant read-write on the cluster's prefix (``/kvstore/<cluster>/``). Both or
            neither.
        ca: PEM file of the CA that signed etcd's server certificate; set (or ``cert``
            set), the channel is TLS.
        cert / key: PEM client certificate and key, for an etcd run with
            ``--client-cert-auth``. Both or neither.
    """

    user: str = ""
    password: str = field(default="", repr=False)
    ca: str = ""
    cert: str = ""
    key: str = ""

    def __post_init__(self) -> None:
        if bool(self.user) != bool(self.password):
            raise ConfigError("etcd_user and etcd_password: set both or neither")
        if bool(self.cert) != bool(self.key):
            raise ConfigError("etcd_cert and etcd_key: set both or neither")
        for name in ("ca", "cert", "key"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ConfigError(f"etcd_{name}: no such file {path!r}")

    @property
    def tls(self) -> bool:
        """Whether the channel to etcd is TLS."""
        return bool(self.ca or self.cert)

    @property
    def empty(self) -> bool:
        """No credentials and no TLS: a plain channel, as to an etcd without auth."""
        return not (self.user or self.tls)

    def settings(self) -> dict[str, str]:
        """The ``etcd_*`` settings that are set, for :func:`child_env` (how ``kvstore
        up`` hands them to its children: environment, never flags)."""
        values = zip(
            ("etcd_user", "etcd_password", "etcd_ca", "etcd_cert", "etcd_key"),
            (self.user, self.password, self.ca, self.cert, self.key),
            strict=True,
        )
        return {name: v for name, v in values if v}


@dataclass(frozen=True, slots=True, kw_only=True)
class EtcdAccess:
    """The ``etcd_*`` settings every config that reaches etcd shares (the server's
    membership, the cluster client, the admin commands, the serving workers), so one set
    of ``KVSTORE_ETCD_*`` variables reaches a cluster's etcd from all of them.

    Attributes:
        etcd_user / etcd_password: etcd user and password (``KVSTORE_ETCD_PASSWORD``:
            keep it out of flags, which show up in ps).
        etcd_ca: PEM CA of etcd's server certificate (turns on TLS).
        etcd_cert / etcd_key: PEM client certificate and key (etcd's
            ``--client-cert-auth``).
    """

    etcd_user: str = ""
    etcd_password: str = field(default="", repr=False)
    etcd_ca: str = ""
    etcd_cert: str = ""
    etcd_key: str = ""

    @property
    def etcd_auth(self) -> EtcdAuth:
        """These settings as one validated value (ConfigError names the bad one)."""
        return EtcdAuth(
            self.etcd_user, self.etcd_password, self.etcd_ca, self.etcd_cert, self.etcd_key
        )


# -- server and client ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServerConfig(EtcdAccess):
    """How ``kvstore serve`` listens, authenticates and bounds requests.

    Attributes:
        host: address both listeners bind (loopback by default: exposing a node is a choice).
        port: gRPC control-plane port (0 picks a free one, reported at start).
        data_port: data-socket port for bulk bytes (0 picks a free one; clients learn it
            from the Info call).
        auth_token: one bearer token for tenant "default" with admin rights (dev setups).
        tokens_file: TOML/JSON file of ``[[tokens]] token, tenant, admin`` entries.
        allow_anonymous: accept calls without a token as tenant "default" (tests only).
        tls_cert / tls_key: PEM files; when set, gRPC and the data socket use TLS.
        max_batch: most keys in one request.
        max_message_bytes: largest gRPC message and data-frame metadata accepted.
        lease_ttl_s: how long a shared-memory read or write lease lives unless released.
        io_timeout_s: a frame that starts must finish within this (else the connection
            closes and its reservation is aborted).
        put_grace_s / put_floor_bytes: a put's reservation expires when its payload is
            not in within ``put_grace_s + nbytes / put_floor_bytes`` seconds (a floor of
            ``put_floor_bytes`` a second after a grace); the connection is cut and the
            reservation released. Same-host (shared-memory) write leases last as long,
            at most ``lease_ttl_s``.
        data_poll_us: after each reply on the data socket, poll up to this long for the
            same client's next request instead of sleeping (0: off). Only while that
            client has the server to itself: see kvstore/wire/polling.py.
        data_poll_crowded: poll even while the host has more runnable tasks than CPUs
            (kvstore/wire/crowding.py). Off by default: a poller then spins on a CPU
            that its clients need. On where /proc/loadavg counts other containers'
            tasks and the polls are still wanted.
        transport: ``tcp`` (the data socket carries payloads) or ``ucx``: the node also
            offers UCX, and a data connection whose client asks moves its frames to a
            UCX worker of its own (kvstore/wire/ucx.py; needs ucxx, the ``ucx`` extra).
            Not with TLS: UCX payloads travel in the clear.
        workers: threads running blocking node calls for gRPC handlers.
        max_connections: concurrent data sockets.
        max_handshakes: data sockets at once that have not authenticated yet (a share of
            max_connections that unauthenticated peers can never exceed).
        max_namespaces_per_tenant: distinct namespaces (model, layout) one tenant may
            create on this node; past it, requests naming a new one are refused.
        shared_memory: who may map the DRAM segment on this host. The segment holds
            every tenant's blocks and any process of the server's Unix user can open
            it, so ``auto`` (the default) keeps DRAM in private memory, with no
            segment at all, as soon as the tokens name two or more tenants; one tenant
            (or none) gets shared memory. ``all_tenants``: a segment for every tenant
            (they trust each other: each can read the others' DRAM blocks). ``off``:
            never. Without a segment, same-host clients use the Unix data socket.
        etcd: ``host:port`` of the cluster directory; empty runs the node standalone.
        cluster: the cluster's name in the directory (1-64 of ``[A-Za-z0-9._-]``).
        node_lease_ttl_s: lifetime of the node's directory lease without a keepalive:
            how long a crashed node's entries outlive it (etcd's minimum is 2).
        advertise_host: the host other machines reach this node at, as registered in
            the directory (default: ``host``, or this machine's FQDN when binding a
            wildcard address).
        metrics_host: address the Prometheus endpoint binds (loopback by default: it
            names tenants).
        metrics_port: port of ``/metrics``; -1 serves none, 0 picks a free one.
        kv_events_endpoint: ZMQ endpoint (``tcp://127.0.0.1:5557``) where the node
            publishes BlockStored / BlockRemoved in vLLM's KV-events format
            (kvstore/server/kv_events.py), so routers that consume vLLM's events can
            follow a kvstore pool; "" publishes none. Needs pyzmq and msgpack.
        kv_events_replay_endpoint: ZMQ ROUTER endpoint where a subscriber that missed
            batches asks for them again by sequence number ("" none).
        kv_events_topic: topic of every published batch.
        kv_events_block_size: tokens per block, as the events report it (the node
            stores bytes and does not know the engine's block size).
        shards: how many processes serve this node (``kvstore serve``): ``auto`` (one
            per two cores, at most 8, each with at least 1 GiB of DRAM:
            kvstore/wire/shards.py) or a number. Each shard owns 1/N of the DRAM, HBM
            and SSD and is a node of its own in the directory; clients send each key
            to its shard. An in-process StoreServer is always one shard.

    The ``etcd_*`` credentials of :class:`EtcdAccess` apply to the directory at ``etcd``.
    """

    host: str = "127.0.0.1"
    port: int = 7400
    data_port: int = 0
    auth_token: str = field(default="", repr=False)
    tokens_file: str = ""
    allow_anonymous: bool = False
    tls_cert: str = ""
    tls_key: str = ""
    max_batch: int = 1024
    max_message_bytes: int = 16 * 1024**2
    lease_ttl_s: float = 30.0
    io_timeout_s: float = 30.0
    put_grace_s: float = 5.0
    put_floor_bytes: int = 1024**2
    data_poll_us: int = 100
    data_poll_crowded: bool = False
    transport: str = "tcp"
    workers: int = 8
    max_connections: int = 256
    max_handshakes: int = 64
    max_namespaces_per_tenant: int = 1024
    shared_memory: str = "auto"
    etcd: str = ""
    cluster: str = "default"
    node_lease_ttl_s: float = 10.0
    advertise_host: str = ""
    metrics_host: str = "127.0.0.1"
    metrics_port: int = -1
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_topic: str = "kvstore"
    kv_events_block_size: int = 16
    shards: str = "auto"

    def __post_init__(self) -> None:
        if self.shards != "auto" and not (self.shards.isdigit() and 1 <= int(self.shards) <= 64):
            raise ConfigError(f"shards {self.shards!r}: use auto or a number from 1 to 64")
        if not self.host or any(c.isspace() for c in self.host):
            raise ConfigError(f"host {self.host!r}: give an address to bind, e.g. 127.0.0.1")
        _check_cluster(self.etcd, self.cluster, allow_standalone=True)
        self.etcd_auth  # noqa: B018 - validates the etcd_* settings
        _positive(self, "node_lease_ttl_s")
        if any(c.isspace() or c == "/" for c in self.advertise_host):
            raise ConfigError(f"advertise_host {self.advertise_host!r}: give a host name or IP")
        for name in ("port", "data_port"):
            v = getattr(self, name)
            if not 0 <= v <= 65535:
                raise ConfigError(f"{name}: {v} is not a TCP port (0-65535)")
        if self.port and self.port == self.data_port:
            raise ConfigError(f"data_port: must differ from port ({self.port})")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            v = getattr(self, name)
            if v and not v.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"{name} {v!r}: a ZMQ endpoint such as tcp://127.0.0.1:5557")
        _positive(self, "kv_events_block_size")
        self._check_metrics_and_auth()
        _positive(self, "max_batch", "max_message_bytes", "workers")
        _positive(
            self,
            "lease_ttl_s",
            "io_timeout_s",
            "put_grace_s",
            "put_floor_bytes",
            "max_connections",
            "max_handshakes",
            "max_namespaces_per_tenant",
        )
        if not 0 <= self.data_poll_us <= 10_000:
            raise ConfigError(
                f"data_poll_us: {self.data_poll_us} is not 0 (off) to 10000 microseconds"
            )
        if self.transport not in ("tcp", "ucx"):
            raise ConfigError(f"transport {self.transport!r}: choose tcp or ucx")
        if self.transport == "ucx" and self.tls_cert:
            raise ConfigError("transport ucx with TLS: UCX payloads would travel in the clear")

    def _check_metrics_and_auth(self) -> None:
        """Part of __post_init__: the metrics listener, shared memory, auth and TLS."""
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port: {self.metrics_port} is not -1 (off) or a TCP port")
        if self.metrics_port > 0 and self.metrics_port in (self.port, self.data_port):
            raise ConfigError("metrics_port: must differ from port and data_port")
        if not self.metrics_host or any(c.isspace() for c in self.metrics_host):
            raise ConfigError(f"metrics_host {self.metrics_host!r}: give an address to bind")
        if self.shared_memory not in SHARED_MEMORY:
            raise ConfigError(
                f"shared_memory {self.shared_memory!r}: choose one of {', '.join(SHARED_MEMORY)}"
            )
        if not (self.auth_token or self.tokens_file or self.allow_anonymous):
            raise ConfigError(
                "auth: set auth_token or tokens_file (allow_anonymous=true only for local tests)"
            )
        if self.auth_token and len(self.auth_token) < 16:
            raise ConfigError("auth_token: use at least 16 characters")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert and tls_key: set both or neither")
        for name in ("tokens_file", "tls_cert", "tls_key"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ConfigError(f"{name}: no such file {path!r}")

    @property
    def tls(self) -> bool:
        """Whether both listeners use TLS."""
        return bool(self.tls_cert)


@dataclass(frozen=True, slots=True)
class ClientConfig(EtcdAccess):
    """How a StoreClient connects, waits and retries.

    Attributes:
        token: bearer token sent on every call (``KVSTORE_TOKEN``).
        timeout_s: default deadline of one call, retries included.
        connect_timeout_s: deadline of opening the client (first Info call).
        retries: extra attempts after a retryable failure (``error.retryable``).
        backoff_s: first retry delay; doubles per attempt, with jitter.
        transport: ``auto`` (shared memory when the server is on this host and its
            segment maps; else UCX when the server offers it and ucxx imports here;
            else TCP), ``shm``, ``tcp`` or ``ucx`` (kvstore/wire/ucx.py).
        tls: use TLS (system roots unless ``tls_ca``).
        tls_ca: PEM file of the CA (or self-signed cert) to trust; implies ``tls``.
        tls_server_name: name to check the server certificate against, when it differs
            from the host in the address.
        pool_size: data sockets kept open (and the async client's thread count).
        verify_shm: also xxh3-check blocks copied out of shared memory (about 18 us per
            MiB). Off by default: the lease deadline already proves the copy was pinned
            (and checksums are used anyway when the server's clock is not this one).
        shm_direct: same-host reads of DRAM blocks find them in the server's published
            index and copy without a lease round trip (kvstore/shm/index.py);
            off: every shm read takes a lease first.
        shm_write_credits: same-host puts keep write credits, space the server lends
            ahead (kvstore/client/transport/credits.py), and commit into them in one
            round trip; off: every put reserves first (two round trips).
        shm_prefault_bytes: how much of a node's mapped segment a background thread
            prefaults at connect (kvstore/shm/prefault.py): without it the first write
            to each page costs a fault, and 1 MiB copies into fresh extents run at
            ~3 GB/s instead of ~17 (benchmarks/bench_prefault.py). Costs 2 MiB of page
            tables per GiB; 0: off.
        max_reply_bytes: largest gRPC message and data-frame metadata this client accepts
            (``KVSTORE_MAX_REPLY_BYTES``; the server's own limit is max_message_bytes).
        reply_poll_us: after sending a data-socket request, poll this long for the
            reply before sleeping on the socket (0: off). A DRAM hit's reply starts
            40-60 us after the request; a sleeping thread then costs as much again to
            wake on a virtual machine. One thread of the process polls at a time (the
            others sleep), so other threads keep their turn at the GIL. No thread
            polls while the host has more runnable tasks than CPUs, unless
            ``reply_poll_crowded`` (kvstore/wire/crowding.py).
        faults: inject failures and stalls under this client, for fault drills (""
            off; ``KVSTORE_FAULTS``): a kvstore/faults.py plan such as
            ``read@10.0.0.7:error=transport:times=3,control.*:delay=0.5``.

    The ``etcd_*`` credentials of :class:`EtcdAccess` apply to a cluster client's
    directory (``StoreClient.from_etcd``).
    """

    token: str = field(default="", repr=False)
    timeout_s: float = 10.0
    connect_timeout_s: float = 5.0
    retries: int = 3
    backoff_s: float = 0.05
    transport: str = "auto"
    tls: bool = False
    tls_ca: str = ""
    tls_server_name: str = ""
    pool_size: int = 8
    verify_shm: bool = False
    shm_direct: bool = True
    shm_write_credits: bool = True
    shm_prefault_bytes: int = 32 * 1024**3
    max_reply_bytes: int = 64 * 1024**2
    reply_poll_us: int = 200
    reply_poll_crowded: bool = False
    faults: str = ""

    def __post_init__(self) -> None:
        if self.transport not in ("auto", "shm", "tcp", "ucx"):
            raise ConfigError(f"transport {self.transport!r}: choose auto, shm, tcp or ucx")
        if self.tls_ca and not os.path.isfile(self.tls_ca):
            raise ConfigError(f"tls_ca: no such file {self.tls_ca!r}")
        if self.retries < 0:
            raise ConfigError("retries: must be >= 0")
        self.etcd_auth  # noqa: B018 - validates the etcd_* settings
        _positive(self, "timeout_s", "connect_timeout_s", "pool_size", "max_reply_bytes")
        if self.backoff_s < 0:
            raise ConfigError("backoff_s: must be >= 0")
        if self.shm_prefault_bytes < 0:
            raise ConfigError("shm_prefault_bytes: must be >= 0")
        if not 0 <= self.reply_poll_us <= 10_000:
            raise ConfigError(
                f"reply_poll_us: {self.reply_poll_us} is not 0 (off) to 10000 microseconds"
            )

    @property
    def use_tls(self) -> bool:
        """Whether to connect with TLS."""
        return self.tls or bool(self.tls_ca)

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> ClientConfig:
        """Defaults, then ``KVSTORE_<FIELD>`` variables, then explicit overrides."""
        return resolve_config(cls, env=env, flags=overrides)

    @classmethod
    def resolve(
        cls, config: ClientConfig | None, token: str | None, **overrides: Any
    ) -> ClientConfig:
        """What a client constructor was given: a config (or the environment), then
        keyword overrides, then an explicit token."""
        if config is None:
            config = cls.load(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        if token is not None:
            config = dataclasses.replace(config, token=token)
        return config


@dataclass(frozen=True, slots=True)
class ClusterConfig(EtcdAccess):
    """Where a cluster's directory lives, for the commands that read it (``kvstore
    nodes``, ``kvstore ls``), for ``kvstore up --etcd`` and the serving workers.

    Attributes:
        etcd: ``host:port`` of an etcd member (``KVSTORE_ETCD``).
        cluster: the cluster's name (``KVSTORE_CLUSTER``).

    Plus the ``etcd_*`` credentials of :class:`EtcdAccess`.
    """

    etcd: str = "127.0.0.1:2379"
    cluster: str = "default"

    def __post_init__(self) -> None:
        _check_cluster(self.etcd, self.cluster, allow_standalone=False)
        self.etcd_auth  # noqa: B018 - validates the etcd_* settings


_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _check_cluster(etcd: str, cluster: str, *, allow_standalone: bool) -> None:
    if etcd or not allow_standalone:
        host, sep, port = etcd.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"etcd {etcd!r}: expected host:port, e.g. 127.0.0.1:2379")
    if not _NAME.fullmatch(cluster):
        raise ConfigError(f"cluster {cluster!r}: use 1-64 of [A-Za-z0-9._-]")


def child_env(settings: Mapping[str, Any], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child ``kvstore`` process: this one's (or ``base``) plus
    ``settings`` as ``KVSTORE_<NAME>`` variables. How ``kvstore up`` hands a secret
    to its nodes without putting it on a command line (flags show up in ``ps``)."""
    env = dict(os.environ if base is None else base)
    env.update({ENV_PREFIX + k.upper(): str(v) for k, v in settings.items()})
    return env


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise ConfigError(f"{name}: must be > 0, got {getattr(obj, name)}")


def resolve_config(
    cls: Any,
    *,
    env: Mapping[str, str] | None = None,
    file_values: Mapping[str, Any] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Any:
    """Build a config dataclass from defaults < file < ``KVSTORE_*`` env < flags.

    Unknown names are refused (naming them), values are coerced to the field's type
    with the field named on error, and the dataclass validates the result.
    """
    env = os.environ if env is None else env
    names = {f.name for f in fields(cls)}
    raw: dict[str, Any] = {}
    unknown = set(file_values or {}) - names
    if unknown:
        raise ConfigError(f"unknown setting(s) in config file: {', '.join(sorted(unknown))}")
    raw.update(file_values or {})
    for name in names:
        v = env.get(ENV_PREFIX + name.upper())
        if v is not None:
            raw[name] = v
    unknown = set(flags or {}) - names
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}")
    raw.update({k: v for k, v in (flags or {}).items() if v is not None})
    return cls(**{k: _coerce_field(cls, k, v) for k, v in raw.items()})


def _coerce_field(cls: type, name: str, value: Any) -> Any:
    default = {f.name: f.default for f in fields(cls)}[name]
    if isinstance(default, float):
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: expected a number, got {value!r}") from None
    if isinstance(default, int) and not isinstance(default, bool) and isinstance(value, float):
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    return _coerce(cls, name, value)


def read_config_file(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """Read a TOML (``.toml``) or JSON file of ``[node]`` and ``[server]`` tables."""
    import json

    p = os.fspath(path)
    try:
        with open(p, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"config file {p!r}: {exc.strerror}") from None
    try:
        if p.endswith(".json"):
            doc = json.loads(data)
        else:
            import tomllib

            doc = tomllib.loads(data.decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {p!r}: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"config file {p!r}: expected tables [node] and [server]")
    extra = set(doc) - {"node", "server"}
    if extra:
        raise ConfigError(f"config file {p!r}: unknown table(s) {', '.join(sorted(extra))}")
    for table in doc.values():
        if not isinstance(table, dict):
            raise ConfigError(f"config file {p!r}: [node] and [server] must be tables")
    return {"node": dict(doc.get("node", {})), "server": dict(doc.get("server", {}))}
