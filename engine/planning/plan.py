"""``kvstore plan``: what hit rate and TTFT a KV pool of a given size buys.

An operator sizing DRAM and SSD for a prefill fleet wants one answer: how much
prefill does this much cache save on *our* traffic, and is pooling the caches
worth it. The command replays a Mooncake-format trace (engine/planning/trace.py) through
the real scheduler and eviction policies (engine/planning/sim.py) with per-node caches,
one pooled cache, or both, and prints a table (or ``--json``) and optionally a
plot of hit rate against capacity, per-node vs pooled.

The plot sweeps the whole per-node capacity (DRAM and SSD scaled together at the
planned DRAM:SSD ratio) in steps of 2x, from a size where the pool holds about a
32nd of the trace's footprint to past both the plan and the footprint, and shows
how much of each hit rate DRAM serves. The sweep's replays run in parallel, one
per CPU (``--workers``).

Capacities are per node, in tokens unless marked as blocks (see
:func:`parse_capacity`): a KV block's bytes depend on the model, its token count
does not, and the trace counts tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import re
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.planning.plot import plot_sweep as _plot
from engine.planning.plot import si as _si
from engine.planning.scheduler import DEFAULT_COST, SCHEDULERS, CostModel, PrefillModel
from engine.planning.sim import SimConfig, SimResult, prefix_reuse_bound, replay
from engine.planning.trace import BLOCK_TOKENS, TraceRequest, load_trace
from kvstore.errors import ConfigError, KVStoreError
from kvstore.tiers.policy import POLICIES

__all__ = ["add_parser", "parse_capacity", "run", "sweep_capacities"]

EXAMPLES = """\
examples:
  kvstore plan --trace conversation_trace.jsonl --nodes 10 --dram 3M --policy lru
  kvstore plan --trace conversation_trace.jsonl --nodes 10 --dram 3M --ssd 12M \\
      --policy s3fifo --both --plot plan.png --json > plan.json

capacity units (per node): tokens by default; k, M, G are decimal (3M = 3,000,000
tokens); append 'blocks' for 512-token blocks (6k blocks = 3,072,000 tokens).
Tokens round down to whole blocks. --ssd 0 means no SSD tier; 'unlimited' means
no limit. Bytes are not accepted: a block's size in bytes depends on the model.
"""

_CAPACITY = re.compile(
    r"^\s*(?P<num>\d+(?:\.\d+)?)\s*(?P<mult>[kmg]?)\s*(?P<unit>tokens?|tok|t|blocks?|blk|b)?\s*$",
    re.IGNORECASE,
)
_MULT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
SATURATED = 0.95
"""Node utilization above which the table warns that queues grow without bound."""
SWEEP_MAX_POINTS = 8
"""About how many capacities the plot sweeps (steps widen past 2x to stay near this)."""
PARALLEL_MIN_WORK = 50_000
"""Request-replays below which the default is to replay serially (workers cost ~0.1 s)."""


def parse_capacity(text: str, block_tokens: int = BLOCK_TOKENS) -> int | None:
    """Parse a per-node capacity into whole blocks; None for unlimited.

    ``"3M"`` / ``"3M tokens"`` -> 5859 blocks (3,000,000 // 512); ``"6k blocks"`` ->
    6000; ``"0"`` -> 0; ``"unlimited"`` / ``"inf"`` -> None. Strict on purpose: a
    typo in a capacity silently planning the wrong cluster is worse than an error.
    """
    if text.strip().lower() in ("unlimited", "inf", "infinite", "none"):
        return None
    m = _CAPACITY.match(text)
    if not m:
        raise ConfigError(
            f"bad capacity {text!r}: use tokens like 3M or 3000000, or blocks like 6k blocks"
        )
    value = float(m["num"]) * _MULT[m["mult"].lower()]
    if (m["unit"] or "t").lower().startswith("b"):
        if value != int(value):
            raise ConfigError(f"bad capacity {text!r}: blocks must be a whole number")
        return int(value)
    blocks = int(value) // block_tokens
    if value > 0 and blocks == 0:
        raise ConfigError(f"capacity {text!r} is less than one {block_tokens}-token block")
    return blocks


def _capacity_arg(text: str) -> int | None:
    try:
        return parse_capacity(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the ``plan`` subcommand; its handler is ``args.func`` (:func:`run`)."""
    p = subparsers.add_parser(
        "plan",
        help="replay a trace to size the KV cache (hit rate, TTFT; per-node vs pooled)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", required=True, type=Path, help="Mooncake-format JSONL trace")
    _add_cluster_arguments(p)
    _add_replay_arguments(p)
    p.set_defaults(func=run)


def _add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """The cluster the trace is replayed on: nodes, tiers, eviction, caches, scheduler."""
    p.add_argument("--nodes", type=int, default=10, help="prefill nodes (default 10)")
    p.add_argument(
        "--dram",
        type=_capacity_arg,
        default=parse_capacity("3M"),
        metavar="CAP",
        help="DRAM per node (default 3M tokens)",
    )
    p.add_argument(
        "--ssd", type=_capacity_arg, default=0, metavar="CAP", help="SSD per node (default 0: none)"
    )
    p.add_argument("--policy", default="lru", choices=sorted(POLICIES), help="eviction policy")
    mode = p.add_mutually_exclusive_group()
    for flag, value in (("--pooled", "pooled"), ("--per-node", "per-node"), ("--both", "both")):
        note = " (default)" if value == "both" else ""
        mode.add_argument(
            flag,
            dest="mode",
            action="store_const",
            const=value,
            help=f"replay {value} caches{note}",
        )
    p.set_defaults(mode="both")
    p.add_argument("--scheduler", default="cache_aware", choices=sorted(SCHEDULERS))


def _add_replay_arguments(p: argparse.ArgumentParser) -> None:
    """How the replay runs and reports: output, slice, workers, SLO, time and cost model."""
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--plot",
        type=Path,
        metavar="OUT.png",
        help="write hit rate vs capacity (DRAM + SSD scaled together)",
    )
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="replays to run at once (default: one per CPU when there is much to replay)",
    )
    p.add_argument("--slo-ms", type=float, help="TTFT SLO: refuse requests no node can meet")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply arrival times (0.5 = twice the request rate)",
    )
    p.add_argument(
        "--prefill-model",
        type=Path,
        metavar="JSON",
        help="fitted prefill coefficients (default: built-in CPU reference)",
    )
    p.add_argument("--kv-bytes-per-token", type=int, help="KV bytes per token for bytes moved")


