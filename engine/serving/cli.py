"""``kvstore worker``, ``kvstore router`` and ``kvstore vllm-router``: the serving path's
commands.

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

    from engine.serving import vllm_pools

    v = sub.add_parser(
        "vllm-router",
        help="pools of `vllm serve` (kvstore's connector) behind one OpenAI front",
        description="Send each request to a prefill server (max_tokens=1), then to a decode "
        "server, skipping the prefill when the store holds the whole prompt.",
        epilog="examples: kvstore vllm-router --model ./m --dtype float32 --block-size 32 "
        "--prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --store 127.0.0.1:7400; "
        "kvstore vllm-router --model ./m --etcd 127.0.0.1:2379 (the servers whose connector "
        'has "register": true)',
    )
    vllm_pools.add_arguments(v)
    v.set_defaults(func=_run_vllm_router)


def _run_worker(args: argparse.Namespace) -> int:
    from engine.serving.worker import run_worker

    return run_worker(args)


def _run_vllm_router(args: argparse.Namespace) -> int:
    from engine.serving.vllm_pools import run

    return run(args)


def _run_router(args: argparse.Namespace) -> int:
    from engine.serving.router import run_router

    return run_router(args)
