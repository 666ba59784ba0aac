"""``kvstore router``: the OpenAI-compatible front of the serving path.

Per request: tokenize with the model's tokenizer and chat template, compute the
prompt's prefix keys, read each store node's run of them (and its tier) from the
directory mirror, let engine/serving/placement.py pick the prefill and decode
workers with the cost model, then drive them (engine/serving/upstream.py): prefill,
first token to the client, decode streamed through. A long new chat message is
tokenized only up to the first block no node holds (:func:`encode_request`); the
prefill worker tokenizes the rest and returns the whole prompt, which the router's
encoder files for the conversation's next turn. A prefill worker that fails
before the client saw anything is retried elsewhere; a decode stream that breaks
after tokens were sent goes on on another worker from the tokens sent
(engine/serving/resume.py), and ends in an OpenAI-style error event only when no
worker can take it.

Every answer says where it went: ``usage.kvstore`` and ``x-kvstore-*`` headers.
Prefill and decode workers are paired only within one KV codec
(engine/serving/pairing.py): ``/v1/models`` and ``/health`` say each model's codec,
unpaired workers are logged, and a request only they could serve is a 503.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route as HttpRoute

from engine.planning.scheduler import Refusal
from engine.registry import WorkerRecord, WorkerView, resolve_directory
from engine.serving.http_server import bind, serve_app
from engine.serving.loading import load_tokenizer
from engine.serving.metrics import RouterMetrics
from engine.serving.openai_api import APIError, GenRequest, chunk, completion, parse_request
from engine.serving.pairing import CodecMismatch, UnpairedLog, describe_codecs
from engine.serving.placement import Placer, PrefixView, Route
from engine.serving.prompts import PromptEncoder
from engine.serving.resume import Mover, Stream
from engine.serving.upstream import Started, StreamCut, Upstream, WorkerFailed, WorkerRefused

__all__ = ["Encoded", "Router", "RouterConfig", "add_arguments", "encode_request", "main"]

log = logging.getLogger(__name__)
SUSPECT_S = 5.0  # a worker that failed a call is skipped this long (or until it re-registers)


@dataclass(frozen=True)
class RouterConfig:
    """Settings of one router (flags of ``kvstore router``)."""

    etcd: str = "127.0.0.1:2379"
    cluster: str = "default"
    policy: str = "cache_aware"
    slo_ttft_s: float | None = None
    short_prompt_tokens: int = 256
    max_attempts: int = 3
    retry_after_s: int = 1
    default_max_tokens: int = 256
    upstream_timeout_s: float = 120.0
    max_stream_moves: int = 2


@dataclass(frozen=True, slots=True)
class Encoded:
    """A request's prompt as the router has it: ``ids`` (exact token ids of ``text``
    minus ``rest``), ``rest`` (text left for the worker to tokenize), and
    ``n_tokens`` (exact when ``rest`` is empty, else estimated from ``ids``' chars
    per token)."""

    text: str
    ids: list[int]
    rest: str
    n_tokens: int


def encode_request(
    enc: PromptEncoder, req: Any, keep_going: Callable[[list[int]], bool] | None = None
) -> Encoded:
    """The prompt of ``req``; with ``keep_going``, a chat stops early (prompts.py)."""
    if req.kind == "chat":
        text = enc.render_chat(req.messages)
        if keep_going is None:
            ids = enc.encode_text(text)
            return Encoded(text, ids, "", len(ids))
        ids, rest = enc.encode_until(text, keep_going)
        if not rest:
            return Encoded(text, ids, "", len(ids))
        done = max(len(text) - len(rest), 1)
        est = len(ids) + math.ceil(len(rest) * max(len(ids), 1) / done)
        return Encoded(text, ids, rest, est)
    p = req.prompt
    ids = list(p) if isinstance(p, list) else enc.encode_completion(p)
    return Encoded("", ids, "", len(ids))


class _Detok:
    """Incremental detokenizer: text deltas that never split a UTF-8 character."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.sent = tok, 0
        self.ids: list[int] = []

    def add(self, tid: int) -> str:
        self.ids.append(tid)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[self.sent :], len(text)
        return delta

    def flush(self) -> str:
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        delta, self.sent = text[self.sent :], len(text)
        return delta


