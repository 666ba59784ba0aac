"""Discrete-event replay of a request trace through the real scheduler and policies.

What it answers: for a cluster of N prefill nodes with given DRAM and SSD per node
and an eviction policy, what share of prompt tokens the KV cache serves (by tier),
and what that does to time to first token under a given scheduler. It replays
Mooncake-format traces (engine/planning/trace.py) whose ``hash_ids`` stand for 512-token
blocks, so no tokens or tensors are needed and an hour of traffic replays in seconds.

Model (each choice made to match how the store behaves, and written down here):

* Caches hold whole blocks; capacity is counted in blocks. Each node has a DRAM
  tier and an optional SSD tier, each ordered by a real policy from
  :mod:`kvstore.tiers.policy`. DRAM evictions demote to SSD; SSD evictions drop; an SSD
  block a request touches is promoted back to DRAM. ``pooled`` replaces the
  per-node caches with one cache of the summed capacity shared by all nodes, which
  remembers the node that wrote each block so a pull is local or remote.
* A hit is prefix-contiguous (a block after the first miss must be recomputed even
  if present) and token-weighted: the partial tail block counts by the tokens it
  holds. This is the counting of ../shared/traces/README.md; with one node,
  unlimited DRAM and LRU the replay reproduces its figures exactly.
* Blocks are admitted when a request is placed (the store's two-phase reserve), so
  the next request can match them. Every block of the request is then touched,
  promoted or written, in prompt order.
* Each prefill node serves its queue first come first served; service time is the
  scheduler's own estimate (pull + prefill from the fitted model), so queued work
  is known exactly and TTFT = queueing + service.
* Optional decode nodes hold each request's KV (prompt + output tokens) from the
  end of its prefill for ``output_length * tpot_s``; placement is
  :func:`engine.planning.scheduler.place_decode`, refusals are counted.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from engine.planning.scheduler import (
    DEFAULT_COST,
    Candidate,
    CostModel,
    DecodeNode,
    Location,
    Placement,
    make_scheduler,
    place_decode,
)
from engine.planning.trace import BLOCK_TOKENS, TraceRequest
from kvstore.errors import ConfigError
from kvstore.tiers.policy import EvictionPolicy, make_policy

__all__ = [
    "SimConfig",
    "SimResult",
    "TieredCache",
    "prefix_reuse_bound",
    "replay",
]

_UNLIMITED = 1 << 62
_LOCS = tuple(Location)  # index -> Location without IntEnum construction cost
_DRAM, _SSD = 0, 1


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One cluster to replay. Capacities are per node, in blocks; ``None`` is unlimited
    and ``ssd_blocks=0`` means no SSD tier. ``time_scale`` multiplies arrival times
    (0.5 replays the trace at twice its rate)."""

    nodes: int = 10
    dram_blocks: int | None = None
    ssd_blocks: int | None = 0
    policy: str = "lru"
    pooled: bool = False
    scheduler: str = "cache_aware"
    slo_s: float | None = None
    time_scale: float = 1.0
    block_tokens: int = BLOCK_TOKENS
    decode_nodes: int = 0
    decode_kv_tokens: int = 2_000_000
    tpot_s: float = 0.02

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError(f"need at least one prefill node, got {self.nodes}")
        if self.dram_blocks is not None and self.dram_blocks < 1:
            raise ConfigError(f"DRAM must hold at least one block, got {self.dram_blocks}")
        if self.ssd_blocks is not None and self.ssd_blocks < 0:
            raise ConfigError(f"SSD capacity cannot be negative, got {self.ssd_blocks}")
        if self.time_scale <= 0 or self.tpot_s < 0:
            raise ConfigError(
                f"need time_scale > 0 and tpot_s >= 0, got {self.time_scale}, {self.tpot_s}"
            )
        make_policy(self.policy, 1)  # fail early on an unknown name

    @property
    def mode(self) -> str:
        return "pooled" if self.pooled else "per-node"


@dataclass(slots=True)
class _Moves:
    """Block movements inside the caches (counted in blocks)."""

    written: int = 0
    promoted: int = 0
    demoted: int = 0
    dropped: int = 0


