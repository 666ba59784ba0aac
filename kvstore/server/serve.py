"""StoreServer: one StoreNode behind two listeners, and the ``kvstore serve`` command.

The gRPC service (kvstore/server/service.py) is the control plane: Info, Health, the
metadata and admin calls; it carries no get or put. The data socket
(kvstore/server/dataserver.py, over TCP and a same-host Unix socket) is the one data
plane: every get and put, and the leases of same-host shared-memory copies.

Start-up validates everything before listening: the node and server configs (defaults <
``--config`` file < ``KVSTORE_*`` env < flags), the tokens file, the TLS files and both
ports; each bad setting is a one-line error naming it. Shutdown (SIGTERM, SIGINT or
:meth:`StoreServer.stop`) stops accepting, closes data connections (ending their leases
and aborting half-received writes), then closes the node, whose SSD tier is reopened
and re-announced by the next start, with the namespace names kept beside it
(kvstore/server/namespaces.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import secrets
import signal
import ssl
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from kvstore._proto import store_pb2 as pb
from kvstore.config import NodeConfig, ServerConfig, read_config_file, resolve_config
from kvstore.errors import ConfigError
from kvstore.node.store import StoreNode
from kvstore.server.auth import TokenTable
from kvstore.server.dataserver import DataServer
from kvstore.server.gateway import Gateway
from kvstore.server.kv_events import KVEventsPublisher
from kvstore.server.membership import Membership, advertised_host, join_address, node_record
from kvstore.server.namespaces import NamespaceRegistry
from kvstore.server.quotas import Quotas
from kvstore.server.service import StoreServicer, add_to_server
from kvstore.server.shards import ShardPlan, run_sharded, shard_count
from kvstore.tenants import Principal
from kvstore.tier_kinds import TierKind
from kvstore.wire.locality import host_id, hostname
from kvstore.wire.shards import ShardRole

__all__ = ["StoreServer", "add_parser", "load_configs"]

log = logging.getLogger(__name__)
VERSION = "0.1.0"


class StoreServer:
    """Serves one node. ``await start()``, then ``await stop()`` (or ``serve()``).

    ``shard``: this server is one shard of a node split across processes
    (kvstore/server/shards.py starts them): it says so in Info and in its directory
    record, and holds 1/count of each tenant's quota, as it holds 1/count of the keys."""

    def __init__(
        self, node_config: NodeConfig, config: ServerConfig, shard: ShardRole | None = None
    ) -> None:
        if shard is not None and node_config.node_id != shard.node_id:
            raise ConfigError(f"node_id {node_config.node_id!r}: shard is {shard.node_id!r}")
        self.config = config
        self.shard = shard
        self.tokens = TokenTable.from_config(config)  # refuses a bad tokens file now
        self.node_config = shared_memory_for(node_config, config, self.tokens.tenants)
        quotas = Quotas.from_config(config)  # and bad quotas in it
        self.quotas = quotas.share(shard.count) if shard is not None else quotas
        self.instance_id = secrets.token_hex(8)
        self.port = 0
        self.data_port = 0
        self.metrics_port = -1  # the bound /metrics port once started; -1: none
        self._metrics: Any = None  # kvstore.observe.prometheus.MetricsServer when metrics_port >= 0
        self.kv_events: KVEventsPublisher | None = None  # kv_events_endpoint set
        self.node: StoreNode | None = None
        self._shm_size = 0
        self._shm_index = ""  # the published DRAM index (kvstore/shm/index.py)
        self._grpc: grpc.aio.Server | None = None
        self._data: DataServer | None = None
        self._gateway: Gateway | None = None
        self.membership: Membership | None = None
        self._pool = ThreadPoolExecutor(config.workers, thread_name_prefix="kvstore-rpc")
        self._tls = _tls_context(config)

    async def start(self) -> None:
        """Open the node and both listeners; ports are known when this returns."""
        c = self.config
        self.node = StoreNode(self.node_config)
        self._shm_size = int(self.node.stats()["tiers"].get("dram", {}).get("capacity", 0))
        try:
            self._shm_index = self.node.publish_index()
            names = NamespaceRegistry.open(self.node_config.ssd_path)  # beside SSD blocks
            gw = self._gateway = Gateway(self.node, c, names, self.quotas)
            gw.leases.start_reaper()
            self._data = DataServer(gw, self.tokens, self.info, c, self._tls)
            self.data_port = self._data.start(f"kvstore-{self.node.node_id}-{self.instance_id}")
            self._grpc = grpc.aio.server(self._pool, options=_grpc_options(c))
            servicer = StoreServicer(gw, self.tokens, self.info, self._pool)
            add_to_server(servicer, self._grpc)
            self.port = self._bind_grpc()
            await self._grpc.start()
            self._start_metrics(gw)
            self._start_kv_events()
            await self._join()
        except BaseException:
            await self.stop()
            raise
        log.info(
            "serving node %s on %s:%d (data %d)",
            self.node.node_id,
            c.host,
            self.port,
            self.data_port,
        )

    async def _join(self) -> None:
        """Register in the cluster directory (``--etcd``), or just drain node events."""
        assert self.node is not None
        assert self._gateway is not None
        info = node_record(self.node, self.config, self.port, self.data_port, self.instance_id)
        if self.shard is not None:
            s = self.shard
            info = dataclasses.replace(info, group=s.group, shard=s.index, shards=s.count)
        info = dataclasses.replace(info, draining=self._gateway.draining)
        self.membership = Membership(self.node, self.config, info)
        self._gateway.on_drain = self.membership.set_draining  # Drain RPC -> directory
        await self.membership.start()

    def _start_kv_events(self) -> None:
        """Publish block events in vLLM's KV-events format (``kv_events_endpoint``)."""
        c, node = self.config, self.node
        if not c.kv_events_endpoint or node is None:
            return

        def blocks() -> list[tuple[bytes, TierKind]]:
            return [(bytes(k), tier) for k, tier, _ in node.snapshot()]

        self.kv_events = KVEventsPublisher(
            node.events.tap(),
            blocks,
            c.kv_events_endpoint,
            replay_endpoint=c.kv_events_replay_endpoint,
            topic=c.kv_events_topic,
            block_size=c.kv_events_block_size,
            rank=self.shard.index if self.shard is not None and self.shard.count > 1 else None,
        )

    def _start_metrics(self, gw: Gateway) -> None:
        """Serve Prometheus ``/metrics`` (``metrics_port`` >= 0): node + gateway books."""
        c = self.config
        if c.metrics_port < 0:
            return
        try:
            from kvstore.observe.prometheus import MetricsServer, node_registry
        except ImportError:
            raise ConfigError(
                "metrics_port: needs prometheus-client (pip install 'kvstore[metrics]')"
            ) from None
        assert self.node is not None
        registry = node_registry(self.node, counters=[gw.books.counters], gauges=gw.gauges)
        self._metrics = MetricsServer(registry, host=c.metrics_host, port=c.metrics_port)
        self.metrics_port = self._metrics.start().port

    def _bind_grpc(self) -> int:
        assert self._grpc is not None
        c = self.config
        addr = f"[{c.host}]:{c.port}" if ":" in c.host else f"{c.host}:{c.port}"
        try:
            if c.tls:
                with open(c.tls_key, "rb") as k, open(c.tls_cert, "rb") as crt:
                    creds = grpc.ssl_server_credentials([(k.read(), crt.read())])
                port = self._grpc.add_secure_port(addr, creds)
            else:
                port = self._grpc.add_insecure_port(addr)
        except RuntimeError as exc:
            raise ConfigError(f"port: cannot listen on {addr} ({exc})") from None
        if port == 0:
            raise ConfigError(f"port: cannot listen on {addr} (in use?)")
        return port

    def info(self, p: Principal) -> pb.InfoResponse:
        """What a client learns at connect time (its own tenant included)."""
        assert self.node is not None and self._gateway is not None
        c, node = self.config, self.node
        return pb.InfoResponse(
            version=VERSION,
            node_id=node.node_id,
            tenant=p.tenant,
            admin=p.admin,
            scope_key=p.scope_key,
            host_id=host_id(),
            hostname=hostname(),
            data_port=self.data_port,
            shm_name=node.shm_name or "",
            shm_size=self._shm_size,
            shm_index=self._shm_index,
            lease_ttl_ms=int(c.lease_ttl_s * 1000),
            limits=pb.Limits(
                max_value_bytes=node.config.max_value_bytes,
                max_batch=c.max_batch,
                max_message_bytes=c.max_message_bytes,
            ),
            tiers=[t.value for t in node.tiers],
            instance_id=self.instance_id,
            draining=self._gateway.draining,
            unix_socket=self._data.unix_name if self._data is not None else "",
            pid=os.getpid(),
            put_sums_follow=True,
            put_layers=True,
            put_credits=bool(node.shm_name),
            ucx=self._data is not None and self._data.ucx,
            **self._shard_info(),
        )

    def _shard_info(self) -> dict[str, Any]:
        """Info's shard fields: none for a whole node; shard 0 lists every shard."""
        s = self.shard
        if s is None:
            return {}
        own = join_address(advertised_host(self.config), self.port)  # known once bound
        peers = [
            pb.Shard(
                index=p.index, address=own if p.index == s.index else p.address, node_id=p.node_id
            )
            for p in s.peers
        ]
        return {"group": s.group, "shard": s.index, "shard_count": s.count, "shards": peers}

    async def stop(self, grace: float = 1.0) -> None:
        """Leave the cluster, stop listening, end connections and leases, close the
        node; idempotent."""
        if self.membership is not None:
            await self.membership.stop()
            self.membership = None
        if self._metrics is not None:
            self._metrics.stop()
            self._metrics = None
        if self.kv_events is not None:
            if self.node is not None:
                self.node.events.untap(self.kv_events.tap)
            self.kv_events.close()
            self.kv_events = None
        if self._grpc is not None:
            await self._grpc.stop(grace)
            self._grpc = None
        if self._data is not None:
            self._data.close()
            self._data = None
        if self._gateway is not None:
            self._gateway.close()
            self._gateway = None
        if self.node is not None:
            self.node.close()
            self.node = None
        self._pool.shutdown(wait=False)

    async def serve(self, ready: Callable[[StoreServer], None] | None = None) -> None:
        """Start, call ``ready``, run until SIGTERM/SIGINT, then stop."""
        await self.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            if ready is not None:
                ready(self)
            await stop.wait()
        finally:
            await self.stop()


