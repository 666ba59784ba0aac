"""The OpenAI wire format: request validation, response and chunk objects, errors.

Only what the router serves: /v1/completions and /v1/chat/completions, greedy
decoding, one choice. Everything a request gets wrong is an :class:`APIError` with
OpenAI's error object (``{"error": {"message", "type", "param", "code"}}``) and the
status OpenAI uses: 400 for a bad body, 404 for an unknown model, 429 for overload,
5xx for the serving path failing.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = ["APIError", "GenRequest", "chunk", "completion", "error_body", "parse_request"]


class APIError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code = param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class GenRequest:
    """A validated generation request (chat or completion)."""

    kind: str  # "chat" or "completion"
    model: str
    max_tokens: int
    stream: bool
    include_usage: bool
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt: str | list[int] = ""
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def parse_request(raw: bytes, kind: str, default_max_tokens: int = 256) -> GenRequest:
    """Validate a body; raises :class:`APIError` (400) for anything unusable."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("you must provide a model parameter", "model")
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise _bad("n > 1 is not supported: this server returns one choice", "n", "unsupported")
    mt_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = body.get(mt_name)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise _bad(f"{mt_name} must be a positive integer, got {max_tokens!r}", mt_name)
    if body.get("stop") not in (None, [], ""):
        raise _bad("stop sequences are not supported yet", "stop", "unsupported")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream must be true or false", "stream")
    opts = body.get("stream_options") or {}
    include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
    req = GenRequest(kind, model, max_tokens, stream, include_usage)
    if kind == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _bad("messages must be a non-empty list", "messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad(f"messages[{i}] needs a role", f"messages[{i}]")
            content = m.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                parts = [p.get("text", "") for p in content if isinstance(p, dict)]
                m = {**m, "content": "".join(str(p) for p in parts)}
            elif not isinstance(content, str):
                raise _bad(f"messages[{i}].content must be a string", f"messages[{i}].content")
            req.messages.append({"role": m["role"], "content": m["content"]})
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            req.prompt = [int(t) for t in prompt]
        elif isinstance(prompt, str) and prompt:
            req.prompt = prompt
        else:
            raise _bad("prompt must be a non-empty string or list of token ids", "prompt")
    return req


def _usage(prompt: int, completion_tokens: int, kv: dict[str, Any]) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": kv.get("cached_tokens", 0)},
        "kvstore": kv,
    }


def completion(
    req: GenRequest, text: str, finish: str, prompt: int, n_out: int, kv: dict[str, Any]
) -> dict[str, Any]:
    """The whole (non-streamed) response object."""
    if req.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish,
            "logprobs": None,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return {
        "id": ("chatcmpl-" if req.kind == "chat" else "cmpl-") + req.id,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "choices": [choice],
        "usage": _usage(prompt, n_out, kv),
    }


def chunk(
    req: GenRequest,
    text: str | None,
    finish: str | None = None,
    *,
    first: bool = False,
    usage: tuple[int, int, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One streamed chunk: a text delta, a finish, or (``usage``) the closing usage."""
    choices: list[dict[str, Any]] = []
    if usage is None:
        if req.kind == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choices = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        else:
            choices = [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]
    out: dict[str, Any] = {
        "id": ("chatcmpl-" if req.kind == "chat" else "cmpl-") + req.id,
        "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
        "created": req.created,
        "model": req.model,
        "choices": choices,
    }
    if usage is not None:
        out["usage"] = _usage(*usage)
    return out