class TieredCache:
    """The DRAM and SSD of one node, or of the whole pool, as two eviction policies.

    Every block has size 1, so a policy's length is its occupancy. ``home`` (kept
    only when ``track_home``) maps a block to the node that wrote it, for pooled
    locality. Not thread-safe; the replay is single-threaded.
    """

    __slots__ = ("dram", "dram_cap", "home", "moves", "ssd", "ssd_cap", "track_home")

    def __init__(
        self, policy: str, dram_blocks: int | None, ssd_blocks: int | None, *,
        track_home: bool = False,
    ) -> None:  # fmt: skip
        self.dram_cap = _UNLIMITED if dram_blocks is None else dram_blocks
        self.dram: EvictionPolicy = make_policy(policy, self.dram_cap)
        self.ssd_cap = _UNLIMITED if ssd_blocks is None else ssd_blocks
        self.ssd: EvictionPolicy | None = (
            make_policy(policy, self.ssd_cap) if ssd_blocks != 0 else None
        )
        self.track_home = track_home
        self.home: dict[Hashable, int] = {}
        self.moves = _Moves()

    def match(self, hash_ids: Sequence[int]) -> list[int]:
        """Tier (0 DRAM, 1 SSD) of each leading block present, up to the first miss."""
        dram, ssd = self.dram, self.ssd
        out: list[int] = []
        for key in hash_ids:
            if key in dram:
                out.append(_DRAM)
            elif ssd is not None and key in ssd:
                out.append(_SSD)
            else:
                break
        return out

    def admit(self, hash_ids: Sequence[int], node: int) -> None:
        """Make every block of a placed request resident in DRAM, in prompt order."""
        dram, ssd, moves = self.dram, self.ssd, self.moves
        for key in hash_ids:
            if key in dram:
                dram.touch(key)
                continue
            if ssd is not None and key in ssd:
                ssd.remove(key)
                moves.promoted += 1
            else:
                moves.written += 1
                if self.track_home:
                    self.home[key] = node
            while len(dram) >= self.dram_cap:
                victim = dram.pop_victim()
                if victim is None:
                    break
                self._demote(victim)
            dram.insert(key, 1)

    def _demote(self, key: Hashable) -> None:
        ssd, moves = self.ssd, self.moves
        if ssd is None:
            moves.dropped += 1
            self.home.pop(key, None)
            return
        while len(ssd) >= self.ssd_cap:
            gone = ssd.pop_victim()
            if gone is None:
                break
            moves.dropped += 1
            self.home.pop(gone, None)
        ssd.insert(key, 1)
        moves.demoted += 1


@dataclass(frozen=True)
class SimResult:
    """What a replay measured. Token counts cover served (not refused) requests;
    times are seconds; ``bytes_*`` use the cost model's KV bytes per token (block
    moves inside the caches count whole blocks). ``busiest_share`` is the busiest
    node's share of requests; ``hotspot_rate`` the share of placements sent to a
    node with queued work while another node sat idle."""

    config: SimConfig
    requests: int
    served: int
    refused: int
    prompt_tokens: int
    hit_tokens: int
    dram_hit_tokens: int
    ssd_hit_tokens: int
    remote_hit_tokens: int
    reused_tokens: int
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    queue_p50_s: float
    queue_p99_s: float
    queue_mean_s: float
    node_requests: tuple[int, ...]
    node_utilization: tuple[float, ...]
    busiest_share: float
    hotspot_rate: float
    bytes_pulled: int
    bytes_written: int
    bytes_promoted: int
    bytes_demoted: int
    blocks_dropped: int
    decode_refused: int
    decode_peak_util: float
    first_refusal: str | None
    wall_s: float

    def _rate(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_rate(self) -> float:
        """Token-weighted prefix hit rate over all tiers."""
        return self._rate(self.hit_tokens)

    @property
    def dram_hit_rate(self) -> float:
        return self._rate(self.dram_hit_tokens)

    @property
    def ssd_hit_rate(self) -> float:
        return self._rate(self.ssd_hit_tokens)

    @property
    def remote_hit_rate(self) -> float:
        """Hits served from another node's memory or disk (pooled caches only)."""
        return self._rate(self.remote_hit_tokens)

    @property
    def reuse_rate(self) -> float:
        """Tokens loaded from cache rather than recomputed (the plan may skip slow hits)."""
        return self._rate(self.reused_tokens)

    @property
    def bytes_moved(self) -> int:
        return self.bytes_pulled + self.bytes_written + self.bytes_promoted + self.bytes_demoted

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready view, rates included."""
        out = asdict(self)
        out["config"] = {**asdict(self.config), "mode": self.config.mode}
        for name in _DERIVED:
            out[name] = getattr(self, name)
        return out


_DERIVED = (
    "hit_rate", "dram_hit_rate", "ssd_hit_rate", "remote_hit_rate", "reuse_rate", "bytes_moved",
)  # fmt: skip


def prefix_reuse_bound(requests: Sequence[TraceRequest], block_tokens: int = BLOCK_TOKENS) -> float:
    """Token-weighted prefix hit rate of an unlimited single cache: the ceiling any
    capacity or placement can reach on this trace (37.4% for the conversation trace)."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        k = 0
        for key in r.hash_ids:
            if key not in seen:
                break
            k += 1
        hit += min(k * block_tokens, r.input_length)
        total += r.input_length
        seen.update(r.hash_ids)
    return hit / total if total else 0.0


@dataclass(slots=True)
class _Tally:
    """Running sums of one replay."""

    prompt: int = 0
    by_loc: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    reused: int = 0
    refused: int = 0
    first_refusal: str | None = None
    ttft: list[float] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)


