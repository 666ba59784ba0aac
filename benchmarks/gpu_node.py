"""Node-level GPU copies against the hardware's own copies, in the same run (issue 31,
item 3 and the "Show" table's HBM and DRAM rows).

For each block size (1, 4 and 16 MiB by default), medians of ``repeats`` rounds of
``blocks`` blocks each, every operation followed by a device synchronization (the
block is ready when the call's time ends), beside its anchor timed the same way:

========================================== =================================== ======
ours (a StoreNode, in process)             anchor                              target
========================================== =================================== ======
HBM tier get_into a CUDA tensor            a D2D copy (``Tensor.copy_``)       >= 0.8
HBM tier put from a CUDA tensor            a D2D copy                          >= 0.5
DRAM tier put from a CUDA tensor           a pinned D2H copy                   >= 0.5
DRAM tier get_into a CUDA tensor           a pinned H2D copy                   (0.58-0.84 before)
========================================== =================================== ======

Each measure also has a *batch* row: the round's blocks in one ``batch_put`` /
``batch_get_into`` call (one submission of copies, one wait, kvstore/node/batches.py),
synchronized once per round, against the same anchor timed per block.

The DRAM tier's slab is registered with CUDA (the row says when registration failed
and the pinned-staging fallback was measured instead). An HBM put's checksum is taken
off the critical path by the tier's background hasher; the rounds pause for it
between puts' rounds (``StoreNode.settle_checksums``), outside the timing.

Functions for benchmarks/bench_gpu.py: :func:`hbm_rows`, :func:`dram_rows` (lists of
:class:`Row`), :func:`format_rows`. Without CUDA they return no rows and
:func:`main` says it skipped; ``--smoke-cpu`` runs every code path on the host
(HBM tier on ``hbm_device="cpu"``, anchors as host copies) with small blocks, to catch
errors before a GPU session: its figures are not GPU figures and are not for RESULTS.

Usage: python benchmarks/gpu_node.py [--sizes-mib 1,4,16] [--blocks 16] [--repeats 5]
       [--json] [--smoke-cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvstore.config import NodeConfig
from kvstore.node.store import StoreNode

__all__ = ["Row", "dram_rows", "format_rows", "hbm_rows", "main"]

MiB = 1 << 20


@dataclass(frozen=True)
class Row:
    """One measure at one block size: ours and its anchor in GB/s, and their ratio."""

    measure: str
    anchor: str
    block_mib: float
    ours_gbps: float
    anchor_gbps: float
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.ours_gbps / self.anchor_gbps if self.anchor_gbps else 0.0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _gbps(nbytes: int, op: Callable[[int], Any], n: int, device: str, repeats: int) -> float:
    """Median GB/s of ``repeats`` rounds of ``op(i)`` for i < n, each op synchronized,
    after one untimed round (first touches and lazy set-up are not the steady state)."""
    for i in range(n):
        op(i)
    _sync(device)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(n):
            op(i)
            _sync(device)
        rates.append(n * nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def _blocks(n: int, nbytes: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(nbytes)
    return [
        torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=g)
        for _ in range(n)
    ]


def _keys(tag: int, n: int) -> list[bytes]:
    return [tag.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(n)]


def _device(smoke_cpu: bool) -> str | None:
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if smoke_cpu else None


def _per_size(
    measure: Callable[[float, int, int, str], list[Row]],
    sizes_mib: Sequence[float],
    blocks: int,
    repeats: int,
    smoke_cpu: bool,
) -> list[Row]:
    """``measure``'s rows for each block size; none without CUDA (unless a smoke run)."""
    device = _device(smoke_cpu)
    if device is None:
        return []
    return [row for mib in sizes_mib for row in measure(mib, blocks, repeats, device)]


def hbm_rows(
    sizes_mib: Sequence[float] = (1, 4, 16),
    blocks: int = 16,
    repeats: int = 5,
    *,
    smoke_cpu: bool = False,
) -> list[Row]:
    """HBM tier get_into and put against a D2D copy, per block size."""
    return _per_size(_hbm_size, sizes_mib, blocks, repeats, smoke_cpu)


def _hbm_size(mib: float, blocks: int, repeats: int, device: str) -> list[Row]:
    nbytes = int(mib * MiB)
    cap = 2 * blocks * (nbytes + 4096) + MiB
    cfg = NodeConfig(hbm_bytes=cap, hbm_device=device, dram_bytes=MiB, shm_name="")
    with StoreNode(cfg) as node:
        src = _blocks(blocks, nbytes, device)
        outs = [torch.empty_like(s) for s in src]
        keys = _keys(1, blocks)
        for k, s in zip(keys, src, strict=True):
            node.put(k, s)
        ours = _gbps(nbytes, lambda i: node.get_into(keys[i], outs[i]), blocks, device, repeats)
        batch_get = median_gbps(
            nbytes * blocks, lambda: node.batch_get_into(keys, outs), device, repeats
        )
        d2d = _gbps(nbytes, lambda i: outs[i].copy_(src[i]), blocks, device, repeats)
        rates, batch_rates = [], []
        for r in range(repeats):  # puts of fresh keys; the hasher catches up between rounds
            fresh = _keys(100 + r, blocks)
            node.settle_checksums(30.0)
            rates.append(_round(nbytes, fresh, src, node.put, device))
            node.remove(fresh)
            node.settle_checksums(30.0)
            batch_rates.append(_batch_round(nbytes, fresh, src, node.batch_put, device))
            node.remove(fresh)
    return [
        Row("HBM get_into", "D2D copy", mib, ours, d2d),
        Row("HBM batch_get_into", "D2D copy", mib, batch_get, d2d),
        Row("HBM put", "D2D copy", mib, statistics.median(rates), d2d),
        Row("HBM batch_put", "D2D copy", mib, statistics.median(batch_rates), d2d),
    ]


