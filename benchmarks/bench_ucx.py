"""The UCX data plane against raw ucxx and against our TCP path, in the same run.

One ``kvstore serve --transport ucx`` process; in this process a client that moves its
connections to UCX (``transport="ucx"``) and one on the TCP data socket
(``transport="tcp"``), both reaching the same server over loopback. The raw anchor is a
second process speaking ucxx directly: a worker and an endpoint with the same settings
(kvstore/wire/ucx.py's context: peer-failure handling, blocking-mode worker), answering a
24-byte request with the payloads (gets) or taking the payloads and answering an 8-byte
ack (puts), driven by busy progress loops while a request is under way (asleep between
requests): what moving the same bytes costs with no store, no frames and no checksums.

Per block size (1 MiB, 4 MiB): get_into and put, singly and in batches of 8 (puts of
fresh keys). Targets: UCX at least 0.8 of raw ucxx, and no slower than our TCP path.
Also: small-block (4 KiB) calls, singly and in batches, over UCX and over TCP, which
give the per-request and per-block cost of our Python path (used in RESULTS.md to say
where it caps a fast NIC);
and Debian's ``ucx_perftest`` (tag_bw) as a C anchor when the ucx-utils package is
installed (a different UCX release: 1.13 against the wheel's), reported MISSING
otherwise.

Each figure is the median of ``--runs`` runs. UCX is limited to ``--tls`` (default tcp)
and to the loopback device.

Usage: python benchmarks/bench_ucx.py [--runs 5] [--tls tcp] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

MiB = 1 << 20
TOKEN = "bench-token-0123456789abcdef"
BATCH = 8
SIZES = (MiB, 4 * MiB)
REQ_TAG, DATA_TAG = 1, 2


def _ucx_env(tls: str) -> dict[str, str]:
    env = {"UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    if tls:
        env["UCX_TLS"] = tls
    return env


# -- the raw ucxx peer (its own process) ----------------------------------------------------


def _busy_wait(worker: Any, reqs: list[Any]) -> None:
    while not all(r.completed for r in reqs):
        worker.progress()
    for r in reqs:
        r.check_error()


def _idle_wait(worker: Any, req: Any) -> None:
    """Wait for the next request asleep (a spinning peer would take a CPU from the
    rows measured meanwhile: this machine has two)."""
    import select

    poller = select.poll()
    poller.register(worker.epoll_file_descriptor, select.POLLIN)
    while not req.completed:
        worker.progress()
        if not req.completed and worker.arm():
            poller.poll(100)
    req.check_error()


def raw_peer() -> int:
    """``--raw-peer``: print this worker's address, read the client's, then serve
    requests (op, size, count) until op 'q'."""
    import numpy as np
    from ucxx._lib.arr import Array

    from kvstore.wire import ucx

    lib = ucx._lib if ucx.available() else None
    assert lib is not None
    worker = lib.UCXWorker(ucx._ctx())
    worker.init_blocking_progress_mode()
    print(bytes(worker.address.tobytes()).hex(), flush=True)
    peer = bytes.fromhex(sys.stdin.readline().strip())
    ep = lib.UCXEndpoint.create_from_worker_address(
        worker, lib.UCXAddress.create_from_buffer(peer), True
    )
    bufs = [np.ones(max(SIZES), np.uint8) for _ in range(BATCH)]
    req = np.zeros(3, np.uint64)
    ack = np.zeros(1, np.uint64)
    while True:
        _idle_wait(worker, worker.tag_recv(Array(req), lib.UCXXTag(REQ_TAG)))
        op, size, count = (int(x) for x in req)
        if op == ord("q"):
            return 0
        views = [memoryview(bufs[i])[:size] for i in range(count)]
        if op == ord("g"):
            _busy_wait(worker, [ep.tag_send(Array(v), lib.UCXXTag(DATA_TAG)) for v in views])
        else:
            _busy_wait(worker, [worker.tag_recv(Array(v), lib.UCXXTag(DATA_TAG)) for v in views])
            _busy_wait(worker, [ep.tag_send(Array(ack), lib.UCXXTag(DATA_TAG))])


class RawUcxx:
    """This end of the raw anchor."""

    def __init__(self, env: dict[str, str]) -> None:
        import numpy as np

        from kvstore.wire import ucx

        ucx.available()
        self.lib = ucx._lib
        self.arr = ucx._arr
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--raw-peer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        peer = bytes.fromhex(self.proc.stdout.readline().strip())
        self.worker = self.lib.UCXWorker(ucx._ctx())
        self.proc.stdin.write(bytes(self.worker.address.tobytes()).hex() + "\n")
        self.proc.stdin.flush()
        self.ep = self.lib.UCXEndpoint.create_from_worker_address(
            self.worker, self.lib.UCXAddress.create_from_buffer(peer), True
        )
        self.outs = [np.empty(max(SIZES), np.uint8) for _ in range(BATCH)]
        self.src = [
            np.random.default_rng(i).integers(0, 255, max(SIZES), np.uint8) for i in range(BATCH)
        ]
        self.req = np.zeros(3, np.uint64)
        self.ack = np.zeros(1, np.uint64)

    def _ask(self, op: str, size: int, count: int) -> None:
        self.req[:] = (ord(op), size, count)
        tag = self.lib.UCXXTag(REQ_TAG)
        _busy_wait(self.worker, [self.ep.tag_send(self.arr.Array(self.req), tag)])

    def get(self, size: int, count: int) -> None:
        self._ask("g", size, count)
        tag = self.lib.UCXXTag(DATA_TAG)
        views = [memoryview(self.outs[i])[:size] for i in range(count)]
        _busy_wait(self.worker, [self.worker.tag_recv(self.arr.Array(v), tag) for v in views])

    def put(self, size: int, count: int) -> None:
        self._ask("p", size, count)
        tag = self.lib.UCXXTag(DATA_TAG)
        views = [memoryview(self.src[i])[:size] for i in range(count)]
        _busy_wait(self.worker, [self.ep.tag_send(self.arr.Array(v), tag) for v in views])
        _busy_wait(self.worker, [self.worker.tag_recv(self.arr.Array(self.ack), tag)])

    def close(self) -> None:
        try:
            self._ask("q", 0, 0)
        finally:
            self.proc.wait(10)


# -- the store ------------------------------------------------------------------------------


@contextmanager
def served(env: dict[str, str]) -> Iterator[str]:
    """``kvstore serve --transport ucx`` on loopback; yields its address."""
    argv = [sys.executable, "-m", "kvstore.cli", "serve", "--json", "--port", "0"]
    argv += ["--dram-bytes", "2GiB", "--max-value-bytes", "16MiB", "--transport", "ucx"]
    argv += ["--shared-memory", "off"]
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    full.update(env, KVSTORE_AUTH_TOKEN=TOKEN)
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=full, text=True
    )
    try:
        assert proc.stdout is not None
        facts = json.loads(proc.stdout.readline())
        yield f"127.0.0.1:{facts['port']}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


class Ours:
    """Our get_into and put over one transport."""

    def __init__(self, address: str, transport: str, size: int) -> None:
        import numpy as np

        from kvstore import StoreClient

        self.c = StoreClient.connect(address, token=TOKEN, transport=transport, timeout_s=30)
        self.size = size
        self.tag = transport[0].encode()
        self.keys = [size.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(BATCH)]
        rng = np.random.default_rng
        self.blocks = [rng(i).integers(0, 255, size, dtype=np.uint8) for i in range(BATCH)]
        self.c.batch_put(self.keys, self.blocks)
        self.outs = [np.empty(size, np.uint8) for _ in range(BATCH)]
        self.written = 0

    def _fresh(self, n: int) -> list[bytes]:
        base, self.written = self.written, self.written + n
        return [
            self.tag + b"w" + self.size.to_bytes(6, "little") + (base + j).to_bytes(8, "little")
            for j in range(n)
        ]

    def get_into(self) -> None:
        assert self.c.get_into(self.keys[0], self.outs[0]) is True

    def batch_get_into(self) -> None:
        assert self.c.batch_get_into(self.keys, self.outs) == [True] * BATCH

    def put(self) -> None:
        assert self.c.put(self._fresh(1)[0], self.blocks[0]) is True

    def batch_put(self) -> None:
        assert self.c.batch_put(self._fresh(BATCH), self.blocks) == [True] * BATCH

    def close(self) -> None:
        self.c.close()


def timed(fn: Callable[[], None], ops: int) -> float:
    """Seconds for ``ops`` calls, after two untimed ones."""
    fn()
    fn()
    t0 = time.perf_counter()
    for _ in range(ops):
        fn()
    return time.perf_counter() - t0


# -- ucx_perftest (Debian's ucx-utils) ------------------------------------------------------


def perftest(size: int, env: dict[str, str]) -> float | None:
    """tag_bw between two ucx_perftest processes on loopback, GB/s (None: not there)."""
    binary = shutil.which("ucx_perftest")
    if binary is None:
        return None
    port = str(13337 + size % 1000)
    common = ["-t", "tag_bw", "-s", str(size), "-n", "2000", "-p", port]
    full = {**os.environ, **env}
    server = subprocess.Popen(
        [binary, *common], env=full, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        time.sleep(0.5)
        out = subprocess.run(
            [binary, "127.0.0.1", *common], env=full, capture_output=True, text=True, timeout=120
        ).stdout
    finally:
        server.wait(30) if server.poll() is not None else server.kill()
    m = re.search(r"Final:\s+\d+\s+\S+\s+\S+\s+\S+\s+\S+\s+(\S+)\s+\S+", out)
    return float(m.group(1)) * MiB / 1e9 if m else None


# -- the run --------------------------------------------------------------------------------


def measure(address: str, raw: RawUcxx, size: int, runs: int) -> dict[str, float]:
    """Median GB/s of each row over ``runs`` runs (the three paths take turns)."""
    ucx, tcp = Ours(address, "ucx", size), Ours(address, "tcp", size)
    ops = max(16, (96 * MiB) // size)
    bops = max(4, ops // BATCH)
    rows: dict[str, list[float]] = {}
    plan: list[tuple[str, Callable[[], None], int, int]] = [
        ("get_into ucx", ucx.get_into, ops, 1),
        ("get_into tcp", tcp.get_into, ops, 1),
        ("get_into raw", lambda: raw.get(size, 1), ops, 1),
        ("batch_get_into ucx", ucx.batch_get_into, bops, BATCH),
        ("batch_get_into tcp", tcp.batch_get_into, bops, BATCH),
        ("batch_get_into raw", lambda: raw.get(size, BATCH), bops, BATCH),
        ("put ucx", ucx.put, ops, 1),
        ("put tcp", tcp.put, ops, 1),
        ("put raw", lambda: raw.put(size, 1), ops, 1),
        ("batch_put ucx", ucx.batch_put, bops, BATCH),
        ("batch_put tcp", tcp.batch_put, bops, BATCH),
        ("batch_put raw", lambda: raw.put(size, BATCH), bops, BATCH),
    ]
    try:
        for _ in range(runs):
            for name, fn, n, per in plan:
                rows.setdefault(name, []).append(n * per * size / timed(fn, n) / 1e9)
    finally:
        ucx.close()
        tcp.close()
    return {k: statistics.median(v) for k, v in rows.items()}


def small_costs(address: str, runs: int) -> dict[str, float]:
    """Microseconds per 4 KiB get_into, alone and per block of a batch of 8, over UCX
    and over our TCP path."""
    out: dict[str, float] = {}
    for transport in ("ucx", "tcp"):
        ours = Ours(address, transport, 4096)
        one, per = [], []
        try:
            for _ in range(runs):
                one.append(timed(ours.get_into, 400) / 400 * 1e6)
                per.append(timed(ours.batch_get_into, 100) / (100 * BATCH) * 1e6)
        finally:
            ours.close()
        out[f"{transport} request_us"] = statistics.median(one)
        out[f"{transport} per_block_in_batch_us"] = statistics.median(per)
    return out


def main() -> int:
    if "--raw-peer" in sys.argv:
        return raw_peer()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tls", default="tcp", help="UCX_TLS for every UCX process ('' lets UCX pick)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    env = _ucx_env(args.tls)
    os.environ.update(env)  # before this process makes its UCX context
    from kvstore.wire import ucx

    if not ucx.available():
        print("bench_ucx: MISSING ucxx (pip install -e '.[ucx]')")
        return 1
    results: dict[str, Any] = {"tls": args.tls, "runs": args.runs, "sizes": {}}
    with served(env) as address:
        raw = RawUcxx(env)
        try:
            for size in SIZES:
                results["sizes"][str(size)] = measure(address, raw, size, args.runs)
            results["small"] = small_costs(address, args.runs)
        finally:
            raw.close()
    results["perftest"] = {str(s): perftest(s, env) for s in SIZES}
    if args.json:
        print(json.dumps(results))
        return 0
    print(
        f"UCX_TLS={args.tls or '(UCX picks)'}, UCX_NET_DEVICES=lo; GB/s, median of {args.runs} runs"
    )
    for size in SIZES:
        fig = results["sizes"][str(size)]
        label = f"{size >> 20} MiB"
        for op in ("get_into", "batch_get_into", "put", "batch_put"):
            u, t, r = fig[f"{op} ucx"], fig[f"{op} tcp"], fig[f"{op} raw"]
            verdict = "ok" if u >= 0.8 * r and u >= t else "MISS"
            print(
                f"{label:>6}  {op:<15} ucx {u:5.2f}  tcp {t:5.2f}  raw ucxx {r:5.2f}  "
                f"ucx/raw {u / r:4.2f} (>=0.8)  ucx/tcp {u / t:4.2f} (>=1)  {verdict}"
            )
        pt = results["perftest"][str(size)]
        print(
            f"{label:>6}  ucx_perftest tag_bw "
            + (f"{pt:5.2f}" if pt else "MISSING (apt-get install ucx-utils)")
        )
    sm = results["small"]
    for transport in ("ucx", "tcp"):
        print(
            f"4 KiB get_into over {transport}: {sm[f'{transport} request_us']:.0f} us a call; "
            f"{sm[f'{transport} per_block_in_batch_us']:.0f} us a block in batches of {BATCH}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
