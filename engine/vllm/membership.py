"""A ``vllm serve`` in the pool directory: its record in etcd under a lease, kept current.

With ``"register": true`` in ``kv_connector_extra_config`` the connector's scheduler
side puts its server in etcd as ``kvstore worker`` puts itself: the same record
(engine/registry.py ``WorkerRecord``) under the same lease machinery
(``WorkerRegistration``), at ``/kvstore/<cluster>/vllm-servers/<server_id>``, where
``kvstore vllm-router --etcd`` follows it (engine/serving/vllm_members.py). The record
says:

- URL: ``url`` from the config, else the server's own ``--host``/``--port``, read from
  its command line (the engine process inherits it; vLLM's defaults: every interface,
  named by this host's name, and port 8000);
- role: ``role`` from the config, else from ``kv_role`` (``kv_producer``: prefill,
  ``kv_consumer``: decode, ``kv_both``: both);
- model: the served model name (what clients send, what /v1/models lists), and the
  connector's namespace, block size and codec, so a router computes the same keys;
- store node: the node of the cluster's directory whose address is ``endpoint``;
- load: requests in flight, counted from vLLM's own calls (``on_new_request`` when the
  scheduler takes a request, ``request_finished`` when it lets it go, each exactly
  once), so waiting and running requests both count.

Why the scheduler side registers: a server has one (its workers have one per rank); it
sees every request come and go; and it runs in the engine core, whose death is the
server's. When the server dies its keepalive stops and the record goes with the lease.
The API server process runs none of the connector's code.

Order of start: etcd is reached while the connector starts, so a server told to
register with etcd out of reach fails at start, naming etcd. The record is written
only once the URL answers ``/v1/models`` listing this model (the engine core is built
before the API server listens), so a router never sees a server that cannot take a
request, and a wrong ``url`` shows up as a warning in the server's log.

Stop: the lease is revoked, so the record goes at once, when the engine core receives
SIGTERM or SIGINT (before vLLM drains or aborts its requests: routers stop sending new
ones) and again when vLLM shuts the connector down. vLLM's default
``--shutdown-timeout 0`` kills the engine core a few milliseconds after its SIGTERM,
which the revoke may lose to; the record then goes with its lease (``lease_ttl_s``).
``--shutdown-timeout N`` (N >= 1: drain in-flight requests for up to N s; an idle
server still stops at once) makes the revoke certain. The connector warns at start
when it is 0. Data parallelism (several engine cores behind one URL) is refused.

Nothing here imports vLLM; engine/vllm/connector.py hands in what it needs.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from engine.registry import (
    WorkerLoad,
    WorkerRecord,
    WorkerRegistration,
    codec_label,
    store_units,
    vllm_servers_prefix,
)
from engine.vllm.store import ConnectorConfig
from kvstore.config import ClusterConfig, resolve_config
from kvstore.directory.background import directory_loop
from kvstore.errors import ConfigError, KVStoreError
from kvstore.keys import Namespace
from kvstore.layout import KVLayout

__all__ = ["Membership", "ServerFacts", "server_role", "server_url"]

logger = logging.getLogger("vllm.kvstore")

_ROLE_OF = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
_WILDCARD = ("", "0.0.0.0", "::", "[::]")
WARN_AFTER_S = 120.0  # a URL that has not answered this long is probably wrong


def server_url(argv: Sequence[str]) -> str:
    """The URL of the OpenAI server started with ``argv`` (``--host``, ``--port``);
    a server on every interface is named by this host's name."""
    opts: dict[str, str] = {}
    for i, arg in enumerate(argv):
        for name in ("--host", "--port", "--uds", "--ssl-certfile"):
            if arg == name and i + 1 < len(argv):
                opts[name] = argv[i + 1]
            elif arg.startswith(name + "="):
                opts[name] = arg.split("=", 1)[1]
    if "--uds" in opts:
        raise ConfigError("register: the server listens on a unix socket; set 'url'")
    port = opts.get("--port", "8000")
    if not port.isdigit():
        raise ConfigError(f"register: --port {port!r} is not a port; set 'url'")
    host = opts.get("--host", "")
    if host in _WILDCARD:
        host = socket.gethostname()
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal
    scheme = "https" if opts.get("--ssl-certfile") else "http"
    return f"{scheme}://{host}:{port}"


def server_role(configured: str, kv_role: str | None) -> str:
    """The record's role: the configured one, else the one ``kv_role`` implies."""
    if configured:
        return configured
    role = _ROLE_OF.get(kv_role or "")
    if role is None:
        raise ConfigError(f"register: kv_role {kv_role!r} implies no role; set 'role'")
    return role


