"""What polling on the data socket buys: the same calls with polling on and off.

Two ``kvstore serve`` processes hold the same blocks: one polls for a lone client's
next request (``--data-poll-us 100``, the default) and one sleeps (``--data-poll-us
0``). The client talks to the polling server with reply polling on (``reply_poll_us``
200, the default) and to the other with it off. The two take turns in short blocks, so
noise from other jobs on the host lands on both alike. Measured per call, medians of
the per-block medians:

- ``get`` of a 1 MiB block over TCP (fresh value, as bench_service.py's ``tcp get``);
- ``exists`` of 64 keys over the data socket (the control plane's usual path).

It also prints the server's ``data_polls_caught`` / ``data_polls_missed``.

Usage: python benchmarks/bench_poll.py [--blocks 12] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from bench_service import TOKEN, kvstore_server

from kvstore import StoreClient

MiB = 1 << 20
CALLS = 60  # timed calls per block and variant


def _block(fn: Callable[[int], Any], calls: int) -> float:
    """Median microseconds of ``calls`` calls of ``fn(i)``, after two untimed ones."""
    fn(0)
    fn(1)
    samples = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn(i)
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    keys = [(i + 1).to_bytes(8, "little") * 2 for i in range(16)]
    probe = [(i + 100).to_bytes(8, "little") * 2 for i in range(64)]
    values = [np.random.default_rng(i).integers(0, 255, MiB, dtype=np.uint8) for i in range(16)]
    figures: dict[str, list[float]] = {}
    polls: dict[str, dict[str, int]] = {}
    with (
        kvstore_server("256MiB", "--data-poll-us", "100") as on,
        kvstore_server("256MiB", "--data-poll-us", "0") as off,
    ):
        clients = {
            "polling": StoreClient.connect(f"127.0.0.1:{on['port']}", token=TOKEN, transport="tcp"),
            "sleeping": StoreClient.connect(
                f"127.0.0.1:{off['port']}", token=TOKEN, transport="tcp", reply_poll_us=0
            ),
        }
        try:
            for c in clients.values():
                c.batch_put(keys, values)
            for _ in range(args.blocks):
                for name, c in clients.items():
                    get = _block(lambda i, c=c: c.get(keys[i % 16]), CALLS)
                    exists = _block(lambda i, c=c: c.exists(probe), CALLS)
                    figures.setdefault(f"{name} get 1MiB", []).append(get)
                    figures.setdefault(f"{name} exists x64", []).append(exists)
            for name, c in clients.items():
                server = c.stats()["server"]
                polls[name] = {
                    k: int(server.get(k, 0)) for k in ("data_polls_caught", "data_polls_missed")
                }
        finally:
            for c in clients.values():
                c.close()
    med = {k: statistics.median(v) for k, v in figures.items()}
    report = {"us": med, "polls": polls, "blocks": args.blocks, "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"polling vs sleeping on the data socket: medians of {args.blocks} blocks, us per call\n")
    print(f"{'call':<14} {'sleeping':>10} {'polling':>10} {'speed-up':>9}")
    for call in ("get 1MiB", "exists x64"):
        slow, fast = med[f"sleeping {call}"], med[f"polling {call}"]
        print(f"{call:<14} {slow:10.1f} {fast:10.1f} {slow / fast:8.2f}x")
    p = polls["polling"]
    print(
        f"\npolling server: {p['data_polls_caught']} polls caught the next request, "
        f"{p['data_polls_missed']} missed (each miss spent up to 100 us of CPU)"
    )


if __name__ == "__main__":
    main()
