"""The server's CPU time per 1 MiB request (issue 32, "Show" item 1): one command, run
before and after the data plane changes.

A real ``kvstore serve`` child (bench_service.kvstore_server) serves the requests; its
CPU time (user + system, all its threads, psutil over /proc/<pid>/stat) is read just
before and just after a window of N calls, and the difference divided by N (with the
system part apart: the kernel's copies and syscalls, against the interpreter's work in
user time). Rows: ``put`` and ``get_into`` of 1 MiB over TCP and over shared memory
(same host, the default transport), and their x8 batches. Gets read from one server,
puts write fresh keys into a second one (2 GiB of DRAM, evicting as it fills, as a full
node does).

Beside each row, for context: wall time per call and the client's own CPU per call
(time.process_time, all client threads). The anchors, measured the same way in the same
run: a raw socket peer in a child process that ``recv_into``s 1 MiB blocks and answers
each with one byte (a put's round trip, with no work but moving the bytes), and one that
answers a one-byte request with 1 MiB (a TCP get's). ``srv/raw`` is the server's CPU per
MiB over the matching anchor's CPU per MiB (puts: the receiver; gets: the sender): how
much of the server's work is beyond moving the bytes.

Each window runs N calls, N chosen by a short calibration so that a window lasts about
``--seconds`` (at least 0.5 s; the kernel counts CPU time in 10 ms ticks, so a window
of 1 s reads to about 1%). Each figure is the median of ``--runs`` runs; within a run
the rows take turns.

Usage: python benchmarks/server_cpu.py [--runs 5] [--seconds 1.0] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_service import BATCH, TOKEN, kvstore_server

from kvstore import StoreClient

MiB = 1 << 20
BLOCKS = 16  # distinct blocks the gets cycle through

Op = Callable[[int], None]
RECV, SEND = "raw recv (anchor)", "raw send (anchor)"


def cpu_seconds(proc: psutil.Process) -> tuple[float, float]:
    """User and system CPU seconds of every thread of ``proc`` so far."""
    t = proc.cpu_times()
    return t.user, t.system


def window(fn: Op, calls: int, proc: psutil.Process) -> dict[str, float]:
    """Wall, the watched process's CPU (user + system, and system alone) and this
    process's CPU, in microseconds per call, over exactly ``calls`` calls of ``fn``."""
    (u0, k0), c0, t0 = cpu_seconds(proc), time.process_time(), time.perf_counter()
    for i in range(calls):
        fn(i)
    t1, c1, (u1, k1) = time.perf_counter(), time.process_time(), cpu_seconds(proc)
    return {
        "wall_us": (t1 - t0) / calls * 1e6,
        "server_cpu_us": (u1 - u0 + k1 - k0) / calls * 1e6,
        "server_sys_us": (k1 - k0) / calls * 1e6,
        "client_cpu_us": (c1 - c0) / calls * 1e6,
    }


def calibrate(fn: Op, seconds: float) -> int:
    """Calls that take about ``seconds``, from a timed warm-up of about a fifth of it."""
    t0, n = time.perf_counter(), 0
    while (elapsed := time.perf_counter() - t0) < seconds / 5 or n < 4:
        fn(n)
        n += 1
    return max(math.ceil(seconds * n / elapsed), 4)


# -- the anchors: a raw socket peer in a child process ---------------------------------------


def _raw_peer(port: int, size: int, sending: bool) -> None:
    """Receives ``size``-byte blocks and answers each with one byte (``sending=False``),
    or answers each one-byte request with a block (``sending=True``), until hung up on."""
    buf = memoryview(bytearray(size))
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * MiB)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MiB)
        if sending:
            while s.recv(1) == b"g":
                s.sendall(buf)
        else:
            while s.recv_into(buf, size, socket.MSG_WAITALL) == size:
                s.sendall(b"k")


class RawPeer:
    """The anchor's client side: ``call(i)`` sends one block and waits for its answer
    (``sending=False``: the child receives), or asks for one and receives it."""

    def __init__(self, size: int, sending: bool) -> None:
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        ctx = mp.get_context("spawn")
        args = (ls.getsockname()[1], size, sending)
        self.child = ctx.Process(target=_raw_peer, args=args)
        self.child.start()
        self.sock, _ = ls.accept()
        ls.close()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * MiB)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MiB)
        self.proc = psutil.Process(self.child.pid)
        self.data = np.random.default_rng(3).integers(0, 255, size, dtype=np.uint8)
        self.view, self.size, self.sending = memoryview(self.data), size, sending

    def call(self, _: int) -> None:
        if self.sending:
            self.sock.sendall(b"g")
            assert self.sock.recv_into(self.view, self.size, socket.MSG_WAITALL) == self.size
        else:
            self.sock.sendall(self.data)
            assert self.sock.recv(1) == b"k"

    def close(self) -> None:
        self.sock.close()
        self.child.join(10)


# -- our requests -----------------------------------------------------------------------------


