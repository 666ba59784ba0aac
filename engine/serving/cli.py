"""``kvstore worker`` and ``kvstore router``: the serving path's two commands.

Each prints one JSON ready line when it listens (the worker: ``worker_id``, ``address``,
``pid``; the router: ``url``, ``pid``), so a script or ``kvstore up`` can wait for it,
and serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    """Register ``kvstore worker`` and ``kvstore router``."""
    from engine.serving import router, worker

    w = sub.add_parser(
        "worker",
        help="a prefill and/or decode worker (transformers) registered in etcd",
        description="Serve a model's prefill and/or decode for the router, KV through kvstore.",
        epilog="example: kvstore worker --role prefill --model tiny --store-node n0 "
        "--etcd 127.0.0.1:2379",
    )
    worker.add_arguments(w)
    w.add_argument("--json", action="store_true", help="(the ready line is always JSON)")
    w.set_defaults(func=_run_worker)

    r = sub.add_parser(
        "router",
        help="the OpenAI-compatible, cache-aware router in front of the workers",
        description="OpenAI-compatible HTTP router: places each request on the prefill "
        "worker with the lowest estimated TTFT and a decode worker near its blocks.",
        epilog="example: kvstore router --port 8000 --policy cache_aware --etcd 127.0.0.1:2379",
    )
    router.add_arguments(r)
    r.add_argument("--json", action="store_true", help="(the ready line is always JSON)")
    r.set_defaults(func=_run_router)


def _run_worker(args: argparse.Namespace) -> int:
    from engine.serving.worker import run_worker

    return run_worker(args)


def _run_router(args: argparse.Namespace) -> int:
    from engine.serving.router import run_router

    return run_router(args)
