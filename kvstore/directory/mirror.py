"""A local, always-current copy of the cluster directory, read synchronously.

The scheduler asks "who holds the longest prefix of these 64 blocks" per request and
a client asks "where is the nearest copy of this block" per read; both must answer
in microseconds, from memory. One writer (the directory's feed task: an etcd watch,
or the embedded directory's change fan-out) applies changes; any number of threads
read.

Concurrency contract: ``_lock`` guards ``_blocks``, ``_nodes``, ``_revision``,
``_entries`` and the interner. The writer holds it for one whole batch (one etcd
watch response, i.e. whole revisions), so readers see whole transactions; a re-list
builds its snapshot outside the lock and swaps it in under it. Readers hold it only
for the dict lookups of one call. Listeners and async waiters are called after the
lock is released, in the writer's thread.

Memory: values are interned. A block held by one node in one tier with a common
size points at a shared ``(Replica,)`` tuple, so an entry costs its dict slot and its
16-byte key, about 100 bytes (see benchmarks/bench_directory.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvstore.directory.records import NodeInfo, Replica
from kvstore.tier_kinds import TierKind

__all__ = ["DEL_BLOCK", "DEL_NODE", "PUT_BLOCK", "PUT_NODE", "Mirror", "MirrorSnapshot", "Op"]

PUT_BLOCK = 0  # (PUT_BLOCK, key, node_id, tier, size)
DEL_BLOCK = 1  # (DEL_BLOCK, key, node_id)
PUT_NODE = 2  # (PUT_NODE, NodeInfo)
DEL_NODE = 3  # (DEL_NODE, node_id)
Op = tuple  # one of the shapes above; plain tuples keep the feed path cheap

_INTERN_LIMIT = 1 << 16


class _Interner:
    """Shares Replica objects and replica tuples between entries (few distinct values).

    Bounded: past the limit a table is cleared, which only reduces sharing. Used by
    one writer at a time (under the mirror lock, or privately by a snapshot builder).
    """

    __slots__ = ("_groups", "_names", "_replicas")

    def __init__(self) -> None:
        self._replicas: dict[tuple[str, TierKind, int], Replica] = {}
        self._groups: dict[tuple[Replica, ...], tuple[Replica, ...]] = {}
        self._names: dict[str, str] = {}

    def replica(self, node_id: str, tier: TierKind, size: int) -> Replica:
        k = (node_id, tier, size)
        r = self._replicas.get(k)
        if r is None:
            if len(self._replicas) >= _INTERN_LIMIT:
                self._replicas.clear()
            name = self._names.setdefault(node_id, node_id)
            r = self._replicas[k] = Replica(name, tier, size)
        return r

    def group(self, reps: tuple[Replica, ...]) -> tuple[Replica, ...]:
        g = self._groups.get(reps)
        if g is None:
            if len(self._groups) >= _INTERN_LIMIT:
                self._groups.clear()
            self._groups[reps] = g = reps
        return g


def _with(reps: tuple[Replica, ...], r: Replica) -> tuple[Replica, ...]:
    """``reps`` with node ``r.node_id``'s replica replaced by ``r``; sorted by node id."""
    out = [x for x in reps if x.node_id != r.node_id]
    out.append(r)
    if len(out) > 1:
        out.sort(key=lambda x: x.node_id)
    return tuple(out)


@dataclass(slots=True)
class MirrorSnapshot:
    """A full listing being built (by a re-list) before it replaces a mirror's state."""

    revision: int = 0
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    blocks: dict[bytes, tuple[Replica, ...]] = field(default_factory=dict)
    entries: int = 0
    _interner: _Interner = field(default_factory=_Interner)

    def add_block(self, key: bytes, node_id: str, tier: TierKind, size: int) -> None:
        """Add one replica (a later one for the same node replaces the earlier)."""
        r = self._interner.replica(node_id, tier, size)
        cur = self.blocks.get(key)
        if cur is None:
            self.blocks[key] = self._interner.group((r,))
            self.entries += 1
            return
        new = _with(cur, r)
        self.entries += len(new) - len(cur)
        self.blocks[key] = self._interner.group(new)


