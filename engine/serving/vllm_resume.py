"""A streamed vLLM answer whose decode server dies mid-way goes on on another one.

Why: ``kvstore vllm-router`` relays a decode server's stream as it comes. When that
server died after the client saw tokens, the stream just ended, and the client had to
ask again and pay the prompt again. The router can go on instead, as
engine/serving/resume.py does for ``kvstore worker`` pools:

- it asks the decode server for the stream's token ids (vLLM's ``return_token_ids``),
  and strips them from what the client gets unless the client asked for them;
- :class:`Answer` keeps the prompt's ids (vLLM's own tokenization, from the first
  chunk), the ids generated so far, and the stream's id, model and creation time;
- when the stream breaks before its end, the rest is asked of another decode server as
  a completion whose prompt is those ids (``/v1/completions``, prompt as token ids,
  with the request's sampling settings and what is left of its token limit). That
  server's connector loads the prompt's blocks from the store; only the generated tail
  is computed again. With greedy sampling the rest is the same continuation, up to
  the float rounding of that tail; with sampling it is a continuation drawn anew. The
  client keeps one stream in its own format (chat deltas or completion text), one
  finish reason, and one usage chunk counting the whole answer.

Only answers the router can continue move: one choice (``n`` of 1), no ``echo``, no
``logprobs``, no tools and no structured output (their parser state lives in the
server that died), no stop strings (the server holds back text that may begin one, and
a stop string may span the cut), no presence or frequency penalty (they count output
tokens, which become prompt), and no reasoning seen in the stream (a reasoning parser's
state). Others end with an error event, as every cut stream did before. A stream that
breaks with an error event of the server's (vLLM sends one when its engine dies under
a live API server) moves like one whose connection broke.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

__all__ = ["Answer", "StreamRelay", "resumable", "with_token_ids"]

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"

# what a continuation carries over of the request (vLLM's sampling settings)
_CARRIED = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos",
    "repetition_penalty", "skip_special_tokens", "spaces_between_special_tokens",
    "logit_bias", "bad_words", "user", "cache_salt",
)  # fmt: skip
_NOT_RESUMABLE = ("echo", "logprobs", "top_logprobs", "tools", "functions", "response_format",
                  "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                  "structured_outputs", "prompt_logprobs", "stop")  # fmt: skip
_OUTPUT_PENALTIES = ("presence_penalty", "frequency_penalty")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # vLLM's /v1/completions without max_tokens


def resumable(path: str, body: dict[str, Any]) -> bool:
    """Whether a cut stream of this request can go on elsewhere (module docstring)."""
    if not body.get("stream") or int(body.get("n") or 1) != 1:
        return False
    prompt = body.get("prompt")
    if not path.endswith("/chat/completions") and (
        not isinstance(prompt, (str, list)) or _many_prompts(prompt)
    ):
        return False
    if any(float(body.get(k) or 0) != 0 for k in _OUTPUT_PENALTIES):
        return False
    return not any(_asked(body.get(k)) for k in _NOT_RESUMABLE)


def _asked(value: Any) -> bool:
    """Whether a request field asks for something: ``logprobs: 0`` does (vLLM returns
    the chosen token's), an absent, null, false or empty one does not."""
    if value is None or value is False:
        return False
    return not (isinstance(value, (str, list, dict)) and not value)


def _many_prompts(prompt: Any) -> bool:
    return isinstance(prompt, list) and any(not isinstance(p, int) for p in prompt)


def with_token_ids(body: dict[str, Any]) -> dict[str, Any]:
    """The request as sent to the decode server: token ids in its stream."""
    return {**body, "return_token_ids": True}


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class Answer:
    """What the router has seen of one streamed answer, and what going on needs."""

    def __init__(self, path: str, body: dict[str, Any]) -> None:
        self.chat = path.endswith("/chat/completions")
        self.body = body
        self.client_ids = bool(body.get("return_token_ids"))
        self.stream_options = {
            k: v
            for k, v in (body.get("stream_options") or {}).items()
            if k in ("include_usage", "continuous_usage_stats") and v
        }
        self.usage = bool(self.stream_options.get("include_usage"))
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if not limit and not self.chat:
            limit = COMPLETION_DEFAULT_MAX_TOKENS  # what the first server went by
        self.limit = int(limit) if limit else None
        self.reasoning = False  # a reasoning parser's output was seen: cannot move
        self.prompt: list[int] | None = None
        self.generated: list[int] = []
        self.finished = False
        self.usage_sent = False
        self.head: dict[str, Any] = {}

    def observe(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Take note of one chunk of the first server's stream; the chunk for the client."""
        if not self.head and "id" in obj:
            self.head = {k: obj[k] for k in ("id", "created", "model") if k in obj}
        ids = obj.get("prompt_token_ids")
        # the closing usage chunk has no choices (continuous stats ride on every chunk)
        self.usage_sent = self.usage_sent or bool(obj.get("usage") and not obj.get("choices"))
        for choice in obj.get("choices") or ():
            ids = ids or choice.get("prompt_token_ids")
            delta = choice.get("delta") or {}
            self.reasoning = self.reasoning or bool(
                delta.get("reasoning_content") or delta.get("reasoning")
            )
            self._take(choice)
        if isinstance(ids, list) and self.prompt is None:
            self.prompt = [int(t) for t in ids]
        return obj if self.client_ids else _without_ids(obj)

    def _take(self, choice: dict[str, Any]) -> None:
        self.generated += [int(t) for t in choice.get("token_ids") or ()]
        if choice.get("finish_reason"):
            self.finished = True

    def left(self) -> int | None:
        """Tokens still to generate (None: no limit was given)."""
        return None if self.limit is None else self.limit - len(self.generated)

    def continuation(self) -> dict[str, Any]:
        """The rest of the answer, asked as a completion of the ids so far."""
        assert self.prompt is not None
        cont = {k: self.body[k] for k in _CARRIED if k in self.body}
        cont.update(model=self.body.get("model"), prompt=self.prompt + self.generated,
                    stream=True, return_token_ids=True)  # fmt: skip
        # No limit (a chat's): null, for the context's room, not /v1/completions' 16.
        cont["max_tokens"] = self.left()
        if self.body.get("min_tokens"):
            cont["min_tokens"] = max(int(self.body["min_tokens"]) - len(self.generated), 0)
        if self.stream_options:
            cont["stream_options"] = dict(self.stream_options)
        return cont

    def convert(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """A chunk of a continuation (a completion) as the client's stream has them."""
        choices = []
        for choice in obj.get("choices") or ():
            self._take(choice)
            choices.append(self._choice(choice))
        usage = obj.get("usage")
        if not choices and not usage:
            return None
        out: dict[str, Any] = {
            **self.head,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "choices": choices,
        }
        if usage:
            self.usage_sent = self.usage_sent or not choices
            n = len(self.prompt or ())
            out["usage"] = {"prompt_tokens": n, "completion_tokens": len(self.generated),
                            "total_tokens": n + len(self.generated)}  # fmt: skip
        return out

    def _choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        text, finish = choice.get("text") or "", choice.get("finish_reason")
        out: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.chat:
            out["delta"] = {"content": text} if text else {}
        else:
            out["text"] = text
        if self.client_ids:
            out["token_ids"] = choice.get("token_ids") or []
        return out

    def closing(self) -> list[bytes]:
        """The end of an answer whose last token (or finish) came before its stream
        broke: its finish, when not sent, and its usage, when asked and not sent."""
        out = []
        if not self.finished:
            done = self.convert({"choices": [{"text": "", "finish_reason": "length"}]})
            out += [_event(done)] if done is not None else []
        if self.usage and not self.usage_sent:
            usage = self.convert({"choices": [], "usage": {"total_tokens": 0}})
            out += [_event(usage)] if usage is not None else []
        return out


def _without_ids(obj: dict[str, Any]) -> dict[str, Any]:
    obj.pop("prompt_token_ids", None)
    for choice in obj.get("choices") or ():
        choice.pop("token_ids", None)
        choice.pop("prompt_token_ids", None)
    return obj


def _error_text(obj: dict[str, Any]) -> str:
    err = obj.get("error", obj)
    return str(err.get("message", err) if isinstance(err, dict) else err)[:200]


async def _data(resp: httpx.Response) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent event stream."""
    async for line in resp.aiter_lines():
        if line.startswith("data:"):
            yield line[5:].strip()


Opened = tuple[Any, httpx.Response]  # (the server, its open streamed response)


class StreamRelay:
    """Relays one answer, moving it when its stream breaks (module docstring).

    ``reopen(body, tried)``: a continuation's stream on a decode server whose URL is
    not in ``tried`` (None: none took it); ``done(server, broke)``: the router's books
    for a stream that ended there, ``broke`` when the server broke it (no [DONE]: cut,
    or an error event), not when it ended or the client left."""

    def __init__(
        self,
        answer: Answer,
        reopen: Callable[[dict[str, Any], set[str]], Awaitable[Opened | None]],
        done: Callable[[Any, bool], None],
        stats: dict[str, int],
        max_moves: int = 2,
    ) -> None:
        self.answer = answer
        self.reopen = reopen
        self.done = done
        self.stats = stats
        self.max_moves = max_moves

    async def events(self, server: Any, resp: httpx.Response) -> AsyncIterator[bytes]:
        """The client's stream: the first server's, then each continuation's."""
        tried: set[str] = set()
        a, moved = self.answer, 0
        while True:
            why = ""  # why the server broke the stream (none when it ended, or we left)
            try:
                async for data in _data(resp):
                    if data == "[DONE]":
                        yield DONE
                        return
                    obj = json.loads(data)
                    if "error" in obj or obj.get("object") == "error":  # its engine died
                        why = f"the server sent an error: {_error_text(obj)}"
                        break
                    out = a.convert(obj) if moved else a.observe(obj)
                    if out is not None:
                        yield _event(out)
                why = why or "the stream ended before [DONE]"
            except (httpx.HTTPError, ValueError) as exc:
                why = f"{type(exc).__name__}: {exc}"
            finally:
                await resp.aclose()
                self.done(server, bool(why))
            tried.add(server.url)
            if a.finished or a.left() == 0:  # its end was sent, or is all that is left
                for chunk in a.closing():
                    yield chunk
                yield DONE
                return
            nxt = await self._next(why, moved, tried)
            if nxt is None:
                err = {"message": f"The decode server failed mid-stream: {why}",
                       "type": "server_error", "param": None, "code": "worker_failed"}  # fmt: skip
                yield _event({"error": err})
                return
            (server, resp), moved = nxt, moved + 1

    async def _next(self, why: str, moved: int, tried: set[str]) -> Opened | None:
        a = self.answer
        if a.prompt is None or a.reasoning or moved >= self.max_moves:
            return None
        log.warning("a decode stream broke (%s); going on on another server", why)
        nxt = await self.reopen(self.answer.continuation(), tried)
        if nxt is not None:
            self.stats["stream_resumes"] = self.stats.get("stream_resumes", 0) + 1
        return nxt
