"""How a client reaches a server: the one injection point under the SDK.

A :class:`Connector` gives a :class:`~kvstore.client.store.NodeClient` its two planes
for one server address (the control plane, :class:`~kvstore.client.control.Control`;
the data plane, :class:`~kvstore.client.transport.base.Links`) and tells a cluster
client whether an address answers at all. Everything above it (per-key results,
batching, namespace scoping, retries, deadlines, lifecycle, cluster fallback) is the
same code whatever the connector.

:class:`SocketConnector` is the real one and the default: gRPC for control, pooled
data sockets (shared memory or TCP per connection) for data. The in-memory one the
hermetic tests use (tests/support/memory_net.py) talks to servers in this process with
no socket; kvstore/client/faults.py wraps either to inject failures. A connector is
asked once per client open, never per request: the data path calls the Links it got.
"""

from __future__ import annotations

import socket
import ssl
from abc import ABC, abstractmethod
from collections.abc import Callable

from kvstore._proto import store_pb2 as pb
from kvstore.client.control import Control, ControlChannel
from kvstore.client.transport.base import Links
from kvstore.client.transport.pool import ConnPool
from kvstore.config import ClientConfig
from kvstore.copies.engine import CopyEngine
from kvstore.copies.registry import HostRegistry
from kvstore.errors import ConfigError
from kvstore.observe.counters import NodeCounters
from kvstore.wire.locality import PROBE_TIMEOUT_S

__all__ = ["Connector", "Locate", "SocketConnector", "probe"]

Locate = Callable[[float], pb.InfoResponse]
"""deadline -> the server's Info, asked again over the control plane (a data
connection refused: the server may have restarted elsewhere)."""


class Connector(ABC):
    """Opens the planes of one server for a client. Stateless or thread-safe: one
    connector may serve many clients (a cluster client passes its own to each node)."""

    @abstractmethod
    def control(self, host: str, port: int, config: ClientConfig) -> Control:
        """The control plane of the server at ``host:port`` (connecting lazily)."""

    @abstractmethod
    def links(
        self,
        host: str,
        config: ClientConfig,
        counters: NodeCounters,
        locate: Locate,
        server: pb.InfoResponse,
    ) -> Links:
        """The data plane of the server whose Info is ``server``."""

    @abstractmethod
    def reachable(self, address: str) -> bool:
        """Whether something answers at ``host:port`` right now (cheap, no handshake)."""


class SocketConnector(Connector):
    """gRPC control channel, pooled data sockets, a TCP connect as the probe.

    ``device``: the copy engine of the device paths (kvstore/client/device/; None: the
    CUDA engine, made on the first CUDA tensor); ``registry``: where the node's segment
    is registered with CUDA (None: this process's). Tests pass a host engine and a
    registry of their own to run the device paths on CPU tensors."""

    def __init__(
        self, device: CopyEngine | None = None, registry: HostRegistry | None = None
    ) -> None:
        self.device = device
        self.registry = registry

    def control(self, host: str, port: int, config: ClientConfig) -> Control:
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return ControlChannel(target, config)

    def links(
        self,
        host: str,
        config: ClientConfig,
        counters: NodeCounters,
        locate: Locate,
        server: pb.InfoResponse,
    ) -> Links:
        tls = _tls_context(config)
        return ConnPool(host, config, counters, locate, tls, server, self.device, self.registry)

    def reachable(self, address: str) -> bool:
        return probe(address)


def probe(address: str) -> bool:
    """Whether something accepts TCP connections at ``host:port`` right now."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), PROBE_TIMEOUT_S):
            return True
    except (OSError, ValueError):
        return False


def _tls_context(config: ClientConfig) -> ssl.SSLContext | None:
    if not config.use_tls:
        return None
    try:
        return ssl.create_default_context(cafile=config.tls_ca or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls_ca: cannot load {config.tls_ca!r}: {exc}") from None