class Router:
    """The router's state: worker view, directory client, placer, metrics, upstream."""

    def __init__(self, cfg: RouterConfig, *, store_client: Any = None) -> None:
        self.cfg = cfg
        self.view = WorkerView(cfg.etcd, cfg.cluster)
        self.store_client = store_client
        self.placer = Placer(
            PrefixView(store_client),
            cfg.policy,
            slo_s=cfg.slo_ttft_s,
            short_prompt_tokens=cfg.short_prompt_tokens,
        )
        self.metrics = RouterMetrics()
        self.upstream = Upstream(cfg.upstream_timeout_s)
        self._tokenizers: dict[str, PromptEncoder] = {}
        self._tokenizer_lock = asyncio.Lock()  # one load at a time: imports race in threads
        self._suspect: dict[str, tuple[float, str]] = {}
        self.mover = Mover(
            self.upstream, self.placer.out, self.workers, self._release, self._broke,
            cfg.max_stream_moves, self._store_nodes,
        )  # fmt: skip
        pairs = UnpairedLog()
        self.view.add_listener(lambda: pairs.check(self.view.workers().values()))

    async def start(self) -> None:
        await self.view.start()
        if self.store_client is None:
            self.store_client = await asyncio.to_thread(self._open_store)
            self.placer.prefixes.client = self.store_client

    def _open_store(self) -> Any:
        from kvstore import StoreClient

        try:  # the token comes from KVSTORE_TOKEN, as for every client
            return StoreClient.from_etcd(self.cfg.etcd, cluster=self.cfg.cluster)
        except Exception as exc:  # no directory: route without cache knowledge
            log.warning("store directory unavailable (%s); routing without prefix data", exc)
            return None

    async def stop(self) -> None:
        await self.view.stop()
        await self.upstream.aclose()
        if self.store_client is not None:
            await asyncio.to_thread(self.store_client.close)

    # -- helpers ---------------------------------------------------------------------------

    async def tokenizer(self, model: str) -> PromptEncoder:
        enc = self._tokenizers.get(model)
        if enc is None:
            async with self._tokenizer_lock:
                enc = self._tokenizers.get(model)
                if enc is None:
                    tok = await asyncio.to_thread(load_tokenizer, model)
                    enc = await asyncio.to_thread(PromptEncoder, tok)
                    self._tokenizers[model] = enc
        return enc

    def workers(self, model: str) -> list[WorkerRecord]:
        now = time.monotonic()
        out = []
        for w in self.view.workers().values():
            if w.model != model:
                continue
            bad = self._suspect.get(w.worker_id)
            if bad is not None and bad[0] > now and bad[1] == w.boot_id:
                continue
            out.append(w)
        return out

    def models(self) -> list[str]:
        return sorted({w.model for w in self.view.workers().values()})

    def codecs(self, model: str) -> dict[str, Any]:
        """The KV codec of ``model``'s pool and any unpaired workers (pairing.py)."""
        return describe_codecs([w for w in self.view.workers().values() if w.model == model])

    def _failed(self, exc: WorkerFailed, by_id: dict[str, WorkerRecord]) -> None:
        self._skip(exc.worker_id, by_id.get(exc.worker_id))
        self.metrics.retries.labels(exc.phase).inc()
        log.warning("%s; placing the request again", exc)

    def _skip(self, worker_id: str, w: WorkerRecord | None) -> None:
        """Leave a worker that failed out of placements for SUSPECT_S (or until it
        re-registers with another boot id)."""
        self._suspect[worker_id] = (time.monotonic() + SUSPECT_S, w.boot_id if w else "")

    def _broke(self, worker_id: str, reason: str) -> None:
        """A worker's decode stream broke mid-way: skip it a while, as a failed one."""
        self._skip(worker_id, self.view.workers().get(worker_id))
        self.metrics.stream_errors.inc()
        log.warning("stream on worker %s cut: %s", worker_id, reason)

    def encode(self, enc: PromptEncoder, req: GenRequest, workers: list[WorkerRecord]) -> Encoded:
        """The request's prompt, a long new message only as far as routing needs."""
        if not workers:
            return encode_request(enc, req)
        return encode_request(enc, req, self.placer.held_walk(workers))

    # -- one request -----------------------------------------------------------------------

    async def generate(self, req: GenRequest) -> Response:
        t0 = time.perf_counter()
        if not self.workers(req.model) and req.model not in self.models():
            raise APIError(
                404, f"The model `{req.model}` does not exist or is not served here.",
                param="model", code="model_not_found",
            )  # fmt: skip
        enc = await self.tokenizer(req.model)
        prompt = self.encode(enc, req, self.workers(req.model))
        tok = enc.tokenizer
        eos = sorted({i for i in (tok.eos_token_id,) if isinstance(i, int)})
        started, route = await self._run(req, prompt, eos, enc, t0)
        ttft = time.perf_counter() - t0
        n_prompt = int(started.info.get("prompt_tokens", len(prompt.ids)))
        self.metrics.ttft.labels(self.cfg.policy).observe(ttft)
        self.metrics.prompt_tokens.inc(n_prompt)
        self.metrics.cached_tokens.inc(started.cached_tokens)
        kv = self._where(route, started, ttft)
        stream = self._stream(req, started, eos, route.prefill or route.decode)
        headers = {
            "x-kvstore-prefill-worker": kv["prefill_worker"],
            "x-kvstore-decode-worker": kv["decode_worker"],
            "x-kvstore-cached-tokens": str(kv["cached_tokens"]),
            "x-kvstore-tier": kv["tier"] or "none",
            "x-kvstore-policy": self.cfg.policy,
        }
        if req.stream:
            return StreamingResponse(
                self._sse(req, tok, stream, n_prompt, kv),
                media_type="text/event-stream",
                headers=headers,
            )
        return await self._whole(req, tok, stream, n_prompt, kv, headers)

    async def _run(
        self, req: GenRequest, prompt: Encoded, eos: list[int], enc: PromptEncoder, t0: float
    ) -> tuple[Started, Route]:
        """Place the request and start it, placing it again without a worker that
        failed, up to ``max_attempts``; raises the client's error when none could."""
        exclude: set[str] = set()
        for attempt in range(self.cfg.max_attempts):
            workers = self.workers(req.model)
            if not workers:
                break
            _check_context(req, prompt, min(w.max_context for w in workers))
            nodes = self._store_nodes()
            placed = self.placer.place(
                workers, prompt.ids, req.max_tokens, frozenset(exclude), nodes,
                n_tokens=prompt.n_tokens,
            )  # fmt: skip
            if attempt == 0:
                self.metrics.decision_s.observe(time.perf_counter() - t0)
            if isinstance(placed, CodecMismatch):  # a deployment fault: no retry helps
                self.metrics.refusals.labels(self.cfg.policy).inc()
                raise APIError(503, placed.reason, type="server_error", code="kv_codec_mismatch")
            if isinstance(placed, Refusal):
                if attempt == 0:
                    self.metrics.refusals.labels(self.cfg.policy).inc()
                    raise APIError(
                        429, f"Overloaded: {placed.reason}", type="rate_limit_error",
                        code="ttft_slo", headers={"retry-after": str(self.cfg.retry_after_s)},
                    )  # fmt: skip
                break
            try:
                return await self._start(placed, req, prompt, eos, enc), placed
            except WorkerFailed as exc:
                exclude.add(exc.worker_id)
                self._failed(exc, {w.worker_id: w for w in workers})
            except WorkerRefused as exc:  # the request's fault: elsewhere would fail alike
                e = exc.error
                raise APIError(
                    400, str(e.get("message", "bad request")),
                    type=str(e.get("type") or "invalid_request_error"),
                    param=e.get("param"), code=e.get("code"),
                ) from exc  # fmt: skip
        raise APIError(503, "No worker could serve the request.", type="server_error",
                       code="no_worker")  # fmt: skip

    async def _start(
        self, route: Route, req: GenRequest, prompt: Encoded, eos: list[int], enc: PromptEncoder
    ) -> Started:
        """Run the prefill (or the whole short request) until the first token is in."""
        rid = uuid.uuid4().hex
        if route.prefill is None:
            return await self._start_whole(route, req, prompt, eos, rid)
        pre, dec, out = route.prefill, route.decode, self.placer.out
        ids, rest = prompt.ids, prompt.rest
        svc = route.estimate.service_s if route.estimate is not None else 0.0
        self.metrics.decisions.labels(self.cfg.policy, "prefill", pre.worker_id).inc()
        out.add(pre.worker_id, prefill_s=svc, running=1)
        try:
            res = await self.upstream.prefill(pre, rid, ids, rest, req.max_tokens)
        finally:
            out.add(pre.worker_id, prefill_s=-svc, running=-1)
        out.finished(pre.worker_id)
        h = res["handoff"]
        full = [int(t) for t in h["prompt"]]
        keys = route.keys
        if rest:  # the worker tokenized the rest: file it for the next turn
            self.metrics.worker_tokenized.inc()
            if full[: len(ids)] == ids:
                enc.learn(prompt.text, full)
            keys = self.placer.keys([pre], full)
        if pre.store_node and int(h.get("shared_blocks", -1)) >= 0:
            self.placer.prefixes.note(pre.store_node, keys[: int(h["shared_blocks"])])
        first = int(h["first_token"])
        cached = int(h["stats"]["cached_blocks"]) * pre.block_tokens
        info: dict[str, Any] = {"prompt_tokens": len(full), "prompt_ids": full}
        if first in eos or req.max_tokens == 1:
            finish = "stop" if first in eos else "length"
            return Started(first, cached, None, finish=finish, info=info)
        self.metrics.decisions.labels(self.cfg.policy, "decode", dec.worker_id).inc()
        reserve = len(full) + req.max_tokens
        out.add(dec.worker_id, running=1, kv=reserve)
        try:
            resp = await self.upstream.decode(dec, h, res["source_node"], req.max_tokens, eos)
        except BaseException:
            out.add(dec.worker_id, running=-1, kv=-reserve)
            raise
        info["release"] = (dec.worker_id, reserve)
        return Started(first, cached, resp, info=info)

    async def _start_whole(
        self, route: Route, req: GenRequest, prompt: Encoded, eos: list[int], rid: str
    ) -> Started:
        """A short request, prefill and decode on one worker: until its first token."""
        dec, out = route.decode, self.placer.out
        ids, rest = prompt.ids, prompt.rest
        reserve = prompt.n_tokens + req.max_tokens
        svc = route.estimate.service_s if route.estimate is not None else 0.0
        self.metrics.decisions.labels(self.cfg.policy, "both", dec.worker_id).inc()
        out.add(dec.worker_id, prefill_s=svc, running=1, kv=reserve)
        try:
            st = await self.upstream.generate(dec, rid, ids, req.max_tokens, eos, rest)
        except BaseException:
            out.add(dec.worker_id, running=-1, kv=-reserve)
            raise
        finally:
            out.add(dec.worker_id, prefill_s=-svc)
        out.finished(dec.worker_id)
        st.info["release"] = (dec.worker_id, reserve)
        st.info.setdefault("prompt_tokens", len(ids))
        if not rest:  # else the worker's own tokenization, when it says it
            st.info["prompt_ids"] = ids
        if rest:
            self.metrics.worker_tokenized.inc()
        shared = int(st.info.get("shared_blocks", -1))
        if dec.store_node and shared > 0 and not rest:
            self.placer.prefixes.note(dec.store_node, route.keys[:shared])
        return st

    def _release(self, st: Started) -> None:
        rel = st.info.pop("release", None)
        if rel is not None:
            self.placer.out.add(rel[0], running=-1, kv=-rel[1])

    def _where(self, route: Route, st: Started, ttft: float) -> dict[str, Any]:
        pre = route.prefill or route.decode
        return {
            "prefill_worker": pre.worker_id,
            "decode_worker": route.decode.worker_id,
            "cached_tokens": st.cached_tokens,
            "tier": route.tier if st.cached_tokens else None,
            "expected_cached_tokens": route.expected_cached,
            "policy": self.cfg.policy,
            "short_prompt": route.prefill is None,
            "estimated_ttft_ms": round(route.estimate.ttft_s * 1e3, 3) if route.estimate else None,
            "ttft_ms": round(ttft * 1e3, 3),
        }

    def _stream(self, req: GenRequest, st: Started, eos: list[int], near: WorkerRecord) -> Stream:
        """The answer's stream; ``near``: the worker whose store has the prompt's blocks."""
        rel = st.info.get("release")
        ids = st.info.get("prompt_ids")
        prompt = [int(t) for t in ids] if isinstance(ids, list) else None
        wid = rel[0] if rel else ""
        return Stream(req.model, prompt, req.max_tokens, eos, st, wid, near=near)

    def _store_nodes(self) -> Mapping[str, Any]:
        """The store's nodes as the mirror sees them (none before it is open)."""
        return self.store_client.nodes() if self.store_client is not None else {}

    async def _sse(
        self, req: GenRequest, tok: Any, s: Stream, n_prompt: int, kv: dict
    ) -> AsyncIterator[bytes]:
        def event(obj: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

        detok = _Detok(tok)
        try:
            yield event(chunk(req, detok.add(s.current.first), first=True))
            try:
                async for t in self.mover.follow(s):
                    delta = detok.add(t)
                    if delta:
                        yield event(chunk(req, delta))
            except StreamCut as exc:
                err = {"message": f"The decode worker failed mid-stream: {exc}",
                       "type": "server_error", "param": None, "code": "worker_failed"}  # fmt: skip
                yield event({"error": err})
                return
            tail = detok.flush()
            yield event(chunk(req, tail or None, s.current.finish))
            if req.include_usage:
                yield event(chunk(req, None, usage=(n_prompt, len(s.sent), self._moved(kv, s))))
            yield b"data: [DONE]\n\n"
            self.metrics.requests.labels(req.kind, "200").inc()
        finally:
            self._release(s.current)
            await s.current.close()

    @staticmethod
    def _moved(kv: dict[str, Any], s: Stream) -> dict[str, Any]:
        """``usage.kvstore``, with the workers a moved stream went on on."""
        return {**kv, "resumed_on": s.resumed_on} if s.resumed_on else kv

    async def _whole(
        self, req: GenRequest, tok: Any, s: Stream, n_prompt: int,
        kv: dict[str, Any], headers: dict[str, str],
    ) -> Response:  # fmt: skip
        try:
            async for _ in self.mover.follow(s):
                pass
        except StreamCut as exc:
            raise APIError(502, f"The decode worker failed: {exc}", type="server_error",
                           code="worker_failed") from exc  # fmt: skip
        finally:
            self._release(s.current)
            await s.current.close()
        text = tok.decode(s.sent, skip_special_tokens=True)
        body = completion(req, text, s.current.finish, n_prompt, len(s.sent), self._moved(kv, s))
        self.metrics.requests.labels(req.kind, "200").inc()
        return JSONResponse(body, headers=headers)

    # -- app -------------------------------------------------------------------------------

    def app(self) -> Starlette:
        async def gen(request: Request, kind: str) -> Response:
            try:
                req = parse_request(await request.body(), kind, self.cfg.default_max_tokens)
                return await self.generate(req)
            except APIError as exc:
                self.metrics.requests.labels(kind, str(exc.status)).inc()
                return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

        async def chat(request: Request) -> Response:
            return await gen(request, "chat")

        async def completions(request: Request) -> Response:
            return await gen(request, "completion")

        async def models(_request: Request) -> Response:
            data = [{"id": m, "object": "model", "created": 0, "owned_by": "kvstore",
                     **self.codecs(m)} for m in self.models()]  # fmt: skip
            return JSONResponse({"object": "list", "data": data})

        async def health(_request: Request) -> Response:
            ws = self.view.workers()
            roles = {
                r: sum(w.role == r for w in ws.values()) for r in ("prefill", "decode", "both")
            }
            ok = any(w.can_decode for w in ws.values())
            sc = self.store_client
            body = {"status": "ok" if ok else "no_workers", "policy": self.cfg.policy,
                    "workers": roles, "models": self.models(),
                    "kv_codecs": {m: self.codecs(m) for m in self.models()},
                    "directory": sc.mirror.stats() if sc is not None else None}  # fmt: skip
            return JSONResponse(body, status_code=200 if ok else 503)

        async def metrics(_request: Request) -> Response:
            return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

        @contextlib.asynccontextmanager
        async def lifespan(_app: Starlette) -> AsyncIterator[None]:
            await self.start()
            try:
                yield
            finally:
                await self.stop()

        return Starlette(
            routes=[
                HttpRoute("/v1/chat/completions", chat, methods=["POST"]),
                HttpRoute("/v1/completions", completions, methods=["POST"]),
                HttpRoute("/v1/models", models, methods=["GET"]),
                HttpRoute("/health", health, methods=["GET"]),
                HttpRoute("/metrics", metrics, methods=["GET"]),
            ],
            lifespan=lifespan,
        )


def _check_context(req: GenRequest, prompt: Encoded, ctx: int) -> None:
    """Refuse a prompt and answer over the model's context (the OpenAI error); a prompt
    with a part left to the worker to tokenize is the worker's to check."""
    n = len(prompt.ids)
    if prompt.rest or n + req.max_tokens <= ctx:
        return
    what = "messages" if req.kind == "chat" else "prompt"
    raise APIError(
        400,
        f"This model's maximum context length is {ctx} tokens. However, you requested "
        f"{n + req.max_tokens} tokens ({n} in the {what}, {req.max_tokens} in the "
        "completion). Please reduce the length of the prompt or completion.",
        param=what,
        code="context_length_exceeded",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``kvstore router`` (also ``python -m engine.serving.router``)."""
    p.add_argument("--etcd", default=None, help="etcd HOST:PORT (KVSTORE_ETCD; 127.0.0.1:2379)")
    p.add_argument("--cluster", default=None, help="cluster name in etcd (KVSTORE_CLUSTER)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0 picks one)")
    p.add_argument("--policy", default="cache_aware",
                   help="cache_aware, round_robin, least_loaded or longest_prefix")  # fmt: skip
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="refuse (429) when no worker can start a request within this")  # fmt: skip
    p.add_argument("--short-prompt-tokens", type=int, default=256,
                   help="prompts shorter than this skip the prefill pool")  # fmt: skip
    p.add_argument("--max-attempts", type=int, default=3, help="placements tried per request")
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--max-stream-moves", type=int, default=2,
                   help="times a broken decode stream may go on on another worker")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    slo = args.slo_ttft_ms / 1e3 if args.slo_ttft_ms is not None else None
    return RouterConfig(
        etcd=args.etcd, cluster=args.cluster, policy=args.policy, slo_ttft_s=slo,
        short_prompt_tokens=args.short_prompt_tokens, max_attempts=args.max_attempts,
        default_max_tokens=args.default_max_tokens, max_stream_moves=args.max_stream_moves,
    )  # fmt: skip


def run_router(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / SIGINT; prints one JSON ready line with the URL."""
    resolve_directory(args)
    router = Router(config_from_args(args))
    sock = bind(args.host, args.port)
    url = f"http://{args.host}:{sock.getsockname()[1]}"
    serve_app(router.app(), sock, {"url": url, "pid": os.getpid(), "policy": args.policy})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore router", description=__doc__.split("\n")[0])
    add_arguments(p)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    return run_router(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
