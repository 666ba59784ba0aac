"""A subscriber to a node's KV events (kvstore/server/kv_events.py), for tests in the main
environment (decoded with msgpack) and in the vLLM one (decoded with vLLM's classes)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq


class Subscriber:
    """A ZMQ SUB socket on ``endpoint`` that collects (seq, payload) messages."""

    def __init__(self, endpoint: str, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.seen: list[tuple[int, bytes]] = []

    def until(
        self, decode: Callable[[bytes], Any], done: Callable[[list[Any]], bool], within_s: float
    ) -> list[Any]:
        """Receive until ``done(decoded batches)`` or the time is up; the batches."""
        end = time.monotonic() + within_s
        batches: list[Any] = [decode(p) for _, p in self.seen]
        while not done(batches) and time.monotonic() < end:
            if self.sock.poll(50):
                _topic, seq, payload = self.sock.recv_multipart()
                self.seen.append((int.from_bytes(seq, "big"), payload))
                batches.append(decode(payload))
        return batches

    def join(self, trigger: Callable[[], object], within_s: float = 15.0) -> None:
        """Call ``trigger`` (something that makes the publisher send) until a message
        arrives. A SUB socket misses whatever is published before its subscription has
        reached the publisher, and how long that takes depends on the machine's load:
        a fixed sleep is a flaky test on a slow machine."""
        end = time.monotonic() + within_s
        while time.monotonic() < end:
            trigger()
            if self.sock.poll(300):
                _topic, seq, payload = self.sock.recv_multipart()
                self.seen.append((int.from_bytes(seq, "big"), payload))
                return
        raise TimeoutError(f"no message reached the subscriber within {within_s} s")

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def replay(endpoint: str, start: int, within_s: float = 5.0) -> list[tuple[int, bytes]]:
    """Ask a replay ROUTER for every batch from ``start``: (seq, payload) up to the end
    marker (sequence -1)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)  # the ROUTER streams several replies to one request
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    out: list[tuple[int, bytes]] = []
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        end = time.monotonic() + within_s
        while time.monotonic() < end:
            if not sock.poll(100):
                continue
            _, _topic, seq, payload = sock.recv_multipart()
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:
                return out
            out.append((n, payload))
        raise TimeoutError("no end marker from the replay endpoint")
    finally:
        sock.close(0)
        ctx.term()
