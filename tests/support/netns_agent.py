"""A cluster client in its own process, on a lab host (tests/support/netns.py), driven
by JSON lines on stdin; one JSON answer per request on stdout.

It is a separate process because a client on another host must have that host's
network namespace, hostname and boot id; the test process has the machine's own. Its
clients are real ``StoreClient.from_etcd`` clients; every block's bytes derive from its
key (:func:`value_for`), so a read is verified byte for byte here, and what the test
gets back are counts: hits, misses, wrong bytes, and the errors raised to the caller.

Requests (``op`` plus arguments):

- ``put``: ``keys`` (hex), ``node`` (write to this node while it lives; None: the
  client's own choice) -> ``stored``, ``errors``;
- ``get``: ``keys``, ``deadline`` (per read, s) -> ``hits``, ``misses``, ``wrong``, ``errors``,
  ``seconds``, ``served`` (per node, this call);
- ``holders``: ``keys`` -> per key, the nodes the mirror lists for it;
- ``nodes``: the node ids in the mirror;
- ``wait_gone``: ``node``, ``within`` -> ``seconds`` until the node and every block
  entry of it left the mirror (None if not within);
- ``wait_back``: ``node``, ``keys``, ``within`` -> ``seconds`` until the node is back
  and the mirror lists it for every one of ``keys``;
- ``transports``: per node, the transports used to reach it (``tcp``, ``shm``);
- ``quit``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore import StoreClient
from kvstore.client.cluster import ClusterClient
from kvstore.errors import KVStoreError

__all__ = ["BLOCK_BYTES", "main", "value_for"]

BLOCK_BYTES = 4096


def value_for(key: bytes) -> np.ndarray:
    """The block stored under ``key``: bytes derived from it, so a wrong block (another
    key's, a torn one) can never look right."""
    digest = hashlib.sha512(key).digest()
    return np.frombuffer(digest * (BLOCK_BYTES // len(digest)), dtype=np.uint8).copy()


class AgentState:
    """This agent's clients: one per write-node pin, the default one reads."""

    def __init__(self, etcd: str, cluster: str, token: str) -> None:
        self.etcd, self.cluster, self.token = etcd, cluster, token
        self.clients: dict[str | None, ClusterClient] = {}

    def scoped(self, keys: list[bytes]) -> list[bytes]:
        """The keys as the directory lists them: scoped by this client's tenant, as
        the nodes told it (the scope may carry a server-side secret)."""
        principal = self.client().members.principal()
        if principal is None:
            raise KVStoreError("no node reachable to learn the tenant scope from")
        return principal.scope_all(keys)

    def client(self, node: str | None = None) -> ClusterClient:
        if node not in self.clients:
            self.clients[node] = StoreClient.from_etcd(
                self.etcd,
                cluster=self.cluster,
                token=self.token,
                node_id=node,
                timeout_s=5.0,
                connect_timeout_s=5.0,
            )
        return self.clients[node]

    def close(self) -> None:
        for c in self.clients.values():
            c.close()


def _keys(args: dict[str, Any]) -> list[bytes]:
    return [bytes.fromhex(k) for k in args["keys"]]


def _until(cond: Callable[[], bool], within: float) -> float | None:
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > within:
            return None
        time.sleep(0.01)
    return time.monotonic() - start


def put(st: AgentState, args: dict[str, Any]) -> dict[str, Any]:
    keys = _keys(args)
    errors: list[str] = []
    stored = 0
    try:
        results = st.client(args.get("node")).batch_put(keys, [value_for(k) for k in keys])
    except KVStoreError as exc:
        return {"stored": 0, "errors": [f"{type(exc).__name__}: {exc}"]}
    for r in results:
        if isinstance(r, KVStoreError):
            errors.append(f"{type(r).__name__}: {r}")
        else:
            stored += 1
    return {"stored": stored, "errors": errors}


def get(st: AgentState, args: dict[str, Any]) -> dict[str, Any]:
    """Read every key one call at a time (a caller's view: each may raise)."""
    c = st.client()
    before = c.counters.snapshot()
    hits = misses = wrong = 0
    errors: list[str] = []
    start = time.monotonic()
    for key in _keys(args):
        out = np.zeros(BLOCK_BYTES, dtype=np.uint8)
        try:
            hit = c.get_into(key, out, timeout=args.get("deadline"))
        except KVStoreError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        if not hit:
            misses += 1
        elif np.array_equal(out, value_for(key)):
            hits += 1
        else:
            wrong += 1
    after = c.counters.snapshot()
    served = {
        k.removeprefix("served."): after[k] - before.get(k, 0)
        for k in after
        if k.startswith("served.") and after[k] != before.get(k, 0)
    }
    return {
        "hits": hits,
        "misses": misses,
        "wrong": wrong,
        "errors": errors,
        "seconds": time.monotonic() - start,
        "served": served,
    }


def holders(st: AgentState, args: dict[str, Any]) -> dict[str, Any]:
    mirror = st.client().mirror
    return {
        "holders": {
            k.hex(): sorted(r.node_id for r in mirror.replicas(s))
            for k, s in zip(_keys(args), st.scoped(_keys(args)), strict=True)
        }
    }


def wait_gone(st: AgentState, args: dict[str, Any]) -> dict[str, Any]:
    mirror, node = st.client().mirror, args["node"]

    def gone() -> bool:
        return node not in mirror.nodes() and not mirror.entries(node)

    return {"seconds": _until(gone, float(args["within"]))}


def wait_back(st: AgentState, args: dict[str, Any]) -> dict[str, Any]:
    mirror, node = st.client().mirror, args["node"]
    scoped = st.scoped(_keys(args))

    def back() -> bool:
        if node not in mirror.nodes():
            return False
        return all(any(r.node_id == node for r in mirror.replicas(k)) for k in scoped)

    return {"seconds": _until(back, float(args["within"]))}


def transports(st: AgentState, args: dict[str, Any]) -> dict[str, Any]:
    """Per node, the transports this agent's clients used to reach it."""
    out: dict[str, set[str]] = {}
    for c in list(st.clients.values()):
        for node in c.nodes():
            try:
                used = c.members.client(node).transport
            except KVStoreError as exc:
                used = f"error: {type(exc).__name__}"
            if used:
                out.setdefault(node, set()).add(used)
    return {"transports": {node: sorted(used) for node, used in out.items()}}


OPS: dict[str, Callable[[AgentState, dict[str, Any]], dict[str, Any]]] = {
    "put": put,
    "get": get,
    "holders": holders,
    "nodes": lambda st, _: {"nodes": sorted(st.client().nodes())},
    "wait_gone": wait_gone,
    "wait_back": wait_back,
    "transports": transports,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--etcd", required=True)
    p.add_argument("--cluster", required=True)
    p.add_argument("--name", default="agent")
    args = p.parse_args(argv)
    logging.basicConfig(  # to stderr: the agent's log file, for a failing test's reader
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    st = AgentState(args.etcd, args.cluster, os.environ["KVT_AGENT_TOKEN"])

    def answer(doc: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()

    try:
        st.client()
        answer({"event": "ready", "name": args.name, "pid": os.getpid()})
        for line in sys.stdin:  # EOF (the test process is gone) ends the agent
            req = json.loads(line)
            if req["op"] == "quit":
                answer({"bye": True})
                break
            try:
                answer(OPS[req["op"]](st, req))
            except Exception as exc:  # reported to the test, which fails with it
                answer({"error": f"{req['op']}: {type(exc).__name__}: {exc}"})
    finally:
        st.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
