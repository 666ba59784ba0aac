"""The scheduler: fitted prefill model, TTFT estimates, choices, refusals, decode placement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.planning.scheduler import (
    DEFAULT_PREFILL,
    DEFAULT_SAMPLES,
    Bandwidths,
    CacheAwareScheduler,
    Candidate,
    CostModel,
    DecodeNode,
    LeastLoadedScheduler,
    Location,
    LongestPrefixScheduler,
    Placement,
    PrefillModel,
    PrefillSample,
    Refusal,
    RoundRobinScheduler,
    fit_prefill_model,
    make_scheduler,
    measure_prefill,
    place_decode,
)
from kvstore.errors import ConfigError

# Round numbers so expected values can be worked by hand: 1 ms per 1k new tokens,
# 1 ms per 1M of P^2 - C^2, KV of 1 kB per token, DRAM at 1 GB/s (1 us per token).
LINEAR = PrefillModel((0.0, 1e-6, 1e-9), "test")
COST = CostModel(LINEAR, kv_bytes_per_token=1_000, bandwidth=Bandwidths(1e9, 0.5e9, 0.1e9, 0.05e9))
COST_FREE_PULL = CostModel(LINEAR, kv_bytes_per_token=1, bandwidth=Bandwidths())


def test_fit_recovers_known_coefficients() -> None:
    truth = PrefillModel((0.002, 3e-6, 4e-9))
    pts = [(256, 0), (1024, 0), (1024, 512), (4096, 0), (4096, 2048), (8192, 0), (8192, 6144)]
    samples = [PrefillSample(p, c, truth.seconds(p, c)) for p, c in pts]
    fit = fit_prefill_model(samples, source="synthetic")
    for got, want in zip(fit.coeffs, truth.coeffs, strict=True):
        assert got == pytest.approx(want, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0) and fit.source == "synthetic"


def test_fit_never_returns_negative_coefficients() -> None:
    # Pure quadratic data plus a negative offset would pull the intercept below zero.
    samples = [PrefillSample(p, 0, 1e-9 * p * p) for p in (1000, 2000, 4000, 8000)]
    samples.append(PrefillSample(100, 0, 1e-6))
    fit = fit_prefill_model(samples)
    assert all(c >= 0 for c in fit.coeffs)


def test_fit_needs_enough_samples() -> None:
    with pytest.raises(ConfigError, match="at least 3"):
        fit_prefill_model([PrefillSample(10, 0, 0.1)])


def test_default_coefficients_are_the_fit_of_the_stored_measurements() -> None:
    fit = fit_prefill_model(DEFAULT_SAMPLES)
    # a least-squares fit: its last digits vary with the BLAS and the core count
    assert fit.coeffs == pytest.approx(DEFAULT_PREFILL.coeffs, rel=1e-9)
    assert fit.r2 == pytest.approx(DEFAULT_PREFILL.r2, abs=1e-6)  # rounded to 6 places
    assert "measure_prefill" in DEFAULT_PREFILL.source


def test_prefill_model_is_monotone() -> None:
    m = DEFAULT_PREFILL
    assert m.seconds(8192, 0) > m.seconds(4096, 0) > m.seconds(1024, 0) > 0
    assert m.seconds(8192, 0) > m.seconds(8192, 4096) > m.seconds(8192, 8191)
    assert m.seconds(8192, 8192) == m.seconds(8192, 8191)  # the last token is always computed


def test_prefill_model_json_roundtrip(tmp_path: Path) -> None:
    p = tmp_path / "m.json"
    p.write_text(json.dumps(LINEAR.to_dict()))
    assert PrefillModel.from_json(p) == LINEAR
    p.write_text(json.dumps({"coeffs": [1, -1, 0]}))
    with pytest.raises(ConfigError, match="non-negative"):
        PrefillModel.from_json(p)


@pytest.mark.slow
def test_measure_real_transformer_prefill_and_fit() -> None:
    pts = [(128, 0), (256, 0), (256, 128), (512, 0), (512, 256), (512, 448)]
    samples = measure_prefill(pts, repeats=1, config={"num_hidden_layers": 1})
    assert [(s.prompt_tokens, s.cached_tokens) for s in samples] == pts
    assert all(s.seconds > 0 for s in samples)
    fit = fit_prefill_model(samples)
    assert fit.seconds(512, 0) > 0 and all(c >= 0 for c in fit.coeffs)


def test_estimate_adds_queue_pull_and_prefill() -> None:
    cand = Candidate(0, queue_s=0.5, segments=((Location.LOCAL_DRAM, 2),))
    est = COST.estimate(2048, cand)
    assert est.cached_tokens == est.reused_tokens == 1024
    assert est.pull_s == pytest.approx(1024 * 1e-6)
    assert est.prefill_s == pytest.approx(LINEAR.seconds(2048, 1024))
    assert est.ttft_s == pytest.approx(0.5 + est.pull_s + est.prefill_s)


def test_estimate_skips_a_prefix_slower_to_pull_than_to_recompute() -> None:
    # Remote SSD: 20 ms per token to pull, far more than recomputing it.
    cand = Candidate(0, 0.0, ((Location.LOCAL_DRAM, 1), (Location.REMOTE_SSD, 3)))
    est = CostModel(LINEAR, kv_bytes_per_token=1_000, bandwidth=Bandwidths(1e12, 1e12, 1e12, 5e3)
                    ).estimate(4096, cand)  # fmt: skip
    assert est.cached_tokens == 2048
    assert est.reused_tokens == 512  # the DRAM block only


def test_estimate_caps_cached_tokens_at_the_prompt() -> None:
    est = COST_FREE_PULL.estimate(700, Candidate(0, 0.0, ((Location.LOCAL_DRAM, 2),)))
    assert est.cached_tokens == 700
    assert est.prefill_s == pytest.approx(LINEAR.seconds(700, 699))


def _cands(*specs: tuple[float, int]) -> list[Candidate]:
    """(queue seconds, DRAM prefix blocks) per node."""
    return [
        Candidate(i, q, ((Location.LOCAL_DRAM, b),) if b else ()) for i, (q, b) in enumerate(specs)
    ]


def test_cache_aware_picks_the_lowest_ttft() -> None:
    sched = CacheAwareScheduler(COST_FREE_PULL)
    # node 1 holds 16 of 20 blocks but queues 1 s; node 2 holds 8 and is idle.
    d = sched.place(10240, _cands((0.2, 0), (1.0, 16), (0.0, 8)))
    assert isinstance(d, Placement) and d.node == 2
    # with a short queue the long prefix wins
    d = sched.place(10240, _cands((0.2, 0), (0.01, 16), (0.0, 8)))
    assert isinstance(d, Placement) and d.node == 1


def test_cache_aware_breaks_ties_by_load_then_rotates() -> None:
    sched = CacheAwareScheduler(COST_FREE_PULL, tie_s=1e-3)
    d = sched.place(1024, _cands((0.0005, 0), (0.0, 0), (0.0008, 0)))
    assert isinstance(d, Placement) and d.node == 1  # all within 1 ms: least loaded
    nodes = []
    for _ in range(3):
        d = sched.place(1024, _cands((0.0, 0), (0.0, 0), (0.0, 0)))
        assert isinstance(d, Placement)
        nodes.append(d.node)
    assert sorted(nodes) == [0, 1, 2]  # an idle cluster fills evenly


def test_round_robin_cycles_blind_to_load() -> None:
    sched = RoundRobinScheduler(COST_FREE_PULL)
    got = []
    for _ in range(4):
        d = sched.place(512, _cands((9.0, 0), (0.0, 1), (0.0, 0)))
        assert isinstance(d, Placement)
        got.append(d.node)
    assert got == [0, 1, 2, 0]


def test_least_loaded_ignores_the_cache() -> None:
    d = LeastLoadedScheduler(COST_FREE_PULL).place(4096, _cands((0.3, 8), (0.1, 0)))
    assert isinstance(d, Placement) and d.node == 1


def test_longest_prefix_follows_the_cache_into_a_queue() -> None:
    d = LongestPrefixScheduler(COST_FREE_PULL).place(4096, _cands((0.0, 1), (30.0, 6), (0.0, 6)))
    assert isinstance(d, Placement) and d.node == 2  # tie on prefix: least loaded
    d = LongestPrefixScheduler(COST_FREE_PULL).place(4096, _cands((0.0, 1), (30.0, 7), (0.0, 6)))
    assert isinstance(d, Placement) and d.node == 1  # the hot spot


@pytest.mark.parametrize("name", ["cache_aware", "round_robin", "least_loaded", "longest-prefix"])
def test_refusal_names_the_slo_and_the_best_node(name: str) -> None:
    sched = make_scheduler(name, COST_FREE_PULL, slo_s=0.5)
    d = sched.place(4096, _cands((2.0, 0), (0.9, 4)))
    assert isinstance(d, Refusal)
    assert "TTFT SLO of 500 ms" in d.reason and "node 1" in d.reason
    assert d.best is not None and d.best.node == 1
    assert isinstance(sched.place(4096, _cands((0.0, 0), (0.9, 4))), Placement)


def test_no_nodes_is_a_refusal() -> None:
    assert isinstance(CacheAwareScheduler().place(10, []), Refusal)


def test_make_scheduler_rejects_unknown_names() -> None:
    with pytest.raises(ConfigError, match="cache_aware"):
        make_scheduler("fastest")
    with pytest.raises(ConfigError, match="SLO"):
        make_scheduler("round_robin", slo_s=0)


def test_decode_goes_to_the_most_free_node_that_fits() -> None:
    nodes = [DecodeNode(0, 5000), DecodeNode(1, 9000), DecodeNode(2, 7000)]
    assert place_decode(4000, nodes) == 1
    assert place_decode(8000, nodes) == 1
    refused = place_decode(9001, nodes)
    assert isinstance(refused, Refusal) and "9001" in refused.reason and "9000" in refused.reason
