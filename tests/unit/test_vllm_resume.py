"""Going on with a cut vLLM stream (engine/serving/vllm_resume.py), over scripted streams
in vLLM's chunk format: what the continuation asks for, what the client's stream says
across the move (its own format, ids stripped, one usage), and which requests do not
move. The real thing, with a decode server SIGKILLed mid-stream:
tests/vllm/test_vllm_serve.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from engine.serving.vllm_resume import Answer, StreamRelay, resumable, with_token_ids


@dataclass
class Server:
    url: str


class Lines:
    """A streamed response: these SSE payloads, then [DONE] or a broken connection."""

    def __init__(self, chunks: list[dict[str, Any]], end: str) -> None:
        self.chunks, self.end = chunks, end
        self.closed = False

    async def aiter_lines(self) -> AsyncIterator[str]:
        for c in self.chunks:
            yield "data: " + json.dumps(c)
            yield ""
        if self.end == "done":
            yield "data: [DONE]"
        else:
            raise httpx.RemoteProtocolError("peer closed connection")

    async def aclose(self) -> None:
        self.closed = True


def chat_chunk(ids: list[int], text: str, *, prompt: list[int] | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"id": "chatcmpl-1", "created": 7, "model": "m",
                         "object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": {"content": text},
                                      "finish_reason": None, "token_ids": ids}]}  # fmt: skip
    if prompt is not None:
        c["prompt_token_ids"] = prompt
    return c


def completion_chunk(ids: list[int], text: str, finish: str | None = None) -> dict[str, Any]:
    return {"id": "cmpl-9", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": finish,
                         "token_ids": ids}]}  # fmt: skip


class Pool:
    """``reopen``: hands out the scripted continuations in order, and records asks."""

    def __init__(self, *continuations: Lines) -> None:
        self.continuations = list(continuations)
        self.asked: list[tuple[dict[str, Any], set[str]]] = []
        self.ended: list[str] = []
        self.broke: list[str] = []  # the servers that broke their stream

    async def reopen(self, body: dict[str, Any], tried: set[str]) -> Any:
        self.asked.append((body, set(tried)))
        if not self.continuations:
            return None
        return Server(f"http://s{len(self.asked)}"), self.continuations.pop(0)

    def done(self, server: Server, broke: bool) -> None:
        self.ended.append(server.url)
        if broke:
            self.broke.append(server.url)


def relay(path: str, body: dict[str, Any], first: Lines, pool: Pool) -> list[Any]:
    stats: dict[str, int] = {}
    r = StreamRelay(Answer(path, body), pool.reopen, pool.done, stats)

    async def run() -> list[bytes]:
        return [e async for e in r.events(Server("http://s0"), first)]  # type: ignore[arg-type]

    out = []
    for event in asyncio.run(run()):
        data = event.decode().removeprefix("data: ").strip()
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "max_tokens": 5,
    "temperature": 0.0,
    "seed": 3,
    "stream_options": {"include_usage": True},
}


def test_a_cut_chat_stream_goes_on_as_a_completion_of_the_ids_so_far() -> None:
    first = Lines([chat_chunk([], "", prompt=[1, 2, 3]), chat_chunk([10], "a"),
                   chat_chunk([11], "b")], end="cut")  # fmt: skip
    usage = {"id": "cmpl-9", "choices": [], "usage": {"prompt_tokens": 5}}
    rest = Lines([completion_chunk([12], "c"), completion_chunk([13], "d"),
                  completion_chunk([14], "e", "length"), usage], end="done")  # fmt: skip
    pool = Pool(rest)
    got = relay("/v1/chat/completions", CHAT, first, pool)
    body, tried = pool.asked[0]
    assert body == {"model": "m", "prompt": [1, 2, 3, 10, 11], "max_tokens": 3, "stream": True,
                    "return_token_ids": True, "temperature": 0.0, "seed": 3,
                    "stream_options": {"include_usage": True}}  # fmt: skip
    assert tried == {"http://s0"} and pool.ended == ["http://s0", "http://s1"]
    assert pool.broke == ["http://s0"]  # the one that ended with [DONE] did not break
    assert got[-1] == "[DONE]"
    chunks = got[:-1]
    assert all(c["id"] == "chatcmpl-1" and c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(ch["delta"].get("content", "") for c in chunks for ch in c["choices"])
    assert text == "abcde"
    assert not any("token_ids" in ch for c in chunks for ch in c["choices"])  # not asked for
    assert not any("prompt_token_ids" in c for c in chunks)
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"]][-1] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


def test_a_stream_cut_after_its_last_token_ends_without_moving() -> None:
    body = {"model": "m", "prompt": [1, 2], "stream": True, "max_tokens": 2}
    first = Lines([{**completion_chunk([10], "a"), "choices": [{
        "index": 0, "text": "a", "finish_reason": None, "token_ids": [10],
        "prompt_token_ids": [1, 2]}]}, completion_chunk([11], "b")], end="cut")  # fmt: skip
    pool = Pool()
    got = relay("/v1/completions", body, first, pool)
    assert pool.asked == []
    assert got[-2]["choices"][0]["finish_reason"] == "length" and got[-1] == "[DONE]"


def test_a_stream_that_cannot_move_ends_in_an_error_event() -> None:
    first = Lines([chat_chunk([], "", prompt=[1]), chat_chunk([10], "a")], end="cut")
    pool = Pool()  # no server takes the rest
    got = relay("/v1/chat/completions", CHAT, first, pool)
    assert len(pool.asked) == 1
    assert got[-1]["error"]["code"] == "worker_failed"
    assert "mid-stream" in got[-1]["error"]["message"]
    cut_again = Lines([completion_chunk([11], "b")], end="cut")
    pool = Pool(cut_again, Lines([], end="cut"), Lines([], end="done"))
    got = relay("/v1/chat/completions", CHAT, Lines(first.chunks, "cut"), pool)
    assert len(pool.asked) == 2  # at most two moves
    assert pool.asked[1][1] == {"http://s0", "http://s1"}  # never back where it broke
    assert "error" in got[-1]


@pytest.mark.parametrize(
    ("path", "body", "ok"),
    [
        ("/v1/chat/completions", {"stream": True, "messages": []}, True),
        ("/v1/completions", {"stream": True, "prompt": "text"}, True),
        ("/v1/completions", {"stream": True, "prompt": [1, 2, 3]}, True),
        ("/v1/completions", {"stream": True, "prompt": ["a", "b"]}, False),  # two prompts
        ("/v1/completions", {"stream": False, "prompt": "x"}, False),  # fails over whole
        ("/v1/chat/completions", {"stream": True, "n": 2}, False),
        ("/v1/chat/completions", {"stream": True, "tools": [{}]}, False),
        ("/v1/chat/completions", {"stream": True, "logprobs": True}, False),
        ("/v1/completions", {"stream": True, "prompt": "x", "echo": True}, False),
        ("/v1/completions", {"stream": True, "prompt": "x", "logprobs": 0}, False),  # asked
        ("/v1/chat/completions", {"stream": True, "tools": []}, True),  # none asked
        ("/v1/chat/completions", {"stream": True, "stop": ["</a>"]}, False),  # held back
        ("/v1/chat/completions", {"stream": True, "stop": []}, True),
        ("/v1/chat/completions", {"stream": True, "presence_penalty": 0.5}, False),
        ("/v1/chat/completions", {"stream": True, "frequency_penalty": 0.0}, True),
    ],
)
def test_which_requests_can_move(path: str, body: dict[str, Any], ok: bool) -> None:
    assert resumable(path, body) is ok
    assert with_token_ids(body)["return_token_ids"] is True and "return_token_ids" not in body


def test_a_continuation_keeps_the_requests_own_limit_when_it_gave_none() -> None:
    """No max_tokens: a chat may run to the context's end (null), a completion to vLLM's
    default of 16 in all, never /v1/completions' 16 more. cache_salt goes along."""
    chat = Answer("/v1/chat/completions", {"stream": True, "model": "m", "cache_salt": "t1"})
    chat.observe(chat_chunk([10, 11], "ab", prompt=[1, 2]))
    cont = chat.continuation()
    assert cont["max_tokens"] is None and cont["cache_salt"] == "t1"
    done = Answer("/v1/completions", {"stream": True, "model": "m", "prompt": [1, 2]})
    done.observe({**completion_chunk([10, 11, 12], "abc"), "prompt_token_ids": [1, 2]})
    assert done.continuation()["max_tokens"] == 13


