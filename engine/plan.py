"""``kvstore plan``: what hit rate and TTFT a KV pool of a given size buys.

An operator sizing DRAM and SSD for a prefill fleet wants one answer: how much
prefill does this much cache save on *our* traffic, and is pooling the caches
worth it. The command replays a Mooncake-format trace (engine/trace.py) through
the real scheduler and eviction policies (engine/sim.py) with per-node caches,
one pooled cache, or both, and prints a table (or ``--json``) and optionally a
plot of hit rate against capacity, per-node vs pooled.

Capacities are per node, in tokens unless marked as blocks (see
:func:`parse_capacity`): a KV block's bytes depend on the model, its token count
does not, and the trace counts tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.scheduler import DEFAULT_COST, SCHEDULERS, CostModel, PrefillModel
from engine.sim import SimConfig, SimResult, prefix_reuse_bound, replay
from engine.trace import BLOCK_TOKENS, TraceRequest, load_trace
from kvstore.errors import ConfigError, KVStoreError, StorageError
from kvstore.policy import POLICIES

__all__ = ["add_parser", "parse_capacity", "run"]

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
SWEEP_FACTORS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0)
"""Capacities plotted, as multiples of the planned DRAM per node."""


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
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", type=Path, metavar="OUT.png", help="write hit rate vs capacity")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
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
    p.set_defaults(func=run)


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


def _sweep_blocks(requests: Sequence[TraceRequest], cfg: SimConfig) -> list[int]:
    """DRAM capacities (blocks per node) to plot around the planned one."""
    base = cfg.dram_blocks
    if base is None:  # unlimited: sweep up to the trace's whole footprint per node
        unique = len({h for r in requests for h in r.hash_ids})
        base = max(1, math.ceil(unique / cfg.nodes / 4))
    return sorted({max(1, round(base * f)) for f in SWEEP_FACTORS})


def _jobs(
    requests: Sequence[TraceRequest], args: argparse.Namespace, base: SimConfig
) -> list[SimConfig]:
    modes = ["per-node", "pooled"] if args.mode == "both" else [args.mode]
    jobs = [replace(base, pooled=m == "pooled") for m in modes]
    if args.plot is not None:
        for blocks in _sweep_blocks(requests, base):
            jobs += [replace(j, dram_blocks=blocks) for j in jobs[: len(modes)]]
    return list(dict.fromkeys(jobs))  # the planned capacity may also be a sweep point


def _run_all(
    requests: Sequence[TraceRequest], jobs: Sequence[SimConfig], cost: CostModel
) -> dict[SimConfig, SimResult]:
    """Replay every job behind one progress bar (on stderr, only on a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    total = len(jobs) * len(requests)
    out: dict[SimConfig, SimResult] = {}
    with Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
        TimeRemainingColumn(), console=console, disable=not console.is_terminal,
    ) as bar:  # fmt: skip
        task = bar.add_task("replaying", total=total)
        for i, cfg in enumerate(jobs):
            done = i * len(requests)
            bar.update(task, description=f"{cfg.mode} {_fmt_blocks(cfg.dram_blocks)} DRAM")
            out[cfg] = replay(requests, cfg, cost, progress=_ticker(bar, task, done))
    return out


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
        results = _run_all(requests, jobs, cost)
        report = _report(args, requests, base, results)
        if args.plot is not None:
            _plot(args.plot, report, base)
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
    main = {
        cfg.mode: res.to_dict()
        for cfg, res in results.items()
        if cfg.dram_blocks == base.dram_blocks
    }
    ratio = None
    if "pooled" in main and "per-node" in main and main["per-node"]["hit_rate"] > 0:
        ratio = main["pooled"]["hit_rate"] / main["per-node"]["hit_rate"]
    sweep = [
        {"mode": cfg.mode, "dram_blocks": cfg.dram_blocks, "hit_rate": res.hit_rate}
        for cfg, res in sorted(results.items(), key=lambda kv: (kv[0].mode, kv[0].dram_blocks or 0))
    ]
    return {
        "trace": str(args.trace),
        "requests": len(requests),
        "block_tokens": base.block_tokens,
        "nodes": base.nodes,
        "dram_blocks_per_node": base.dram_blocks,
        "ssd_blocks_per_node": base.ssd_blocks,
        "policy": base.policy,
        "scheduler": base.scheduler,
        "prefix_reuse_bound": prefix_reuse_bound(requests, base.block_tokens),
        "results": main,
        "pooled_over_per_node": ratio,
        "sweep": sweep if args.plot is not None else [],
        "plot": None if args.plot is None else str(args.plot),
    }


def _fmt_blocks(blocks: int | None, block_tokens: int = BLOCK_TOKENS) -> str:
    if blocks is None:
        return "unlimited"
    return f"{_si(blocks * block_tokens)} tok ({blocks:,} blocks)"


def _si(x: float, unit: str = "") -> str:
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}{unit}"
    return f"{x:.3g}{unit}"


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


def _plot(path: Path, report: dict[str, Any], base: SimConfig) -> None:
    """Hit rate against DRAM per node, one line per mode, the bound and the plan marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bt = report["block_tokens"]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for mode, style in (("per-node", "o-"), ("pooled", "s-")):
        pts = [p for p in report["sweep"] if p["mode"] == mode]
        if pts:
            xs = [p["dram_blocks"] * bt for p in pts]
            ax.plot(xs, [100 * p["hit_rate"] for p in pts], style, label=f"{mode} caches")
    ax.axhline(100 * report["prefix_reuse_bound"], ls="--", c="grey", label="unlimited (bound)")
    if base.dram_blocks is not None:
        ax.axvline(base.dram_blocks * bt, ls=":", c="black", label="planned DRAM")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda x, _: _si(x)))
    ax.set_xlabel("DRAM per node (tokens, log scale)")
    ax.set_ylabel("token-weighted prefix hit rate (%)")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"{Path(report['trace']).name}: {report['nodes']} nodes, {report['policy']}, "
        f"{report['scheduler']}",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    _atomic_savefig(fig, path)
    plt.close(fig)


def _atomic_savefig(fig: Any, path: Path) -> None:
    """Write to a temp file beside ``path``, fsync, rename: never a half-written PNG."""
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            fig.savefig(fh, format="png")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise StorageError(f"cannot write the plot to {path}: {exc}") from exc
