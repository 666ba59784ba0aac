"""``save_decode`` writes a finished answer's blocks off the model thread
(engine/serving/runtime.py): while one answer's write hangs on its store node, other
streams keep getting tokens and end; the hung answer ends once its write returns, with
its blocks stored."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import torch

from engine.blockstore import GuardedStore, NodeStore
from engine.serving.loading import load_model
from engine.serving.runtime import WorkerEngine
from kvstore import Namespace, StoreNode


class _HeldPuts(NodeStore):
    """A store node whose batch puts off the model thread (an answer's, not a
    prefill's) wait for ``release`` once ``hold`` is set."""

    def __init__(self, node: StoreNode) -> None:
        super().__init__(node, Namespace("tiny", "fp32:L2:H4:D16"))  # the adapter passes its own
        self.hold = threading.Event()
        self.release = threading.Event()
        self.held = threading.Event()

    def batch_put(self, keys: Sequence[bytes], values: Sequence[Any], **kw: Any) -> list[Any]:
        if self.hold.is_set() and not threading.current_thread().name.startswith("model"):
            self.held.set()
            assert self.release.wait(30), "the test never released the write"
        return super().batch_put(keys, values, **kw)


async def _run(engine: WorkerEngine, rid: str, prompt: list[int], n: int) -> list[dict[str, Any]]:
    return [item async for item in engine.generate(rid, prompt, n, [])]


def test_a_hung_answer_write_holds_no_other_stream() -> None:
    torch.set_num_threads(1)
    with StoreNode() as node:
        store = _HeldPuts(node)
        guarded = GuardedStore(lambda: store, retry_after_s=1.0, spawn=None)
        engine = WorkerEngine(load_model("tiny"), local=guarded, block_tokens=16, save_decode=True)
        long_prompt = list(range(1, 41))  # 40 tokens and 30 more: answer blocks 2 and 3

        async def body() -> None:
            await _run(engine, "warm", [7, 8, 9], 2)  # nothing to store: shorter than a block
            store.hold.set()
            held = asyncio.ensure_future(_run(engine, "held", long_prompt, 30))
            while not store.held.is_set():  # its tokens are out; its write waits
                await asyncio.sleep(0.01)
                assert not held.done()
            other = await asyncio.wait_for(_run(engine, "other", [5, 6, 7, 8], 12), 20)
            assert other[-1]["done"] and other[-1]["completion_tokens"] == 12
            assert not held.done()  # its end waits for its write, the other's did not
            store.release.set()
            items = await asyncio.wait_for(held, 20)
            assert items[-1]["done"] and items[-1]["completion_tokens"] == 30
            answer = [it["token"] for it in items if "token" in it]
            keys = engine.adapter.keys(long_prompt + answer[:-1])
            assert len(keys) == 4 and store.match_prefix(keys) == 4  # the prefill's 2, its 2

        try:
            asyncio.run(body())
        finally:
            store.release.set()
            engine.close()
        assert engine.counters["answer_blocks"] == 2