def error_event(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "InternalServerError", "code": 500}}


def test_an_error_event_from_the_server_moves_the_stream_and_is_never_dropped() -> None:
    """vLLM ends a stream whose engine died with an error event and [DONE]: that is a
    break, before a move and after one; when nothing takes the rest the client gets
    worker_failed, never a silently short answer."""
    first = Lines([chat_chunk([], "", prompt=[1]), chat_chunk([10], "a"),
                   error_event("EngineCore died")], end="done")  # fmt: skip
    rest = Lines([completion_chunk([11], "b"), error_event("died too")], end="done")
    pool = Pool(rest)
    got = relay("/v1/chat/completions", CHAT, first, pool)
    assert len(pool.asked) == 2 and pool.asked[0][0]["prompt"] == [1, 10]
    assert pool.asked[1][0]["prompt"] == [1, 10, 11]
    text = "".join(ch["delta"].get("content", "") for c in got[:-1] for ch in c["choices"])
    assert text == "ab"
    assert got[-1]["error"]["code"] == "worker_failed"
    assert "EngineCore died" not in json.dumps(got[:-1])  # the server's event is not relayed
    assert pool.broke == pool.ended == ["http://s0", "http://s1"]  # both count as failures


def test_a_stream_with_reasoning_does_not_move() -> None:
    thinking = chat_chunk([10], "")
    thinking["choices"][0]["delta"] = {"reasoning_content": "hmm"}
    first = Lines([chat_chunk([], "", prompt=[1]), thinking], end="cut")
    pool = Pool(Lines([], end="done"))
    got = relay("/v1/chat/completions", CHAT, first, pool)
    assert pool.asked == [] and got[-1]["error"]["code"] == "worker_failed"


