"""Where a request runs: the cache-aware prefill scheduler, its baselines, decode placement.

For every prefill node the scheduler estimates the time to first token::

    TTFT(node) = queued work + pull(cached prefix) + prefill(uncached suffix)

and picks the minimum (Mooncake's Conductor). Pulling a prefix is not always
worth it: from a slow tier a long prefix can cost more than recomputing it, so the
estimate also picks how much of the prefix to use (see :meth:`CostModel.estimate`).
Ties are broken by load. When no node can meet the TTFT SLO the request is
refused with a reason (429-style): admitting it would only push every request
queued behind it past the SLO as well.

The baselines (round robin, least loaded, longest prefix only) sit behind the same
interface and use the same estimates, so a replay compares choices, not models.

The scheduler sees nodes only as :class:`Candidate` records (queued seconds plus
where each run of the cached prefix lives). It never reads caches itself: the
trace replay (engine/planning/sim.py) and the live engine both build candidates from
their own view of the cluster (policies in the replay, the directory in a live
cluster).

The prefill time model is fitted from measurements, not hand-set; see
:class:`PrefillModel`, :func:`fit_prefill_model` and :func:`measure_prefill`.
"""

from __future__ import annotations

import json
import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from kvstore.errors import ConfigError

__all__ = [
    "DEFAULT_COST",
    "DEFAULT_PREFILL",
    "DEFAULT_SAMPLES",
    "SCHEDULERS",
    "Bandwidths",
    "CacheAwareScheduler",
    "Candidate",
    "CostModel",
    "DecodeNode",
    "Estimate",
    "LeastLoadedScheduler",
    "Location",
    "LongestPrefixScheduler",
    "Placement",
    "PrefillModel",
    "PrefillSample",
    "Refusal",
    "RoundRobinScheduler",
    "Scheduler",
    "fit_prefill_model",
    "make_scheduler",
    "measure_prefill",
    "place_decode",
]


# --------------------------------------------------------------------------- prefill model


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One measured prefill: ``prompt_tokens`` in all, the first ``cached_tokens``
    supplied as KV, the rest computed, in ``seconds``."""

    prompt_tokens: int
    cached_tokens: int
    seconds: float


def _features(prompt: float, cached: float) -> tuple[float, float, float]:
    """Basis of the prefill polynomial, with ``S = P - C`` new tokens to compute.

    ``1`` (per-forward overhead), ``S`` (projections and MLP: linear in new tokens)
    and ``P**2 - C**2 = S * (P + C)`` (causal attention of the S new queries over
    their P keys). This is the quadratic in (P, C) constrained so that a fully
    cached prompt costs only the overhead and, with non-negative coefficients, more
    cache never costs more. The free six-term quadratic overfits the dozen points
    one can afford to measure, and would also learn a quirk of the CPU reference:
    transformers' sdpa path attends to a cache through an explicit mask and then
    measures slower than the arithmetic says (8192 tokens with 4096 cached took
    longer than none cached), which serving kernels do not share.
    """
    return 1.0, prompt - cached, prompt * prompt - cached * cached


@dataclass(frozen=True, slots=True)
class PrefillModel:
    """Prefill seconds ``t(P, C) = c0 + c1 (P - C) + c2 (P^2 - C^2)``.

    Decreasing and concave in C for a fixed P (coefficients are non-negative), which
    :meth:`CostModel.estimate` relies on. ``source`` says where the coefficients
    came from; keep it with them.
    """

    coeffs: tuple[float, float, float]
    source: str = ""
    r2: float | None = None

    def seconds(self, prompt_tokens: int, cached_tokens: int) -> float:
        """Predicted prefill time; at least one token is always computed (the logits)."""
        c = min(cached_tokens, prompt_tokens - 1) if prompt_tokens > 0 else 0
        c0, c1, c2 = self.coeffs
        return c0 + c1 * (prompt_tokens - c) + c2 * (prompt_tokens * prompt_tokens - c * c)

    def to_dict(self) -> dict[str, Any]:
        return {"coeffs": list(self.coeffs), "source": self.source, "r2": self.r2}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrefillModel:
        coeffs = data.get("coeffs")
        if not isinstance(coeffs, list) or len(coeffs) != 3:
            raise ConfigError("prefill model needs 'coeffs': [c0, c1, c2] (seconds)")
        if any(not isinstance(c, (int, float)) or c < 0 for c in coeffs):
            raise ConfigError(f"prefill coefficients must be non-negative numbers, got {coeffs}")
        c0, c1, c2 = (float(c) for c in coeffs)
        return cls((c0, c1, c2), str(data.get("source", "")), data.get("r2"))

    @classmethod
    def from_json(cls, path: str | Path) -> PrefillModel:
        """Load coefficients written by :meth:`to_dict` (e.g. a fit of :func:`measure_prefill`)."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read prefill model {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"prefill model {path} must hold a JSON object")
        return cls.from_dict(data)