def _cost(args: argparse.Namespace) -> CostModel:
    cost = DEFAULT_COST
    if args.prefill_model is not None:
        cost = replace(cost, prefill=PrefillModel.from_json(args.prefill_model))
    if args.kv_bytes_per_token is not None:
        if args.kv_bytes_per_token <= 0:
            raise ConfigError("--kv-bytes-per-token must be positive")
        cost = replace(cost, kv_bytes_per_token=args.kv_bytes_per_token)
    return cost


def _base_config(args: argparse.Namespace) -> SimConfig:
    if args.dram == 0:
        raise ConfigError("--dram must be at least one block (writes land in DRAM)")
    return SimConfig(
        nodes=args.nodes,
        dram_blocks=args.dram,
        ssd_blocks=args.ssd,
        policy=args.policy,
        scheduler=args.scheduler,
        slo_s=None if args.slo_ms is None else args.slo_ms / 1e3,
        time_scale=args.time_scale,
    )


def _footprint_per_node(requests: Sequence[TraceRequest], nodes: int) -> int:
    """Blocks per node that hold every distinct block of the trace, split evenly."""
    unique = len({h for r in requests for h in r.hash_ids})
    return max(1, math.ceil(unique / nodes))


def sweep_capacities(
    requests: Sequence[TraceRequest], cfg: SimConfig
) -> list[tuple[int, int | None]]:
    """(DRAM, SSD) blocks per node that the plot sweeps, smallest first.

    DRAM and SSD scale together by powers of 2, keeping the planned DRAM:SSD ratio,
    so the x axis is the whole per-node capacity; the planned capacity itself is a
    point. The sweep reaches down to about a 32nd of the trace's footprint per node
    (or a quarter of the plan, whichever is smaller) and up to at least the footprint
    per node (or twice the plan, whichever is larger), where a pooled cache holds
    everything. Steps widen past 2x to keep about SWEEP_MAX_POINTS points.
    With unlimited SSD only DRAM scales (SSD stays unlimited); with unlimited DRAM
    the planned point is off the axis and the sweep is DRAM only around the footprint.
    """
    footprint = _footprint_per_node(requests, cfg.nodes)
    dram, ssd = (footprint, 0) if cfg.dram_blocks is None else (cfg.dram_blocks, cfg.ssd_blocks)
    planned = dram + (ssd or 0)
    lo = min(planned / 4, footprint / 32)
    hi = max(planned * 2, footprint)
    k_lo = math.ceil(math.log2(lo / planned) - 1e-9)  # <= -2
    k_hi = math.ceil(math.log2(hi / planned) - 1e-9)  # >= 1; the last point reaches hi
    step = max(1, math.ceil((k_hi - k_lo + 1) / SWEEP_MAX_POINTS))
    ks = sorted({*range(0, k_lo - step, -step), *range(0, k_hi + step, step)})  # cover both
    points: dict[tuple[int, int | None], None] = {}
    for k in ks:
        f = 2.0**k
        d = max(1, round(dram * f))
        s = ssd if not ssd else max(1, round(ssd * f))  # 0 (no tier) and None stay as they are
        points[(d, s)] = None
    return list(points)