@dataclass(frozen=True, slots=True)
class ServerFacts:
    """What the record says about the server, besides its store node and load."""

    url: str
    role: str
    model: str  # the served model name
    namespace: Namespace
    block_tokens: int
    max_context: int
    kv_codec: str = ""

    @classmethod
    def of_engine(
        cls, config: ConnectorConfig, vllm_config: Any, namespace: Namespace, argv: Sequence[str]
    ) -> ServerFacts:
        """The facts of the server whose engine has ``vllm_config`` (and refuses what
        one record cannot describe)."""
        if vllm_config.parallel_config.data_parallel_size > 1:
            raise ConfigError("register: data parallelism (several engines per URL) is not "
                              "supported; register each server without it")  # fmt: skip
        tc = vllm_config.kv_transfer_config
        return cls(
            url=(config.url or server_url(argv)).rstrip("/"),
            role=server_role(config.role, tc.kv_role),
            model=str(vllm_config.model_config.served_model_name),
            namespace=namespace,
            block_tokens=int(vllm_config.cache_config.block_size),
            max_context=int(vllm_config.model_config.max_model_len),
            kv_codec=config.kv_codec,
        )


class Membership:
    """One server's record in etcd, from the connector's start to its stop.

    Concurrency: vLLM calls ``request_added`` / ``request_finished`` from the
    scheduler's thread, which alone touches the in-flight set; each change is handed
    to the process's directory loop (kvstore/directory/background.py), which alone
    touches the registration. ``stop`` may be called from any thread and more than
    once (signal handler, connector shutdown, exit).
    """

    def __init__(
        self, facts: ServerFacts, config: ConnectorConfig, *, probe_s: float = 0.5
    ) -> None:
        where = resolve_config(
            ClusterConfig, flags={"etcd": config.etcd or None, "cluster": config.cluster or None}
        )
        self.facts, self.etcd, self.cluster = facts, where.etcd, where.cluster
        self.endpoint, self.probe_s = config.endpoint, probe_s
        self.server_id = f"vllm-{facts.role}-{uuid.uuid4().hex[:8]}"
        self.store_node = ""
        self.registration = WorkerRegistration(
            self.etcd, self.cluster, ttl=config.lease_ttl_s,
            prefix=vllm_servers_prefix(self.cluster),
        )  # fmt: skip
        self._loop: asyncio.AbstractEventLoop | None = None
        self._join: asyncio.Task[None] | None = None
        self._registered = False
        self._stopped = False
        self._in_flight: set[str] = set()
        self._done = 0
        self._load = WorkerLoad()

    # -- start -----------------------------------------------------------------------------

    @classmethod
    def join(cls, config: ConnectorConfig, vllm_config: Any, namespace: Namespace) -> Membership:
        """Register the server whose engine core this is (see the module docstring)."""
        members = cls(ServerFacts.of_engine(config, vllm_config, namespace, sys.argv), config)
        members.start()
        members.revoke_on_signals()
        if not getattr(vllm_config, "shutdown_timeout", 0):
            logger.warning("KVStoreConnector: vLLM kills its engine at once on a stop "
                           "(--shutdown-timeout 0), which may leave this server's record "
                           "in etcd until its lease lapses (%d s); --shutdown-timeout N "
                           "deregisters it for sure", config.lease_ttl_s)  # fmt: skip
        return members

    def start(self, timeout_s: float = 15.0) -> None:
        """Reach etcd and find the store node (raises ConfigError naming etcd when it
        cannot), then register in the background once the server answers."""
        self._loop = directory_loop()
        fut = asyncio.run_coroutine_threadsafe(self._connect(), self._loop)
        try:
            fut.result(timeout_s)
        except ConfigError:
            self.stop()
            raise
        except (KVStoreError, OSError, TimeoutError) as exc:
            fut.cancel()
            self.stop()
            raise ConfigError(
                f"register: etcd at {self.etcd} cannot be reached ({type(exc).__name__}: "
                f'{exc}); start etcd or leave "register" out'
            ) from exc
        atexit.register(self.stop)
        logger.info("KVStoreConnector: registering %s (%s, %s) in etcd %s cluster %s",
                    self.facts.url, self.facts.role, self.facts.model, self.etcd,
                    self.cluster)  # fmt: skip

    async def _connect(self) -> None:
        await self.registration.connect()
        units = await store_units(self.etcd, self.cluster)
        self.store_node = next((n for n, a in sorted(units.items()) if a == self.endpoint), "")
        if not self.store_node:
            logger.warning("KVStoreConnector: no store node of cluster %s has address %s; "
                           "the record names none", self.cluster, self.endpoint)  # fmt: skip
        self._join = asyncio.create_task(self._join_when_serving(), name="vllm-membership")

    async def _join_when_serving(self) -> None:
        import httpx

        loop = asyncio.get_running_loop()
        warn_at = loop.time() + WARN_AFTER_S
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as http:
            while not await self._serving(http):
                if loop.time() > warn_at:
                    warn_at = float("inf")
                    logger.warning("KVStoreConnector: nothing at %s lists %s yet; is 'url' "
                                   "right?", self.facts.url, self.facts.model)  # fmt: skip
                await asyncio.sleep(self.probe_s)
        await self._register()
        self._registered = True
        self.registration.update_load(self._load)  # what changed while it was written
        logger.info("KVStoreConnector: %s joined the pool as %s", self.facts.url, self.server_id)

    async def _register(self) -> None:
        """Write the record under a new lease; etcd away at that moment: again later
        (the server serves all the while, only outside the pool)."""
        while True:
            try:
                await self.registration.start(self.record())
                return
            except Exception as exc:
                from kvstore.directory.etcd_client import cancelling  # aetcd: lazily

                if cancelling():  # grpc reports a cancellation as an RPC error
                    raise asyncio.CancelledError from exc
                logger.warning("KVStoreConnector: registering %s: %s; trying again",
                               self.facts.url, exc)  # fmt: skip
                await asyncio.sleep(max(self.probe_s, 1.0))

    async def _serving(self, http: Any) -> bool:
        """Whether the server's URL answers and lists this model."""
        try:
            r = await http.get(self.facts.url + "/v1/models")
            ids = [m.get("id") for m in r.json().get("data", [])] if r.status_code == 200 else []
        except Exception:  # not listening yet, or not a JSON answer: not serving
            return False
        return self.facts.model in ids

    def record(self) -> WorkerRecord:
        """The server's record as it stands (its load included)."""
        f, ns = self.facts, self.facts.namespace
        return WorkerRecord(
            worker_id=self.server_id, role=f.role, model=f.model, address=f.url,
            namespace={"model": ns.model, "layout": ns.layout, "tenant": ns.tenant},
            store_node=self.store_node, block_tokens=f.block_tokens, max_context=f.max_context,
            kv_bytes_per_token=KVLayout.parse(ns.layout).block_bytes() // f.block_tokens,
            load=self._load, kv_codec=codec_label(f.kv_codec),
        )  # fmt: skip

    # -- load ------------------------------------------------------------------------------

    def request_added(self, request_id: str) -> None:
        """The scheduler took a request (it waits or runs until it finishes)."""
        self._in_flight.add(request_id)
        self._publish()

    def request_finished(self, request_id: str) -> None:
        """The scheduler let a request go (finished, aborted or failed)."""
        if request_id in self._in_flight:
            self._in_flight.discard(request_id)
            self._done += 1
            self._publish()

    def _publish(self) -> None:
        load = WorkerLoad(running=len(self._in_flight), done=self._done)
        if self._loop is not None and not self._stopped:
            self._loop.call_soon_threadsafe(self._set_load, load)

    def _set_load(self, load: WorkerLoad) -> None:
        self._load = load
        if self._registered:
            self.registration.update_load(load)  # written coalesced by its own task

    # -- stop ------------------------------------------------------------------------------

    def stop(self, timeout_s: float = 5.0) -> None:
        """Revoke the lease (the record goes at once) and close; idempotent."""
        if self._stopped or self._loop is None:
            self._stopped = True
            return
        self._stopped = True
        fut = asyncio.run_coroutine_threadsafe(self._stop(), self._loop)
        try:
            fut.result(timeout_s)
        except Exception as exc:  # the lease then lapses by itself
            logger.warning("KVStoreConnector: deregistering %s: %s", self.server_id, exc)

    async def _stop(self) -> None:
        join, self._join = self._join, None
        if join is not None:
            join.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await join  # cancelled, or failed before: stopping either way
        self._registered = False
        await self.registration.stop()

    def revoke_on_signals(self, timeout_s: float = 0.5) -> None:
        """Revoke as the engine core receives SIGTERM / SIGINT, then hand the signal to
        the handler that was there (vLLM's, which starts its shutdown). Only from the
        main thread, where Python runs signal handlers; elsewhere the connector's
        shutdown and the lease are the ways out."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _Chained(self, signal.getsignal(sig), timeout_s))


class _Chained:
    """A signal handler that revokes the lease first (bounded: a signal may interrupt
    a thread holding a lock the revoke needs), then does what was there before."""

    def __init__(self, membership: Membership, previous: Any, timeout_s: float) -> None:
        self.membership, self.previous, self.timeout_s = membership, previous, timeout_s

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.membership.stop(self.timeout_s)
        if callable(self.previous):
            self.previous(signum, frame)
        elif self.previous == signal.SIG_DFL:  # die of it, as without this handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
