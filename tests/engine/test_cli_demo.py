"""The main job: `kvstore demo` runs end to end and its numbers add up."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.demo.inproc import run_demo
from kvstore.cli import main


def test_demo_serves_turns_through_both_tiers() -> None:
    r = run_demo(model="tiny", conversations=3, turns=3, new_tokens=4, dram="1MiB").as_dict()
    tiers = r["node"]["tiers"]
    assert tiers["dram"]["blocks"] > 0 and tiers["ssd"]["blocks"] > 0
    follow = r["classes"]["follow-up"]
    assert follow["requests"] == 6 and follow["cached_share"] > 0.5
    assert r["hit_rate_per_tier"]["dram"] > 0 and r["hit_rate_per_tier"]["ssd"] > 0
    assert r["bytes_moved"]["dram->ssd (demotion)"] > 0
    assert r["node"]["counters"].get("corrupt_blocks", 0) == 0


def test_cli_demo_json_in_process(capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["demo", "--json", "--in-process", "--model", "tiny", "--conversations", "2",
            "--turns", "2"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert sum(c["requests"] for c in out["classes"].values()) == 4
    assert out.get("mode") != "live"


def test_cli_demo_without_etcd_says_so_and_runs_in_process(  # type: ignore[no-untyped-def]
    capsys, monkeypatch
) -> None:
    import engine.serving.stack as stack

    monkeypatch.setattr(stack, "etcd_available", lambda: False)
    argv = ["demo", "--json", "--model", "tiny", "--conversations", "1", "--turns", "2"]
    assert main(argv) == 0
    cap = capsys.readouterr()
    note = [line for line in cap.err.splitlines() if "no etcd binary" in line]
    assert len(note) == 1 and "in-process path" in note[0]
    out = json.loads(cap.out)
    assert sum(c["requests"] for c in out["classes"].values()) == 2


needs_etcd = pytest.mark.skipif(
    not __import__("engine.serving.stack", fromlist=["x"]).etcd_available(),
    reason="the live demo needs an etcd binary",
)


@pytest.mark.process
@needs_etcd
def test_live_demo_routes_every_turn_and_stops_everything() -> None:
    """The default path: processes, the router, the openai client; every answer says
    where it went (usage.kvstore and headers agree), follow-ups reuse their prefix,
    and every process the demo started is gone by PID at the end."""
    p = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "demo", "--json", "--model", "tiny",
         "--conversations", "2", "--turns", "2", "--new-tokens", "4"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["mode"] == "live" and out["policy"] == "cache_aware"
    procs = out["processes"]
    assert {"etcd", "n0", "n1", "p0", "p1", "d0", "router"} <= set(procs)
    assert out["stopped"] is True
    for pid in procs.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    routes = out["routes"]
    assert len(routes) == 4
    for r in routes:
        assert r["prefill_worker"] in ("p0", "p1") and r["decode_worker"] == "d0"
        h = r["headers"]
        assert h["x-kvstore-prefill-worker"] == r["prefill_worker"]
        assert h["x-kvstore-decode-worker"] == r["decode_worker"]
        assert int(h["x-kvstore-cached-tokens"]) == r["cached_tokens"]
    follow = [r for r in routes if r["turn"] > 0]
    assert all(r["cached_tokens"] > 0 and r["tier"] for r in follow)
    assert out["classes"]["follow-up"]["cached_share"] > 0.4
    assert out["bytes_moved"]["prefill->store (put)"] > 0


@pytest.mark.process
def test_cli_bad_setting_is_one_line_and_nonzero() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "demo", "--model", "tiny", "--dram", "12 parsecs"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 1
    assert "cannot parse size" in p.stderr and "hint:" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.process
@needs_etcd
def test_cli_tables_fit_80_columns() -> None:
    env = {**os.environ, "COLUMNS": "80"}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore.cli",
            "demo",
            "--model",
            "tiny",
            "--conversations",
            "2",
            "--turns",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "TTFT per request class" in p.stdout and "bytes moved per path" in p.stdout
    assert "where each request went" in p.stdout and "all stopped" in p.stdout
    assert max(len(line) for line in p.stdout.splitlines()) <= 80
