"""Trace replay and the ``plan`` command.

The replay's hit counting is checked against an independent plain-LRU counter
written here from the README's definition, and against the README's own figures.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest

from engine.planning import plan
from engine.planning.scheduler import CostModel, PrefillModel
from engine.planning.sim import SimConfig, prefix_reuse_bound, replay
from engine.planning.trace import TraceRequest, load_trace, parse_trace
from kvstore.errors import ConfigError

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "conversation_trace.jsonl"
needs_trace = pytest.mark.skipif(not TRACE.exists(), reason=f"conversation trace not at {TRACE}")
FAST = CostModel(PrefillModel((0.0, 1e-6, 0.0)), kv_bytes_per_token=1000)


def lru_hit_rate(reqs: Sequence[TraceRequest], capacity: int | None, block: int = 512) -> float:
    """Independent count: one LRU of ``capacity`` blocks, prefix-contiguous hits,
    token-weighted with the partial tail block counted by its own tokens."""
    lru: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for r in reqs:
        k = 0
        while k < len(r.hash_ids) and r.hash_ids[k] in lru:
            k += 1
        hit += min(k * block, r.input_length)
        total += r.input_length
        for h in r.hash_ids:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                if capacity is not None and len(lru) > capacity:
                    lru.popitem(last=False)
    return hit / total


@cache
def trace(limit: int | None = None) -> list[TraceRequest]:
    return load_trace(TRACE, limit=limit)


def synth(*reqs: tuple[float, int, list[int]], out: int = 10) -> list[TraceRequest]:
    """Requests from (ms, input tokens, hash ids)."""
    lines = [
        json.dumps({"timestamp": t, "input_length": n, "output_length": out, "hash_ids": ids})
        for t, n, ids in reqs
    ]
    return parse_trace(lines)


@needs_trace
@pytest.mark.parametrize("capacity", [300, 1000, 4000])
def test_single_node_matches_independent_lru(capacity: int) -> None:
    reqs = trace(4000)
    got = replay(reqs, SimConfig(nodes=1, dram_blocks=capacity), FAST).hit_rate
    assert abs(got - lru_hit_rate(reqs, capacity)) < 0.005


@needs_trace
def test_pooled_cache_is_one_lru_of_the_summed_capacity() -> None:
    reqs = trace(4000)
    cfg = SimConfig(nodes=4, dram_blocks=250, pooled=True, scheduler="round_robin")
    assert abs(replay(reqs, cfg, FAST).hit_rate - lru_hit_rate(reqs, 1000)) < 0.005


@needs_trace
def test_full_trace_reproduces_the_readme_lru_figures() -> None:
    reqs = trace()
    readme = {1000: 0.045, 6000: 0.141, 30000: 0.332, None: 0.374}
    for capacity, want in readme.items():
        got = replay(reqs, SimConfig(nodes=1, dram_blocks=capacity), FAST).hit_rate
        assert got == pytest.approx(want, abs=5e-4), capacity  # the README's 3 places
    assert prefix_reuse_bound(reqs) == pytest.approx(0.374, abs=5e-4)


@needs_trace
@pytest.mark.parametrize("scheduler", ["cache_aware", "round_robin"])
def test_pooled_beats_per_node_in_the_mooncake_shape(scheduler: str) -> None:
    """10 prefill nodes with 3M tokens of DRAM each (5859 blocks)."""
    cfg = SimConfig(nodes=10, dram_blocks=3_000_000 // 512, scheduler=scheduler)
    per_node = replay(trace(), cfg).hit_rate
    pooled = replay(trace(), replace(cfg, pooled=True)).hit_rate
    assert pooled >= 1.5 * per_node, (pooled, per_node)


def test_dram_evictions_demote_to_ssd_and_ssd_hits_promote() -> None:
    reqs = synth((0, 1024, [1, 2]), (1, 1024, [3, 4]), (2, 1024, [1, 2]))
    res = replay(reqs, SimConfig(nodes=1, dram_blocks=2, ssd_blocks=4), FAST)
    assert res.ssd_hit_tokens == 1024 and res.dram_hit_tokens == 0
    block_bytes = 512 * FAST.kv_bytes_per_token
    assert res.bytes_written == 4 * block_bytes
    assert res.bytes_demoted == 4 * block_bytes  # 1, 2 then 3, 4 pushed out of DRAM
    assert res.bytes_promoted == 2 * block_bytes
    assert res.blocks_dropped == 0


def test_no_ssd_means_evictions_drop() -> None:
    reqs = synth((0, 1024, [1, 2]), (1, 1024, [3, 4]), (2, 1024, [1, 2]))
    res = replay(reqs, SimConfig(nodes=1, dram_blocks=2), FAST)
    assert res.hit_tokens == 0 and res.blocks_dropped == 4


def test_partial_tail_block_counts_its_own_tokens() -> None:
    reqs = synth((0, 700, [1, 2]), (1, 700, [1, 2]))
    res = replay(reqs, SimConfig(nodes=1), FAST)
    assert res.hit_tokens == 700 and res.prompt_tokens == 1400


def test_pooled_hits_from_another_node_are_remote() -> None:
    reqs = synth((0, 1024, [1, 2]), (1, 1536, [1, 2, 3]))
    res = replay(reqs, SimConfig(nodes=2, pooled=True, scheduler="round_robin"), FAST)
    assert res.node_requests == (1, 1)
    assert res.hit_tokens == res.remote_hit_tokens == 1024


def test_queueing_on_one_node() -> None:
    reqs = synth((0, 1000, [1, 2]), (0, 1000, [3, 4]))
    res = replay(reqs, SimConfig(nodes=1), FAST)
    one = FAST.prefill.seconds(1000, 0)
    assert res.queue_p99_s == pytest.approx(one, rel=0.02)
    assert res.ttft_p99_s == pytest.approx(2 * one, rel=0.02)


def test_cache_aware_spreads_where_longest_prefix_hot_spots() -> None:
    # Every request shares block 0 (a system prompt), then its own conversation.
    reqs = synth(*[(i * 10, 1024, [0, 100 + i]) for i in range(40)])
    slow = CostModel(PrefillModel((0.0, 1e-4, 0.0)), kv_bytes_per_token=1000)
    lp = replay(reqs, SimConfig(nodes=4, scheduler="longest_prefix"), slow)
    ca = replay(reqs, SimConfig(nodes=4, scheduler="cache_aware"), slow)
    # every request on the node that saw block 0 first
    assert lp.busiest_share == pytest.approx(1.0)
    assert lp.hotspot_rate > 0.5
    assert ca.busiest_share <= 0.5 and ca.ttft_p99_s < lp.ttft_p99_s


def test_slo_refusals_are_counted_and_not_cached() -> None:
    reqs = synth((0, 4096, list(range(8))), (0, 4096, list(range(10, 18))), (1, 512, [10]))
    cfg = SimConfig(nodes=1, slo_s=1.5 * FAST.prefill.seconds(4096, 0))
    res = replay(reqs, cfg, FAST)
    assert res.refused == 1 and res.served == 2
    assert res.first_refusal is not None and res.first_refusal.startswith("line 2: ")
    assert res.hit_tokens == 0  # the refused request's blocks never entered the cache


def test_decode_placement_refuses_when_kv_is_full() -> None:
    reqs = synth(*[(i, 512, [i]) for i in range(6)], out=1000)
    cfg = SimConfig(nodes=1, decode_nodes=2, decode_kv_tokens=3100, tpot_s=1.0)
    res = replay(reqs, cfg, FAST)
    assert res.decode_refused == 2  # 1512 tokens each: two fit per node
    assert res.decode_peak_util == pytest.approx(4 * 1512 / 6200)


def test_replay_is_deterministic_and_reports_progress() -> None:
    reqs = synth(*[(i, 1024, [i % 3, 10 + i]) for i in range(300)])
    seen: list[int] = []
    a = replay(reqs, SimConfig(nodes=3, dram_blocks=8), FAST, progress=seen.append)
    b = replay(reqs, SimConfig(nodes=3, dram_blocks=8), FAST)
    assert replace(a, wall_s=0) == replace(b, wall_s=0)
    assert seen == [256, 300]


def test_bad_configs() -> None:
    with pytest.raises(ConfigError, match="policy"):
        SimConfig(policy="mru")
    with pytest.raises(ConfigError, match="at least one"):
        SimConfig(nodes=0)
    with pytest.raises(ConfigError, match="block size"):
        replay(synth((0, 10, [1])), SimConfig(block_tokens=256), FAST)


# --------------------------------------------------------------------------- plan


@pytest.mark.parametrize(
    ("text", "blocks"),
    [("3M", 5859), ("3000000", 5859), ("3M tokens", 5859), ("6k blocks", 6000), ("6kb", 6000),
     ("0", 0), ("512", 1), ("1.5k", 2), ("unlimited", None), ("inf", None)],
)  # fmt: skip
def test_parse_capacity(text: str, blocks: int | None) -> None:
    assert plan.parse_capacity(text) == blocks


@pytest.mark.parametrize("text", ["3GiB", "-1", "100", "1.5 blocks", "lots"])
def test_parse_capacity_rejects(text: str) -> None:
    with pytest.raises(ConfigError):
        plan.parse_capacity(text)


def run_plan(*argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="kvstore")
    plan.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = args.func(args)
    return code, out.getvalue(), err.getvalue()


def write_lines(n: int) -> list[str]:
    return [
        json.dumps({"timestamp": i * 50, "input_length": 1500, "output_length": 20,
                    "hash_ids": [0, 1000 + i % 25, 2000 + i]})
        for i in range(n)
    ]  # fmt: skip


def write_trace(path: Path, n: int = 200) -> Path:
    path.write_text("\n".join(write_lines(n)) + "\n")
    return path


# matplotlib runs fc-list to build its font cache on a machine's first plot
@pytest.mark.process
def test_plan_json_and_plot(tmp_path: Path) -> None:
    trace_file = write_trace(tmp_path / "t.jsonl")
    png = tmp_path / "hit.png"
    code, out, _ = run_plan(
        *("--trace", str(trace_file), "--nodes", "4", "--dram", "20 blocks", "--ssd", "40b"),
        *("--policy", "s3fifo", "--json", "--plot", str(png)),
    )
    assert code == 0
    report = json.loads(out)
    assert set(report["results"]) == {"per-node", "pooled"}
    assert report["results"]["pooled"]["config"]["dram_blocks"] == 20
    assert report["pooled_over_per_node"] is not None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["sweep_axis"] == "dram+ssd"
    for mode, res in report["results"].items():
        pts = [p for p in report["sweep"] if p["mode"] == mode]
        tokens = [p["tokens_per_node"] for p in pts]
        assert tokens == sorted(set(tokens)) and len(pts) >= 4  # strictly growing capacity
        assert [p["ssd_blocks"] for p in pts] == sorted(p["ssd_blocks"] for p in pts)
        (planned,) = [p for p in pts if p["planned"]]
        assert (planned["dram_blocks"], planned["ssd_blocks"]) == (20, 40)
        assert planned["tokens_per_node"] == 60 * 512
        assert planned["hit_rate"] == pytest.approx(res["hit_rate"], rel=1e-9)
        for p in pts:
            assert p["dram_hit_rate"] + p["ssd_hit_rate"] == pytest.approx(p["hit_rate"])
            assert p["hit_rate"] <= report["prefix_reuse_bound"] + 1e-9


def sweep(dram: int | None, ssd: int | None, nodes: int = 4) -> list[tuple[int, int | None]]:
    # 1 + 25 + 200 distinct blocks: a footprint of 57 blocks per node over 4 nodes
    return plan.sweep_capacities(plan_trace(), SimConfig(nodes=nodes, dram_blocks=dram,
                                                         ssd_blocks=ssd))  # fmt: skip


@cache
def plan_trace() -> list[TraceRequest]:
    return parse_trace(write_lines(200))


def test_sweep_scales_dram_and_ssd_together_around_the_plan() -> None:
    points = sweep(20, 80)
    totals = [d + (s or 0) for d, s in points]
    assert totals == sorted(set(totals))
    assert (20, 80) in points
    assert totals[0] <= 100 / 4 and totals[-1] >= 2 * 100  # a quarter of the plan to twice it
    for d, s in points:
        assert s == 4 * d or d < 8  # the planned 1:4, up to rounding of tiny capacities
    assert 4 <= len(points) <= plan.SWEEP_MAX_POINTS + 1


def test_sweep_reaches_the_footprint_and_stays_small_for_huge_plans() -> None:
    footprint = -(-226 // 4)
    assert sweep(4, 0)[-1][0] >= footprint  # past the point where the pool holds everything
    assert sweep(4, 0)[0][0] <= footprint / 32
    huge = sweep(10**9, 3 * 10**9)
    assert (10**9, 3 * 10**9) in huge and len(huge) <= plan.SWEEP_MAX_POINTS + 1
    assert huge[0][0] <= 2 and huge[-1][0] >= 2 * 10**9  # still a 32nd of the footprint up


def test_sweep_with_unlimited_tiers() -> None:
    no_ssd = sweep(20, 0)
    assert all(s == 0 for _, s in no_ssd) and (20, 0) in no_ssd
    ssd_unlimited = sweep(20, None)  # only DRAM scales; the SSD stays unlimited
    assert all(s is None for _, s in ssd_unlimited) and (20, None) in ssd_unlimited
    assert [d for d, _ in ssd_unlimited] == sorted({d for d, _ in ssd_unlimited})
    dram_unlimited = sweep(None, 50)  # the plan is off the axis: DRAM only, finite
    assert all(s == 0 and d >= 1 for d, s in dram_unlimited)
    assert plan.sweep_tokens(None, 50) is None and plan.sweep_tokens(3, 5) == 8 * 512


@pytest.mark.process
def test_plan_parallel_replays_match_serial(tmp_path: Path) -> None:
    trace_file = write_trace(tmp_path / "t.jsonl")
    argv = ("--trace", str(trace_file), "--nodes", "3", "--dram", "8b", "--ssd", "8b",
            "--json", "--plot", str(tmp_path / "p.png"))  # fmt: skip

    def strip(out: str) -> dict[str, object]:
        report = json.loads(out)
        for res in report["results"].values():
            res["wall_s"] = 0
        return report

    code1, out1, _ = run_plan(*argv, "--workers", "1")
    code2, out2, _ = run_plan(*argv, "--workers", "2")
    assert code1 == code2 == 0
    assert strip(out1) == strip(out2)
    code, _, err = run_plan(*argv, "--workers", "0")
    assert code == 2 and "--workers" in err


def test_plan_table(tmp_path: Path) -> None:
    trace_file = write_trace(tmp_path / "t.jsonl")
    code, out, _ = run_plan("--trace", str(trace_file), "--nodes", "2", "--dram", "10k",
                            "--pooled", "--scheduler", "least_loaded")  # fmt: skip
    assert code == 0
    assert "hit rate (token-weighted)" in out and "pooled" in out and "per-node" not in out


def test_plan_bad_trace_names_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    rec = '{"timestamp": %d, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
    bad.write_text(rec % 5 + rec % 1)
    code, _, err = run_plan("--trace", str(bad))
    assert code == 2
    assert f"{bad}:2: timestamp 1 ms is earlier" in err


def test_plan_help_shows_an_example() -> None:
    parser = argparse.ArgumentParser(prog="kvstore")
    plan.add_parser(parser.add_subparsers())
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parser.parse_args(["plan", "--help"])
    assert "kvstore plan --trace" in out.getvalue() and "3M = 3,000,000" in out.getvalue()