class _Replay:
    """One replay's state: caches, queues, decode events and tallies."""

    def __init__(self, config: SimConfig, cost: CostModel) -> None:
        self.cfg, self.cost = config, cost
        n = config.nodes
        self.scheduler = make_scheduler(config.scheduler, cost, slo_s=config.slo_s)
        if config.pooled:
            pool = TieredCache(
                config.policy, _times(config.dram_blocks, n), _times(config.ssd_blocks, n),
                track_home=True,
            )  # fmt: skip
            self.caches = [pool]
        else:
            self.caches = [
                TieredCache(config.policy, config.dram_blocks, config.ssd_blocks) for _ in range(n)
            ]
        self.busy_until = [0.0] * n
        self.busy_s = [0.0] * n
        self.node_requests = [0] * n
        self.hotspots = 0
        self.tally = _Tally()
        self.decode = _DecodeSim(config)
        self.last_finish = 0.0

    def candidates(self, r: TraceRequest, now: float) -> list[Candidate]:
        """Each node's queue and the runs of its cached prefix, by location."""
        busy = self.busy_until
        if self.cfg.pooled:
            pool = self.caches[0]
            tiers = pool.match(r.hash_ids)
            homes = [pool.home.get(k, -1) for k in r.hash_ids[: len(tiers)]]
            return [
                Candidate(
                    n, max(0.0, busy[n] - now),
                    _runs([2 * t + (h != n) for t, h in zip(tiers, homes, strict=True)]),
                )
                for n in range(self.cfg.nodes)
            ]  # fmt: skip
        return [
            Candidate(n, max(0.0, busy[n] - now), _runs([2 * t for t in c.match(r.hash_ids)]))
            for n, c in enumerate(self.caches)
        ]

    def step(self, r: TraceRequest) -> None:
        """Place one arriving request, account for it, admit its blocks."""
        now = r.arrival_s * self.cfg.time_scale
        self.decode.advance(now)
        cands = self.candidates(r, now)
        decision = self.scheduler.place(r.input_length, cands)
        t = self.tally
        if not isinstance(decision, Placement):
            t.refused += 1
            t.first_refusal = t.first_refusal or f"line {r.line}: {decision.reason}"
            return
        est = decision.estimate
        node = est.node
        finish = now + est.ttft_s
        self.busy_until[node] = finish
        self.busy_s[node] += est.service_s
        self.last_finish = max(self.last_finish, finish)
        self.node_requests[node] += 1
        if est.queue_s > 0 and min(c.queue_s for c in cands) == 0:
            self.hotspots += 1  # queued behind others while a node sat idle
        t.prompt += r.input_length
        t.ttft.append(est.ttft_s)
        t.queue.append(est.queue_s)
        self._count_hits(cands[node].segments, r.input_length, est.reused_tokens)
        cache = self.caches[0] if self.cfg.pooled else self.caches[node]
        cache.admit(r.hash_ids, node)
        self.decode.submit(finish, r)

    def _count_hits(
        self, segments: tuple[tuple[Location, int], ...], prompt: int, reused: int
    ) -> None:
        """Token-weighted hits per location (the partial tail counts its own tokens)."""
        t, left = self.tally, prompt
        for loc, blocks in segments:
            tokens = min(blocks * self.cfg.block_tokens, left)
            left -= tokens
            t.by_loc[loc] += tokens
        t.reused += reused

    def result(self, requests: int, wall_s: float) -> SimResult:
        t, cfg, b = self.tally, self.cfg, self.cost.kv_bytes_per_token * self.cfg.block_tokens
        ttft = np.asarray(t.ttft) if t.ttft else np.zeros(1)
        queue = np.asarray(t.queue) if t.queue else np.zeros(1)
        served = len(t.ttft)
        span = max(self.last_finish, 1e-9)
        moves = _Moves()
        for c in self.caches:
            for k in ("written", "promoted", "demoted", "dropped"):
                setattr(moves, k, getattr(moves, k) + getattr(c.moves, k))
        self.decode.advance(float("inf"))
        return SimResult(
            cfg, requests, served, t.refused, t.prompt,
            sum(t.by_loc), t.by_loc[0] + t.by_loc[1], t.by_loc[2] + t.by_loc[3],
            t.by_loc[1] + t.by_loc[3], t.reused,
            float(np.percentile(ttft, 50)), float(np.percentile(ttft, 99)), float(ttft.mean()),
            float(np.percentile(queue, 50)), float(np.percentile(queue, 99)), float(queue.mean()),
            tuple(self.node_requests), tuple(round(s / span, 4) for s in self.busy_s),
            max(self.node_requests) / served if served else 0.0,
            self.hotspots / served if served else 0.0,
            t.reused * self.cost.kv_bytes_per_token, moves.written * b, moves.promoted * b,
            moves.demoted * b, moves.dropped, self.decode.refused, self.decode.peak_util,
            t.first_refusal, wall_s,
        )  # fmt: skip


