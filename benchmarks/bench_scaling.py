"""Issue 32's measurement: does one node's throughput scale with its clients and cores?

For each shard count asked for (``kvstore serve --shards N``; ``auto`` is the default a
user gets), one server for gets (512 MiB of DRAM holding the blocks every client reads)
and one for puts (fresh keys into 2 GiB that evicts as it fills), then 1 MiB ops from
1, 2, 4 and 8 client processes at once (benchmarks/service_load.py: each client its own
spawned process and connection, one barrier, one shared window). Redis (GET and SET of
the same sizes, redis-py + hiredis, one redis-server) runs the same way in the same run
as the anchor.

It prints aggregate GB/s per row and count, whether each kvstore row holds from 1 to 8
clients (never falls more than 10% from one count to the next), and at the largest count
the ratios the issue asks for: puts / Redis SET and TCP gets / Redis GET (target 2x).

    PYTHONPATH=$PWD python benchmarks/bench_scaling.py --shards 1,auto --clients 1,2,4,8

On a 2-core host every count past one shares its cores with the server: there the
figures say only that nothing falls; the scaling figures come from a 16-core host.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import service_load
from bench_service import TOKEN, kvstore_server, redis_server

MiB = 1 << 20
KVSTORE_OPS = [  # (label, transport, op)
    ("shm get_into", "shm", "get"),
    ("tcp get_into", "tcp", "get"),
    ("shm put", "shm", "put"),
    ("tcp put", "tcp", "put"),
]
REDIS_OPS = [("Redis GET", "get"), ("Redis SET", "put")]
TARGETS = [("shm put", "Redis SET"), ("tcp put", "Redis SET"), ("tcp get_into", "Redis GET")]


def _spec(system: str, transport: str, op: str, port: int) -> dict[str, Any]:
    return {
        "system": system,
        "transport": transport,
        "op": op,
        "size": MiB,
        "address": f"127.0.0.1:{port}",
        "token": TOKEN,
        "port": port,
    }


def _row(spec: dict[str, Any], counts: list[int], runs: int) -> dict[int, float]:
    return {
        n: statistics.median(service_load.aggregate(spec, n) for _ in range(runs)) for n in counts
    }


def measure_kvstore(shards: str, counts: list[int], runs: int) -> dict[str, Any]:
    """Every kvstore row against servers of ``shards`` shards."""
    flags = ("--shards", shards)
    with kvstore_server("512MiB", *flags) as gets, kvstore_server("2GiB", *flags) as puts:
        rows = {}
        for label, transport, op in KVSTORE_OPS:
            target = puts if op == "put" else gets
            rows[label] = _row(_spec("kvstore", transport, op, target["port"]), counts, runs)
        return {"shards": len(gets.get("shards") or [0]), "rows": rows}


def measure_redis(counts: list[int], runs: int) -> dict[str, dict[int, float]]:
    """Redis GET and SET, or nothing when redis-server or redis-py is missing."""
    with redis_server() as r:
        if r is None:
            return {}
        port = r.connection_pool.connection_kwargs["port"]
        return {label: _row(_spec("redis", "", op, port), counts, runs) for label, op in REDIS_OPS}


def report(result: dict[str, Any]) -> None:
    """The tables and verdicts."""
    counts = result["counts"]
    redis = result["redis"]
    print(f"aggregate GB/s, 1 MiB values, medians of {result['runs']} runs, {result['cpus']} CPUs")
    print(f"{'':<34}" + "".join(f"{n:>8}" for n in counts))
    for label, row in redis.items():
        print(f"  {label:<32}" + "".join(f"{row[n]:8.2f}" for n in counts))
    for run in result["kvstore"]:
        for label, row in run["rows"].items():
            holds = all(row[b] >= 0.9 * row[a] for a, b in itertools.pairwise(counts))
            name = f"{label}, {run['shards']} shard(s)"
            cells = "".join(f"{row[n]:8.2f}" for n in counts)
            print(f"  {name:<32}{cells}  {'holds' if holds else 'FALLS'}")
    top = counts[-1]
    for run in result["kvstore"]:
        for ours, theirs in TARGETS:
            if theirs in redis:
                ratio = run["rows"][ours][top] / redis[theirs][top]
                verdict = "ok" if ratio >= 2 else "MISS"
                print(
                    f"  {run['shards']} shard(s), {top} clients: {ours} / {theirs} = "
                    f"{ratio:.2f} (target >= 2) {verdict}"
                )
    if not redis:
        print("!! ANCHOR NOT MEASURED: Redis (apt install redis-server; pip install redis hiredis)")
    print(f"1-min load average {result['load'][0]:.1f} at start, {result['load'][1]:.1f} at end")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="1,auto", help="shard counts to serve with")
    parser.add_argument("--clients", default="1,2,4,8", help="client process counts")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    counts = [int(n) for n in args.clients.split(",") if n]
    result: dict[str, Any] = {"runs": args.runs, "counts": counts, "cpus": os.cpu_count()}
    load0 = os.getloadavg()[0]
    result["redis"] = measure_redis(counts, args.runs)
    result["kvstore"] = [measure_kvstore(s, counts, args.runs) for s in args.shards.split(",")]
    result["load"] = (load0, os.getloadavg()[0])
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        report(result)


if __name__ == "__main__":
    main()