class Mirror:
    """Read side of the directory: synchronous, thread-safe, served from memory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._blocks: dict[bytes, tuple[Replica, ...]] = {}
        self._nodes: dict[str, NodeInfo] = {}
        self._revision = 0
        self._entries = 0
        self._interner = _Interner()
        self._synced = threading.Event()
        self._listeners: list[Callable[[int], None]] = []
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.relists = 0
        self.ignored = 0  # entries the feed refused (stale epoch, malformed)

    # -- reads (any thread) --------------------------------------------------------------

    @property
    def revision(self) -> int:
        """The directory revision this mirror reflects completely."""
        return self._revision

    @property
    def synced(self) -> bool:
        """Whether a first full listing has been loaded."""
        return self._synced.is_set()

    def __len__(self) -> int:
        """Number of (block, node) entries."""
        return self._entries

    def nodes(self) -> dict[str, NodeInfo]:
        """Live nodes by id (a copy)."""
        with self._lock:
            return dict(self._nodes)

    def node(self, node_id: str) -> NodeInfo | None:
        """One live node's record, None if it is not registered."""
        with self._lock:
            return self._nodes.get(node_id)

    def replicas(self, key: bytes) -> tuple[Replica, ...]:
        """Every copy of one block (empty if none)."""
        with self._lock:
            return self._blocks.get(key, ())

    def lookup(self, keys: Sequence[bytes]) -> list[tuple[Replica, ...]]:
        """Per key, every copy; one consistent view for the whole call."""
        with self._lock:
            get = self._blocks.get
            return [get(k, ()) for k in keys]

    def ranked(
        self, key: bytes, local_node_id: str | None = None, local_host: str | None = None
    ) -> list[Replica]:
        """Copies of a block, best first: same node, then same host, then other hosts;
        within each, HBM before DRAM before SSD (ties by node id, for determinism).
        Copies on nodes whose record is gone are left out."""
        with self._lock:
            reps = self._blocks.get(key, ())
            nodes = self._nodes
            scored = []
            for r in reps:
                info = nodes.get(r.node_id)
                if info is None:
                    continue
                if r.node_id == local_node_id:
                    loc = 0
                elif local_host is not None and info.host == local_host:
                    loc = 1
                else:
                    loc = 2
                scored.append((loc, r.tier.rank, r.node_id, r))
        scored.sort(key=lambda s: s[:3])
        return [s[3] for s in scored]

    def nearest(
        self, key: bytes, local_node_id: str | None = None, local_host: str | None = None
    ) -> Replica | None:
        """The copy to read first (see :meth:`ranked`), None when there is none."""
        best = self.ranked(key, local_node_id, local_host)
        return best[0] if best else None

    def longest_prefix(self, keys: Sequence[bytes]) -> dict[str, int]:
        """Per node, how many leading ``keys`` it holds (nodes holding none are absent).

        Keys are chained hashes, so a node holding block i usually holds 0..i-1 too;
        the count stops at the first block the node lacks.
        """
        out: dict[str, int] = {}
        if not keys:
            return out
        with self._lock:
            get = self._blocks.get
            reps = get(keys[0])
            if not reps:
                return out
            alive = [r.node_id for r in reps]
            i, n = 1, len(keys)
            while i < n:
                reps = get(keys[i])
                if not reps:
                    break
                if len(reps) == 1 and len(alive) == 1:
                    if reps[0].node_id != alive[0]:
                        break
                else:
                    here = {r.node_id for r in reps}
                    still = []
                    for nd in alive:
                        if nd in here:
                            still.append(nd)
                        else:
                            out[nd] = i
                    alive = still
                    if not alive:
                        return out
                i += 1
        for nd in alive:
            out[nd] = i
        return out

    def entries(self, node_id: str | None = None) -> list[tuple[bytes, Replica]]:
        """A copy of every (key, replica), optionally of one node; O(entries), for CLIs."""
        with self._lock:
            items = list(self._blocks.items())
        return [(k, r) for k, reps in items for r in reps if node_id in (None, r.node_id)]

    def stats(self) -> dict[str, int]:
        """Sizes and counters, as plain data."""
        with self._lock:
            return {
                "keys": len(self._blocks),
                "entries": self._entries,
                "nodes": len(self._nodes),
                "revision": self._revision,
                "relists": self.relists,
                "ignored": self.ignored,
            }

    def wait_for_revision_sync(self, revision: int, timeout: float | None = None) -> bool:
        """Block this (non-loop) thread until the mirror reflects ``revision``."""
        with self._cond:
            return self._cond.wait_for(lambda: self._revision >= revision, timeout)

    async def wait_for_revision(self, revision: int, timeout: float | None = None) -> bool:
        """Wait (in any event loop) until the mirror reflects ``revision``; False on timeout."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._revision >= revision:
                return True
            self._waiters.append((revision, loop, fut))
        try:
            await asyncio.wait_for(fut, timeout)
            return True
        except TimeoutError:
            with self._lock:
                self._waiters = [w for w in self._waiters if w[2] is not fut]
            return self._revision >= revision

    def add_listener(self, fn: Callable[[int], None]) -> None:
        """Call ``fn(revision)`` after every applied batch, in the writer's thread.

        Keep it short: it delays the feed. Exceptions propagate into the feed task.
        """
        self._listeners.append(fn)

    # -- writes (the feed only) -------------------------------------------------------------

    def reset(self, snap: MirrorSnapshot) -> None:
        """Replace everything with a full listing (after a re-list)."""
        with self._lock:
            self._blocks = snap.blocks
            self._nodes = snap.nodes
            self._entries = snap.entries
            self._interner = snap._interner
            self._revision = max(self._revision, snap.revision)
            self.relists += 1
            woken = self._wake_locked()
        self._synced.set()
        self._after(woken)

    def apply(self, ops: Iterable[Op], revision: int) -> None:
        """Apply one batch of changes atomically and advance to ``revision``."""
        with self._lock:
            for op in ops:
                kind = op[0]
                if kind == PUT_BLOCK:
                    self._put_block_locked(op[1], op[2], op[3], op[4])
                elif kind == DEL_BLOCK:
                    self._del_block_locked(op[1], op[2])
                elif kind == PUT_NODE:
                    self._nodes[op[1].node_id] = op[1]
                else:
                    self._nodes.pop(op[1], None)
            if revision > self._revision:
                self._revision = revision
            woken = self._wake_locked()
        self._after(woken)

    def advance(self, revision: int) -> None:
        """Nothing changed up to ``revision`` (an etcd progress notification)."""
        self.apply((), revision)

    def _put_block_locked(self, key: bytes, node_id: str, tier: TierKind, size: int) -> None:
        r = self._interner.replica(node_id, tier, size)
        cur = self._blocks.get(key)
        if cur is None:
            self._blocks[key] = self._interner.group((r,))
            self._entries += 1
            return
        new = _with(cur, r)
        self._entries += len(new) - len(cur)
        self._blocks[key] = self._interner.group(new)

    def _del_block_locked(self, key: bytes, node_id: str) -> None:
        cur = self._blocks.get(key)
        if cur is None:
            return
        rest = tuple(r for r in cur if r.node_id != node_id)
        if len(rest) == len(cur):
            return
        self._entries -= 1
        if rest:
            self._blocks[key] = self._interner.group(rest)
        else:
            del self._blocks[key]

    def _wake_locked(self) -> list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]:
        self._cond.notify_all()
        if not self._waiters:
            return []
        rev = self._revision
        woken = [(loop, fut) for r, loop, fut in self._waiters if r <= rev]
        if woken:
            self._waiters = [w for w in self._waiters if w[0] > rev]
        return woken

    def _after(self, woken: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]) -> None:
        for loop, fut in woken:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_resolve, fut)
        for fn in self._listeners:
            fn(self._revision)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