class Requests:
    """Gets from ``get_facts``'s server, fresh-key puts into ``put_facts``'s; one client
    per transport and server."""

    def __init__(self, get_facts: dict[str, Any], put_facts: dict[str, Any]) -> None:
        def connect(facts: dict[str, Any], transport: str) -> StoreClient:
            address = f"127.0.0.1:{facts['port']}"
            return StoreClient.connect(address, token=TOKEN, transport=transport)

        rng = np.random.default_rng
        self.blocks = [rng(i).integers(0, 255, MiB, dtype=np.uint8) for i in range(BLOCKS)]
        self.keys = [b"cpu-get-" + i.to_bytes(8, "little") for i in range(BLOCKS)]
        self.batches = [self.keys[j : j + BATCH] for j in range(0, BLOCKS, BATCH)]
        self.get = {t: connect(get_facts, t) for t in ("tcp", "shm")}
        self.put = {t: connect(put_facts, t) for t in ("tcp", "shm")}
        self.get["shm"].batch_put(self.keys, self.blocks)
        self.put["shm"].put(b"cpu-warm-up-0000", self.blocks[0])
        self.put["shm"].wait_prefaulted(60)
        self.out = np.empty(MiB, dtype=np.uint8)
        self.outs = [np.empty(MiB, dtype=np.uint8) for _ in range(BATCH)]
        self.written = 0

    def fresh(self, n: int) -> list[bytes]:
        """Keys never written before: a rewrite of a key moves nothing."""
        base, self.written = self.written, self.written + n
        return [b"cpu-put-" + (base + j).to_bytes(8, "little") for j in range(n)]

    def ops(self) -> dict[str, tuple[Op, int]]:
        """Row name -> (call taking the op number, MiB per call)."""
        rows: dict[str, tuple[Op, int]] = {}
        for t in ("tcp", "shm"):
            getter, putter = self.get[t], self.put[t]

            def put(i: int, c: StoreClient = putter) -> None:
                assert c.put(self.fresh(1)[0], self.blocks[i % BLOCKS]) is True

            def batch_put(i: int, c: StoreClient = putter) -> None:
                assert c.batch_put(self.fresh(BATCH), self.blocks[:BATCH]) == [True] * BATCH

            def get_into(i: int, c: StoreClient = getter) -> None:
                assert c.get_into(self.keys[i % BLOCKS], self.out)

            def batch_get_into(i: int, c: StoreClient = getter) -> None:
                assert all(c.batch_get_into(self.batches[i % len(self.batches)], self.outs))

            rows[f"{t} put"] = (put, 1)
            rows[f"{t} get_into"] = (get_into, 1)
            rows[f"{t} batch_put x{BATCH}"] = (batch_put, BATCH)
            rows[f"{t} batch_get_into x{BATCH}"] = (batch_get_into, BATCH)
        return rows

    def close(self) -> None:
        for c in (*self.get.values(), *self.put.values()):
            c.close()


# -- the measurement --------------------------------------------------------------------------


def measure(runs: int, seconds: float) -> dict[str, Any]:
    """Every row: the median over ``runs`` of each per-call figure, plus the servers'
    idle CPU (what their background threads spend with no request in flight)."""
    with kvstore_server("1GiB") as get_facts, kvstore_server("2GiB") as put_facts:
        get_proc, put_proc = psutil.Process(get_facts["pid"]), psutil.Process(put_facts["pid"])
        req = Requests(get_facts, put_facts)
        recv, send = RawPeer(MiB, sending=False), RawPeer(MiB, sending=True)
        try:
            rows: dict[str, tuple[Op, int, psutil.Process]] = {
                RECV: (recv.call, 1, recv.proc),
                SEND: (send.call, 1, send.proc),
            }
            for name, (fn, mib) in req.ops().items():
                rows[name] = (fn, mib, put_proc if "put" in name else get_proc)
            calls = {name: calibrate(fn, seconds) for name, (fn, _, _) in rows.items()}
            samples: dict[str, list[dict[str, float]]] = {name: [] for name in rows}
            for _ in range(runs):
                for name, (fn, _, proc) in rows.items():
                    samples[name].append(window(fn, calls[name], proc))
            idle = {"get server": idle_cpu(get_proc), "put server": idle_cpu(put_proc)}
        finally:
            recv.close()
            send.close()
            req.close()
    out = {}
    for name, (_, mib, _) in rows.items():
        med = {k: statistics.median(s[k] for s in samples[name]) for k in samples[name][0]}
        out[name] = {"calls": calls[name], "mib_per_call": mib, **med}
    return {"rows": out, "idle_cpu_us_per_s": idle, "runs": runs, "seconds": seconds}


def idle_cpu(proc: psutil.Process, seconds: float = 1.0) -> float:
    """Microseconds of CPU ``proc`` spends per second with nothing asked of it."""
    c0 = sum(cpu_seconds(proc))
    time.sleep(seconds)
    return (sum(cpu_seconds(proc)) - c0) / seconds * 1e6


def table(doc: dict[str, Any]) -> str:
    rows = doc["rows"]
    recv, send = rows[RECV]["server_cpu_us"], rows[SEND]["server_cpu_us"]
    head = (
        "| op (1 MiB values) | calls | wall us/call | server CPU us/call | of which sys "
        f"| server CPU us/MiB | client CPU us/call | srv/raw |\n|{'---|' * 8}"
    )
    lines = [head]
    for name, r in rows.items():
        per_mib = r["server_cpu_us"] / r["mib_per_call"]
        raw = send if "get" in name or name == SEND else recv
        lines.append(
            f"| {name} | {r['calls']} | {r['wall_us']:.0f} | {r['server_cpu_us']:.0f} "
            f"| {r['server_sys_us']:.0f} | {per_mib:.0f} | {r['client_cpu_us']:.0f} "
            f"| {per_mib / raw:.2f} |"
        )
    idle = ", ".join(f"{k} {v:.0f} us/s" for k, v in doc["idle_cpu_us_per_s"].items())
    lines.append(
        f"\nServer = the kvstore serve process (for an anchor: its child). srv/raw: "
        f"puts over the raw receiver, gets over the raw sender. "
        f"Median of {doc['runs']} runs, windows of about {doc['seconds']} s. "
        f"Idle server CPU: {idle}."
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--seconds", type=float, default=1.0, help="length of a window (>= 0.5)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    args = p.parse_args()
    if args.seconds < 0.5:
        p.error("--seconds must be at least 0.5")
    doc = measure(args.runs, args.seconds)
    print(json.dumps(doc, indent=2) if args.json else table(doc))


if __name__ == "__main__":
    main()
