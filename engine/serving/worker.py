"""``kvstore worker``: one model behind an HTTP API that the router calls.

Endpoints (JSON in; NDJSON out for the streaming ones, one object per line):

- ``POST /prefill {request_id, prompt, rest?, max_tokens?}`` -> ``{handoff,
  source_node}``: compute the prompt reusing the local store node's prefix, write its
  new blocks there, hand off. ``rest`` is text the router did not tokenize (it is
  tokenized here and appended); the handoff carries the whole prompt's ids.
- ``POST /decode {handoff, source_node, max_tokens, stop_ids}`` -> ``{"token": id}``
  lines for every token after the handoff's first, then ``{"done": ...}``.
- ``POST /generate {request_id, prompt, rest?, max_tokens, stop_ids}`` -> ``{"prefill": ...}``,
  every token, ``{"done": ...}``: both phases here (short prompts).
- ``GET /health`` -> the worker's record, counters, its KV codec, and its latest
  prefill's stats and handoff read (``last_prefill``, ``last_decode``).

``--kv-codec int8|fp8`` stores the worker's blocks compressed (kvstore/codec/), on its
device; the codec is in its record, and the router pairs a prefill worker only with a
decode worker of the same codec (engine/serving/pairing.py).

A stream that ends without its ``done`` line was cut (the worker died): the router
turns that into an error for its client, never into a short answer.

The process registers in etcd (engine/registry.py) once it serves, prints one
JSON ready line on stdout, and revokes its lease on SIGTERM / SIGINT.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.registry import ROLES, WorkerRecord, WorkerRegistration, resolve_directory
from engine.serving.http_server import bind, serve_app
from engine.serving.runtime import Faults, WorkerEngine
from kvstore.client.groups import unit_addresses, unit_names
from kvstore.codec.registry import codec_names

__all__ = ["add_arguments", "build_app", "main", "run_worker"]

log = logging.getLogger(__name__)
_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


async def _body(request: Request) -> dict[str, Any]:
    try:
        data = await request.json()
    except ValueError as exc:
        raise _BadRequest(f"malformed JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise _BadRequest("the body must be a JSON object")
    return data


class _BadRequest(Exception):
    pass


def _rest(body: dict[str, Any]) -> str:
    rest = body.get("rest", "")
    if not isinstance(rest, str):
        raise _BadRequest("rest must be a string")
    return rest


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) for t in value):
        raise _BadRequest(f"{what} must be a list of token ids")
    return value


def _ndjson(items: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def lines() -> AsyncIterator[bytes]:
        async for item in items:
            yield json.dumps(item, separators=(",", ":")).encode() + b"\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


class _Handlers:
    """The worker's HTTP endpoints: each parses its request, refuses what this role
    does not serve, and hands the rest to the engine."""

    def __init__(self, engine: WorkerEngine, record: WorkerRecord) -> None:
        self.engine, self.record = engine, record

    def _wrong_role(self) -> Response:
        r = self.record
        return _error(409, f"worker {r.worker_id} is a {r.role} worker")

    async def health(self, _request: Request) -> Response:
        engine, record = self.engine, self.record
        return JSONResponse(
            {
                "worker_id": record.worker_id,
                "role": record.role,
                "model": record.model,
                "kv_codec": record.kv_codec,
                "load": dataclasses.asdict(engine.load()),
                "counters": engine.counters,
                "last_prefill": engine.last_prefill,
                "last_decode": engine.last_decode,
                "store_up": engine.local.available if engine.local is not None else None,
            }
        )

    async def prefill(self, request: Request) -> Response:
        if not self.record.can_prefill:
            return self._wrong_role()
        try:
            body = await _body(request)
            prompt, rest = _ints(body.get("prompt"), "prompt"), _rest(body)
            if not prompt and not rest:
                raise _BadRequest("empty prompt")
            max_tokens = int(body.get("max_tokens", 0))
        except (_BadRequest, ValueError, TypeError) as exc:
            return _error(400, str(exc))
        prompt = await self.engine.full_prompt(prompt, rest)
        too_long = self.engine.context_error(len(prompt), max_tokens, "messages")
        if too_long is not None:
            return JSONResponse({"error": too_long}, status_code=400)
        rid = str(body.get("request_id") or uuid.uuid4().hex)
        return JSONResponse(await self.engine.prefill(rid, prompt))

    async def decode(self, request: Request) -> Response:
        if not self.record.can_decode:
            return self._wrong_role()
        try:
            body = await _body(request)
            handoff = body.get("handoff")
            if not isinstance(handoff, dict):
                raise _BadRequest("handoff must be an object")
            max_tokens = int(body.get("max_tokens", 16))
            stop_ids = _ints(body.get("stop_ids", []), "stop_ids")
        except (_BadRequest, ValueError, TypeError) as exc:
            return _error(400, str(exc))
        src = str(body.get("source_node") or "")
        return _ndjson(self.engine.decode(handoff, src, max_tokens, stop_ids))

    async def generate(self, request: Request) -> Response:
        if not self.record.can_decode:
            return self._wrong_role()
        try:
            body = await _body(request)
            prompt, rest = _ints(body.get("prompt"), "prompt"), _rest(body)
            if not prompt and not rest:
                raise _BadRequest("empty prompt")
            max_tokens = int(body.get("max_tokens", 16))
            stop_ids = _ints(body.get("stop_ids", []), "stop_ids")
        except (_BadRequest, ValueError, TypeError) as exc:
            return _error(400, str(exc))
        if rest:
            prompt = await self.engine.full_prompt(prompt, rest)
            too_long = self.engine.context_error(len(prompt), max_tokens, "messages")
            if too_long is not None:
                return JSONResponse({"error": too_long}, status_code=400)
        rid = str(body.get("request_id") or uuid.uuid4().hex)
        return _ndjson(self.engine.generate(rid, prompt, max_tokens, stop_ids))


def build_app(
    engine: WorkerEngine, record: WorkerRecord, reg: WorkerRegistration | None
) -> Starlette:
    """The worker's ASGI app; ``reg`` (when given) registers on start, revokes on stop."""
    h = _Handlers(engine, record)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        if reg is not None:
            engine.on_load = reg.update_load
            await reg.start(record)
        try:
            yield
        finally:
            if reg is not None:
                await reg.stop()
            engine.close()

    return Starlette(
        routes=[
            Route("/health", h.health, methods=["GET"]),
            Route("/prefill", h.prefill, methods=["POST"]),
            Route("/decode", h.decode, methods=["POST"]),
            Route("/generate", h.generate, methods=["POST"]),
        ],
        lifespan=lifespan,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``kvstore worker`` (also ``python -m engine.serving.worker``)."""
    p.add_argument("--role", choices=ROLES, required=True, help="prefill, decode or both")
    p.add_argument("--model", default="tiny", help="tiny, smollm2 or a local model directory")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument(
        "--kv-codec",
        default="none",
        choices=["none", *codec_names()],
        help="store KV compressed (int8, fp8; kvstore/codec/); every worker of a model "
        "must use the same one, or the router cannot pair its prefill and decode workers",
    )
    p.add_argument(
        "--device",
        default=None,
        choices=["cpu", "cuda"],
        help="where the model runs (default: cuda where torch sees one, else cpu)",
    )
    p.add_argument("--etcd", default=None, help="etcd HOST:PORT (KVSTORE_ETCD; 127.0.0.1:2379)")
    p.add_argument("--cluster", default=None, help="cluster name in etcd (KVSTORE_CLUSTER)")
    p.add_argument(
        "--store-node",
        default="",
        help="id of the store node beside this worker ('auto': the one on this host)",
    )
    p.add_argument("--worker-id", default="", help="unique id (default: role + random)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=0, help="HTTP port (0 picks one)")
    p.add_argument("--advertise-host", default="", help="host the router dials (default --host)")
    p.add_argument("--zone", default="", help="topology label (rack, zone) for placement")
    p.add_argument("--kv-tokens", type=int, default=65536, help="KV capacity for decodes, tokens")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: deterministic)")
    p.add_argument("--tiny-layers", type=int, default=2, help="layers of the tiny model")
    p.add_argument("--lease-ttl-s", type=int, default=10, help="etcd lease of the record")
    p.add_argument(
        "--save-decode",
        action="store_true",
        help="store each whole answer's full blocks in the store node holding its prompt's "
        "(a handoff's source), so a chat's next turn, whose prompt repeats the answer, "
        "finds its whole history",
    )
    p.add_argument(
        "--layer-parts",
        type=int,
        default=0,
        help="load a prompt's stored prefix in this many parts of the model's depth "
        "beside the forward, so the fetch runs behind the compute (0: fetch it first)",
    )
    p.add_argument(
        "--no-calibrate",
        action="store_true",
        help="skip timing prefill at start (the router then uses its default model)",
    )
    p.add_argument("--inject-prefill-delay-s", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--inject-token-delay-s", type=float, default=0.0, help=argparse.SUPPRESS)


def _units(cluster: Any) -> dict[str, str]:
    """The store nodes a worker may sit beside, by name: a sharded node by its group."""
    return unit_addresses(cluster.nodes())


def _node_on_this_host(cluster: Any, wait_s: float = 15.0) -> str:
    """``--store-node auto``: the store node whose host id (boot id) is this host's, so a
    worker scheduled beside a node (a Kubernetes pod on the same machine) finds it
    without being told its name; the first node by id when none is here."""
    from kvstore.wire.locality import host_id

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        nodes = cluster.nodes()
        names = unit_names(nodes)  # a sharded node is one node: its group's name
        here = sorted(
            {names[n] for n, info in nodes.items() if info.host_id and info.host_id == host_id()}
        )
        if here:
            return str(here[0])
        if nodes and time.monotonic() > deadline - wait_s / 2:
            first = sorted(set(names.values()))[0]
            logging.getLogger(__name__).warning(
                "no store node on this host; writing to %s over the network", first
            )
            return str(first)
        time.sleep(0.2)
    raise SystemExit("--store-node auto: no store node registered in the directory")


def _store_clients(args: argparse.Namespace, namespace: Any) -> tuple[Any, Any, Any]:
    """(cluster client, local guarded store, node id -> guarded store)."""
    from engine.blockstore import GuardedStore
    from kvstore import StoreClient

    fast = {"timeout_s": 2.0, "connect_timeout_s": 2.0, "retries": 0}
    cluster = StoreClient.from_etcd(args.etcd, cluster=args.cluster, namespace=namespace, **fast)
    guarded: dict[str, GuardedStore] = {}

    def node_client(node_id: str) -> GuardedStore | None:
        if node_id not in guarded:

            def connect(nid: str = node_id) -> Any:
                address = unit_addresses(cluster.nodes()).get(nid)
                if address is None:
                    from kvstore.errors import Unavailable

                    raise Unavailable(f"store node {nid!r} is not in the directory")
                return StoreClient.connect(address, namespace=namespace, **fast)

            guarded[node_id] = GuardedStore(connect, retry_after_s=2.0, spawn=None)
        return guarded[node_id]

    local = None
    if args.store_node == "auto":
        args.store_node = _node_on_this_host(cluster)
    if args.store_node:
        deadline = time.monotonic() + 15.0
        while args.store_node not in _units(cluster) and time.monotonic() < deadline:
            time.sleep(0.1)
        if args.store_node not in _units(cluster):
            raise SystemExit(f"store node {args.store_node!r} is not registered in {args.etcd}")
        local = node_client(args.store_node)
    return cluster, local, node_client


def _record(
    args: argparse.Namespace, wid: str, engine: WorkerEngine, address: str, coeffs: Any
) -> WorkerRecord:
    """What this worker registers in etcd (its namespace names its KV codec too)."""
    ns, lm = engine.adapter.namespace, engine.lm
    return WorkerRecord(
        worker_id=wid, role=args.role, model=lm.name, address=address,
        namespace={"model": ns.model, "layout": ns.layout, "tenant": ns.tenant},
        store_node=args.store_node, zone=args.zone, block_tokens=engine.adapter.block_tokens,
        max_context=lm.max_context, kv_bytes_per_token=engine.kv_bytes_per_token,
        prefill_coeffs=coeffs, load=engine.load(), kv_codec=engine.kv_codec,
    )  # fmt: skip


def run_worker(args: argparse.Namespace) -> int:
    """Load the model, open the stores, serve until SIGTERM / SIGINT."""
    import torch

    from engine.serving.loading import load_model, resolve_device
    from engine.serving.runtime import calibrate_prefill
    from kvstore.errors import ConfigError

    resolve_directory(args)
    torch.set_num_threads(max(args.threads, 1))
    wid = args.worker_id or f"{args.role}-{uuid.uuid4().hex[:6]}"
    if not _ID.fullmatch(wid):
        raise SystemExit(f"worker id {wid!r}: use 1-64 of [A-Za-z0-9._-]")
    try:
        device = resolve_device(args.device)
    except ConfigError as exc:
        raise SystemExit(f"kvstore worker: {exc}") from exc
    lm = load_model(args.model, args.dtype, tiny_layers=args.tiny_layers, device=device)
    coeffs = None
    if not args.no_calibrate and args.role != "decode":
        coeffs = calibrate_prefill(lm.model, lm.model.config.vocab_size, lm.max_context).coeffs
    engine = WorkerEngine(
        lm,
        local=None,
        kv_capacity_tokens=args.kv_tokens,
        faults=Faults(args.inject_prefill_delay_s, args.inject_token_delay_s),
        kv_codec=args.kv_codec,
        save_decode=args.save_decode,
        layer_parts=args.layer_parts,
    )
    engine.cluster, engine.local, engine.source_client = _store_clients(
        args, engine.adapter.namespace
    )
    engine.store_node = args.store_node
    sock = bind(args.host, args.port)
    host = args.advertise_host or args.host
    record = _record(args, wid, engine, f"http://{host}:{sock.getsockname()[1]}", coeffs)
    reg = WorkerRegistration(args.etcd, args.cluster, ttl=args.lease_ttl_s)
    app = build_app(engine, record, reg)
    ready = {
        "worker_id": wid, "role": args.role, "model": lm.name, "address": record.address,
        "pid": os.getpid(), "store_node": args.store_node, "device": str(device),
        "kv_codec": record.kv_codec,
    }  # fmt: skip
    try:
        serve_app(app, sock, ready)
    finally:
        engine.cluster.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore worker", description=__doc__.split("\n")[0])
    add_arguments(p)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    return run_worker(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
