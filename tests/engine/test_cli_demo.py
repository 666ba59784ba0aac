"""The main job: `kvstore demo` runs end to end and its numbers add up."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.demo import run_demo
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


def test_cli_demo_json(capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["demo", "--json", "--model", "tiny", "--conversations", "2", "--turns", "2"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert sum(c["requests"] for c in out["classes"].values()) == 4


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
    )
    assert p.returncode == 0, p.stderr
    assert "TTFT per request class" in p.stdout and "bytes moved per path" in p.stdout
    assert max(len(line) for line in p.stdout.splitlines()) <= 80
