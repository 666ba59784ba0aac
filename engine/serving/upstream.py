"""The router's calls to workers (httpx), and what a failed call means.

Two kinds of failure, kept apart because the client must see them differently:

- :class:`WorkerFailed`: a call failed before anything reached the client (connect
  refused, the worker died during a prefill, a 5xx): the router places the request
  again, elsewhere.
- :class:`StreamCut`: a token stream ended without its ``done`` line or broke
  mid-way: tokens were already sent, so the client gets an error event, never a
  silently short answer.

And one that is the request's own fault, not the worker's: :class:`WorkerRefused`
(HTTP 400, e.g. a prompt the router did not tokenize whole turned out longer than the
context). Placing it elsewhere would fail alike, so the client gets the error.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["Started", "StreamCut", "Upstream", "WorkerFailed", "WorkerRefused"]


class WorkerFailed(Exception):
    """A worker call failed before the client saw anything: retry elsewhere."""

    def __init__(self, worker_id: str, phase: str, detail: str) -> None:
        super().__init__(f"{phase} on worker {worker_id} failed: {detail}")
        self.worker_id, self.phase = worker_id, phase


class WorkerRefused(Exception):
    """The worker answered 400: the request itself is wrong. ``error`` is the worker's
    error object (message, type, and code/param where it gave them)."""

    def __init__(self, worker_id: str, error: dict[str, Any]) -> None:
        super().__init__(str(error.get("message", "bad request")))
        self.worker_id, self.error = worker_id, error


def _refused(w: Any, status: int, body: bytes) -> WorkerRefused | None:
    if status != 400:
        return None
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return WorkerRefused(w.worker_id, err) if isinstance(err, dict) else None


class StreamCut(Exception):
    """A token stream broke after tokens were sent to the client."""


@dataclass
class Started:
    """A request whose first token is known; ``rest`` streams the later tokens.

    ``finish`` is set once ``rest`` is exhausted (``stop`` or ``length``).
    """

    first: int
    cached_tokens: int
    response: httpx.Response | None
    finish: str = "length"
    completion_tokens: int = 1
    info: dict[str, Any] = field(default_factory=dict)

    async def rest(self) -> AsyncIterator[int]:
        """Tokens after the first, then sets ``finish``; raises StreamCut on a break."""
        if self.response is None:
            return
        try:
            async for line in self.response.aiter_lines():
                if not line:
                    continue
                item = json.loads(line)
                if "token" in item:
                    yield int(item["token"])
                elif item.get("done"):
                    self.finish = str(item.get("finish_reason", "length"))
                    self.completion_tokens = int(item.get("completion_tokens", 0))
                    return
                elif "error" in item:
                    raise StreamCut(str(item["error"]))
        except (httpx.HTTPError, ValueError) as exc:
            raise StreamCut(f"the decode worker's stream broke: {exc!r}") from exc
        finally:
            await self.response.aclose()
        raise StreamCut("the decode worker's stream ended without finishing")

    async def close(self) -> None:
        if self.response is not None:
            await self.response.aclose()


class Upstream:
    """httpx calls to workers; one pooled client for the router's lifetime."""

    def __init__(self, timeout_s: float = 120.0) -> None:
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=64),
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    async def prefill(
        self, w: Any, request_id: str, prompt: list[int], rest: str = "", max_tokens: int = 0
    ) -> dict[str, Any]:
        """Prefill ``prompt`` (then ``rest``, text the worker tokenizes) on ``w``."""
        body: dict[str, Any] = {"request_id": request_id, "prompt": prompt}
        if rest:
            body["rest"] = rest
        if max_tokens:
            body["max_tokens"] = max_tokens
        try:
            r = await self.client.post(w.address + "/prefill", json=body)
        except httpx.HTTPError as exc:
            raise WorkerFailed(w.worker_id, "prefill", repr(exc)) from exc
        refused = _refused(w, r.status_code, r.content)
        if refused is not None:
            raise refused
        if r.status_code != 200:
            raise WorkerFailed(w.worker_id, "prefill", f"HTTP {r.status_code}: {r.text[:200]}")
        return dict(r.json())

    async def _open(self, w: Any, path: str, body: dict[str, Any], phase: str) -> httpx.Response:
        req = self.client.build_request("POST", w.address + path, json=body)
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise WorkerFailed(w.worker_id, phase, repr(exc)) from exc
        if resp.status_code != 200:
            text = await resp.aread()
            await resp.aclose()
            refused = _refused(w, resp.status_code, text)
            if refused is not None:
                raise refused
            raise WorkerFailed(w.worker_id, phase, f"HTTP {resp.status_code}: {text[:200]!r}")
        return resp

    async def decode(
        self, w: Any, handoff: dict[str, Any], source: str, max_tokens: int, stop: list[int]
    ) -> httpx.Response:
        body = {"handoff": handoff, "source_node": source, "max_tokens": max_tokens}
        return await self._open(w, "/decode", {**body, "stop_ids": stop}, "decode")

    async def generate(
        self,
        w: Any,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        stop: list[int],
        rest: str = "",
    ) -> Started:
        """Start a whole generation on one worker; returns once its first token is in."""
        body: dict[str, Any] = {"request_id": request_id, "prompt": prompt}
        body["max_tokens"] = max_tokens
        if rest:
            body["rest"] = rest
        resp = await self._open(w, "/generate", {**body, "stop_ids": stop}, "generate")
        lines = resp.aiter_lines()
        try:
            head: dict[str, Any] = {}
            info: dict[str, Any] = {}
            while "token" not in head and "done" not in head:
                line = await anext(lines)
                item = json.loads(line) if line else {}
                if "prefill" in item:
                    info = item["prefill"]
                head = item
        except (httpx.HTTPError, StopAsyncIteration, ValueError) as exc:
            await resp.aclose()
            raise WorkerFailed(w.worker_id, "generate", repr(exc)) from exc
        except BaseException:  # cancelled (the client left): the worker stops at once
            await resp.aclose()
            raise
        if "done" in head:  # max_tokens reached before a token: cannot happen (>= 1)
            await resp.aclose()
            raise WorkerFailed(w.worker_id, "generate", "finished without a token")
        st = Started(int(head["token"]), int(info.get("cached_tokens", 0)), None, info=info)
        st.response = _Rest(resp, lines)  # type: ignore[assignment]
        return st


class _Rest:
    """An open response whose line iterator was already started (duck-types the two
    methods :meth:`Started.rest` uses)."""

    def __init__(self, resp: httpx.Response, lines: AsyncIterator[str]) -> None:
        self._resp, self._lines = resp, lines

    def aiter_lines(self) -> AsyncIterator[str]:
        return self._lines

    async def aclose(self) -> None:
        await self._resp.aclose()