def fit_prefill_model(samples: Sequence[PrefillSample], source: str = "") -> PrefillModel:
    """Least-squares fit of :class:`PrefillModel` with non-negative coefficients.

    Fitted on relative error (rows weighted by 1/t) so the short prompts, which
    most requests are, count as much as the long ones. A negative coefficient would
    make some prompt cheaper than a shorter one, so the fit is constrained: an
    active-set loop drops the most negative term and refits (three terms, at most
    three rounds).
    """
    if len(samples) < 3:
        raise ConfigError(f"need at least 3 prefill samples to fit, got {len(samples)}")
    x = np.array([_features(s.prompt_tokens, s.cached_tokens) for s in samples], dtype=float)
    y = np.array([s.seconds for s in samples], dtype=float)
    if np.any(y <= 0):
        raise ConfigError("prefill samples must have positive durations")
    w = 1.0 / y
    active = [0, 1, 2]
    coef = np.zeros(3)
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if np.all(sol >= 0):
            coef[:] = 0.0
            coef[active] = sol
            break
        del active[int(np.argmin(sol))]
    pred = x @ coef
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2)) or 1.0
    c0, c1, c2 = (float(c) for c in coef)
    return PrefillModel((c0, c1, c2), source, round(1.0 - ss_res / ss_tot, 6))


TINY_LLAMA: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16384,
    "initializer_range": 0.1,
}
"""Shape of the model :func:`measure_prefill` times by default (random weights)."""

DEFAULT_POINTS: tuple[tuple[int, int], ...] = (
    (256, 0), (1024, 0), (1024, 512), (2048, 0), (2048, 1024), (2048, 1536),
    (4096, 0), (4096, 2048), (4096, 3584), (8192, 0), (8192, 4096), (8192, 7680),
)  # fmt: skip


def measure_prefill(
    points: Sequence[tuple[int, int]] = DEFAULT_POINTS,
    *,
    repeats: int = 3,
    seed: int = 0,
    threads: int | None = 1,
    config: dict[str, Any] | None = None,
) -> list[PrefillSample]:
    """Time a real transformer prefill on CPU at each ``(prompt, cached)`` point.

    A random-weight ``LlamaForCausalLM`` (``config`` overrides :data:`TINY_LLAMA`;
    fixed seed) first fills a ``DynamicCache`` with the cached prefix, untimed, then
    the timed forward computes the suffix against it, keeping only the last logits
    as a server does. Timings are the median of ``repeats``; one warm-up forward
    runs first. Weights do not change the arithmetic, so no checkpoint is needed.
    """
    import torch
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY_LLAMA, **(config or {})})
    model = LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    out: list[PrefillSample] = []
    with torch.inference_mode():
        model(input_ids=torch.zeros(1, 64, dtype=torch.long), logits_to_keep=1)
        for prompt, cached in points:
            if not 0 <= cached < prompt:
                raise ConfigError(f"need 0 <= cached < prompt, got ({prompt}, {cached})")
            ids = torch.randint(0, cfg.vocab_size, (1, prompt), generator=gen)
            times = []
            for _ in range(repeats):
                cache = DynamicCache(config=cfg)
                if cached:
                    model(input_ids=ids[:, :cached], past_key_values=cache, logits_to_keep=1)
                t0 = time.perf_counter()
                model(input_ids=ids[:, cached:], past_key_values=cache, logits_to_keep=1)
                times.append(time.perf_counter() - t0)
            out.append(PrefillSample(prompt, cached, statistics.median(times)))
    return out


