"""``save_decode`` writes a finished answer's blocks off the model thread
(engine/serving/runtime.py): while one answer's write hangs on its store node, other
streams keep getting tokens and end; the hung answer ends once its write returns, with
its blocks stored. Answers waiting for their write are bounded: past the bound an
answer is not stored (a later miss), and says so in a counter."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest
import torch

import engine.serving.runtime as runtime
from engine.blockstore import GuardedStore, NodeStore
from engine.serving.loading import load_model
from engine.serving.runtime import WorkerEngine
from kvstore import Namespace, StoreNode

LONG = list(range(1, 41))  # 40 tokens, and 30 more of answer: answer blocks 2 and 3
SECOND = LONG[:20] + [9] * 20  # another prompt of 40


class _HeldPuts(NodeStore):
    """A store node whose batch puts of keys other than ``known`` (an answer's blocks,
    not a prompt's) wait for ``release``, on whatever thread they come from."""

    def __init__(self, node: StoreNode) -> None:
        super().__init__(node, Namespace("tiny", "fp32:L2:H4:D16"))  # the adapter passes its own
        self.known: set[bytes] = set()
        self.release = threading.Event()
        self.held = threading.Event()

    def batch_put(self, keys: Sequence[bytes], values: Sequence[Any], **kw: Any) -> list[Any]:
        if self.known and not set(keys) <= self.known:
            self.held.set()
            assert self.release.wait(60), "the test never released the write"
        return super().batch_put(keys, values, **kw)


async def _run(engine: WorkerEngine, rid: str, prompt: list[int], n: int) -> list[dict[str, Any]]:
    return [item async for item in engine.generate(rid, prompt, n, [])]


def _engine(store: _HeldPuts) -> WorkerEngine:
    torch.set_num_threads(1)
    guarded = GuardedStore(lambda: store, retry_after_s=1.0, spawn=None)
    engine = WorkerEngine(load_model("tiny"), local=guarded, block_tokens=16, save_decode=True)
    store.known = {bytes(k) for p in (LONG, SECOND) for k in engine.adapter.keys(p)}
    return engine


def _drive(engine: WorkerEngine, store: _HeldPuts, body: Callable[[], Awaitable[None]]) -> None:
    """Run ``body``; whatever it does, release the held write and close the engine."""
    try:
        asyncio.run(body())  # type: ignore[arg-type]
    finally:
        store.release.set()
        engine.close()


def test_a_hung_answer_write_holds_no_other_stream() -> None:
    with StoreNode() as node:
        store = _HeldPuts(node)
        engine = _engine(store)

        async def body() -> None:
            held = asyncio.ensure_future(_run(engine, "held", LONG, 30))
            while not store.held.is_set():  # its tokens are out; its write waits
                await asyncio.sleep(0.01)
                assert not held.done()
            other = await asyncio.wait_for(_run(engine, "other", [5, 6, 7, 8], 12), 30)
            assert other[-1]["done"] and other[-1]["completion_tokens"] == 12
            assert not held.done()  # its end waits for its write, the other's did not
            store.release.set()
            items = await asyncio.wait_for(held, 30)
            assert items[-1]["done"] and items[-1]["completion_tokens"] == 30
            answer = [it["token"] for it in items if "token" in it]
            keys = engine.adapter.keys(LONG + answer[:-1])
            assert len(keys) == 4 and store.match_prefix(keys) == 4  # the prefill's 2, its 2

        _drive(engine, store, body)
        assert engine.counters["answer_blocks"] == 2


def test_answers_waiting_for_their_write_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "ANSWERS_QUEUED", 1)
    with StoreNode() as node:
        store = _HeldPuts(node)
        engine = _engine(store)

        async def body() -> None:
            held = asyncio.ensure_future(_run(engine, "held", LONG, 30))
            while not store.held.is_set():
                await asyncio.sleep(0.01)
            # a second long answer finds the queue full: it ends at once, not stored
            second = await asyncio.wait_for(_run(engine, "second", SECOND, 30), 30)
            assert second[-1]["done"] and not held.done()
            assert engine.counters["answers_not_stored"] == 1
            store.release.set()
            await asyncio.wait_for(held, 30)

        _drive(engine, store, body)
        assert engine.counters["answer_blocks"] == 2