def sweep_tokens(dram: int | None, ssd: int | None, block_tokens: int = BLOCK_TOKENS) -> int | None:
    """The plot's x value: DRAM + SSD tokens per node (DRAM alone when SSD is unlimited)."""
    if dram is None:
        return None
    return (dram + (ssd or 0)) * block_tokens


def _jobs(
    requests: Sequence[TraceRequest], args: argparse.Namespace, base: SimConfig
) -> list[SimConfig]:
    modes = ["per-node", "pooled"] if args.mode == "both" else [args.mode]
    planned = [replace(base, pooled=m == "pooled") for m in modes]
    jobs = list(planned)
    if args.plot is not None:
        for dram, ssd in sweep_capacities(requests, base):
            jobs += [replace(j, dram_blocks=dram, ssd_blocks=ssd) for j in planned]
    return list(dict.fromkeys(jobs))  # the planned capacity is also a sweep point


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _workers(args: argparse.Namespace, jobs: int, requests: int) -> int:
    """Replays to run at once: ``--workers``, else one per CPU for sizeable work."""
    if args.workers is not None:
        if args.workers < 1:
            raise ConfigError(f"--workers must be at least 1, got {args.workers}")
        return min(args.workers, jobs)
    if jobs * requests < PARALLEL_MIN_WORK:
        return 1
    return max(1, min(_cpus(), jobs))


def _run_all(
    requests: Sequence[TraceRequest],
    jobs: Sequence[SimConfig],
    cost: CostModel,
    workers: int = 1,
) -> dict[SimConfig, SimResult]:
    """Replay every job behind one progress bar (on stderr, only on a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    total = len(jobs) * len(requests)

    def progress() -> Progress:
        return Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
            TimeRemainingColumn(), console=console, disable=not console.is_terminal,
        )  # fmt: skip

    if workers <= 1:
        out: dict[SimConfig, SimResult] = {}
        with progress() as bar:
            task = bar.add_task("replaying", total=total)
            for i, cfg in enumerate(jobs):
                done = i * len(requests)
                bar.update(task, description=f"{i + 1}/{len(jobs)} {_job_name(cfg)}")
                out[cfg] = replay(requests, cfg, cost, progress=_ticker(bar, task, done))
        return out
    return _run_parallel(requests, jobs, cost, workers, progress)


def _job_name(cfg: SimConfig) -> str:
    cap = f"{_fmt_blocks(cfg.dram_blocks)} DRAM"
    if cfg.ssd_blocks != 0:
        cap += f" + {_fmt_blocks(cfg.ssd_blocks)} SSD"
    return f"{cfg.mode}, {cap}"


_WORKER: dict[str, Any] = {}
"""A worker process's trace, cost model and progress queue (set by _worker_init)."""


def _worker_init(requests: Sequence[TraceRequest], cost: CostModel, queue: Any) -> None:
    queue.cancel_join_thread()  # unread ticks must never keep a finished worker alive
    _WORKER.update(requests=requests, cost=cost, queue=queue)


def _worker_replay(index: int, cfg: SimConfig) -> SimResult:
    queue = _WORKER["queue"]
    return replay(
        _WORKER["requests"], cfg, _WORKER["cost"], progress=lambda n: queue.put((index, n))
    )


