"""Where one request runs: engine/planning/scheduler.py's cost model fed from the live cluster.

Per request the router asks this module for a :class:`Route`:

- **prefill**: every live prefill worker of the model becomes a scheduler
  :class:`~engine.planning.scheduler.Candidate`: its queue (the larger of what it reports in
  etcd and what this router sent it and has not heard back about) and the runs of the
  request's prefix its store node holds, by tier, read from the directory mirror in
  one pass (:class:`PrefixView`). A prefill worker reuses its own node's prefix, so
  those runs are local pulls. The scheduler policy estimates TTFT per candidate,
  refuses when none meets the SLO, and picks.
- **decode**: the decode worker with the fewest running requests that has room for the
  prompt and the answer in its KV; at equal load the one nearest the prefill's blocks
  (same store node or host, then same ``zone``), then the most free KV.
- **short prompts** (under ``short_prompt_tokens``) skip the prefill pool: one
  decode-capable worker does both, chosen like a decode, SLO-checked like a prefill.
- **KV codecs**: all of this happens within one pool of workers storing the same
  ``kv_codec`` (engine/serving/pairing.py), so a decode worker never gets a handoff in
  another codec's bytes; a request no pool can pair is refused as a codec mismatch.

The module is synchronous and does no I/O: the mirror is read from memory, and
workers are the router's watch-fed records.
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.planning.scheduler import (
    DEFAULT_PREFILL,
    Candidate,
    CostModel,
    Estimate,
    Location,
    PrefillModel,
    Refusal,
    Scheduler,
    make_scheduler,
)
from engine.registry import WorkerRecord
from engine.serving.pairing import codec_pools, mismatch
from kvstore import Namespace, TierKind, prefix_keys
from kvstore.client.groups import unit_names, unit_prefix
from kvstore.errors import KVStoreError

__all__ = ["Outstanding", "Placer", "PrefixView", "Route", "choose_decode", "proximity"]


class PrefixView:
    """Per store node, the runs of a prompt's prefix it holds, by tier, from the mirror.

    ``client`` is a cluster client (``StoreClient.from_etcd``): its mirror is the
    directory, and its tenant scopes keys the way the store nodes do. None (or a
    cluster with no reachable node yet) means no cache is known: every candidate
    computes from scratch.
    """

    RECENT_S = 10.0  # own writes count this long (the directory catches up well before)
    RECENT_MAX = 1 << 16

    def __init__(self, client: Any) -> None:
        self.client = client
        self._recent: OrderedDict[bytes, dict[str, float]] = OrderedDict()

    def note(self, node_id: str, keys: Sequence[bytes]) -> None:
        """A prefill on ``node_id``'s worker just wrote ``keys``: count them as held there
        before the directory's watch reports them (a conversation's next turn may
        arrive first)."""
        now = time.monotonic()
        for k in keys:
            self._recent.setdefault(k, {})[node_id] = now
            self._recent.move_to_end(k)
        while len(self._recent) > self.RECENT_MAX:
            self._recent.popitem(last=False)

    def _recent_runs(self, keys: Sequence[bytes]) -> dict[str, int]:
        first = self._recent.get(keys[0]) if keys else None
        if not first:
            return {}
        old = time.monotonic() - self.RECENT_S
        out = {}
        for node, t in first.items():
            if t < old:
                continue
            n = 1
            while n < len(keys) and self._recent.get(keys[n], {}).get(node, 0.0) >= old:
                n += 1
            out[node] = n
        return out

    def _scoped(self, keys: Sequence[bytes]) -> list[bytes] | None:
        # Directory keys are tenant-scoped by the store; the cluster client knows the
        # tenant of its token. See the report: a public ClusterClient.prefix_runs()
        # would replace this reach into members.
        try:
            principal = self.client.members.principal()
        except KVStoreError:
            return None
        return None if principal is None else principal.scope_all(keys)

    def holds(self, key: bytes) -> bool:
        """Does any node hold ``key`` (mirror, or a write of this router's just now)?"""
        seen = self._recent.get(key)
        if seen and max(seen.values()) >= time.monotonic() - self.RECENT_S:
            return True
        scoped = self._scoped([key]) if self.client is not None else None
        return bool(scoped and self.client.mirror.replicas(scoped[0]))

    def runs(self, keys: Sequence[bytes]) -> dict[str, list[tuple[TierKind, int]]]:
        """node id -> [(tier, blocks), ...] of its leading run of ``keys``."""
        if not keys:
            return {}
        recent = self._recent_runs(keys)
        scoped = self._scoped(keys) if self.client is not None else None
        if scoped is None:
            return {node: [(TierKind.DRAM, n)] for node, n in recent.items()}
        mirror = self.client.mirror
        # A sharded store node is one node to a worker beside it (its record names the
        # group): its prompt's blocks lie spread over its shards, so count per group.
        names = unit_names(mirror.nodes())
        if any(n != u for n, u in names.items()):
            counts = unit_prefix(mirror.lookup(scoped), names)
        else:
            counts = mirror.longest_prefix(scoped)
        for node, n in recent.items():
            counts[node] = max(counts.get(node, 0), n)
        if not counts:
            return {}
        reps = mirror.lookup(scoped[: max(counts.values())])
        out: dict[str, list[tuple[TierKind, int]]] = {}
        for node, n in counts.items():
            runs: list[tuple[TierKind, int]] = []
            for i in range(n):  # a block only this router knows of yet: just written, DRAM
                held = (r.tier for r in reps[i] if names.get(r.node_id, r.node_id) == node)
                tier = next(held, TierKind.DRAM)
                if runs and runs[-1][0] == tier:
                    runs[-1] = (tier, runs[-1][1] + 1)
                else:
                    runs.append((tier, 1))
            out[node] = runs
        return out


def _ttft(route: Route) -> float:
    return route.estimate.ttft_s if route.estimate is not None else float("inf")


def _location(tier: TierKind) -> Location:
    return Location.LOCAL_SSD if tier == TierKind.SSD else Location.LOCAL_DRAM


def tier_label(runs: Sequence[tuple[TierKind, int]], blocks: int) -> str | None:
    """The tiers the first ``blocks`` cached blocks come from: "dram", "dram+ssd", None."""
    seen: list[str] = []
    left = blocks
    for tier, n in runs:
        if left <= 0:
            break
        if tier.value not in seen:
            seen.append(tier.value)
        left -= n
    return "+".join(seen) or None


@dataclass
class Outstanding:
    """What this router sent to each worker and has not seen finish (fresher than etcd)."""

    prefill_s: dict[str, float] = field(default_factory=dict)
    running: dict[str, int] = field(default_factory=dict)
    kv: dict[str, int] = field(default_factory=dict)
    done: dict[str, int] = field(default_factory=dict)  # prefills this router saw finish

    def finished(self, wid: str) -> None:
        self.done[wid] = self.done.get(wid, 0) + 1

    def add(self, wid: str, *, prefill_s: float = 0.0, running: int = 0, kv: int = 0) -> None:
        self.prefill_s[wid] = max(self.prefill_s.get(wid, 0.0) + prefill_s, 0.0)
        self.running[wid] = max(self.running.get(wid, 0) + running, 0)
        self.kv[wid] = max(self.kv.get(wid, 0) + kv, 0)


def proximity(w: WorkerRecord, near: WorkerRecord | None, nodes: Mapping[str, Any]) -> int:
    """0: beside the blocks (same store node or host), 1: same zone, 2: elsewhere."""
    if near is None:
        return 0
    if w.store_node and w.store_node == near.store_node:
        return 0
    node = nodes.get(near.store_node)
    node_host = getattr(node, "host_id", "") or ""
    if (w.host_id and w.host_id == near.host_id) or (node_host and w.host_id == node_host):
        return 0
    if w.zone and w.zone == near.zone:
        return 1
    return 2


def choose_decode(
    workers: Sequence[WorkerRecord],
    kv_tokens: int,
    near: WorkerRecord | None,
    out: Outstanding,
    nodes: Mapping[str, Any] | None = None,
) -> WorkerRecord | Refusal:
    """Fewest running, then nearest the blocks, then most free KV (that fits)."""
    scored = []
    for w in workers:
        free = min(w.load.free_kv_tokens, w.load.kv_capacity_tokens - out.kv.get(w.worker_id, 0))
        if free < kv_tokens:
            continue
        running = max(w.load.running, out.running.get(w.worker_id, 0))
        scored.append((running, proximity(w, near, nodes or {}), -free, w.worker_id, w))
    if not scored:
        most = max((w.load.free_kv_tokens for w in workers), default=0)
        return Refusal(f"no decode worker has {kv_tokens} free KV tokens (most free: {most})")
    return min(scored, key=lambda s: s[:4])[4]


@dataclass(frozen=True)
class Route:
    """Where a request goes. ``prefill`` is None for a short prompt served whole by
    ``decode``. ``expected_cached`` and ``tier`` are the mirror's view at decision time."""

    prefill: WorkerRecord | None
    decode: WorkerRecord
    estimate: Estimate | None
    expected_cached: int
    tier: str | None
    keys: Sequence[bytes]


class Placer:
    """Routes requests of any model over the live workers with one scheduler policy.

    Not thread-safe: the router calls it from its event loop only.
    """

    def __init__(
        self,
        prefixes: PrefixView,
        policy: str = "cache_aware",
        *,
        slo_s: float | None = None,
        short_prompt_tokens: int = 256,
    ) -> None:
        self.prefixes = prefixes
        self.policy = policy
        self.slo_s = slo_s
        self.short_prompt_tokens = short_prompt_tokens
        self.out = Outstanding()
        self._schedulers: dict[tuple[Any, ...], Scheduler] = {}
        make_scheduler(policy)  # an unknown name fails at start

    def _scheduler(self, workers: Sequence[WorkerRecord]) -> Scheduler:
        """One scheduler per model and calibration: the median of the workers' fitted
        prefill models (they run the same weights), the layout's KV bytes per token."""
        coeffs = [w.prefill_coeffs for w in workers if w.prefill_coeffs]
        if coeffs:
            c = tuple(statistics.median(c[i] for c in coeffs) for i in range(3))
            prefill = PrefillModel((c[0], c[1], c[2]), "median of the workers' calibrations")
        else:
            prefill = DEFAULT_PREFILL
        w0 = workers[0]
        key = (prefill.coeffs, w0.kv_bytes_per_token, w0.block_tokens)
        s = self._schedulers.get(key)
        if s is None:
            cost = CostModel(prefill, max(w0.kv_bytes_per_token, 1), block_tokens=w0.block_tokens)
            s = self._schedulers[key] = make_scheduler(self.policy, cost, slo_s=self.slo_s)
        return s

    def _queue_s(self, w: WorkerRecord, prefill: PrefillModel) -> float:
        """The worker's queue: what this router sent and awaits, or what the worker
        reports when that is larger (other routers' work). A report written before a
        prefill this router already saw finish is stale and counts for nothing."""
        own = self.out.prefill_s.get(w.worker_id, 0.0)
        if w.load.done < self.out.done.get(w.worker_id, 0) or not w.load.queued_tokens:
            return own
        return max(prefill.seconds(w.load.queued_tokens, 0), own)

    def held_walk(self, workers: Sequence[WorkerRecord]) -> Callable[[list[int]], bool]:
        """A ``keep_going`` for engine/serving/prompts.py ``encode_until``: called with
        a growing head of the prompt, it says whether the head's last full block is
        held by some store node (while it is, a longer prefix may still match; once
        not, none can). Keys are chained on from the previous call, and one key per
        namespace (one per codec pool, engine/serving/pairing.py) is looked up per
        call, so a walk costs O(blocks), not O(blocks^2)."""
        spaces = {(w.block_tokens, tuple(sorted(w.namespace.items()))) for w in workers}
        walks: list[tuple[int, Namespace, list[bytes]]] = [
            (bt, Namespace(**dict(ns)), []) for bt, ns in sorted(spaces)
        ]
        if not walks:
            return lambda _ids: False

        def keep_going(ids: list[int]) -> bool:
            held = False
            for bt, ns, keys in walks:
                n = len(ids) // bt
                if n > len(keys):
                    parent = keys[-1] if keys else None
                    keys.extend(prefix_keys(ids[len(keys) * bt : n * bt], bt, ns, parent=parent))
                held = held or n == 0 or self.prefixes.holds(keys[n - 1])
            return held

        return keep_going

    def keys(self, workers: Sequence[WorkerRecord], ids: Sequence[int]) -> Sequence[bytes]:
        """The prefix keys of ``ids`` in the namespace of ``workers`` (one codec pool)."""
        w0 = workers[0]
        return prefix_keys(ids, w0.block_tokens, Namespace(**w0.namespace))

    def place(
        self,
        workers: Sequence[WorkerRecord],
        ids: Sequence[int],
        max_tokens: int,
        exclude: frozenset[str] = frozenset(),
        nodes: Mapping[str, Any] | None = None,
        *,
        n_tokens: int | None = None,
    ) -> Route | Refusal:
        """Choose the workers of one request (``workers``: this model's live ones).

        ``ids`` may be only the head of the prompt (engine/serving/prompts.py
        encode_until stops at the first block no node holds); ``n_tokens`` is then the
        prompt's estimated length, which the cost model uses.

        Workers are placed within their KV codec's pool (engine/serving/pairing.py):
        a prefill and a decode worker of a split request always store the same codec.
        With several pools, the route with the lowest estimated TTFT wins; when no pool
        can pair the request, the answer is a :class:`CodecMismatch`.
        """
        live = [w for w in workers if w.worker_id not in exclude]
        if not any(w.can_decode for w in live):
            return Refusal("no decode worker is available for this model")
        n = max(n_tokens or 0, len(ids))
        alone = not any(w.can_prefill for w in live)  # decode workers serve every prompt
        best: Route | None = None
        refused: Refusal | None = None
        for pool in codec_pools(live).values():
            got = self._place_pool(pool, ids, max_tokens, n, alone, nodes)
            if isinstance(got, Refusal):
                refused = refused or got
            elif got is not None and (best is None or _ttft(got) < _ttft(best)):
                best = got
        if best is not None:
            return best
        return refused if refused is not None else mismatch(live)

    def _place_pool(
        self,
        pool: Sequence[WorkerRecord],
        ids: Sequence[int],
        max_tokens: int,
        n: int,
        alone: bool,
        nodes: Mapping[str, Any] | None,
    ) -> Route | Refusal | None:
        """Place within one codec pool; None when the pool cannot serve this request
        (a long prompt and no prefill-decode pair here, while ``alone`` is False)."""
        prefills = [w for w in pool if w.can_prefill]
        decodes = [w for w in pool if w.can_decode]
        short = n < self.short_prompt_tokens or alone
        if not decodes or not (short or prefills):
            return None
        w0 = pool[0]
        keys = prefix_keys(ids, w0.block_tokens, Namespace(**w0.namespace))
        runs = self.prefixes.runs(keys)
        cand_pool = decodes if short else prefills
        sched = self._scheduler(cand_pool)
        cands = []
        for i, w in enumerate(cand_pool):
            segs = tuple((_location(t), b) for t, b in runs.get(w.store_node, []))
            cands.append(Candidate(i, self._queue_s(w, sched.cost.prefill), segs))
        got: tuple[WorkerRecord | None, WorkerRecord, Estimate] | Refusal
        if short:
            got = self._place_short(decodes, cand_pool, cands, sched, n + max_tokens, n, nodes)
        else:
            got = self._place_split(decodes, cand_pool, cands, sched, n + max_tokens, n, nodes)
        if isinstance(got, Refusal):
            return got
        pre, dec, est = got
        holder = pre or dec
        cached_blocks = min(
            sum(b for _, b in runs.get(holder.store_node, [])), (n - 1) // holder.block_tokens
        )
        tier = tier_label(runs.get(holder.store_node, []), cached_blocks)
        return Route(pre, dec, est, cached_blocks * holder.block_tokens, tier, keys)

    def _place_short(
        self,
        decodes: Sequence[WorkerRecord],
        pool: Sequence[WorkerRecord],
        cands: Sequence[Candidate],
        sched: Scheduler,
        kv_tokens: int,
        n: int,
        nodes: Mapping[str, Any] | None,
    ) -> tuple[None, WorkerRecord, Estimate] | Refusal:
        """A short prompt: one decode worker runs it all, if it meets the TTFT SLO."""
        chosen = choose_decode(decodes, kv_tokens, None, self.out, nodes)
        if isinstance(chosen, Refusal):
            return chosen
        est = sched.cost.estimate(n, cands[pool.index(chosen)])
        if self.slo_s is not None and est.ttft_s > self.slo_s:
            return Refusal(
                f"no worker can meet the TTFT SLO of {self.slo_s * 1e3:.0f} ms: "
                f"the least loaded needs {est.ttft_s * 1e3:.0f} ms",
                est,
            )
        return None, chosen, est

    def _place_split(
        self,
        decodes: Sequence[WorkerRecord],
        pool: Sequence[WorkerRecord],
        cands: Sequence[Candidate],
        sched: Scheduler,
        kv_tokens: int,
        n: int,
        nodes: Mapping[str, Any] | None,
    ) -> tuple[WorkerRecord, WorkerRecord, Estimate] | Refusal:
        """The scheduler's prefill worker, then a decode worker for its handoff."""
        placed = sched.place(n, cands)
        if isinstance(placed, Refusal):
            return placed
        pre = pool[placed.node]
        dec = choose_decode(decodes, kv_tokens, pre, self.out, nodes)
        if isinstance(dec, Refusal):
            return dec
        return pre, dec, placed.estimate
