"""``kvstore vllm-router``: pools of ``vllm serve`` behind one OpenAI-compatible front.

The vLLM servers run with kvstore's connector (engine/vllm/connector.py): prefill
servers as ``kv_producer`` (they write each prompt's KV blocks to the store), decode
servers as ``kv_consumer`` (they load the blocks the store holds and compute the rest).
Per request, as vLLM's disaggregated-prefill proxy does:

1. the prompt's token ids (the completion's ``prompt``, or the chat messages through the
   model's chat template) and their kvstore block keys, in the namespace the
   connector uses (model id and the canonical layout, from the model's config);
2. how many of those blocks the store already holds (one ``match_prefix``). When it
   holds every full block, the prefill step is skipped: the decode server loads them
   all. That is the router's cache-awareness: it comes from the store, not from
   guessing which engine saw the prompt before;
3. otherwise the request goes to a prefill server with ``max_tokens=1`` (no stream),
   which computes the prompt and saves its blocks; a prefill that fails is tried on the
   next server, and with none left the decode server computes the prompt itself;
4. the original request goes to a decode server (the one with fewest requests in
   flight; one that cannot be reached or answers 5xx before anything was sent: the
   next) and its answer, streamed or not, goes back as it comes; a streamed answer
   whose server dies mid-way goes on on another (engine/serving/vllm_resume.py).

Every answer says where it went: ``x-kvstore-prefill`` (a URL or ``skipped``),
``x-kvstore-decode`` and ``x-kvstore-cached-blocks``.

The pools come from flags (``--prefill``, ``--decode``), or with ``--etcd`` from the
servers registered there (connector ``"register": true``), followed as they start, stop
and die (engine/serving/vllm_members.py). Registered servers carry their namespace,
block size and store node, so the cache check asks the store node of the decode server
the request is headed for, in that server's namespace, and a prefill server beside the
same store node is preferred. A server's load is the larger of this router's requests
in flight there and the server's own count (every router's, as of its last report).

The namespace must match the connector's for the cache check to see anything; a
mismatch (another dtype or block size) only costs the skip, never a wrong answer, since
each engine's connector finds its own blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.registry import WorkerRecord
from engine.serving.vllm_adapters import UNKNOWN, Adapters
from engine.serving.vllm_members import PoolMembers
from engine.serving.vllm_resume import Answer, StreamRelay, resumable, with_token_ids
from engine.vllm.keys import chain_root
from kvstore import Namespace, StoreClient, prefix_keys
from kvstore.errors import KVStoreError

__all__ = ["Pools", "PoolsConfig", "add_arguments", "namespace_of", "run"]

MODELS_TIMEOUT_S = 2.0  # a server's model list, asked in a request's path (LoRA check)

log = logging.getLogger(__name__)


def namespace_of(model: str, dtype: str, block_size: int, model_id: str = "") -> Namespace:
    """The connector's namespace for ``model`` (a local HF directory) served with
    ``dtype`` and ``block_size`` by one rank: engine/vllm/connector.py namespace_for
    computed from the model's config.json instead of a running engine."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads", heads))
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    layers = int(cfg["num_hidden_layers"])
    layout = f"{dtype}:L{layers}:H{kv_heads}:D{head_dim}:B{block_size}:R0"
    return Namespace(model=model_id or model, layout=layout)


@dataclass
class PoolsConfig:
    """Settings of one vLLM-pools router (flags of ``kvstore vllm-router``)."""

    prefill: list[str]
    decode: list[str]
    model: str  # the served model's directory: tokenizer, chat template, geometry
    dtype: str = "bfloat16"
    block_size: int = 16
    model_id: str = ""  # the connector's model_id ("" = the model as served)
    store: str = ""  # host:port of a store node for the cache check ("" = none)
    token: str = field(default="", repr=False)  # "": KVSTORE_TOKEN, as every client
    timeout_s: float = 600.0
    etcd: str = ""  # host:port: follow the servers registered there, not the lists
    cluster: str = "default"
    served_model: str = ""  # the model name the servers register ("" = model)


