"""Does the etcd directory keep up with a cluster's metadata, and serve reads from memory?

Four questions, each against an anchor measured in the same run on the same etcd
(started here on free loopback ports, data in a temp dir):

1. Registration rate: blocks/s through ``EtcdDirectory.publish`` (coalescing,
   128-op transactions, a few in flight) vs raw aetcd: sequential 128-op
   transactions of the same keys and values built with ``client.transaction``.
   Target: >= 70% of the anchor.
2. Longest-prefix match of a 64-block prompt over three nodes, served by the mirror
   (holding --entries other entries too): p50 per call. Target: <= 50 us. Anchor:
   one etcd range per block, the round trip per block the mirror exists to avoid.
3. Propagation, a publish in this process to the mirror of another process: p99.
   Target: <= 20 ms. Anchor: a raw aetcd put to a raw aetcd watch in that process.
   Both processes read CLOCK_MONOTONIC, which is system-wide on Linux.
4. Mirror memory per million entries, from tracemalloc (Python objects) and RSS, in
   a fresh process that loads --entries entries; anchor: a plain dict of etcd key ->
   value bytes (what a generic etcd mirror would hold) built from the same listing.

Medians of --runs runs (the machine is shared and noisy); a ratio is the median
of per-run ratios.

    python benchmarks/bench_directory.py [--runs 3] [--keys 20000] [--entries 200000] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aetcd
from aetcd import rpc

from kvstore.directory import NodeInfo
from kvstore.directory.etcd import EtcdDirectory, block_key
from kvstore.directory.etcd_process import EtcdProcess
from kvstore.events import BlockStored
from kvstore.tier_kinds import TierKind

ROOT = Path(__file__).resolve().parents[1]
DRAM = TierKind.DRAM
MEM_CLUSTER = "bench-mem"


def keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# -- 1. registration rate ------------------------------------------------------------------


async def raw_rate(etcd: EtcdProcess, n: int, run: int) -> float:
    """Anchor: sequential 128-op aetcd transactions, keys and values as ours."""
    c = aetcd.Client("127.0.0.1", etcd.client_port)
    await c.connect()
    lease = await c.lease(120)
    ks = keys(n)
    cluster = f"bench-raw-{run}"
    start = time.perf_counter()
    for i in range(0, n, 128):
        ops = [
            c.transactions.put(block_key(cluster, k, "n1"), b"d4096", lease=lease)
            for k in ks[i : i + 128]
        ]
        await c.transaction(compare=[], success=ops, failure=[])
    rate = n / (time.perf_counter() - start)
    await lease.revoke()
    await c.close()
    return rate


async def dir_rate(etcd: EtcdProcess, n: int, run: int, inflight: int) -> float:
    """Ours: one publish of n BlockStored events (as a Publisher batch would be)."""
    async with EtcdDirectory(
        etcd.endpoint, f"bench-dir-{run}-{inflight}", max_inflight=inflight
    ) as d:
        await d.register_node(NodeInfo("n1", "h1", "h1:7400"), ttl=120)
        events = [BlockStored(k, DRAM, 4096, b"") for k in keys(n)]
        start = time.perf_counter()
        await d.publish("n1", events)
        return n / (time.perf_counter() - start)


async def bench_registration(etcd: EtcdProcess, n: int, runs: int) -> dict[str, Any]:
    anchor, ours, ours1 = [], [], []
    for run in range(runs):
        anchor.append(await raw_rate(etcd, n, run))
        ours.append(await dir_rate(etcd, n, run, 4))
        ours1.append(await dir_rate(etcd, n, run, 1))
    ratios = [o / a for o, a in zip(ours, anchor, strict=True)]
    ratios1 = [o / a for o, a in zip(ours1, anchor, strict=True)]
    return {
        "anchor_keys_per_s": statistics.median(anchor),
        "ours_keys_per_s": statistics.median(ours),
        "ours_inflight1_keys_per_s": statistics.median(ours1),
        "ratio": statistics.median(ratios),
        "ratio_inflight1": statistics.median(ratios1),
        "target_ratio": 0.70,
        "runs": {"anchor": anchor, "ours": ours, "ours_inflight1": ours1},
    }


# -- 2 and 4 setup: a cluster with many entries --------------------------------------------------


async def populate(etcd: EtcdProcess, entries: int) -> EtcdDirectory:
    """Two nodes, 3/4 of the entries on one, 1/4 on the other (half of those shared)."""
    d = EtcdDirectory(etcd.endpoint, MEM_CLUSTER)
    await d.open()
    a_keys = keys(entries * 3 // 4)
    b_keys = a_keys[: entries // 8] + keys(entries // 4 - entries // 8)
    for node_id, ks in (("big", a_keys), ("small", b_keys)):
        await d.register_node(NodeInfo(node_id, "h-" + node_id, "x:1"), ttl=600)
        await d.publish(node_id, [BlockStored(k, DRAM, 1 << 20, b"") for k in ks])
    return d


async def bench_prefix(etcd: EtcdProcess, d: EtcdDirectory, runs: int) -> dict[str, Any]:
    prompt = keys(64)
    for node_id, n in (("a", 64), ("b", 40), ("c", 12)):
        await d.register_node(NodeInfo(node_id, "h-" + node_id, "x:1"), ttl=600)
        rev = await d.publish(node_id, [BlockStored(k, DRAM, 1 << 20, b"") for k in prompt[:n]])
    m = await d.mirror()
    assert await m.wait_for_revision(rev, 30)
    assert m.longest_prefix(prompt) == {"a": 64, "b": 40, "c": 12}
    p50s, p99s = [], []
    clock = time.perf_counter_ns
    for _ in range(runs):
        lat: list[float] = []
        for _ in range(20_000):
            t0 = clock()
            m.longest_prefix(prompt)
            lat.append((clock() - t0) / 1e3)
        p50s.append(pct(lat, 0.5))
        p99s.append(pct(lat, 0.99))
    anchor = []
    kv = d.client.kvstub
    for _ in range(runs):
        t = time.perf_counter()
        for k in prompt:  # what a directory without a mirror pays per prompt
            prefix = block_key(MEM_CLUSTER, k, "")
            end = prefix[:-1] + b"0"
            await kv.Range(rpc.RangeRequest(key=prefix, range_end=end), timeout=5)
        anchor.append((time.perf_counter() - t) * 1e6)
    return {
        "anchor_us_round_trip_per_block": statistics.median(anchor),
        "ours_p50_us": statistics.median(p50s),
        "ours_p99_us": statistics.median(p99s),
        "ratio": statistics.median(p50s) / statistics.median(anchor),
        "target_p50_us": 50.0,
        "mirror_entries": len(m),
    }


# -- 3. propagation to another process ------------------------------------------------------------

_WATCHER = r"""
import asyncio, json, sys, time
import aetcd
from kvstore.directory.etcd import EtcdDirectory

