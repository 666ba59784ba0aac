"""Moving a cut decode stream (engine/serving/resume.py), with scripted workers: what the
Mover asks the next worker for, the tokens the caller gets across moves, and when a
stream is not moved. The real thing, with worker processes killed mid-stream:
tests/serving/test_faults.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from engine.registry import WorkerLoad, WorkerRecord
from engine.serving.placement import Outstanding
from engine.serving.resume import Mover, Stream
from engine.serving.upstream import Started, StreamCut, WorkerFailed

NS = {"model": "tiny", "layout": "float32:L2:H2:D8:B16"}
EOS = [99]


def worker(wid: str, role: str = "decode", store_node: str = "") -> WorkerRecord:
    load = WorkerLoad(free_kv_tokens=4096, kv_capacity_tokens=8192)
    url = f"http://127.0.0.1/{wid}"
    host = f"host-{store_node or wid}"  # a host of its own (the default: this machine's)
    return WorkerRecord(wid, role, "tiny", url, NS, load=load, store_node=store_node, host_id=host)


class Lines:
    """A worker's token stream: these tokens, then ``done`` or a break."""

    def __init__(self, tokens: list[int], end: str) -> None:
        self.tokens, self.end = tokens, end
        self.closed = False

    async def aiter_lines(self) -> AsyncIterator[str]:
        for t in self.tokens:
            yield json.dumps({"token": t})
        if self.end == "done":
            yield json.dumps({"done": True, "finish_reason": "length"})
        elif self.end == "eos":
            yield json.dumps({"done": True, "finish_reason": "stop"})
        # "cut": the stream just ends

    async def aclose(self) -> None:
        self.closed = True


class Workers:
    """The upstream's ``generate``: each worker's scripted answer (first token, then
    the rest), and every call it got."""

    def __init__(self, scripts: dict[str, tuple[int, list[int], str] | Exception]) -> None:
        self.scripts = scripts
        self.calls: list[tuple[str, list[int], int]] = []

    async def generate(
        self, w: WorkerRecord, rid: str, prompt: list[int], max_tokens: int, stop: list[int]
    ) -> Started:
        self.calls.append((w.worker_id, list(prompt), max_tokens))
        script = self.scripts[w.worker_id]
        if isinstance(script, Exception):
            raise script
        first, rest, end = script
        return Started(first, 0, Lines(rest, end))  # type: ignore[arg-type]


class Harness:
    def __init__(self, pool: list[WorkerRecord], workers: Workers, max_moves: int = 2) -> None:
        self.out = Outstanding()
        self.released: list[Started] = []
        self.broke: list[str] = []
        self.mover = Mover(
            workers,  # type: ignore[arg-type]
            self.out,
            lambda model: pool,
            self.released.append,
            lambda wid, why: self.broke.append(wid),
            max_moves,
        )

    def run(self, s: Stream) -> tuple[list[int], BaseException | None]:
        got: list[int] = []

        async def body() -> None:
            async for t in self.mover.follow(s):
                got.append(t)

        try:
            asyncio.run(body())
        except StreamCut as exc:
            return got, exc
        return got, None


def stream(rest: list[int], end: str, *, first: int = 10, max_tokens: int = 8) -> Stream:
    st = Started(first, 0, Lines(rest, end))  # type: ignore[arg-type]
    return Stream("tiny", [1, 2, 3], max_tokens, EOS, st, "d0")


def test_a_cut_stream_goes_on_on_another_worker_from_the_tokens_sent() -> None:
    workers = Workers({"d1": (13, [14, 15], "done")})
    h = Harness([worker("p0", "prefill"), worker("d0"), worker("d1")], workers)
    s = stream([11, 12], "cut", max_tokens=6)
    got, err = h.run(s)
    assert err is None and got == [11, 12, 13, 14, 15]
    assert s.sent == [10, 11, 12, 13, 14, 15] and s.current.finish == "length"
    assert workers.calls == [("d1", [1, 2, 3, 10, 11, 12], 3)]  # prompt + sent, what is left
    assert s.resumed_on == ["d1"] and h.broke == ["d0"] and s.worker_id == "d1"
    assert len(h.released) == 1  # the cut generation's load given back; the caller ends d1's
    assert h.out.running.get("d1") == 1


def test_a_stream_moves_at_most_max_moves_times_never_back() -> None:
    workers = Workers({"d1": (11, [], "cut"), "d2": (12, [], "cut"), "d3": (13, [], "done")})
    pool = [worker(w) for w in ("d0", "d1", "d2", "d3")]
    s = stream([], "cut")
    got, err = Harness(pool, workers, max_moves=2).run(s)
    assert isinstance(err, StreamCut) and got == [11, 12]
    assert [c[0] for c in workers.calls] == ["d1", "d2"] and s.tried == {"d0", "d1", "d2"}


def test_a_worker_that_cannot_start_is_passed_over() -> None:
    workers = Workers({"d1": WorkerFailed("d1", "generate", "refused"), "d2": (11, [], "done")})
    s = stream([], "cut", max_tokens=2)
    got, err = Harness([worker("d0"), worker("d1"), worker("d2")], workers).run(s)
    assert err is None and got == [11] and s.resumed_on == ["d2"]


@pytest.mark.parametrize(
    ("rest", "max_tokens", "finish"),
    [([11, 99], 8, "stop"), ([11, 12, 13], 4, "length")],  # after eos; after the last
)
def test_a_stream_cut_after_its_last_token_is_whole(
    rest: list[int], max_tokens: int, finish: str
) -> None:
    workers = Workers({})
    s = stream(rest, "cut", max_tokens=max_tokens)
    got, err = Harness([worker("d0"), worker("d1")], workers).run(s)
    assert err is None and got == rest and s.current.finish == finish
    assert workers.calls == []


def test_no_move_without_the_prompt_or_another_decode_worker() -> None:
    s = stream([11], "cut")
    s.prompt = None  # the router never learned the prompt's ids
    _, err = Harness([worker("d0"), worker("d1")], Workers({})).run(s)
    assert isinstance(err, StreamCut)
    _, err = Harness([worker("d0"), worker("p0", "prefill")], Workers({})).run(stream([], "cut"))
    assert isinstance(err, StreamCut)


def test_a_move_prefers_a_worker_beside_the_prompts_blocks() -> None:
    """The rest loads the prompt's blocks: among equally busy workers, the one on the
    store node that holds them (the prefill worker's) takes it."""
    pool = [worker("d0", store_node="n0"), worker("d1", store_node="n1")]
    pool += [worker("d2", store_node="n2")]
    workers = Workers({w: (11, [], "done") for w in ("d1", "d2")})
    s = stream([], "cut", max_tokens=2)
    s.near = worker("p0", "prefill", store_node="n2")
    got, err = Harness(pool, workers).run(s)
    assert err is None and got == [11] and s.resumed_on == ["d2"]
    s = stream([], "cut", max_tokens=2)
    s.near = worker("p0", "prefill", store_node="n1")
    got, err = Harness(pool, workers).run(s)
    assert err is None and s.resumed_on == ["d1"]
