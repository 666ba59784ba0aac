"""A decode stream that breaks mid-way goes on on another worker (request migration).

Why: a decode worker that dies after the client saw tokens used to end the answer with
an error event, and the client had to ask again and pay the whole prefill again. The
router holds all that going on needs: the prompt's token ids, the tokens it already
sent, how many are left and the stop ids. So when a stream breaks, :class:`Mover`
starts the rest on another decode worker as one generation (``POST /generate``) whose
prompt is the prompt plus the tokens sent: that worker loads the prompt's cached
prefix from the store (the prefill worker's blocks) and computes only the tail. The
engines decode greedily, so what follows is the same continuation, up to the float
rounding of the tail's recomputed KV. The client sees one stream with one finish
reason; ``usage.kvstore.resumed_on`` names the workers the answer moved to.

A stream moves at most ``max_moves`` times; a worker it broke on is not tried again
(and the router skips it for a while, as after a failed prefill). When no worker can
take it, the caller gets :class:`~engine.serving.upstream.StreamCut`, as before.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.planning.scheduler import Refusal
from engine.registry import WorkerRecord
from engine.serving.placement import Outstanding, choose_decode
from engine.serving.upstream import Started, StreamCut, Upstream, WorkerFailed, WorkerRefused

__all__ = ["Mover", "Stream"]

log = logging.getLogger(__name__)


@dataclass
class Stream:
    """One answer's tokens and where they come from now.

    ``prompt`` is None when the router never learned the prompt's ids: such a stream
    cannot move. ``current`` is the generation the tokens come from now (its ``finish``
    is the answer's, and the caller releases and closes it at the end). ``near``: the
    worker whose store node holds the prompt's blocks (its prefill worker's, or its
    decode worker's for a short prompt), so a move prefers a worker beside them."""

    model: str
    prompt: list[int] | None
    max_tokens: int
    eos: list[int]
    current: Started
    worker_id: str
    sent: list[int] = field(default_factory=list)
    tried: set[str] = field(default_factory=set)
    resumed_on: list[str] = field(default_factory=list)
    near: WorkerRecord | None = None


class Mover:
    """Follows streams across workers (see the module docstring).

    ``workers(model)``: the workers the router would place on now; ``release(st)``:
    give back a generation's load accounting; ``failed(worker_id, reason)``: tell the
    router a worker broke a stream; ``nodes()``: the store nodes by name, as placement
    sees them (which host and zone each is on)."""

    def __init__(
        self,
        upstream: Upstream,
        out: Outstanding,
        workers: Callable[[str], Sequence[WorkerRecord]],
        release: Callable[[Started], None],
        failed: Callable[[str, str], None],
        max_moves: int = 2,
        nodes: Callable[[], Mapping[str, Any]] = dict,
    ) -> None:
        self.upstream = upstream
        self.out = out
        self.workers = workers
        self.release = release
        self.failed = failed
        self.max_moves = max_moves
        self.nodes = nodes

    async def follow(self, s: Stream) -> AsyncIterator[int]:
        """The answer's tokens after its first, across moves; StreamCut when the
        stream broke and could not move."""
        s.sent.append(s.current.first)
        while True:
            try:
                async for t in s.current.rest():
                    s.sent.append(t)
                    yield t
                return
            except StreamCut as exc:
                if self._complete(s):  # it broke after its last token: nothing is missing
                    self.failed(s.worker_id, str(exc))  # but the worker did break
                    return
                await self._move(s, exc)
            s.sent.append(s.current.first)
            yield s.current.first

    def _complete(self, s: Stream) -> bool:
        """Whether the tokens sent already make the whole answer (set its finish)."""
        if s.sent[-1] in s.eos:
            s.current.finish = "stop"
            return True
        if len(s.sent) >= s.max_tokens:
            s.current.finish = "length"
            return True
        return False

    async def _move(self, s: Stream, cut: StreamCut) -> None:
        """Start the rest of ``s`` on another worker; raise ``cut`` when none takes it."""
        self.failed(s.worker_id, str(cut))
        s.tried.add(s.worker_id)
        if s.prompt is None or len(s.resumed_on) >= self.max_moves:
            raise cut
        ids, left = s.prompt + s.sent, s.max_tokens - len(s.sent)
        while True:
            pool = [w for w in self.workers(s.model) if w.can_decode and w.worker_id not in s.tried]
            w = choose_decode(pool, len(ids) + left, s.near, self.out, self.nodes())
            if isinstance(w, Refusal):
                log.warning("stream cut (%s) and no worker to go on: %s", cut, w.reason)
                raise cut
            try:
                nxt = await self._start(w, ids, left, s.eos)
            except (WorkerFailed, WorkerRefused) as exc:
                log.warning("going on with a cut stream on %s failed: %s", w.worker_id, exc)
                if isinstance(exc, WorkerFailed):  # other requests should skip it too
                    self.failed(w.worker_id, str(exc))
                s.tried.add(w.worker_id)
                continue
            log.info("stream cut on %s (%s); going on on %s", s.worker_id, cut, w.worker_id)
            old, s.current, s.worker_id = s.current, nxt, w.worker_id  # before any await
            s.resumed_on.append(w.worker_id)
            self.release(old)
            await old.close()
            return

    async def _start(self, w: WorkerRecord, ids: list[int], left: int, eos: list[int]) -> Any:
        reserve = len(ids) + left
        self.out.add(w.worker_id, running=1, kv=reserve)
        try:
            st = await self.upstream.generate(w, uuid.uuid4().hex, ids, left, eos)
        except BaseException:
            self.out.add(w.worker_id, running=-1, kv=-reserve)
            raise
        self.out.finished(w.worker_id)
        st.info["release"] = (w.worker_id, reserve)
        return st