async def main(endpoint, cluster, keys_file, raw_prefix):
    want = [bytes.fromhex(h) for h in open(keys_file).read().split()]
    got = [0] * len(want)
    raw = {}
    d = EtcdDirectory(endpoint, cluster)
    await d.open()
    m = await d.mirror()
    idx = [0]
    def on_change(rev):
        now = time.monotonic_ns()
        while idx[0] < len(want) and m.replicas(want[idx[0]]):
            got[idx[0]] = now
            idx[0] += 1
    m.add_listener(on_change)
    host, port = endpoint.rsplit(":", 1)
    c = aetcd.Client(host, int(port))
    await c.connect()
    watch = await c.watch_prefix(raw_prefix)
    async def raw_loop():
        async for ev in watch:
            raw[int(ev.kv.key[len(raw_prefix):])] = time.monotonic_ns()
    task = asyncio.create_task(raw_loop())
    print("READY", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    print(json.dumps({"mirror": got, "raw": [raw.get(i, 0) for i in range(len(want))]}), flush=True)
    task.cancel()

asyncio.run(main(*sys.argv[1:4], sys.argv[4].encode()))
"""


async def propagation_run(etcd: EtcdProcess, samples: int, tmp: Path, run: int) -> dict[str, Any]:
    """One child mirror; ``samples`` raw puts and publishes, interleaved, 3 ms apart."""
    cluster, raw_prefix = f"bench-prop-{run}", f"/bench-raw-watch-{run}/".encode()
    warm = 20  # the first publishes pay one-time costs; not counted
    ks = keys(samples + warm)
    kf = tmp / f"prop-keys-{run}.txt"
    kf.write_text("\n".join(k.hex() for k in ks))
    child = subprocess.Popen(
        [sys.executable, "-c", _WATCHER, etcd.endpoint, cluster, str(kf), raw_prefix.decode()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        text=True,
    )
    assert child.stdout is not None and child.stdin is not None
    assert (await asyncio.to_thread(child.stdout.readline)).startswith("READY")
    sent_ours, sent_raw, committed = [], [], []
    async with EtcdDirectory(etcd.endpoint, cluster) as d:
        await d.register_node(NodeInfo("p", "h-p", "x:1"), ttl=60)
        c = d.client
        for i, k in enumerate(ks):
            sent_raw.append(time.monotonic_ns())
            await c.put(raw_prefix + b"%d" % i, b"d4096")
            await asyncio.sleep(0.003)
            sent_ours.append(time.monotonic_ns())
            await d.publish("p", [BlockStored(k, DRAM, 4096, b"")])
            committed.append(time.monotonic_ns())
            await asyncio.sleep(0.003)
        await asyncio.sleep(0.5)
    out, _ = await asyncio.to_thread(child.communicate, "done\n", 30)
    got = json.loads(out.strip().splitlines()[-1])

    def ms(arrived: list[int], sent: list[int]) -> list[float]:
        pairs = list(zip(arrived, sent, strict=True))[warm:]
        return [(g - s) / 1e6 for g, s in pairs if g]

    ours, raw = ms(got["mirror"], sent_ours), ms(got["raw"], sent_raw)
    commit = ms(committed, sent_ours)
    after = [o - c for o, c in zip(ms(got["mirror"], sent_ours), commit, strict=False)]
    return {
        "raw_p50": pct(raw, 0.5),
        "raw_p99": pct(raw, 0.99),
        "ours_p50": pct(ours, 0.5),
        "ours_p99": pct(ours, 0.99),
        "commit_p99": pct(commit, 0.99),
        "after_commit_p99": pct(after, 0.99),
        "lost": (samples - len(ours)) + (samples - len(raw)),
    }


async def bench_propagation(
    etcd: EtcdProcess, samples: int, runs: int, tmp: Path
) -> dict[str, Any]:
    rs = [await propagation_run(etcd, samples, tmp, run) for run in range(runs)]

    def med(name: str) -> float:
        return statistics.median(r[name] for r in rs)

    return {
        "anchor_raw_watch_p50_ms": med("raw_p50"),
        "anchor_raw_watch_p99_ms": med("raw_p99"),
        "ours_p50_ms": med("ours_p50"),
        "ours_p99_ms": med("ours_p99"),
        "ratio_p99": statistics.median(r["ours_p99"] / r["raw_p99"] for r in rs),
        "ours_etcd_commit_p99_ms": med("commit_p99"),
        "ours_after_commit_p99_ms": med("after_commit_p99"),
        "not_delivered": sum(r["lost"] for r in rs),
        "target_p99_ms": 20.0,
        "runs": rs,
    }


# -- 4. mirror memory ---------------------------------------------------------------------------

_MEMORY = r"""
import asyncio, gc, json, resource, sys, tracemalloc
from aetcd import rpc
from kvstore.directory.etcd import EtcdDirectory, cluster_prefix

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

async def main(endpoint, cluster, mode):
    d = EtcdDirectory(endpoint, cluster)
    await d.open()
    gc.collect()
    if mode == "trace":
        tracemalloc.start()
    base_rss, base = rss(), tracemalloc.get_traced_memory()[0]
    m = await d.mirror()
    gc.collect()
    ours, ours_rss = tracemalloc.get_traced_memory()[0] - base, rss() - base_rss
    naive = {}
    p = cluster_prefix(cluster)
    start, end, rev = p, p[:-1] + b"0", 0
    mid = tracemalloc.get_traced_memory()[0]
    while True:  # the anchor: a plain {etcd key: value} dict of the same listing
        resp = await d.client.kvstub.Range(
            rpc.RangeRequest(key=start, range_end=end, limit=10000, revision=rev), timeout=30)
        rev = rev or resp.header.revision
        for kv in resp.kvs:
            naive[kv.key] = kv.value
        if not resp.more:
            break
        start = resp.kvs[-1].key + b"\0"
    gc.collect()
    anchor = tracemalloc.get_traced_memory()[0] - mid
    print(json.dumps({"entries": len(m), "ours": ours, "ours_rss": ours_rss,
                      "anchor": anchor, "anchor_entries": len(naive)}), flush=True)
    await d.close()

asyncio.run(main(*sys.argv[1:4]))
"""


def bench_memory(etcd: EtcdProcess) -> dict[str, Any]:
    def child(mode: str) -> dict[str, Any]:
        out = subprocess.run(
            [sys.executable, "-c", _MEMORY, etcd.endpoint, MEM_CLUSTER, mode],
            capture_output=True,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            text=True,
            timeout=300,
            check=True,
        )
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))

    traced, plain = child("trace"), child("rss")
    per_m = 1e6 / traced["entries"]
    return {
        "entries": traced["entries"],
        "anchor_naive_dict_mb_per_million": traced["anchor"] * per_m / 1e6,
        "ours_traced_mb_per_million": traced["ours"] * per_m / 1e6,
        "ours_rss_mb_per_million": plain["ours_rss"] * 1e6 / plain["entries"] / 1e6,
        "ours_bytes_per_entry": traced["ours"] / traced["entries"],
        "ratio": traced["ours"] / traced["anchor"],
    }


# -- report -------------------------------------------------------------------------------------


def report(res: dict[str, Any]) -> None:
    r, p, q, m = res["registration"], res["prefix"], res["propagation"], res["memory"]
    ok = {True: "ok", False: "MISSED"}
    print(f"etcd {res['etcd_version']}, {res['cpus']} CPUs, medians of {res['runs']} runs\n")
    print(f"{'question':<44}{'anchor':>16}{'ours':>16}{'ratio':>9}  target")
    print(
        f"{'1. block registration (keys/s)':<44}{r['anchor_keys_per_s']:>16,.0f}"
        f"{r['ours_keys_per_s']:>16,.0f}{r['ratio']:>9.2f}  >= 0.70 {ok[r['ratio'] >= 0.7]}"
    )
    print(
        f"{'   same, one transaction in flight':<44}{'':>16}"
        f"{r['ours_inflight1_keys_per_s']:>16,.0f}{r['ratio_inflight1']:>9.2f}"
    )
    print(
        f"{'2. longest prefix, 64 blocks (us, p50)':<44}"
        f"{p['anchor_us_round_trip_per_block']:>16,.0f}{p['ours_p50_us']:>16.1f}"
        f"{p['ratio']:>9.4f}  <= 50 us {ok[p['ours_p50_us'] <= 50]}"
    )
    print(
        f"{'   p99 (mirror of ' + str(p['mirror_entries']) + ' entries)':<44}{'':>16}"
        f"{p['ours_p99_us']:>16.1f}"
    )
    print(
        f"{'3. publish -> other process mirror (ms, p99)':<44}"
        f"{q['anchor_raw_watch_p99_ms']:>16.2f}{q['ours_p99_ms']:>16.2f}"
        f"{q['ratio_p99']:>9.2f}  <= 20 ms {ok[q['ours_p99_ms'] <= 20]}"
    )
    print(
        f"{'   p50':<44}{q['anchor_raw_watch_p50_ms']:>16.2f}{q['ours_p50_ms']:>16.2f}"
        f"{'':>9}  not delivered: {q['not_delivered']}"
    )
    print(
        f"{'   p99 split: etcd commit / commit -> mirror':<44}{'':>16}"
        f"{q['ours_etcd_commit_p99_ms']:>8.2f} / {q['ours_after_commit_p99_ms']:.2f}"
    )
    print(
        f"{'4. mirror memory (MB per million entries)':<44}"
        f"{m['anchor_naive_dict_mb_per_million']:>16.0f}{m['ours_traced_mb_per_million']:>16.0f}"
        f"{m['ratio']:>9.2f}  (RSS: {m['ours_rss_mb_per_million']:.0f} MB/M, "
        f"{m['ours_bytes_per_entry']:.0f} B/entry, measured on {m['entries']:,})"
    )


async def run_all(etcd: EtcdProcess, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"runs": args.runs, "cpus": os.cpu_count()}
    res["propagation"] = await bench_propagation(etcd, args.samples, args.runs, tmp)
    res["registration"] = await bench_registration(etcd, args.keys, args.runs)
    d = await populate(etcd, args.entries)
    try:
        res["prefix"] = await bench_prefix(etcd, d, args.runs)
        res["memory"] = await asyncio.to_thread(bench_memory, etcd)
    finally:
        await d.close()
    return res


def etcd_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.split("\n")[0].removeprefix("etcd Version: ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--keys", type=int, default=20_000, help="blocks per registration run")
    ap.add_argument("--entries", type=int, default=200_000, help="mirror size for 2 and 4")
    ap.add_argument("--samples", type=int, default=300, help="propagation samples per run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="bench-directory-") as tmp,
        EtcdProcess(Path(tmp) / "etcd") as etcd,
    ):
        res = asyncio.run(run_all(etcd, args, Path(tmp)))
        res["etcd_version"] = etcd_version(etcd.binary)
        res["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        report(res)


if __name__ == "__main__":
    main()