def _round(
    nbytes: int, keys: list[bytes], src: list[torch.Tensor], put: Callable[..., Any], device: str
) -> float:
    """GB/s of one round of puts, each synchronized."""
    t0 = time.perf_counter()
    for k, s in zip(keys, src, strict=True):
        put(k, s)
        _sync(device)
    return len(keys) * nbytes / (time.perf_counter() - t0) / 1e9


def _batch_round(
    nbytes: int,
    keys: list[bytes],
    src: list[torch.Tensor],
    batch_put: Callable[..., Any],
    device: str,
) -> float:
    """GB/s of one round of puts as one batch_put, synchronized once."""
    t0 = time.perf_counter()
    got = batch_put(keys, src)
    _sync(device)
    rate = len(keys) * nbytes / (time.perf_counter() - t0) / 1e9
    if got != [True] * len(keys):
        raise RuntimeError(f"batch_put: {got}")
    return rate


def median_gbps(total: int, op: Callable[[], Any], device: str, repeats: int) -> float:
    """Median GB/s of ``repeats`` calls of ``op`` moving ``total`` bytes each, each
    synchronized once, after one untimed call."""
    op()
    _sync(device)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        op()
        _sync(device)
        rates.append(total / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def dram_rows(
    sizes_mib: Sequence[float] = (1, 4, 16),
    blocks: int = 16,
    repeats: int = 5,
    *,
    smoke_cpu: bool = False,
) -> list[Row]:
    """DRAM tier put from and get_into a CUDA tensor against pinned D2H / H2D copies."""
    return _per_size(_dram_size, sizes_mib, blocks, repeats, smoke_cpu)


def _dram_size(mib: float, blocks: int, repeats: int, device: str) -> list[Row]:
    nbytes = int(mib * MiB)
    cap = (2 * repeats + 2) * blocks * (nbytes + 4096) + MiB
    with StoreNode(NodeConfig(dram_bytes=cap, shm_name="")) as node:
        registered = node._tiers[0].registered  # the tier's own flag, for the row's note
        note = "" if registered or device == "cpu" else "unregistered: pinned staging"
        src = _blocks(blocks, nbytes, device)
        outs = [torch.empty_like(s) for s in src]
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device != "cpu")
        rounds = [
            _round(nbytes, _keys(200 + r, blocks), src, node.put, device) for r in range(repeats)
        ]
        batch_rounds = [
            _batch_round(nbytes, _keys(300 + r, blocks), src, node.batch_put, device)
            for r in range(repeats)
        ]
        d2h = _gbps(
            nbytes, lambda i: pinned.copy_(src[i], non_blocking=True), blocks, device, repeats
        )
        keys = _keys(200, blocks)
        ours = _gbps(nbytes, lambda i: node.get_into(keys[i], outs[i]), blocks, device, repeats)
        batch_get = median_gbps(
            nbytes * blocks, lambda: node.batch_get_into(keys, outs), device, repeats
        )
        h2d = _gbps(
            nbytes, lambda i: outs[i].copy_(pinned, non_blocking=True), blocks, device, repeats
        )
    return [
        Row("DRAM put from CUDA", "pinned D2H", mib, statistics.median(rounds), d2h, note),
        Row(
            "DRAM batch_put from CUDA",
            "pinned D2H",
            mib,
            statistics.median(batch_rounds),
            d2h,
            note,
        ),
        Row("DRAM get_into CUDA", "pinned H2D", mib, ours, h2d, note),
        Row("DRAM batch_get_into CUDA", "pinned H2D", mib, batch_get, h2d, note),
    ]


def format_rows(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table: measure, block, ours, anchor, ratio."""
    out = [
        "| measure | block | ours GB/s | anchor | anchor GB/s | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        note = f" ({r.note})" if r.note else ""
        out.append(
            f"| {r.measure}{note} | {r.block_mib:g} MiB | {r.ours_gbps:.1f} | {r.anchor} | "
            f"{r.anchor_gbps:.1f} | {r.ratio:.2f} |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", default="1,4,16", help="block sizes, MiB, comma-separated")
    ap.add_argument("--blocks", type=int, default=16, help="blocks per round")
    ap.add_argument("--repeats", type=int, default=5, help="rounds; the median is reported")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    ap.add_argument("--smoke-cpu", action="store_true", help="run the code paths on the host")
    args = ap.parse_args(argv)
    sizes = [float(s) for s in args.sizes_mib.split(",") if s]
    if _device(args.smoke_cpu) is None:
        print("gpu_node: skipped, torch sees no CUDA device")
        return 0
    kw = {"blocks": args.blocks, "repeats": args.repeats, "smoke_cpu": args.smoke_cpu}
    rows = hbm_rows(sizes, **kw) + dram_rows(sizes, **kw)
    if args.json:
        for r in rows:
            print(json.dumps({**asdict(r), "ratio": r.ratio}))
    else:
        print(format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