def test_continuous_usage_stats_go_along_and_the_closing_usage_is_still_sent() -> None:
    body = {**CHAT, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with_usage = {**chat_chunk([10], "a"), "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    first = Lines([chat_chunk([], "", prompt=[1]), with_usage], end="cut")
    rest = Lines([completion_chunk([11], "b", "stop")], end="cut")  # ends, then breaks
    pool = Pool(rest)
    got = relay("/v1/chat/completions", body, first, pool)
    assert pool.asked[0][0]["stream_options"] == body["stream_options"]
    assert got[-1] == "[DONE]" and got[-2]["choices"] == []
    assert got[-2]["usage"] == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}


def test_a_client_that_leaves_is_not_the_servers_failure() -> None:
    """A stream the client walked away from ends on its server without counting against
    it; one that ended with [DONE] does not either."""
    first = Lines([chat_chunk([], "", prompt=[1]), chat_chunk([10], "a"),
                   chat_chunk([11], "b")], end="done")  # fmt: skip
    pool = Pool()
    r = StreamRelay(Answer("/v1/chat/completions", CHAT), pool.reopen, pool.done, {})

    async def leave() -> None:
        events = r.events(Server("http://s0"), first)  # type: ignore[arg-type]
        await events.__anext__()
        await events.aclose()  # the client left after its first chunk

    asyncio.run(leave())
    assert first.closed and pool.ended == ["http://s0"] and pool.broke == []