# Measured with measure_prefill(repeats=5) (TINY_LLAMA, DEFAULT_POINTS, 1 thread,
# sdpa attention) on the project's 2-core dev box (CPU, torch 2.13, transformers
# 5.23), then fitted with fit_prefill_model(): R^2 0.82. The misfit is mostly the
# cached points at 4096/8192 tokens, where transformers' masked sdpa path runs
# slower than the arithmetic (see _features), plus a noisy shared machine (a rerun
# gave 0.64-0.73 s for the 8192-token point). The samples are kept so the fit can
# be checked and redone. A stand-in for a real deployment: measure your model on
# your hardware and pass the fitted JSON (`kvstore plan --prefill-model FILE`).
DEFAULT_SAMPLES: tuple[PrefillSample, ...] = tuple(
    PrefillSample(p, c, t)
    for p, c, t in (
        (256, 0, 0.004941),
        (1024, 0, 0.030329),
        (1024, 512, 0.017293),
        (2048, 0, 0.071402),
        (2048, 1024, 0.057894),
        (2048, 1536, 0.029618),
        (4096, 0, 0.189391),
        (4096, 2048, 0.234317),
        (4096, 3584, 0.053328),
        (8192, 0, 0.641123),
        (8192, 4096, 0.951706),
        (8192, 7680, 0.097657),
    )
)
DEFAULT_PREFILL = PrefillModel(
    (0.0009298963424170823, 1.3999785214293052e-05, 1.0775549539054082e-08),
    "fit of measure_prefill(repeats=5): random tiny Llama (2 layers, hidden 128, sdpa), "
    "1 CPU thread, 2-core dev box, torch 2.13 / transformers 5.23",
    0.823044,
)


# --------------------------------------------------------------------------- cost model


class Location(IntEnum):
    """Where a run of the cached prefix lives, as seen from the candidate node."""

    LOCAL_DRAM = 0
    REMOTE_DRAM = 1
    LOCAL_SSD = 2
    REMOTE_SSD = 3


@dataclass(frozen=True, slots=True)
class Bandwidths:
    """Bytes per second from each location into the prefill node's accelerator.

    Defaults are this project's measurements (DESIGN.md, 2-core loopback box):
    host memcpy ~24 GB/s for 16 MiB, shared memory / ucxx ~10 GB/s between
    processes, the virtual disk's ~1 GB/s reads; remote SSD is bounded by the disk.
    """

    local_dram: float = 20e9
    remote_dram: float = 10e9
    local_ssd: float = 1.0e9
    remote_ssd: float = 0.9e9

    def of(self, loc: Location) -> float:
        return (self.local_dram, self.remote_dram, self.local_ssd, self.remote_ssd)[loc]


@dataclass(frozen=True, slots=True)
class Candidate:
    """A prefill node as the scheduler sees it for one request.

    ``segments`` are the runs of the request's cached prefix in prompt order, each
    ``(location, blocks)``; their sum is the number of leading blocks present.
    """

    node: int
    queue_s: float
    segments: tuple[tuple[Location, int], ...] = ()

    @property
    def cached_blocks(self) -> int:
        return sum(n for _, n in self.segments)


