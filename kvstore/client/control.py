"""The client end of the gRPC control plane: one channel, bearer metadata, typed errors.

Calls wait for the channel to be ready within their deadline (``wait_for_ready``), so a
server restarting under a connected client delays calls instead of failing them; the
reconnect backoff is kept short for the same reason. Opening a client does not wait:
an unreachable server is an Unavailable, retried until the connect timeout. Every
``grpc.RpcError`` leaves through ``grpc_errors.mapped`` as a KVStoreError.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

import grpc

from kvstore._proto import store_pb2_grpc as pb_grpc
from kvstore.config import ClientConfig
from kvstore.errors import ConfigError, TimeoutError_
from kvstore.wire.auth import bearer_metadata
from kvstore.wire.grpc_errors import mapped

__all__ = ["Control", "ControlChannel"]


class Control(ABC):
    """The control plane of one server: unary calls by ``kvstore.v1.Store`` method name,
    protobuf request in, protobuf reply out, failures as KVStoreErrors. ControlChannel
    is the gRPC implementation; tests/support/memory_net.py has an in-memory one."""

    @abstractmethod
    def call(self, method: str, request: Any, deadline: float, *, wait: bool = True) -> Any:
        """Invoke ``method`` bounded by ``deadline`` (time.monotonic). ``wait`` rides out
        a reconnect within the deadline; without it an unreachable server fails the
        call at once with Unavailable."""

    @abstractmethod
    def close(self) -> None:
        """Release the channel (idempotent)."""


class ControlChannel(Control):
    """A gRPC channel to one server and the ``kvstore.v1.Store`` stub on it."""

    def __init__(self, target: str, config: ClientConfig) -> None:
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", config.max_reply_bytes),
            ("grpc.max_send_message_length", config.max_reply_bytes),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        if config.use_tls:
            root = None
            if config.tls_ca:
                try:
                    with open(config.tls_ca, "rb") as f:
                        root = f.read()
                except OSError as exc:
                    raise ConfigError(f"tls_ca: cannot read {config.tls_ca!r}: {exc}") from None
            if config.tls_server_name:
                options.append(("grpc.ssl_target_name_override", config.tls_server_name))
            creds = grpc.ssl_channel_credentials(root_certificates=root)
            self._channel = grpc.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = pb_grpc.StoreStub(self._channel)
        self._metadata = bearer_metadata(config.token) if config.token else ()

    def call(self, method: str, request: Any, deadline: float, *, wait: bool = True) -> Any:
        """Invoke one unary RPC by name, bounded by ``deadline`` (time.monotonic).

        ``wait`` (the default) rides out a reconnect within the deadline; without it a
        server that cannot be reached fails the call at once with Unavailable.
        """
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError_(f"{method}: deadline passed before the call")
        with mapped(method):
            return getattr(self._stub, method)(
                request, timeout=left, metadata=self._metadata, wait_for_ready=wait
            )

    def close(self) -> None:
        """Close the channel (idempotent)."""
        self._channel.close()
