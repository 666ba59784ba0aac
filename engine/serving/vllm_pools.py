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
   next) and its answer, streamed or not, goes back as it comes.

Every answer says where it went: ``x-kvstore-prefill`` (a URL or ``skipped``),
``x-kvstore-decode`` and ``x-kvstore-cached-blocks``.

The namespace must match the connector's for the cache check to see anything; a
mismatch (another dtype or block size) only costs the skip, never a wrong answer, since
each engine's connector finds its own blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvstore import Namespace, StoreClient, prefix_keys
from kvstore.errors import KVStoreError

__all__ = ["Pools", "PoolsConfig", "add_arguments", "namespace_of", "run"]

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


@dataclass
class _Server:
    url: str
    in_flight: int = 0
    failures: int = 0


class Pools:
    """The router: prefill then decode over two pools of vLLM servers."""

    def __init__(self, config: PoolsConfig) -> None:
        if not config.prefill or not config.decode:
            raise ValueError("give at least one prefill and one decode server")
        self.config = config
        self.prefill = [_Server(u.rstrip("/")) for u in config.prefill]
        self.decode = [_Server(u.rstrip("/")) for u in config.decode]
        self.namespace = namespace_of(
            config.model, config.dtype, config.block_size, config.model_id
        )
        self._tokenizer: Any = None
        self._store: StoreClient | None = None
        self._http: httpx.AsyncClient | None = None
        self.stats = {"requests": 0, "prefill_skipped": 0, "prefill_failed": 0}

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

    def cached_blocks(self, ids: list[int]) -> tuple[int, int]:
        """(blocks the store holds of the prompt's leading full blocks, full blocks)."""
        keys = prefix_keys(ids, self.config.block_size, self.namespace)
        if not keys or not self.config.store:
            return 0, len(keys)
        try:
            if self._store is None:
                # no token given: the client's config reads KVSTORE_TOKEN
                self._store = StoreClient.connect(
                    self.config.store, token=self.config.token or None, timeout_s=2.0
                )
            return self._store.match_prefix(keys), len(keys)
        except KVStoreError as exc:
            log.warning("cache check failed (%s): the request goes through prefill", exc)
            return 0, len(keys)

    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self.config.timeout_s)
        return self._http

    @staticmethod
    def _least_busy(servers: list[_Server]) -> list[_Server]:
        return sorted(servers, key=lambda s: (s.in_flight, s.failures))

    # -- the request -----------------------------------------------------------------------

    async def _prefill(self, path: str, body: dict[str, Any]) -> str:
        """Run the prompt on a prefill server (one token, no stream); its URL, or ""
        when every prefill server failed (the decode server then computes it)."""
        req = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        req["max_tokens"] = 1
        if "max_completion_tokens" in req:
            req["max_completion_tokens"] = 1
        for s in self._least_busy(self.prefill):
            s.in_flight += 1
            try:
                r = await self.http().post(s.url + path, json=req)
            except httpx.HTTPError as exc:
                s.failures += 1
                log.warning("prefill on %s failed: %s", s.url, exc)
                continue
            finally:
                s.in_flight -= 1
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
        try:
            ids = await asyncio.to_thread(self.token_ids, path, body)
            cached, full = await asyncio.to_thread(self.cached_blocks, ids)
        except Exception as exc:  # the check is an optimization: never fail a request on it
            log.warning("cache check skipped (%s: %s)", type(exc).__name__, exc)
            cached, full = 0, 0
        try:
            if full and cached >= full:
                prefill = "skipped"
                self.stats["prefill_skipped"] += 1
            else:
                prefill = await self._prefill(path, body) or "failed"
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
        return await self._decode(path, body, headers)

    async def _decode(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        http = self.http()
        failed: list[str] = []
        for s in self._least_busy(self.decode):  # one that cannot be reached: the next
            s.in_flight += 1
            try:
                req = http.build_request("POST", s.url + path, json=body)
                up = await http.send(req, stream=True)
            except httpx.HTTPError as exc:
                s.in_flight -= 1
                s.failures += 1
                failed.append(f"{s.url}: {exc}")
                continue
            if up.status_code >= 500 and len(failed) + 1 < len(self.decode):
                await up.aclose()
                s.in_flight -= 1
                s.failures += 1
                failed.append(f"{s.url}: HTTP {up.status_code}")
                continue
            break
        else:
            return _error(502, "every decode server failed: " + "; ".join(failed), headers)
        headers["x-kvstore-decode"] = s.url
        if not body.get("stream"):
            try:
                content = await up.aread()
            finally:
                await up.aclose()
                s.in_flight -= 1
            return Response(content, up.status_code, headers=headers, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in up.aiter_raw():
                    yield chunk
            finally:
                await up.aclose()
                s.in_flight -= 1

        return StreamingResponse(
            relay(), up.status_code, headers=headers, media_type="text/event-stream"
        )

    async def models(self, request: Request) -> Response:
        s = self._least_busy(self.decode)[0]
        try:
            r = await self.http().get(s.url + "/v1/models")
        except httpx.HTTPError as exc:
            return _error(502, f"decode server {s.url} failed: {exc}")
        return Response(r.content, r.status_code, media_type="application/json")

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", **self.stats})

    def app(self) -> Starlette:
        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            yield
            if self._http is not None:
                await self._http.aclose()
            if self._store is not None:
                self._store.close()

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
    p.add_argument("--prefill", action="append", required=True, help="a prefill server URL")
    p.add_argument("--decode", action="append", required=True, help="a decode server URL")
    p.add_argument("--model", required=True, help="the served model's directory")
    p.add_argument("--dtype", default="bfloat16", help="the dtype the servers run")
    p.add_argument("--block-size", type=int, default=16, help="the servers' --block-size")
    p.add_argument("--model-id", default="", help="the connector's model_id, if set")
    p.add_argument("--store", default="", help="host:port of a store node (cache check)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / SIGINT; prints one JSON ready line with the URL."""
    from engine.serving.http_server import bind, serve_app

    pools = Pools(
        PoolsConfig(
            prefill=args.prefill,
            decode=args.decode,
            model=args.model,
            dtype=args.dtype,
            block_size=args.block_size,
            model_id=args.model_id,
            store=args.store,
        )
    )
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