def _run_parallel(
    requests: Sequence[TraceRequest],
    jobs: Sequence[SimConfig],
    cost: CostModel,
    workers: int,
    progress: Callable[[], Any],
) -> dict[SimConfig, SimResult]:
    """Replays in ``workers`` processes; each reports its progress on a queue.

    Every job is submitted before the progress bar (and its refresh thread) starts,
    so a fork start method forks a single-threaded process. Results do not depend on
    the order the replays finish in: each replay is deterministic and independent.
    """
    ctx = multiprocessing.get_context()
    ticks = ctx.Queue()
    with ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_worker_init, initargs=(requests, cost, ticks)
    ) as pool:
        futures: dict[Future[SimResult], int] = {
            pool.submit(_worker_replay, i, cfg): i for i, cfg in enumerate(jobs)
        }
        try:
            _watch(futures, ticks, len(requests), workers, progress)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        results = {jobs[i]: f.result() for f, i in futures.items()}
    ticks.close()
    return {cfg: results[cfg] for cfg in jobs}


def _watch(
    futures: dict[Future[SimResult], int],
    ticks: Any,
    n_requests: int,
    workers: int,
    progress: Callable[[], Any],
) -> None:
    """Drive the progress bar until every replay is done; re-raise the first failure."""
    import queue as queue_mod

    jobs = len(futures)
    done = [0] * jobs  # requests replayed, per job
    pending = set(futures)
    with progress() as bar:
        task = bar.add_task(f"{jobs} replays on {workers} cores", total=jobs * n_requests)
        while pending:
            finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            try:
                while True:
                    i, n = ticks.get_nowait()
                    done[i] = max(done[i], n)
            except queue_mod.Empty:
                pass
            for f in finished:
                f.result()  # a failed replay fails the plan now, not at the end
                done[futures[f]] = n_requests
            left = jobs - sum(n == n_requests for n in done)
            bar.update(task, completed=sum(done), description=f"{jobs} replays, {left} left")


def _ticker(bar: Any, task: Any, done: int) -> Callable[[int], None]:
    def tick(n: int) -> None:
        bar.update(task, completed=done + n)

    return tick