def _grpc_options(c: ServerConfig) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", c.max_message_bytes),
        ("grpc.max_send_message_length", c.max_message_bytes),
        ("grpc.so_reuseport", 0),  # never share a port with another server by accident
    ]


def _tls_context(c: ServerConfig) -> ssl.SSLContext | None:
    if not c.tls:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(c.tls_cert, c.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls_cert/tls_key: cannot load ({exc})") from None
    return ctx


def shared_memory_for(
    node: NodeConfig, config: ServerConfig, tenants: frozenset[str]
) -> NodeConfig:
    """The node config with its DRAM shared only where ``config.shared_memory`` allows:
    the segment holds every tenant's blocks and opens to any process of this Unix user,
    so by default (``auto``) a server of two or more tenants keeps DRAM private."""
    mode = config.shared_memory
    shared = mode == "all_tenants" or (mode == "auto" and len(tenants) <= 1)
    if shared or not node.shared_dram:
        return node
    if node.shm_name:
        raise ConfigError(
            f"shm_name: set, but this server keeps DRAM private (shared_memory={mode!r}, "
            f"{len(tenants)} tenants); set shared_memory=all_tenants if they trust each other"
        )
    log.info("DRAM is private (shared_memory=%s, %d tenants): no segment", mode, len(tenants))
    return node.replace(shared_dram=False)


# -- kvstore serve ------------------------------------------------------------------------

_NODE_FLAGS = {
    "node_id": "node id in the cluster",
    "dram_bytes": "DRAM tier size, e.g. 4GiB",
    "hbm_bytes": "HBM tier size (needs CUDA)",
    "hbm_device": "HBM tier device: cuda, cuda:<n> (or cpu, the tier's code on host memory)",
    "ssd_path": "SSD tier directory",
    "ssd_bytes": "SSD tier size",
    "policy": "eviction policy: lru, fifo, s3fifo",
    "max_value_bytes": "largest block accepted",
    "shm_name": "name of the DRAM segment under /dev/shm",
}
_SERVER_FLAGS = {
    "host": "address to bind (default 127.0.0.1)",
    "port": "gRPC port (default 7400; 0 picks one)",
    "data_port": "data-socket port (default 0: pick one)",
    "tokens_file": "TOML/JSON [[tokens]] file: token, tenant, admin; [quotas.<tenant>]",
    "tls_cert": "PEM certificate (enables TLS)",
    "tls_key": "PEM private key",
    "max_batch": "most keys per request",
    "max_message_bytes": "largest gRPC message / frame metadata",
    "lease_ttl_s": "lifetime of a shared-memory lease, seconds",
    "io_timeout_s": "a started frame must finish within this, seconds",
    "put_grace_s": "a put's payload may take this long plus nbytes / put_floor_bytes (5)",
    "put_floor_bytes": "slowest payload rate a put keeps its reservation at, per second (1MiB)",
    "data_poll_us": "poll this long for a lone client's next request (default 100; 0: off)",
    "transport": "tcp, or ucx: also offer UCX to clients that ask (needs ucxx)",
    "workers": "threads for blocking node calls",
    "max_connections": "concurrent data sockets (default 256)",
    "max_handshakes": "data sockets not yet authenticated, at once (default 64)",
    "max_namespaces_per_tenant": "namespaces one tenant may create here (default 1024)",
    "shared_memory": "DRAM segment for same-host clients: auto (one tenant), all_tenants, off",
    "etcd": "HOST:PORT of the cluster directory (default: standalone)",
    "cluster": "cluster name in the directory (default 'default')",
    "node_lease_ttl_s": "directory lease of this node, seconds (default 10)",
    "advertise_host": "host other nodes and clients dial (default: --host)",
    "metrics_host": "address of the Prometheus endpoint (default 127.0.0.1)",
    "metrics_port": "Prometheus /metrics port (default -1: off; 0 picks one)",
    "kv_events_endpoint": "ZMQ endpoint publishing vLLM-format KV events (tcp://127.0.0.1:5557)",
    "kv_events_replay_endpoint": "ZMQ ROUTER endpoint answering KV-event replay requests",
    "kv_events_topic": "topic of the KV-event batches (default kvstore)",
    "kv_events_block_size": "tokens per block, as the KV events report it (default 16)",
    "shards": "processes serving this node: auto (one per two cores, at most 8, >= 1GiB "
    "DRAM each) or a number; each is a node <node-id>.s<i> with 1/N of the capacity",
}


def add_parser(sub: Any) -> None:
    """Register ``kvstore serve``."""
    p = sub.add_parser(
        "serve",
        help="serve a store node over gRPC and the data socket",
        description="Serve one store node. Settings: defaults < --config file < KVSTORE_* "
        "environment < flags. The auth token is read from KVSTORE_AUTH_TOKEN or a tokens "
        "file, never from a flag (flags show up in ps).",
        epilog="example: KVSTORE_AUTH_TOKEN=$(openssl rand -hex 16) kvstore serve "
        "--dram-bytes 4GiB --ssd-path /var/lib/kvstore --ssd-bytes 200GiB",
    )
    p.add_argument("--config", help="TOML or JSON file with [node] and [server] tables")
    for name, text in {**_NODE_FLAGS, **_SERVER_FLAGS}.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, help=text)
    p.add_argument(
        "--allow-anonymous",
        action="store_true",
        default=None,
        help="accept calls without a token as tenant 'default' (local tests)",
    )
    p.add_argument(
        "--data-poll-crowded",
        action="store_true",
        default=None,
        help="poll for clients even while the host has more runnable tasks than CPUs",
    )
    p.add_argument("--json", action="store_true", help="print the ready line as JSON")
    p.add_argument("--shard-role", help=argparse.SUPPRESS)  # set by the shard supervisor
    p.set_defaults(func=_cmd_serve)


