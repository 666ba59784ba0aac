"""Where ``kvstore vllm-router`` sends a prefill (engine/serving/vllm_pools.py): to the
server that would finish it soonest, counting the prompt tokens this router has queued
on each and each server's prefill rate as seen, not the number of requests in flight;
beside the decode server's store node first."""

from __future__ import annotations

import json
from pathlib import Path

from engine.serving.vllm_pools import Pools, PoolsConfig


def pools(tmp_path: Path, prefill: list[str]) -> Pools:
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
           "num_hidden_layers": 2}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return Pools(PoolsConfig(prefill=prefill, decode=["http://d"], model=str(tmp_path)))


def test_a_long_prompt_in_flight_weighs_more_than_two_short_ones(tmp_path: Path) -> None:
    p = pools(tmp_path, ["http://a", "http://b"])
    a, b = p.prefill
    a.in_flight, a.queued_tokens = 1, 4000  # one long prompt
    b.in_flight, b.queued_tokens = 2, 200  # two short ones
    assert [s.url for s in p.prefill_order(300)] == ["http://b", "http://a"]


def test_a_server_seen_to_prefill_faster_takes_more(tmp_path: Path) -> None:
    p = pools(tmp_path, ["http://a", "http://b"])
    a, b = p.prefill
    a.saw_prefill(1000, 2.0)  # 2 ms a token
    b.saw_prefill(1000, 0.5)  # 0.5 ms a token
    a.queued_tokens, b.queued_tokens = 500, 1500
    # a: (500 + 500) * 2 ms = 2 s; b: (1500 + 500) * 0.5 ms = 1 s
    assert p.prefill_order(500)[0].url == "http://b"
    b.saw_prefill(100, 1.0)  # one slow prefill moves its rate, not all the way
    assert 0.5e-3 < b.s_per_token < 10e-3


def test_idle_servers_tie_and_go_by_requests_sent(tmp_path: Path) -> None:
    p = pools(tmp_path, ["http://a", "http://b"])
    a, _ = p.prefill
    a.sent = 3
    assert [s.url for s in p.prefill_order(100)] == ["http://b", "http://a"]
