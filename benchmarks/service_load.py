"""Aggregate throughput of one server under 1, 2, 4 and 8 client processes.

Each client is its own process (spawned, so nothing is inherited) with its own
connection. All of them wait on one barrier, then run their op in a loop until a
shared wall-clock deadline; the figure is the bytes all of them moved over the
window. A server that serializes its clients (one lock, the GIL held across a copy,
a poller spinning on a CPU the others need) shows as a figure that falls as clients
are added; one that scales holds or rises until the host's CPUs are the limit.

Ops, 1 MiB values:
- ``get``: get_into a reused buffer, cycling over 16 blocks written beforehand;
- ``put``: put of fresh keys (keys name content, so a rewrite would move no bytes);
  the server evicts to make room, as a full node does in service.

Redis (GET / SET of the same sizes through redis-py + hiredis) runs the same way as
the anchor.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

MiB = 1 << 20
BLOCKS = 16
WINDOW_S = 1.5  # each measurement's window, after every client is ready


def _blocks(size: int) -> list[np.ndarray]:
    return [np.random.default_rng(i).integers(0, 255, size, dtype=np.uint8) for i in range(BLOCKS)]


def _keys(size: int) -> list[bytes]:
    return [b"load" + size.to_bytes(4, "little") + i.to_bytes(8, "little") for i in range(BLOCKS)]


def _kvstore_op(address: str, token: str, transport: str, op: str, size: int) -> Callable[[], int]:
    from kvstore import StoreClient

    c = StoreClient.connect(address, token=token, transport=transport)
    tag = os.getpid().to_bytes(4, "little")
    blocks = _blocks(size)
    if op == "get":
        keys = _keys(size)
        c.batch_put(keys, blocks)  # the same 16 blocks for every client: stored once
        c.wait_prefaulted(60)  # a client's start-up cost, not its steady state
        out = np.empty(size, dtype=np.uint8)
        state = {"i": 0}

        def get() -> int:
            i = state["i"] = state["i"] + 1
            if not c.get_into(keys[i % BLOCKS], out):
                raise RuntimeError("a get missed: the benchmark's blocks were evicted")
            return size

        return get
    counter = {"n": 0}

    def put() -> int:
        n = counter["n"] = counter["n"] + 1
        key = b"put" + tag + n.to_bytes(9, "little")
        if c.put(key, blocks[n % BLOCKS]) is not True:
            raise RuntimeError("a put was not stored")
        return size

    put()
    c.wait_prefaulted(60)
    return put


def _redis_op(port: int, op: str, size: int) -> Callable[[], int]:
    import redis

    r = redis.Redis(host="127.0.0.1", port=port)
    tag = os.getpid().to_bytes(4, "little")
    blocks = _blocks(size)
    keys = _keys(size)
    state = {"i": 0}
    if op == "get":
        for k, b in zip(keys, blocks, strict=True):
            r.set(k, b.tobytes())

        def get() -> int:
            i = state["i"] = state["i"] + 1
            if r.get(keys[i % BLOCKS]) is None:
                raise RuntimeError("a Redis GET missed")
            return size

        return get
    payloads = [b.tobytes() for b in blocks]

    def put() -> int:  # SET overwrites: Redis's cheapest write of these bytes
        i = state["i"] = state["i"] + 1
        r.set(b"put" + tag + (i % BLOCKS).to_bytes(2, "little"), payloads[i % BLOCKS])
        return size

    return put


def _client(spec: dict[str, Any], ready: Any, start_at: Any, result: Any) -> None:
    """One client process: build its op, say ready, run from the shared start time to
    the end of the window, report the bytes moved and the time spent."""
    if spec["system"] == "redis":
        fn = _redis_op(spec["port"], spec["op"], spec["size"])
    else:
        fn = _kvstore_op(
            spec["address"], spec["token"], spec["transport"], spec["op"], spec["size"]
        )
    fn()
    ready.wait()  # barrier: every client has connected and warmed up
    while not start_at.value:  # set by the parent once everyone is through
        time.sleep(0.0005)
    t_start = start_at.value
    while time.time() < t_start:
        time.sleep(0.0005)
    end = t_start + WINDOW_S
    moved = 0
    while time.time() < end:
        moved += fn()
    result.put((moved, time.time() - t_start))


def aggregate(spec: dict[str, Any], clients: int) -> float:
    """GB/s moved by ``clients`` processes running ``spec`` side by side."""
    ctx = mp.get_context("spawn")
    ready = ctx.Barrier(clients + 1)
    start_at = ctx.Value("d", 0.0)
    result = ctx.Queue()
    args = (spec, ready, start_at, result)
    procs = [ctx.Process(target=_client, args=args) for _ in range(clients)]
    for p in procs:
        p.start()
    try:
        ready.wait(120)
        start_at.value = time.time() + 0.05 + 0.01 * clients
        got = [result.get(timeout=120) for _ in range(clients)]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    span = max(t for _, t in got)
    return sum(m for m, _ in got) / span / 1e9