def _times(blocks: int | None, n: int) -> int | None:
    return None if blocks is None else blocks * n


def _runs(locs: list[int]) -> tuple[tuple[Location, int], ...]:
    """Run-length encode per-block location codes into scheduler segments."""
    if not locs:
        return ()
    out: list[tuple[Location, int]] = []
    cur, count = locs[0], 0
    for loc in locs:
        if loc == cur:
            count += 1
        else:
            out.append((_LOCS[cur], count))
            cur, count = loc, 1
    out.append((_LOCS[cur], count))
    return tuple(out)


class _DecodeSim:
    """Decode nodes as KV capacity held from prefill end to last token."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.free = [cfg.decode_kv_tokens] * cfg.decode_nodes
        self.events: list[tuple[float, int, int, int, int]] = []  # (t, kind, seq, node, kv)
        self.seq = 0
        self.refused = 0
        self.peak_util = 0.0

    def submit(self, prefill_done: float, r: TraceRequest) -> None:
        if self.free:
            kv = r.input_length + r.output_length
            heapq.heappush(self.events, (prefill_done, 1, self.seq, r.output_length, kv))
            self.seq += 1

    def advance(self, now: float) -> None:
        """Apply every event up to ``now``: releases (kind 0) before placements (1)."""
        ev, cap = self.events, self.cfg.decode_kv_tokens * len(self.free)
        while ev and ev[0][0] <= now:
            t, kind, _, arg, kv = heapq.heappop(ev)
            if kind == 0:
                self.free[arg] += kv
                continue
            nodes = [DecodeNode(i, f) for i, f in enumerate(self.free)]
            node = place_decode(kv, nodes)
            if not isinstance(node, int):
                self.refused += 1
                continue
            self.free[node] -= kv
            self.peak_util = max(self.peak_util, 1 - sum(self.free) / cap)
            heapq.heappush(ev, (t + arg * self.cfg.tpot_s, 0, self.seq, node, kv))
            self.seq += 1


def replay(
    requests: Sequence[TraceRequest],
    config: SimConfig,
    cost: CostModel = DEFAULT_COST,
    *,
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    """Replay ``requests`` (sorted by arrival) on the cluster ``config`` describes.

    ``progress`` is called with the number of requests done every 256 requests and
    at the end (for a progress bar). Deterministic: same input, same result.
    """
    if cost.block_tokens != config.block_tokens:
        raise ConfigError(
            f"cost model block size {cost.block_tokens} != replay block size {config.block_tokens}"
        )
    t0 = time.perf_counter()
    sim = _Replay(config, cost)
    for i, r in enumerate(requests, start=1):
        sim.step(r)
        if progress is not None and i % 256 == 0:
            progress(i)
    if progress is not None:
        progress(len(requests))
    return sim.result(len(requests), time.perf_counter() - t0)
