"""Fault injection under the client: a Connector, Links, Transport and Control that
delegate to real ones and fail or stall calls as a :class:`~kvstore.faults.FaultPlan`
says (STYLE habit 11).

``FaultyConnector(SocketConnector(), plan)`` (or over the in-memory network of the
tests) is given to a NodeClient or ClusterClient as ``connector=``; a client whose
``ClientConfig.faults`` is set wraps its own connector this way. Operation names:
``control.<Method>`` for control calls, ``lend`` for taking a link, ``read``,
``write``, ``exists``, ``match_prefix`` for transport calls, ``reachable`` for a
cluster client's probe (a firing rule makes the node look down); ``where`` is the
server's host.

A read or write rule with ``after_keys`` serves that many keys of the batch through the
real transport, then fails the rest: with ``per_key`` each of them reports the rule's
error as its own result; without, the call raises it once the served part is done (a
connection cut mid-reply). Keys are never served wrong: what fails is never handed over.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore._proto import store_pb2 as pb
from kvstore.blocks import ValueInfo
from kvstore.client.connector import Connector, Locate
from kvstore.client.control import Control
from kvstore.client.transport.base import LayerSink, Link, Links, Transport
from kvstore.config import ClientConfig
from kvstore.errors import TransportError
from kvstore.faults import Fault, FaultPlan
from kvstore.observe.counters import NodeCounters

__all__ = ["FaultyConnector", "FaultyControl", "FaultyLinks", "FaultyTransport"]


class FaultyConnector(Connector):
    """A Connector whose planes inject the plan's faults."""

    def __init__(self, inner: Connector, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan

    def control(self, host: str, port: int, config: ClientConfig) -> Control:
        return FaultyControl(self.inner.control(host, port, config), self.plan, host)

    def links(
        self,
        host: str,
        config: ClientConfig,
        counters: NodeCounters,
        locate: Locate,
        server: pb.InfoResponse,
    ) -> Links:
        inner = self.inner.links(host, config, counters, locate, server)
        return FaultyLinks(inner, self.plan, host)

    def reachable(self, address: str) -> bool:
        host = address.rpartition(":")[0]
        if self.plan.take("reachable", host) is not None:
            return False
        return self.inner.reachable(address)


class FaultyControl(Control):
    def __init__(self, inner: Control, plan: FaultPlan, where: str) -> None:
        self.inner, self.plan, self.where = inner, plan, where

    def call(self, method: str, request: Any, deadline: float, *, wait: bool = True) -> Any:
        self.plan.inject(f"control.{method}", self.where)
        return self.inner.call(method, request, deadline, wait=wait)

    def close(self) -> None:
        self.inner.close()


class FaultyLinks(Links):
    """Lends the inner links' connections with their transport wrapped."""

    def __init__(self, inner: Links, plan: FaultPlan, where: str) -> None:
        self.inner, self.plan, self.where = inner, plan, where
        self._wrapped: dict[int, FaultyTransport] = {}  # id(inner transport) -> wrapper

    def lend(self, deadline: float) -> Link:
        self.plan.inject("lend", self.where)
        conn, transport = self.inner.lend(deadline)
        self.last_transport = self.inner.last_transport
        wrapped = self._wrapped.get(id(transport))
        if wrapped is None or wrapped.inner is not transport:
            wrapped = FaultyTransport(transport, self.plan, self.where)
            self._wrapped[id(transport)] = wrapped
        return Link(conn, wrapped)

    def give_back(self, link: Link) -> None:
        conn, t = link
        self.inner.give_back(Link(conn, t.inner if isinstance(t, FaultyTransport) else t))

    def settle(self, deadline: float) -> None:
        self.inner.settle(deadline)

    def prefaulted(self, timeout: float | None) -> bool:
        return self.inner.prefaulted(timeout)

    def close(self) -> None:
        self.inner.close()


class FaultyTransport(Transport[Any]):
    """Delegates to ``inner`` once the plan has had its say."""

    def __init__(self, inner: Transport[Any], plan: FaultPlan, where: str) -> None:
        super().__init__(inner.counters)
        self.inner, self.plan, self.where = inner, plan, where
        self.name = inner.name  # type: ignore[misc]

    def read(
        self,
        conn: Any,
        keys: Sequence[bytes],
        outs: Sequence[Any] | None,
        scope: pb.Scope,
        deadline: float,
        layers: tuple[int, int] | None = None,
    ) -> list[Any]:
        f = self.plan.inject("read", self.where)
        if f is None or f.after_keys is None:  # none fired, or a stall that has passed
            return self.inner.read(conn, keys, outs, scope, deadline, layers)
        n = min(f.after_keys or 0, len(keys))
        head = outs[:n] if outs is not None else None
        done = self.inner.read(conn, keys[:n], head, scope, deadline, layers) if n else []
        return self._rest(f, done, len(keys))

    def write(
        self,
        conn: Any,
        keys: Sequence[bytes],
        values: Sequence[Any],
        scope: pb.Scope,
        deadline: float,
    ) -> list[Any]:
        f = self.plan.inject("write", self.where)
        if f is None or f.after_keys is None:
            return self.inner.write(conn, keys, values, scope, deadline)
        n = min(f.after_keys or 0, len(keys))
        done = self.inner.write(conn, keys[:n], values[:n], scope, deadline) if n else []
        return self._rest(f, done, len(keys))

    def begin_layers(
        self,
        conn: Any,
        keys: Sequence[bytes],
        infos: Sequence[ValueInfo],
        layers: int,
        scope: pb.Scope,
        deadline: float,
    ) -> LayerSink:
        f = self.plan.inject("write", self.where)
        if f is not None and f.after_keys is not None:  # a cut batch: cut at its start
            raise f.error or TransportError("injected fault: connection cut at the write")
        return self.inner.begin_layers(conn, keys, infos, layers, scope, deadline)

    def exists(self, conn: Any, keys: Sequence[bytes], deadline: float) -> list[bool]:
        self.plan.inject("exists", self.where)
        return self.inner.exists(conn, keys, deadline)

    def match_prefix(self, conn: Any, keys: Sequence[bytes], deadline: float) -> int:
        self.plan.inject("match_prefix", self.where)
        return self.inner.match_prefix(conn, keys, deadline)

    @staticmethod
    def _rest(f: Fault, done: list[Any], total: int) -> list[Any]:
        """A batch served for its first ``len(done)`` keys only."""
        err = f.error or TransportError("injected fault: connection cut mid-batch")
        if not f.per_key:
            raise err
        return done + [err] * (total - len(done))