@dataclass(eq=False)
class _Server:
    url: str
    in_flight: int = 0  # this router's requests there now
    failures: int = 0
    sent: int = 0
    record: WorkerRecord | None = None  # a registered server's latest record
    queued_tokens: int = 0  # prompt tokens of this router's prefills running there
    s_per_token: float = 0.0  # its prefill time per uncached token (EWMA; 0: none seen)

    def prefill_s(self, tokens: int, default_s: float) -> float:
        """When a prefill of ``tokens`` more would finish there: what this router has
        queued there plus it, at the rate seen there (the pool's when none was)."""
        return (self.queued_tokens + tokens) * (self.s_per_token or default_s)

    def saw_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            rate = seconds / tokens
            self.s_per_token = rate if not self.s_per_token else 0.8 * self.s_per_token + 0.2 * rate

    @property
    def busy(self) -> int:
        """Requests in flight: this router's, or the server's own count when higher."""
        return max(self.in_flight, self.record.load.running if self.record else 0)

    @property
    def store_node(self) -> str:
        return self.record.store_node if self.record else ""

    def report(self) -> dict[str, Any]:
        """What /health says of it."""
        rec = self.record
        return {
            "url": self.url,
            "id": rec.worker_id if rec else "",
            "in_flight": self.in_flight,
            "reported": rec.load.running if rec else None,
            "failures": self.failures,
            "sent": self.sent,
        }


