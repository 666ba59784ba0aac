"""The ``kvstore`` console script.

Each subcommand lives in the module that owns its work and registers itself here
through ``add_parser(subparsers)``; this file only routes, renders errors as one
line plus a hint, and sets exit codes. Every command takes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from kvstore.errors import KVStoreError

__all__ = ["build_parser", "main"]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _demo_tables(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    node = report["node"]
    t = Table(title="where the blocks landed")
    for col in ("tier", "blocks", "used", "capacity", "fill"):
        t.add_column(col, justify="right" if col != "tier" else "left")
    for name, tier in node["tiers"].items():
        fill = tier["used"] / tier["capacity"] if tier["capacity"] else 0.0
        t.add_row(
            name,
            str(tier["blocks"]),
            _fmt_bytes(tier["used"]),
            _fmt_bytes(tier["capacity"]),
            f"{fill:.0%}",
        )
    console.print(t)
    c = node["counters"]
    s = Table(title="what happened")
    s.add_column("counter")
    s.add_column("value", justify="right")
    rows = [
        ("requests", report["requests"]),
        ("prompt blocks", report["prompt_blocks"]),
        ("prefix hits (blocks)", f"{report['hit_blocks']} ({report['block_hit_rate']:.1%})"),
        ("blocks written", report["written_blocks"]),
        ("blocks read back and verified", report["verified_blocks"]),
        ("hits from DRAM / SSD", f"{c.get('hits_dram', 0)} / {c.get('hits_ssd', 0)}"),
        ("demotions DRAM->SSD", c.get("demotions_dram", 0)),
        ("promotions SSD->DRAM", c.get("promotions", 0)),
        ("evicted from SSD", c.get("evictions_ssd", 0)),
        (
            "bytes in / out",
            f"{_fmt_bytes(c.get('bytes_in', 0))} / {_fmt_bytes(c.get('bytes_out', 0))}",
        ),
        ("wall time", f"{report['seconds']:.1f} s"),
    ]
    for k, v in rows:
        s.add_row(k, str(v))
    console.print(s)


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvstore.demo import run_demo

    if args.json:
        report = run_demo(
            conversations=args.conversations,
            turns=args.turns,
            dram=args.dram,
            ssd=args.ssd,
            policy=args.policy,
        )
        print(json.dumps(report.as_dict(), indent=2))
        return 0
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("chat turns", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        report = run_demo(
            conversations=args.conversations,
            turns=args.turns,
            dram=args.dram,
            ssd=args.ssd,
            policy=args.policy,
            progress=progress,
        )
    _demo_tables(report.as_dict())
    return 0


def _add_demo(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run chat traffic through an in-process node and show where blocks landed",
        description="Chat turns with shared prefixes through one node (DRAM + SSD tiers).",
        epilog="example: kvstore demo --conversations 24 --turns 6 --dram 256MiB --ssd 2GiB",
    )
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--dram", default="256MiB", help="DRAM tier size (default 256MiB)")
    p.add_argument("--ssd", default="2GiB", help="SSD tier size (default 2GiB)")
    p.add_argument("--policy", default="s3fifo", help="eviction policy: lru, fifo, s3fifo")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    """The full parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="kvstore", description="A tiered, distributed KV-cache store for LLM serving."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo(sub)
    try:
        from engine import plan
    except ImportError:
        plan = None  # type: ignore[assignment]
    if plan is not None:
        plan.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except KVStoreError as exc:
        print(f"kvstore {args.command}: error: {exc}", file=sys.stderr)
        print(
            f"hint: run 'kvstore {args.command} --help' (error code: {exc.code})", file=sys.stderr
        )
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