def load_configs(
    args: dict[str, Any], env: dict[str, str] | None = None
) -> tuple[NodeConfig, ServerConfig]:
    """Node and server configs from a config file path, flags and the environment."""
    file = read_config_file(args["config"]) if args.get("config") else {"node": {}, "server": {}}
    node_flags = {k: args.get(k) for k in _NODE_FLAGS}
    server_flags = {
        k: args.get(k) for k in (*_SERVER_FLAGS, "allow_anonymous", "data_poll_crowded")
    }
    node = resolve_config(NodeConfig, env=env, file_values=file["node"], flags=node_flags)
    server = resolve_config(ServerConfig, env=env, file_values=file["server"], flags=server_flags)
    return node, server


_PASSED_ON = (
    {"config", "allow_anonymous", "data_poll_crowded"} | set(_NODE_FLAGS) | set(_SERVER_FLAGS)
)  # the flags a shard gets from its supervisor's command line


def _cmd_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    node_cfg, cfg = load_configs(vars(args))
    role = ShardRole.from_json(args.shard_role) if args.shard_role else None
    count = shard_count(node_cfg, cfg)
    if role is None and count > 1:
        given = {k: v for k, v in vars(args).items() if k in _PASSED_ON}
        return run_sharded(ShardPlan(node_cfg, cfg, count, given), args.json)
    server = StoreServer(node_cfg, cfg, role)

    def ready(s: StoreServer) -> None:
        assert s.node is not None
        facts = {
            "event": "ready",
            "host": cfg.host,
            "port": s.port,
            "data_port": s.data_port,
            "shm_name": s.node.shm_name,
            "node_id": s.node.node_id,
            "tls": cfg.tls,
            "pid": os.getpid(),
            "cluster": cfg.cluster if cfg.etcd else None,
            "address": s.membership.info.address if s.membership else None,
            "metrics_port": s.metrics_port if s.metrics_port >= 0 else None,
            "kv_events": s.kv_events.endpoint if s.kv_events else None,
            "kv_events_replay": s.kv_events.replay_endpoint if s.kv_events else None,
        }
        if args.json:
            print(json.dumps(facts), flush=True)
        else:
            print(
                f"kvstore serve: node {facts['node_id']} on {cfg.host}:{s.port} "
                f"(data port {s.data_port}, tls {'on' if cfg.tls else 'off'}"
                + (f", metrics port {s.metrics_port})" if s.metrics_port >= 0 else ")"),
                flush=True,
            )

    asyncio.run(server.serve(ready))
    print("kvstore serve: stopped", file=sys.stderr, flush=True)
    return 0