def run(args: argparse.Namespace) -> int:
    """Handler of ``kvstore plan``; returns the process exit code (2 on bad input)."""
    try:
        if args.limit is not None and args.limit < 1:
            raise ConfigError(f"--limit must be at least 1, got {args.limit}")
        requests = load_trace(args.trace, limit=args.limit)
        cost = _cost(args)
        base = _base_config(args)
        jobs = _jobs(requests, args, base)
        results = _run_all(requests, jobs, cost, _workers(args, len(jobs), len(requests)))
        report = _report(args, requests, base, results)
        if args.plot is not None:
            _plot(args.plot, report)
    except KVStoreError as exc:
        print(f"kvstore plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_table(report)
    return 0


def _report(
    args: argparse.Namespace,
    requests: Sequence[TraceRequest],
    base: SimConfig,
    results: dict[SimConfig, SimResult],
) -> dict[str, Any]:
    """Everything the table, the JSON and the plot show, as plain data."""
    planned = {replace(base, pooled=False), replace(base, pooled=True)}
    main = {cfg.mode: res.to_dict() for cfg, res in results.items() if cfg in planned}
    ratio = None
    if "pooled" in main and "per-node" in main and main["per-node"]["hit_rate"] > 0:
        ratio = main["pooled"]["hit_rate"] / main["per-node"]["hit_rate"]
    swept = set(sweep_capacities(requests, base)) if args.plot is not None else set()
    sweep = [
        {
            "mode": cfg.mode,
            "dram_blocks": cfg.dram_blocks,
            "ssd_blocks": cfg.ssd_blocks,
            "tokens_per_node": sweep_tokens(cfg.dram_blocks, cfg.ssd_blocks, cfg.block_tokens),
            "planned": cfg in planned,
            "hit_rate": res.hit_rate,
            "dram_hit_rate": res.dram_hit_rate,
            "ssd_hit_rate": res.ssd_hit_rate,
            "ttft_p50_s": res.ttft_p50_s,
        }
        for cfg, res in results.items()
        if (cfg.dram_blocks, cfg.ssd_blocks) in swept
    ]
    sweep.sort(key=lambda p: (p["mode"], p["tokens_per_node"]))
    return {
        "trace": str(args.trace),
        "requests": len(requests),
        "block_tokens": base.block_tokens,
        "nodes": base.nodes,
        "dram_blocks_per_node": base.dram_blocks,
        "ssd_blocks_per_node": base.ssd_blocks,
        "policy": base.policy,
        "scheduler": base.scheduler,
        "time_scale": base.time_scale,
        "footprint_blocks_per_node": _footprint_per_node(requests, base.nodes),
        "prefix_reuse_bound": prefix_reuse_bound(requests, base.block_tokens),
        "results": main,
        "pooled_over_per_node": ratio,
        "sweep_axis": "dram" if base.ssd_blocks is None else "dram+ssd",
        "sweep": sweep,
        "plot": None if args.plot is None else str(args.plot),
    }


def _fmt_blocks(blocks: int | None, block_tokens: int = BLOCK_TOKENS) -> str:
    if blocks is None:
        return "unlimited"
    return f"{_si(blocks * block_tokens)} tok ({blocks:,} blocks)"


def _pct(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda r: f"{r[key]:.1%}"


def _pair(a: str, b: str, fmt: Callable[[float], str]) -> Callable[[dict[str, Any]], str]:
    return lambda r: f"{fmt(r[a])} / {fmt(r[b])}"


def _secs(x: float) -> str:
    return f"{x:.2f} s"


def _bytes(x: float) -> str:
    return _si(x, "B")


_ROWS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("hit rate (token-weighted)", _pct("hit_rate")),
    ("  from DRAM", _pct("dram_hit_rate")),
    ("  from SSD", _pct("ssd_hit_rate")),
    ("  from a remote node", _pct("remote_hit_rate")),
    ("reused (pulled, not recomputed)", _pct("reuse_rate")),
    ("TTFT p50 / p99", _pair("ttft_p50_s", "ttft_p99_s", _secs)),
    ("queueing mean / p99", _pair("queue_mean_s", "queue_p99_s", _secs)),
    ("node utilization min-max", lambda r: _span(r["node_utilization"], "{:.0%}")),
    ("requests per node min-max", lambda r: _span(r["node_requests"], "{:,}")),
    ("busiest node share", _pct("busiest_share")),
    ("hot-spot placements", _pct("hotspot_rate")),
    ("bytes pulled / written", _pair("bytes_pulled", "bytes_written", _bytes)),
    ("bytes demoted / promoted", _pair("bytes_demoted", "bytes_promoted", _bytes)),
    ("refused (SLO)", lambda r: f"{r['refused']:,}"),
    ("replay time", lambda r: f"{r['wall_s']:.1f} s"),
)


def _span(values: Sequence[float], fmt: str) -> str:
    return f"{fmt.format(min(values))} - {fmt.format(max(values))}"


def _print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    bt = report["block_tokens"]
    title = (
        f"{report['trace']}: {report['requests']:,} requests, {report['nodes']} prefill nodes, "
        f"DRAM {_fmt_blocks(report['dram_blocks_per_node'], bt)} + "
        f"SSD {_fmt_blocks(report['ssd_blocks_per_node'], bt)} per node, "
        f"{report['policy']}, {report['scheduler']}"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("")
    modes = list(report["results"])
    for mode in modes:
        table.add_column(mode, justify="right")
    for label, cell in _ROWS:
        table.add_row(label, *(cell(report["results"][m]) for m in modes))
    console = Console()
    console.print(table)
    console.print(f"prefix-reuse bound (unlimited cache): {report['prefix_reuse_bound']:.1%}")
    if report["pooled_over_per_node"] is not None:
        console.print(f"pooled / per-node hit rate: {report['pooled_over_per_node']:.2f}x")
    hot = [m for m in modes if max(report["results"][m]["node_utilization"]) >= SATURATED]
    if hot:
        console.print(
            f"[yellow]warning:[/] prefill nodes saturated ({', '.join(hot)}: a node is busy "
            f">= {SATURATED:.0%} of the time), so TTFT grows with the trace's length. Add "
            "nodes, slow the arrivals (--time-scale), or pass your model's --prefill-model."
        )
    for mode in modes:
        if report["results"][mode]["first_refusal"]:
            console.print(f"{mode}: first refusal: {report['results'][mode]['first_refusal']}")
    if report["plot"]:
        console.print(f"plot written to {report['plot']}")
