"""The router's Prometheus metrics, in a registry of its own (never the global one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

__all__ = ["RouterMetrics"]

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class RouterMetrics:
    """Decisions per policy and worker, TTFT, refusals, retries, prompt cache hits."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.decisions = Counter(
            "kvstore_router_decisions", "Requests placed, per policy, phase and worker",
            ["policy", "phase", "worker"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "kvstore_router_ttft_seconds", "Arrival to first token sent, per policy",
            ["policy"], buckets=_TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.refusals = Counter(
            "kvstore_router_refusals", "Requests refused with 429 (no worker meets the SLO)",
            ["policy"], registry=r,
        )  # fmt: skip
        self.requests = Counter(
            "kvstore_router_requests", "Requests answered, per endpoint and status",
            ["endpoint", "status"], registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "kvstore_router_retries", "Calls to a worker retried on another, per phase",
            ["phase"], registry=r,
        )  # fmt: skip
        self.stream_errors = Counter(
            "kvstore_router_stream_errors", "Streams cut by a failing worker", registry=r
        )
        self.prompt_tokens = Counter(
            "kvstore_router_prompt_tokens", "Prompt tokens routed", registry=r
        )
        self.cached_tokens = Counter(
            "kvstore_router_cached_tokens", "Prompt tokens served from the store", registry=r
        )
        self.worker_tokenized = Counter(
            "kvstore_router_worker_tokenized",
            "Requests whose prompt tail the prefill worker tokenized (no node held it)",
            registry=r,
        )
        self.decision_s = Histogram(
            "kvstore_router_decision_seconds",
            "Router's own cost per request: tokenize, keys, mirror, decision",
            buckets=(1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2), registry=r,
        )  # fmt: skip

    def render(self) -> bytes:
        return generate_latest(self.registry)
