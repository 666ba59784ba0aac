"""The main job: `kvstore demo` runs end to end and its numbers add up."""

from __future__ import annotations

import json
import subprocess
import sys

from kvstore.cli import main
from kvstore.demo import run_demo


def test_demo_moves_blocks_through_both_tiers() -> None:
    r = run_demo(conversations=6, turns=4, dram="16MiB", ssd="256MiB").as_dict()
    tiers = r["node"]["tiers"]
    assert tiers["dram"]["blocks"] > 0 and tiers["ssd"]["blocks"] > 0
    assert r["hit_blocks"] > 0 and r["verified_blocks"] == r["hit_blocks"]
    assert r["node"]["blocks"] == r["written_blocks"]  # nothing lost while capacity remains
    c = r["node"]["counters"]
    assert c["demotions_dram"] > 0 and c.get("hits_ssd", 0) > 0


def test_cli_demo_json(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["demo", "--json", "--conversations", "3", "--turns", "2", "--dram", "8MiB"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 6


def test_cli_bad_setting_is_one_line_and_nonzero() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "demo", "--dram", "12 parsecs"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 1
    assert "cannot parse size" in p.stderr and "hint:" in p.stderr
    assert "Traceback" not in p.stderr


def test_cli_table_renders() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "demo", "--conversations", "3", "--turns", "2"],
        capture_output=True,
        text=True,
        env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"},
    )
    assert p.returncode == 0, p.stderr
    assert "where the blocks landed" in p.stdout and "dram" in p.stdout
    assert max(len(line) for line in p.stdout.splitlines()) <= 80