@dataclass(frozen=True, slots=True)
class Estimate:
    """Estimated TTFT of one request on one node, and its parts.

    ``cached_tokens`` are the prefix tokens present; ``reused_tokens`` the ones the
    plan loads rather than recomputes (fewer when pulling costs more than computing).
    """

    node: int
    ttft_s: float
    queue_s: float
    pull_s: float
    prefill_s: float
    cached_tokens: int
    reused_tokens: int

    @property
    def service_s(self) -> float:
        """Time the node is busy with this request (pull, then prefill)."""
        return self.pull_s + self.prefill_s


@dataclass(frozen=True, slots=True)
class CostModel:
    """Turns a candidate into an :class:`Estimate`: prefill model + KV bytes + links.

    ``kv_bytes_per_token`` defaults to the measured tiny model's KV (2 layers x K and
    V x 2 heads x 32 dims x fp32 = 1 KiB), consistent with :data:`DEFAULT_PREFILL`;
    a Llama-3-8B in bf16 holds 128 KiB per token.
    """

    prefill: PrefillModel = field(default_factory=lambda: DEFAULT_PREFILL)
    kv_bytes_per_token: int = 1024
    bandwidth: Bandwidths = field(default_factory=Bandwidths)
    block_tokens: int = 512

    def pull_seconds(self, loc: Location, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.bandwidth.of(loc)

    def estimate(self, prompt_tokens: int, cand: Candidate) -> Estimate:
        """Best plan for this node: use the first k cached blocks, recompute the rest.

        Pull time is linear in k within a run of one location and prefill time is
        concave in the cached length, so their sum is concave within a run and its
        minimum lies at a run boundary: only those (and k = 0) are evaluated.
        """
        best_cost = self.prefill.seconds(prompt_tokens, 0)
        best_pull, best_reused = 0.0, 0
        tokens, pull = 0, 0.0
        for loc, blocks in cand.segments:
            step = min(blocks * self.block_tokens, prompt_tokens - tokens)
            pull += self.pull_seconds(loc, step)
            tokens += step
            cost = pull + self.prefill.seconds(prompt_tokens, tokens)
            if cost < best_cost:
                best_cost, best_pull, best_reused = cost, pull, tokens
        return Estimate(
            cand.node,
            cand.queue_s + best_cost,
            cand.queue_s,
            best_pull,
            best_cost - best_pull,
            tokens,
            best_reused,
        )


DEFAULT_COST = CostModel()


# --------------------------------------------------------------------------- schedulers


@dataclass(frozen=True, slots=True)
class Placement:
    """The request goes to ``estimate.node``."""

    estimate: Estimate

    @property
    def node(self) -> int:
        return self.estimate.node


@dataclass(frozen=True, slots=True)
class Refusal:
    """No placement (429-style): ``reason`` is for the caller's log and response."""

    reason: str
    best: Estimate | None = None


class Scheduler(ABC):
    """Chooses a prefill node. Subclasses only rank estimates (:meth:`choose`);
    estimating and the SLO admission check are shared so baselines are comparable.

    Not thread-safe: one scheduler instance per dispatch loop.
    """

    name: ClassVar[str]

    def __init__(self, cost: CostModel = DEFAULT_COST, *, slo_s: float | None = None) -> None:
        if slo_s is not None and slo_s <= 0:
            raise ConfigError(f"TTFT SLO must be positive, got {slo_s}")
        self.cost = cost
        self.slo_s = slo_s
        self._turn = 0  # rotates among exact ties so idle clusters fill evenly

    def place(self, prompt_tokens: int, candidates: Sequence[Candidate]) -> Placement | Refusal:
        """Estimate every candidate, refuse if none meets the SLO, else choose."""
        if not candidates:
            return Refusal("no prefill node is available")
        ests = [self.cost.estimate(prompt_tokens, c) for c in candidates]
        best = min(ests, key=lambda e: e.ttft_s)
        if self.slo_s is not None and best.ttft_s > self.slo_s:
            return Refusal(
                f"no prefill node can meet the TTFT SLO of {self.slo_s * 1e3:.0f} ms: "
                f"the best, node {best.node}, needs {best.ttft_s * 1e3:.0f} ms "
                f"({best.queue_s * 1e3:.0f} queued + {best.pull_s * 1e3:.0f} pull + "
                f"{best.prefill_s * 1e3:.0f} prefill)",
                best,
            )
        chosen = self.choose(ests)
        self._turn += 1
        return Placement(chosen)

    @abstractmethod
    def choose(self, estimates: Sequence[Estimate]) -> Estimate:
        """Pick one of the (non-empty) estimates."""

    def _least_loaded(self, estimates: Sequence[Estimate]) -> Estimate:
        """Lowest queue; exact ties rotate so equal nodes share the work."""
        n = len(estimates)
        return min(estimates, key=lambda e: (e.queue_s, (e.node - self._turn) % n))


class CacheAwareScheduler(Scheduler):
    """Minimum estimated TTFT; estimates within ``tie_s`` count as equal and go to
    the least loaded (a cache hit worth less than that is not worth a hot spot)."""

    name = "cache_aware"

    def __init__(
        self, cost: CostModel = DEFAULT_COST, *, slo_s: float | None = None, tie_s: float = 1e-3
    ) -> None:
        super().__init__(cost, slo_s=slo_s)
        self.tie_s = tie_s

    def choose(self, estimates: Sequence[Estimate]) -> Estimate:
        floor = min(e.ttft_s for e in estimates) + self.tie_s
        return self._least_loaded([e for e in estimates if e.ttft_s <= floor])


class RoundRobinScheduler(Scheduler):
    """Each node in turn, blind to caches and load (baseline)."""

    name = "round_robin"

    def choose(self, estimates: Sequence[Estimate]) -> Estimate:
        return estimates[self._turn % len(estimates)]


class LeastLoadedScheduler(Scheduler):
    """Shortest queue, blind to caches (baseline)."""

    name = "least_loaded"

    def choose(self, estimates: Sequence[Estimate]) -> Estimate:
        return self._least_loaded(estimates)


class LongestPrefixScheduler(Scheduler):
    """Longest cached prefix, load only as a tie break (baseline; it hot-spots)."""

    name = "longest_prefix"

    def choose(self, estimates: Sequence[Estimate]) -> Estimate:
        most = max(e.cached_tokens for e in estimates)
        return self._least_loaded([e for e in estimates if e.cached_tokens == most])


SCHEDULERS: dict[str, type[Scheduler]] = {
    cls.name: cls
    for cls in (
        CacheAwareScheduler,
        RoundRobinScheduler,
        LeastLoadedScheduler,
        LongestPrefixScheduler,
    )
}


def make_scheduler(
    name: str, cost: CostModel = DEFAULT_COST, *, slo_s: float | None = None
) -> Scheduler:
    """Build a scheduler by name (``cache_aware``, ``round_robin``, ``least_loaded``,
    ``longest_prefix``; dashes accepted)."""
    try:
        cls = SCHEDULERS[name.lower().replace("-", "_")]
    except KeyError:
        raise ConfigError(
            f"unknown scheduler {name!r}; choose one of {', '.join(sorted(SCHEDULERS))}"
        ) from None
    return cls(cost, slo_s=slo_s)


# --------------------------------------------------------------------------- decode


@dataclass(frozen=True, slots=True)
class DecodeNode:
    """A decode node's free KV capacity, in tokens."""

    node: int
    free_kv_tokens: int


def place_decode(kv_tokens: int, nodes: Sequence[DecodeNode]) -> int | Refusal:
    """Decode node with the most free KV that fits ``kv_tokens`` (prompt + output).

    Most-free (worst fit) keeps headroom everywhere: a decode that outgrows its
    node must be preempted, and evenly spread free space makes that least likely.
    """
    fits = [d for d in nodes if d.free_kv_tokens >= kv_tokens]
    if not fits:
        most = max((d.free_kv_tokens for d in nodes), default=0)
        return Refusal(f"no decode node has {kv_tokens} free KV tokens (most free: {most})")
    return max(fits, key=lambda d: (d.free_kv_tokens, -d.node)).node