class Pools:
    """The router: prefill then decode over two pools of vLLM servers."""

    def __init__(self, config: PoolsConfig) -> None:
        if config.etcd and (config.prefill or config.decode):
            raise ValueError("give --etcd or --prefill/--decode servers, not both")
        if not config.etcd and (not config.prefill or not config.decode):
            raise ValueError("give at least one prefill and one decode server, or --etcd")
        self.config = config
        self.prefill = [_Server(u.rstrip("/")) for u in config.prefill]
        self.decode = [_Server(u.rstrip("/")) for u in config.decode]
        self.members: PoolMembers | None = None
        self.namespace: Namespace | None = None  # the flags' (registered servers carry theirs)
        if config.etcd:
            model = config.served_model or config.model
            self.members = PoolMembers(config.etcd, config.cluster, model, self.follow)
        else:
            self.namespace = namespace_of(
                config.model, config.dtype, config.block_size, config.model_id
            )
        self._tokenizer: Any = None
        self._stores: dict[str, StoreClient] = {}  # address -> client (cache checks)
        self._stores_lock = threading.Lock()  # checks run in worker threads
        self._http: httpx.AsyncClient | None = None
        served = {config.model, config.served_model} - {""}
        self.adapters = Adapters(self._models, served)  # LoRA adapters, for the check
        self.stats = {
            "requests": 0, "prefill_skipped": 0, "prefill_failed": 0, "stream_resumes": 0,
        }  # fmt: skip

    def follow(self, prefill: list[WorkerRecord], decode: list[WorkerRecord]) -> None:
        """The pools from the registered servers' records (PoolMembers calls it after
        every change); a server keeps its counters across updates of its record."""
        known = {s.record.worker_id: s for s in (*self.prefill, *self.decode) if s.record}

        def pool(records: list[WorkerRecord]) -> list[_Server]:
            servers = []
            for r in records:
                s = known.setdefault(r.worker_id, _Server(r.address.rstrip("/")))
                s.record = r
                servers.append(s)
            return servers

        self.prefill, self.decode = pool(prefill), pool(decode)

    # -- parts ---------------------------------------------------------------------------

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.config.model)
        return self._tokenizer

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        """The prompt's token ids as the engine will see them (best effort: used only
        for the cache check)."""
        if path.endswith("/chat/completions"):
            ids = self.tokenizer().apply_chat_template(
                body.get("messages", []), add_generation_prompt=True, tokenize=True
            )
            # a BatchEncoding (a mapping) in newer transformers, a list in older ones
            return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, str):
            return list(self.tokenizer()(prompt)["input_ids"])
        return []

    def check_target(self, server: _Server) -> tuple[Namespace, int, str]:
        """(namespace, block size, store address) of the cache check for a request
        headed to decode ``server``: the flags', or what its record says."""
        rec = server.record
        if rec is None:
            assert self.namespace is not None
            return self.namespace, self.config.block_size, self.config.store
        store = self.config.store
        if not store and rec.store_node and self.members is not None:
            store = self.members.store_address(rec.store_node) or ""
        return Namespace(**rec.namespace), rec.block_tokens, store

    def cached_blocks(
        self,
        ids: list[int],
        target: tuple[Namespace, int, str],
        salt: str | None = None,
        lora: str | None = None,
    ) -> tuple[int, int]:
        """(blocks the store holds of the prompt's leading full blocks, full blocks),
        keyed as the connector keys them: a LoRA adapter (``lora``: ``name@path``,
        engine/serving/vllm_adapters.py) and a ``cache_salt`` root chains of their own
        (engine/vllm/keys.py)."""
        namespace, block_size, store = target
        root = chain_root(namespace, block_size, lora=lora, salt=salt)
        keys = prefix_keys(ids, block_size, namespace, parent=root)
        if not keys or not store:
            return 0, len(keys)
        try:
            with self._stores_lock:
                client = self._stores.get(store)
                if client is None:
                    # no token given: the client's config reads KVSTORE_TOKEN
                    client = self._stores[store] = StoreClient.connect(
                        store, token=self.config.token or None, timeout_s=2.0
                    )
            return client.match_prefix(keys), len(keys)
        except KVStoreError as exc:
            log.warning("cache check failed (%s): the request goes through prefill", exc)
            return 0, len(keys)

    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self.config.timeout_s)
        return self._http

    @staticmethod
    def _least_busy(servers: list[_Server], near: str = "") -> list[_Server]:
        """Least busy first; with ``near`` (a store node), the servers beside it first."""
        return sorted(
            servers,
            key=lambda s: (bool(near) and s.store_node != near, s.busy, s.failures, s.sent),
        )

    # -- the request -----------------------------------------------------------------------

    def prefill_order(self, tokens: int, near: str = "") -> list[_Server]:
        """Prefill servers, soonest done first: beside store node ``near`` first, then by
        when a prefill of ``tokens`` uncached tokens would finish there, as the cost
        model of ``kvstore router`` ranks its workers (engine/planning/scheduler.py),
        with each server's rate learned from the prefills this router saw it run."""
        rates = [s.s_per_token for s in self.prefill if s.s_per_token]
        default_s = sum(rates) / len(rates) if rates else 1.0
        return sorted(
            self.prefill,
            key=lambda s: (
                bool(near) and s.store_node != near,
                s.prefill_s(tokens, default_s),
                s.busy, s.failures, s.sent,
            ),
        )  # fmt: skip

    async def _prefill(self, path: str, body: dict[str, Any], near: str, tokens: int) -> str:
        """Run the prompt on a prefill server (one token, no stream), the one that
        would finish ``tokens`` uncached tokens soonest (beside store node ``near``
        first); its URL, or "" when every prefill server failed (the decode server
        then computes it)."""
        req = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        req["max_tokens"] = 1
        if "max_completion_tokens" in req:
            req["max_completion_tokens"] = 1
        for s in self.prefill_order(tokens, near):
            s.in_flight += 1
            s.sent += 1
            s.queued_tokens += tokens
            start = time.monotonic()
            try:
                r = await self.http().post(s.url + path, json=req)
            except httpx.HTTPError as exc:
                s.failures += 1
                log.warning("prefill on %s failed: %s", s.url, exc)
                continue
            finally:
                s.in_flight -= 1
                s.queued_tokens -= tokens
            if r.status_code == 200:
                s.saw_prefill(tokens, time.monotonic() - start)
            if r.status_code == 400:
                raise _Refused(r)
            if r.status_code == 200:
                return s.url
            s.failures += 1
            log.warning("prefill on %s answered %d", s.url, r.status_code)
        self.stats["prefill_failed"] += 1
        return ""

    async def handle(self, request: Request) -> Response:
        path = request.url.path
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        self.stats["requests"] += 1
        if not self.decode:
            return _error(503, "no decode server in the pool")
        # the store the check asks, and the prefill and decode servers prefer: the one
        # beside the decode server that is least busy now
        near = self._least_busy(self.decode)[0]
        try:
            ids = await asyncio.to_thread(self.token_ids, path, body)
            target = self.check_target(near)
            salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
            lora = await self.adapters.lora(body.get("model"))
            if lora is UNKNOWN:  # no server lists it: never skip its prefill
                cached, full = 0, 0
            else:
                cached, full = await asyncio.to_thread(
                    self.cached_blocks, ids, target, salt, lora or None
                )
            uncached = max(len(ids) - cached * target[1], 0)  # what the prefill computes
        except Exception as exc:  # the check is an optimization: never fail a request on it
            log.warning("cache check skipped (%s: %s)", type(exc).__name__, exc)
            cached, full, uncached = 0, 0, 0
        try:
            if full and cached >= full:
                prefill = "skipped"
                self.stats["prefill_skipped"] += 1
            else:
                prefill = await self._prefill(path, body, near.store_node, uncached) or "failed"
        except _Refused as refused:
            return Response(
                refused.response.content,
                refused.response.status_code,
                media_type="application/json",
            )
        headers = {
            "x-kvstore-prefill": prefill,
            "x-kvstore-cached-blocks": f"{cached}/{full}",
        }
        # where the prompt's blocks are now: the prefill server's store (the checked one
        # when the prefill was skipped or failed), which the decode server loads from
        held = next((s.store_node for s in self.prefill if s.url == prefill), near.store_node)
        return await self._decode(path, body, headers, held)

    async def _decode(
        self, path: str, body: dict[str, Any], headers: dict[str, str], near: str
    ) -> Response:
        """Send the request to the least busy decode server (beside store node ``near``
        first) that takes it: one that cannot be reached, fails before answering or
        answers 5xx passes it to the next. Chosen now, not before the prefill, so
        requests that arrived together spread over the pool. A streamed answer whose
        server dies mid-way goes on on another (engine/serving/vllm_resume.py)."""
        order = self._least_busy(self.decode, near)
        if not order:  # the pool emptied during the prefill
            return _error(503, "no decode server in the pool", headers)
        moving = resumable(path, body)
        opened = await self._open(path, with_token_ids(body) if moving else body, order)
        if isinstance(opened, list):
            return _error(502, "every decode server failed: " + "; ".join(opened), headers)
        s, up = opened
        headers["x-kvstore-decode"] = s.url
        if not body.get("stream"):
            try:
                content = await up.aread()
            finally:
                await up.aclose()
                s.in_flight -= 1
            return Response(content, up.status_code, headers=headers, media_type="application/json")
        if moving and up.status_code == 200:
            reopen = functools.partial(self._reopen, near=near)
            relay = StreamRelay(Answer(path, body), reopen, self._ended, self.stats)
            return StreamingResponse(
                relay.events(s, up), 200, headers=headers, media_type="text/event-stream"
            )

        async def as_is() -> AsyncIterator[bytes]:
            try:
                async for chunk in up.aiter_raw():
                    yield chunk
            finally:
                await up.aclose()
                s.in_flight -= 1

        return StreamingResponse(
            as_is(), up.status_code, headers=headers, media_type="text/event-stream"
        )

    async def _open(
        self, path: str, body: dict[str, Any], order: list[_Server]
    ) -> tuple[_Server, httpx.Response] | list[str]:
        """The first server of ``order`` that takes the request (the last one's answer
        whatever it is), counted in flight there; else why each failed."""
        http, failed = self.http(), []
        for i, s in enumerate(order):
            s.in_flight += 1
            s.sent += 1
            try:
                up = await http.send(
                    http.build_request("POST", s.url + path, json=body), stream=True
                )
            except httpx.HTTPError as exc:
                s.in_flight -= 1
                s.failures += 1
                failed.append(f"{s.url}: {exc}")
                continue
            except BaseException:  # cancelled (the client left): not in flight
                s.in_flight -= 1
                raise
            if up.status_code >= 500 and i + 1 < len(order):
                await up.aclose()
                s.in_flight -= 1
                s.failures += 1
                failed.append(f"{s.url}: HTTP {up.status_code}")
                continue
            return s, up
        return failed

    async def _reopen(
        self, body: dict[str, Any], tried: set[str], near: str = ""
    ) -> tuple[_Server, httpx.Response] | None:
        """A cut stream's continuation on a decode server it has not been on, beside
        store node ``near`` (where the prompt's blocks are) first."""
        order = [s for s in self._least_busy(self.decode, near) if s.url not in tried]
        opened = await self._open("/v1/completions", body, order) if order else []
        if isinstance(opened, list):
            log.warning("no decode server took a cut stream: %s", "; ".join(opened) or "none left")
            return None
        s, up = opened
        if up.status_code != 200:
            try:
                text = await up.aread()
            finally:
                await up.aclose()
                s.in_flight -= 1
            log.warning(
                "%s refused a cut stream's rest: HTTP %d %s", s.url, up.status_code, text[:200]
            )
            return None
        return s, up

    @staticmethod
    def _ended(s: _Server, broke: bool) -> None:
        """A relayed stream ended on ``s``; one it broke counts as its failure, as a
        failed open does, so the least busy order passes it over."""
        s.in_flight -= 1
        if broke:
            s.failures += 1

    async def _models(self) -> dict[str, Any]:
        """A decode server's ``/v1/models`` body (its LoRA adapters for the check)."""
        if not self.decode:
            raise RuntimeError("no decode server in the pool")
        server = self._least_busy(self.decode)[0]
        r = await self.http().get(server.url + "/v1/models", timeout=MODELS_TIMEOUT_S)
        r.raise_for_status()
        return dict(r.json())

    async def models(self, request: Request) -> Response:
        if not self.decode:
            return _error(503, "no decode server in the pool")
        s = self._least_busy(self.decode)[0]
        try:
            r = await self.http().get(s.url + "/v1/models")
        except httpx.HTTPError as exc:
            return _error(502, f"decode server {s.url} failed: {exc}")
        return Response(r.content, r.status_code, media_type="application/json")

    async def health(self, request: Request) -> Response:
        pools = {
            "prefill": [s.report() for s in self.prefill],
            "decode": [s.report() for s in self.decode],
        }
        return JSONResponse({"status": "ok", **self.stats, "pools": pools})

    def app(self) -> Starlette:
        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            if self.members is not None:  # etcd out of reach: the router fails to start
                await self.members.start()
            yield
            if self.members is not None:
                await self.members.stop()
            if self._http is not None:
                await self._http.aclose()
            for client in self._stores.values():
                client.close()

        return Starlette(
            routes=[
                Route("/v1/completions", self.handle, methods=["POST"]),
                Route("/v1/chat/completions", self.handle, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            lifespan=lifespan,
        )


class _Refused(Exception):
    """A prefill server answered 400: the request itself is wrong."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(response.text)
        self.response = response


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}},
        status,
        headers=headers,
    )


# -- command line ----------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``kvstore vllm-router``."""
    p.add_argument("--prefill", action="append", default=[], help="a prefill server URL")
    p.add_argument("--decode", action="append", default=[], help="a decode server URL")
    p.add_argument(
        "--etcd",
        default="",
        help="etcd HOST:PORT: follow the servers registered there (connector "
        '"register": true) instead of --prefill/--decode',
    )
    p.add_argument("--cluster", default=None, help="cluster name in etcd (KVSTORE_CLUSTER)")
    p.add_argument("--model", required=True, help="the served model's directory")
    p.add_argument(
        "--served-model-name", default="", help="the name servers register (default: --model)"
    )
    p.add_argument("--dtype", default="bfloat16", help="the dtype the servers run (flags only)")
    p.add_argument("--block-size", type=int, default=16, help="the servers' --block-size (flags)")
    p.add_argument("--model-id", default="", help="the connector's model_id, if set (flags)")
    p.add_argument("--store", default="", help="host:port of a store node (cache check)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / SIGINT; prints one JSON ready line with the URL."""
    from engine.serving.http_server import bind, serve_app
    from kvstore.config import ClusterConfig, resolve_config

    where = resolve_config(
        ClusterConfig, flags={"etcd": args.etcd or None, "cluster": args.cluster}
    )
    try:
        pools = Pools(
            PoolsConfig(
                prefill=args.prefill, decode=args.decode, model=args.model, dtype=args.dtype,
                block_size=args.block_size, model_id=args.model_id, store=args.store,
                etcd=args.etcd and where.etcd, cluster=where.cluster,
                served_model=args.served_model_name,
            )
        )  # fmt: skip
    except ValueError as exc:
        raise SystemExit(f"kvstore vllm-router: {exc}") from exc
    sock = bind(args.host, args.port)
    url = f"http://{args.host}:{sock.getsockname()[1]}"
    serve_app(pools.app(), sock, {"url": url, "pid": os.getpid()})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore vllm-router", description=__doc__.split("\n")[0])
    add_arguments(p)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
